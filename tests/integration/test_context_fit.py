"""When a prompt or its answer outgrows num_ctx: a clear error by default;
`truncate` drops the oldest turns (keeping the system prompt and the last user turn) and
`shift` makes room while generating, and the response says what was dropped, in every
dialect. On the real model, with a 512-token context so that outgrowing it is quick."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmrun.store import Store
from tests.conftest import Daemon, make_home

SYSTEM = "You are a terse assistant. Always answer in one short sentence."


def history(turns: int) -> list[dict[str, str]]:
    out = [{"role": "system", "content": SYSTEM}]
    for i in range(turns):
        out += [{"role": "user", "content": f"Question {i}: " + "tell me about rivers. " * 12},
                {"role": "assistant", "content": f"Answer {i}: " + "rivers flow to the sea. " * 12}]
    return [*out, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Daemon]:
    home = make_home(tmp_path_factory.mktemp("fit-home"), smollm2_path)
    Store(home).create("fits", f"FROM {smollm2_path}\nPARAMETER truncate true\n"
                               "PARAMETER shift true\n")
    d = Daemon(home, env={"LLMRUN_CONTEXT_LENGTH": "512", "LLMRUN_NUM_PARALLEL": "1"}).start()
    yield d
    d.stop()


def chat(d: Daemon, messages: list[dict[str, str]], **extra: Any) -> httpx.Response:
    return httpx.post(d.url + "/api/chat", timeout=300, json={
        "model": "smollm2", "messages": messages, "stream": False,
        "options": {"temperature": 0, "num_predict": 16}, **extra})


def test_a_long_history_is_refused_by_default(small: Daemon) -> None:
    r = chat(small, history(8))
    assert r.status_code == 400
    assert "num_ctx" in r.json()["error"]


def test_truncate_drops_the_oldest_turns_and_says_so(small: Daemon) -> None:
    messages = history(8)
    r = chat(small, messages, truncate=True)
    assert r.status_code == 200, r.text
    out = r.json()
    dropped = out["truncated_messages"]
    assert dropped >= 2 and dropped % 2 == 0  # whole turns: a question and its answer
    assert out["truncated_tokens"] > 0 and out["prompt_eval_count"] < 512
    # exactly the system prompt and the newest turns: the same request, cut by hand, reads
    # a prompt of the same tokens (all of them already in the slot)
    by_hand = [messages[0], *messages[1 + dropped:]]
    same = chat(small, by_hand)
    assert same.status_code == 200, same.text
    assert same.json()["prompt_eval_count"] == out["prompt_eval_count"]
    assert "truncated_messages" not in same.json()


def test_truncate_cannot_save_a_last_turn_that_is_too_long(small: Daemon) -> None:
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "word " * 800}]
    r = chat(small, messages, truncate=True)
    assert r.status_code == 400 and "num_ctx" in r.json()["error"]


def test_shift_generates_past_the_context(small: Daemon) -> None:
    body = {"options": {"temperature": 0, "num_predict": 700, "repeat_penalty": 1.0}}
    prompt = [{"role": "user", "content": "Repeat the word hello forever: hello hello hello"}]
    plain = chat(small, prompt, **body)
    assert plain.status_code == 200, plain.text
    assert plain.json()["done_reason"] == "length" and plain.json()["eval_count"] < 512
    assert "shifted_tokens" not in plain.json()
    shifted = chat(small, prompt, shift=True, **body)
    assert shifted.status_code == 200, shifted.text
    out = shifted.json()
    assert out["eval_count"] == 700 and out["done_reason"] == "length"
    assert out["shifted_tokens"] > 0
    # and the slot serves the next request as usual
    again = chat(small, prompt, **body)
    assert again.status_code == 200 and again.json()["eval_count"] < 512


def test_a_modelfile_default_applies_in_the_other_dialects(small: Daemon) -> None:
    import anthropic
    import openai

    messages = history(8)
    with openai.OpenAI(base_url=small.url + "/v1", api_key="x", max_retries=0,
                       timeout=300) as oa:
        r = oa.chat.completions.create(model="fits", messages=messages,  # type: ignore[arg-type]
                                       max_tokens=8, temperature=0)
    usage = r.usage.model_dump()  # type: ignore[union-attr]
    assert usage["truncated_messages"] >= 2 and usage["truncated_tokens"] > 0
    with anthropic.Anthropic(base_url=small.url, api_key="x", max_retries=0,
                             timeout=300) as an:
        m = an.messages.create(model="fits", system=SYSTEM, messages=messages[1:],  # type: ignore[arg-type]
                               max_tokens=8)
    assert m.usage.model_dump()["truncated_messages"] >= 2


def test_a_long_prompt_reports_its_progress_when_asked(small: Daemon) -> None:
    """`return_progress` (llama-server's name): the stream opens once the prompt has a slot
    and says how far its reading is after each step (num_batch 128: a ~400-token prompt
    takes four), then the answer; without it, no such line."""
    import json

    def lines(text: str, **extra: Any) -> list[dict[str, Any]]:
        messages = [{"role": "user", "content": "Summarise: " + text * 70}]
        with httpx.stream("POST", small.url + "/api/chat", timeout=300, json={
                "model": "smollm2", "messages": messages, "stream": True,
                "options": {"num_batch": 128, "num_predict": 4}, **extra}) as r:
            assert r.status_code == 200
            return [json.loads(line) for line in r.iter_lines() if line]

    got = lines("the tide comes in. ", return_progress=True)
    progress = [x["prompt_progress"] for x in got if "prompt_progress" in x]
    assert len(progress) >= 2
    total = progress[0]["total"]
    assert total > 300 and all(p["total"] == total for p in progress)
    done = [p["processed"] for p in progress]
    assert done == sorted(done) and done[-1] < total
    first_text = next(i for i, x in enumerate(got) if "prompt_progress" not in x)
    assert all("prompt_progress" not in x for x in got[first_text:])
    assert got[-1]["done"] is True
    # (another prompt: the first is in the slot now, and would be read in one step)
    assert not any("prompt_progress" in x for x in lines("the wind goes out. "))
