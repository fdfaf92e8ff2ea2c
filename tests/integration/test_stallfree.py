"""Stall-free batching: while a sequence generates, a new prompt is read in chunks
that fit the step budget, so the stream beside it keeps going; alone, a prompt is read at full
speed. In-process on the real model; the budget here is a token count, so the chunk sizes
are exact whatever the machine's speed."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmrun import config
from llmrun.engine.llama import Model
from llmrun.engine.promptcost import PromptCost, attention_per_cell
from tests.integration.test_engine import Harness

FACTS = " ".join(f"Fact {i}: the number {i} is written {i * 7} in another base."
                 for i in range(60))


@pytest.fixture(scope="module")
def model(smollm2_path: Path) -> Iterator[Model]:
    m = Model(smollm2_path)
    yield m
    m.close()


def steps(progress: list[dict[str, int]], start: int) -> list[int]:
    done = [start, *(p["processed"] for p in progress)]
    return [b - a for a, b in itertools.pairwise(done)]


def start_story(h: Harness) -> str:
    """A long greedy story, once it is under way: the stream beside the prompts."""
    story = h.submit("Tell me a very long story about a dragon.", max_tokens=1500)
    with h.cond:
        assert h.cond.wait_for(lambda: len(h.text.get(story, "")) > 0, timeout=120)
    return story


def test_a_prompt_beside_a_stream_is_read_in_budgeted_chunks(model: Model) -> None:
    h = Harness(model, slots=2, n_ctx=2048)
    h.engine.step_budget = (0.0, 24)
    try:
        story = start_story(h)
        prompt = h.tokens([{"role": "user", "content": FACTS + " Which is the largest?"}])
        assert len(prompt) > 600
        reader = h.submit_tokens(prompt, max_tokens=2)
        h.wait(reader)
        generating = story not in h.final  # the story went on all the while
        h.engine.cancel(story)
        h.wait(story)
    finally:
        h.close()
    assert generating
    chunks = steps(h.progress[reader], h.started[reader]["cached_tokens"])
    assert chunks and max(chunks) <= 24, chunks
    # the story got a token in (nearly) every step that read part of the prompt
    assert len(h.text[story]) > len(chunks) // 2
    # what /metrics reports of it: the mixed steps, and the budget they ran under
    stats = h.engine.stats
    assert stats.mixed_steps >= len(chunks) - 1 and stats.budget_tokens <= 24
    assert stats.prompt_tokens >= sum(chunks) and stats.steps > stats.mixed_steps


def test_alone_a_prompt_is_read_in_whole_batches(model: Model) -> None:
    h = Harness(model, slots=2, n_ctx=2048)
    h.engine.step_budget = (0.0, 24)
    try:
        prompt = h.tokens([{"role": "user", "content": FACTS}])
        reader = h.submit_tokens(prompt, max_tokens=2)
        h.wait(reader)
    finally:
        h.close()
    chunks = steps(h.progress.get(reader, []), 0)
    assert chunks and chunks[0] == 512  # the batch's capacity: nobody to wait for it


def test_a_prompt_read_in_chunks_beside_a_stream_answers_as_read_alone(model: Model) -> None:
    """Chunking changes no greedy answer: a long prompt read in whole batches with nobody
    beside it, and in 24-token chunks beside a stream (flash attention on, the default;
    two engines, so the second read reuses nothing of the first)."""
    question = [{"role": "user", "content": FACTS + " Which fact comes last?"}]
    h = Harness(model, slots=2, n_ctx=2048)
    try:
        alone = h.submit_tokens(h.tokens(question), max_tokens=24)
        h.wait(alone)
    finally:
        h.close()
    big = steps(h.progress.get(alone, []), 0)
    h2 = Harness(model, slots=2, n_ctx=2048)
    h2.engine.step_budget = (0.0, 24)
    try:
        story = start_story(h2)
        beside = h2.submit_tokens(h2.tokens(question), max_tokens=24)
        h2.wait(beside)
        h2.engine.cancel(story)
        h2.wait(story)
    finally:
        h2.close()
    chunks = steps(h2.progress[beside], h2.started[beside]["cached_tokens"])
    assert big and big[0] == 512 and len(chunks) > 10 and max(chunks) <= 24, (big, chunks)
    assert h2.text[beside] == h.text[alone] and h.text[alone]


def test_the_stream_beside_a_prompt_read_in_chunks_writes_what_it_writes_alone(
        model: Model) -> None:
    """The generating rows of a step that reads a prompt piece are decoded apart from the
    piece, as in a step of their own: the neighbour's greedy text is the same to the token
    as without the prompt beside it."""
    tell = "Tell me a very long story about a dragon."
    h = Harness(model, slots=2, n_ctx=2048)
    try:
        alone = h.submit(tell, max_tokens=80)
        h.wait(alone)
    finally:
        h.close()
    h2 = Harness(model, slots=2, n_ctx=2048)
    h2.engine.step_budget = (0.0, 24)
    try:
        story = h2.submit(tell, max_tokens=80)
        with h2.cond:
            assert h2.cond.wait_for(lambda: len(h2.text.get(story, "")) > 0, timeout=120)
        reader = h2.submit_tokens(h2.tokens([{"role": "user", "content": FACTS}]),
                                  max_tokens=2)
        h2.wait(reader)
        h2.wait(story)
    finally:
        h2.close()
    assert h2.engine.stats.mixed_steps > 10  # the story wrote beside the prompt's pieces
    assert h2.text[story] == h.text[alone] and h.text[alone]


def test_a_short_prompt_is_not_stuck_behind_a_long_one(model: Model) -> None:
    h = Harness(model, slots=3, n_ctx=2048)
    h.engine.step_budget = (0.0, 32)
    try:
        story = start_story(h)
        long = h.submit_tokens(h.tokens([{"role": "user", "content": FACTS}]), max_tokens=2)
        with h.cond:  # the long one is being read
            assert h.cond.wait_for(lambda: long in h.progress, timeout=120)
        short = h.submit("Hi", max_tokens=2)
        h.wait(short)
        short_done_first = long not in h.final
        h.wait(long)
        h.engine.cancel(story)
        h.wait(story)
    finally:
        h.close()
    assert short_done_first


@pytest.mark.parametrize(("text", "budget"), [("150ms", (0.15, 0)), ("0.2s", (0.2, 0)),
                                              ("64", (0.0, 64)), ("0", (0.0, 0))])
def test_step_budget_setting(text: str, budget: tuple[float, int]) -> None:
    assert config.parse_step_budget(text) == pytest.approx(budget)


def test_a_bad_step_budget_is_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMRUN_STEP_BUDGET", "fast")
    assert config.step_budget() == "225ms"
    monkeypatch.setenv("LLMRUN_STEP_BUDGET", "48")
    assert config.step_budget() == "48"


def _budget(scale: float | None = None, base: int = 0, spent: float = 0.0,
            **state: object) -> int:
    """Engine._prompt_budget on an engine in the given state (what it reads of itself): a
    prompt token costing `scale` seconds (no attention term), `base` tokens into its prompt."""
    from types import SimpleNamespace

    from llmrun.engine.batcher import Engine

    cost = PromptCost(0.0)
    cost.scale = scale
    fake = SimpleNamespace(batch=SimpleNamespace(capacity=512), prompt_cost=cost, **state)
    fake._decode_time = lambda rows: Engine._decode_time(fake, rows)  # type: ignore[attr-defined]
    return Engine._prompt_budget(fake, 1, base, spent)  # type: ignore[arg-type]


def test_the_time_budget_leaves_the_decode_rows_their_time() -> None:
    base = {"step_budget": (0.1, 0), "min_chunk": 8}
    # unmeasured: a first small chunk
    assert _budget(**base, scale=None, decode_token_s=None) == 16
    # 100 ms, of which the generating row takes 20: 80 ms of prompt at 5 ms a token
    assert _budget(**base, scale=0.005, decode_token_s=0.020) == 16
    # the time the step before spent keeping a prompt's state comes out of this one's
    assert _budget(**base, scale=0.005, decode_token_s=0.020, spent=0.03) == 10
    # a decode that takes the whole budget still lets the prompt move on
    assert _budget(**base, scale=0.005, decode_token_s=0.150) == 8
    # with flash attention on the CPU, chunks stay on its fast path
    assert _budget(**{**base, "min_chunk": 18}, scale=0.005, decode_token_s=0.020) == 18
    # no limit, or a token count
    assert _budget(step_budget=(0.0, 0), min_chunk=8, scale=0.005,
                   decode_token_s=0.02) == 512
    assert _budget(step_budget=(0.0, 24), min_chunk=8, scale=0.005,
                   decode_token_s=0.02) == 24


def test_a_prompt_token_costs_more_the_further_in_it_is() -> None:
    """The chunk that fits a budget shrinks as the prompt goes on (its attention spans more
    cells), as measured: without it, late chunks overran the budget by 10-20%."""
    cost = PromptCost(3.3e-4)  # SmolLM2's attention per cell (attention_per_cell)
    assert cost.fit(0, 0.25, 512) is None  # nothing measured yet
    # a step read 90 tokens from position 100 in 200 ms: s is what makes that so
    cost.observe([(100, 90)], 0.2)
    assert cost.seconds(100, 90) == pytest.approx(0.2)
    early, late = cost.fit(100, 0.2, 512), cost.fit(3000, 0.2, 512)
    assert early == 90 and late is not None and late < early * 0.6
    assert cost.seconds(3000, late) <= 0.2 < cost.seconds(3000, late + 1)
    # each piece of a step is weighed at its own position
    cost.observe([(0, 45), (3000, 45)], cost.seconds(0, 45) + cost.seconds(3000, 45))
    assert cost.fit(100, 0.2, 512) == 90
    # hostile bounds: no time, a huge budget, a step that took no time or went backwards
    assert cost.fit(3000, 0.0, 512) == 0 and cost.fit(0, 1e9, 512) == 512
    s = cost.scale
    cost.observe([(0, 10)], 0.0)
    cost.observe([(0, 10)], -1.0)
    cost.observe([], 0.1)
    assert cost.scale == s


def test_a_sliding_window_caps_a_tokens_span() -> None:
    cost = PromptCost(3.7e-4, window=512)
    cost.observe([(0, 64)], 0.1)
    assert cost.fit(1000, 0.1, 512) == cost.fit(20000, 0.1, 512)
    assert cost.fit(0, 0.1, 512) > cost.fit(1000, 0.1, 512)


def test_attention_per_cell_follows_the_models_shape(model: Model) -> None:
    # SmolLM2-135M: 30 layers of 9 heads of 64 + 64 over 134.5M weights less a 49152 x 576
    # embedding table; the slope measured in steps beside a stream was 3.3e-4 a cell
    assert attention_per_cell(model) == pytest.approx(30 * 9 * 128 / (134_515_008 - 49152 * 576))
    assert 3.0e-4 < attention_per_cell(model) < 3.6e-4


def test_debug_logs_every_step_of_the_runner(tmp_path: Path, smollm2_path: Path) -> None:
    """LLMRUN_DEBUG=1: each engine step leaves a line in its runner's log (what a latency
    question needs: rows, prompt pieces, times); without it, none."""
    import httpx

    from tests.conftest import Daemon, make_home

    logs = {}
    for debug in ("1", "0"):
        home = make_home(tmp_path / f"debug-{debug}", smollm2_path)
        d = Daemon(home, env={"LLMRUN_DEBUG": debug, "LLMRUN_NUM_PARALLEL": "1"}).start()
        try:
            r = httpx.post(f"{d.url}/api/generate", timeout=120, json={
                "model": "smollm2", "prompt": FACTS, "stream": False,
                "options": {"num_predict": 3, "temperature": 0}})
            assert r.status_code == 200, r.text
        finally:
            d.stop()
        logs[debug] = "".join(p.read_text() for p in (home / "logs").glob("runner-*.log"))
    steps = [line for line in logs["1"].splitlines() if "DEBUG step:" in line]
    # the prompt read in one piece from cell 0, then a step per generated token
    assert len(steps) >= 3, logs["1"][-2000:]
    assert "generating; prompt pieces (cells before, tokens) [(0, " in steps[0]
    assert "ms decoding" in steps[-1]
    assert "step:" not in logs["0"] and logs["0"]
