"""Speculative decoding by prompt lookup (engine/draft.py): drafts change the speed, never
the text. Each engine test runs the same prompts with drafting off and with drafting forced
on every step it can (the cost model told that a row is free), and compares exactly: text,
log-probabilities, finish reasons and the KV cells each slot holds afterwards."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmrun.engine.batcher import SeqParams
from llmrun.engine.draft import (
    PROBE_ROWS,
    Acceptance,
    DraftModel,
    History,
    StepCost,
    draft_length,
    probe_exact_rows,
)
from llmrun.engine.llama import Batch, Context, LlamaError, Model
from tests.conftest import wait_until
from tests.integration.test_engine import GREEDY, Harness

# A file and the request to repeat it with one name changed: the answer copies the prompt.
SOURCE = '''def total(items):
    result = 0
    for item in items:
        if item.price > 0:
            result += item.price * item.count
    return result


def average(items):
    if not items:
        return 0
    return total(items) / len(items)
'''
EDIT = (f"Here is a Python file:\n```python\n{SOURCE}```\n"
        f"Here is the same file with `result` renamed to `amount`:\n```python\n")


# -- the parts ------------------------------------------------------------------------------


def test_history_proposes_what_followed_the_latest_longest_tail() -> None:
    h = History([1, 2, 3, 4, 5, 9, 2, 3, 7, 8])
    for tok in (6, 2, 3):
        h.append(tok)
    # the tail (2, 3) occurred twice: the latest occurrence's continuation comes first
    assert h.propose(3) == [7, 8, 6]
    # a longer recurring tail wins over a later shorter one
    h = History([5, 1, 2, 3, 40, 41, 9, 2, 3, 50, 0, 1, 2, 3])
    assert h.propose(2) == [40, 41]


def test_history_needs_a_recurring_tail_of_two_tokens() -> None:
    assert History([1, 2, 3, 4]).propose(4) == []
    assert History([7, 1, 8, 1]).propose(4) == []  # one token recurring is not enough
    assert History([1, 2]).propose(4) == []
    assert History([1, 2, 9, 1, 2]).propose(0) == []


def test_history_stops_at_its_end_and_grows() -> None:
    h = History([1, 2, 3, 1, 2])
    assert h.propose(10) == [3, 1, 2]  # what followed, up to the tokens known
    for i in range(500):  # past the first array's size
        h.append(100 + i % 7)
    assert h.n == 505
    assert h.propose(3) == [100 + (500 % 7), 100 + (501 % 7), 100 + (502 % 7)]


def test_acceptance_moves_with_outcomes() -> None:
    a = Acceptance()
    start = a.p
    a.update(5, False)
    assert a.p > start
    high = a.p
    a.update(0, True)
    assert a.p < high
    for _ in range(200):
        a.update(0, True)
    assert a.p < 1e-3
    for _ in range(200):
        a.update(10, False)
    assert 0.99 < a.p < 1.0


def test_draft_length_drafts_only_what_pays() -> None:
    assert draft_length(0.9, 0.95, 16) == 0  # a row costs more than it is likely to win
    assert draft_length(0.9, math.inf, 16) == 0  # nothing measured yet
    assert draft_length(0.99, 0.0, 16) == 16  # free rows: as many as allowed
    assert draft_length(0.95, 0.5, 16) == 13  # 0.95**13 > 0.5 > 0.95**14
    assert draft_length(0.95, 0.5, 4) == 4
    assert draft_length(0.95, 0.5, 0) == 0


def test_step_cost_learns_what_a_row_costs() -> None:
    cost = StepCost()
    assert cost.row_share(1, 1) == math.inf
    for _ in range(50):  # compute-bound: each row costs 8 ms over 3 ms of fixed work
        cost.observe(1, 0.011)
        cost.observe(9, 0.075)
    assert cost.row_share(1, 1) == pytest.approx(8 / 11, rel=0.05)
    # four sequences each waiting for their token: one more row costs each of them less
    assert cost.row_share(4, 4) == pytest.approx(8 * 4 / 35, rel=0.05)
    cost.observe(512, 1.0)  # a prompt being read says nothing about decode rows
    assert cost.row_share(1, 1) == pytest.approx(8 / 11, rel=0.05)


# -- in the engine --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(smollm2_path: Path) -> Iterator[Model]:
    m = Model(smollm2_path)
    yield m
    m.close()


def forced(h: Harness) -> Harness:
    """Draft whenever a guess exists: the cost model is told a row costs nothing."""
    h.engine.step_cost.row_share = lambda rows, tokens: 0.0  # type: ignore[method-assign]
    return h


def run(model: Model, prompts: list[list[int]], draft: int, n_ctx: int = 1024,
        slots: int = 1, **params: Any) -> tuple[list[str], list[dict[str, Any]], Harness]:
    """Generate for every prompt at once, drafting up to `draft` tokens (forced)."""
    h = forced(Harness(model, slots=slots, n_ctx=n_ctx))
    rids = []
    sampling = {**GREEDY, **params.pop("sampling", {})}
    for i, prompt in enumerate(prompts):
        rid = f"p{i}"
        h.engine.submit(rid, prompt, SeqParams(sampling=sampling, draft=draft, **params))
        rids.append(rid)
    texts = h.wait(*rids)
    return texts, [h.final[r][1] for r in rids], h


def closed(h: Harness) -> None:
    """Check every slot's cells are exactly the tokens it believes it holds, then close."""
    try:
        wait_until(lambda: all(s.seq is None for s in h.engine.slots), what="slots free")
        for slot in h.engine.slots:
            assert h.ctx.seq_pos_max(slot.seq_id) == len(slot.tokens) - 1
    finally:
        h.close()


def compare(model: Model, prompts: list[list[int]], n_ctx: int = 1024, slots: int = 1,
            **params: Any) -> tuple[list[str], list[dict[str, Any]]]:
    plain, plain_stats, h = run(model, prompts, 0, n_ctx, slots, **dict(params))
    closed(h)
    texts, stats, h = run(model, prompts, 16, n_ctx, slots, **dict(params))
    try:
        assert texts == plain
        for a, b in zip(stats, plain_stats, strict=True):
            assert a["finish_reason"] == b["finish_reason"]
            assert a["completion_tokens"] == b["completion_tokens"]
            assert a["stop_sequence"] == b["stop_sequence"]
            assert b["draft_tokens"] == 0
    finally:
        closed(h)
    return texts, stats


def test_drafted_greedy_output_is_plain_output(model: Model) -> None:
    prompt = model.tokenize(EDIT, add_special=True)
    texts, stats = compare(model, [prompt], max_tokens=120)
    assert "amount" in texts[0] or "result" in texts[0]  # it is copying the file
    s = stats[0]
    assert s["draft_tokens"] >= 20 and s["draft_accepted"] >= 10, s
    assert s["draft_accepted"] <= s["draft_tokens"]


def test_drafted_sampled_output_is_the_same_with_the_same_seed(model: Model) -> None:
    # every token is still drawn by the sequence's own chain, once per token output
    prompt = model.tokenize(EDIT, add_special=True)
    sampling = {"temperature": 0.7, "top_k": 40, "top_p": 0.9, "repeat_penalty": 1.1,
                "seed": 7}
    _, stats = compare(model, [prompt], max_tokens=80, sampling=sampling)
    assert stats[0]["draft_tokens"] > 0


def test_drafts_respect_max_tokens_stops_and_the_context_end(model: Model) -> None:
    prompt = model.tokenize(EDIT, add_special=True)
    for n in (1, 2, 5, 17):  # drafts may never carry the output past num_predict
        _, stats = compare(model, [prompt], max_tokens=n)
        assert stats[0]["completion_tokens"] == n
    # a stop string met inside a run of drafted tokens ends the output where it ends alone
    _, stats = compare(model, [prompt], max_tokens=120, stops=["/ len("])
    assert stats[0]["stop_sequence"] == "/ len(" and stats[0]["finish_reason"] == "stop"
    # the context ends while drafts would run past it
    n_ctx = len(prompt) + 40
    _, stats = compare(model, [prompt], n_ctx=n_ctx, max_tokens=-1)
    assert stats[0]["finish_reason"] == "length"
    assert stats[0]["prompt_tokens"] + stats[0]["completion_tokens"] <= n_ctx


def test_drafted_logprobs_are_plain_logprobs(model: Model) -> None:
    prompt = model.tokenize(EDIT, add_special=True)
    plain, _, h = run(model, [prompt], 0, max_tokens=40, logprobs=3)
    want = h.logprobs["p0"]
    closed(h)
    texts, stats, h = run(model, [prompt], 16, max_tokens=40, logprobs=3)
    try:
        assert texts == plain and stats[0]["draft_accepted"] > 0
        assert h.logprobs["p0"] == want
    finally:
        closed(h)


def test_drafting_beside_other_sequences_changes_nothing(model: Model) -> None:
    # four at once, each its own copy task or free text, drafting where it can; then the
    # same four with drafting off: every text the same, every slot's cells consistent
    prompts = [model.tokenize(EDIT, add_special=True),
               model.tokenize(EDIT.replace("result", "acc"), add_special=True),
               model.tokenize("Write a poem about cats.", add_special=True),
               model.tokenize("a b c a b c a b c a b", add_special=True)]
    _, stats = compare(model, prompts, slots=4, max_tokens=60)
    assert sum(s["draft_accepted"] for s in stats) > 0


def test_a_follow_up_reuses_the_cells_a_drafting_request_left(model: Model) -> None:
    # rejected drafts' cells are dropped: the next request on the slot reuses only cells
    # that hold its tokens, and answers as a fresh engine does
    prompt = model.tokenize(EDIT, add_special=True)
    _, _, h = run(model, [prompt], 16, max_tokens=60)
    try:
        follow = prompt + model.tokenize("def total(items):", add_special=False)
        rid = "follow"
        h.engine.submit(rid, follow, SeqParams(sampling=dict(GREEDY), max_tokens=30, draft=0))
        (reused,) = h.wait(rid)
        assert h.final[rid][1]["cached_tokens"] >= len(prompt)
    finally:
        closed(h)
    fresh, _, h = run(model, [follow], 0, max_tokens=30)
    closed(h)
    assert reused.split()[:8] == fresh[0].split()[:8]


def test_probe_measures_and_leaves_no_cells(model: Model) -> None:
    ctx = Context(model, n_ctx_seq=256, n_seq=1, n_batch=64, n_threads=1)
    try:
        tokens = model.tokenize(SOURCE, add_special=True)
        batch = Batch(64)
        for i, tok in enumerate(tokens[:20]):
            batch.add(tok, i, 0, False)
        assert ctx.decode(batch) == 0
        batch.close()
        rows = probe_exact_rows(ctx, 0, 20, tokens[20:])
        # one thread, a short context, Q4_1: llama.cpp computes each row alike
        assert 2 <= rows <= PROBE_ROWS
        assert ctx.seq_pos_max(0) == 19
    finally:
        ctx.close()


# -- a draft model ----------------------------------------------------------------------------


def with_draft_model(model: Model, path: Path, prompts: list[list[int]], slots: int = 1,
                     n_ctx: int = 1024, **params: Any
                     ) -> tuple[list[str], list[dict[str, Any]], Harness]:
    """Generate for every prompt at once with `path` as the draft model, drafting up to 8
    tokens whenever it can (rows and the draft model's time taken as free)."""
    draft = Model(path)
    ctx = Context(draft, n_ctx_seq=n_ctx, n_seq=slots, n_batch=512, n_threads=1)
    drafter = DraftModel(draft, ctx, slots)
    drafter.check_vocabulary(model)
    h = forced(Harness(model, slots=slots, n_ctx=n_ctx, drafter=drafter))
    h.engine._drafter_share = lambda: 0.0  # type: ignore[method-assign]
    sampling = {**GREEDY, **params.pop("sampling", {})}
    rids = [f"d{i}" for i in range(len(prompts))]
    for rid, prompt in zip(rids, prompts, strict=True):
        h.engine.submit(rid, prompt, SeqParams(sampling=sampling, draft=8, **params))
    try:
        texts = h.wait(*rids)
    finally:
        h.close_drafter = drafter.close  # type: ignore[attr-defined]
    return texts, [h.final[r][1] for r in rids], h


def closed_with_drafter(h: Harness) -> None:
    try:
        closed(h)
    finally:
        h.close_drafter()  # type: ignore[attr-defined]


def test_draft_model_greedy_output_is_plain_output(model: Model, smollm2_path: Path) -> None:
    # SmolLM2 drafting for itself: nearly every guess comes true, and nothing changes
    prompts = [model.tokenize(EDIT, add_special=True),
               model.tokenize("Once upon a time, in a small village,", add_special=True)]
    plain, plain_stats, h = run(model, prompts, 0, slots=2, max_tokens=60)
    closed(h)
    texts, stats, h = with_draft_model(model, smollm2_path, prompts, slots=2, max_tokens=60)
    try:
        assert texts == plain
        for a, b in zip(stats, plain_stats, strict=True):
            assert (a["finish_reason"], a["completion_tokens"]) == \
                (b["finish_reason"], b["completion_tokens"])
            assert a["draft_tokens"] >= 20 and a["draft_accepted"] >= 0.8 * a["draft_tokens"], a
    finally:
        closed_with_drafter(h)


def test_draft_model_sampled_output_is_the_same_with_the_same_seed(model: Model,
                                                                   smollm2_path: Path) -> None:
    prompt = model.tokenize("Tell me about the sea.", add_special=True)
    sampling = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "seed": 11}
    plain, _, h = run(model, [prompt], 0, max_tokens=50, sampling=dict(sampling))
    closed(h)
    texts, stats, h = with_draft_model(model, smollm2_path, [prompt], max_tokens=50,
                                       sampling=dict(sampling))
    try:
        assert texts == plain and stats[0]["draft_tokens"] > 0
    finally:
        closed_with_drafter(h)


def test_draft_model_of_another_vocabulary_is_refused(model: Model, gemma3_path: Path) -> None:
    draft = Model(gemma3_path)
    ctx = Context(draft, n_ctx_seq=256, n_seq=1, n_batch=512, n_threads=1)
    drafter = DraftModel(draft, ctx, 1)
    try:
        with pytest.raises(LlamaError, match="vocabulary"):
            drafter.check_vocabulary(model)
    finally:
        drafter.close()


def test_a_modelfile_names_a_draft_model(tmp_path: Path, smollm2_path: Path,
                                         gemma3_path: Path) -> None:
    import httpx

    from llmrun.store import Store
    from tests.conftest import Daemon, make_home

    home = make_home(tmp_path / "home", smollm2_path)
    store = Store(home)
    store.create("gemma3", f"FROM {gemma3_path}\n")
    store.create("spec", f"FROM {smollm2_path}\nPARAMETER draft_model smollm2\n")
    store.create("wrong", f"FROM {smollm2_path}\nPARAMETER draft_model gemma3\n")
    store.create("missing", f"FROM {smollm2_path}\nPARAMETER draft_model nothing-here\n")
    d = Daemon(home, env={"LLMRUN_NUM_PARALLEL": "1"}).start()
    try:
        def ask(model: str) -> httpx.Response:
            return httpx.post(d.url + "/api/generate", timeout=120, json={
                "model": model, "prompt": EDIT, "raw": True, "stream": False,
                "options": {"temperature": 0, "num_predict": 60}})

        plain, drafted = ask("smollm2"), ask("spec")
        assert drafted.status_code == 200, drafted.text
        assert drafted.json()["response"] == plain.json()["response"]
        # loaded beside it (whether its guesses are sent is the cost model's call: on this
        # CPU a model drafting for itself never pays; the engine tests above force it)
        logs = "".join(p.read_text() for p in (home / "logs").glob("runner-*.log"))
        assert "draft model" in logs and "checked in the model's decodes" in logs
        bad = ask("wrong")
        assert bad.status_code >= 400 and "vocabulary" in bad.text, bad.text
        gone = ask("missing")
        assert gone.status_code == 400 and "nothing-here" in gone.text, gone.text
    finally:
        d.stop()
