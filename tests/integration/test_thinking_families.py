"""Thoughts of each family through the real daemon in all four dialects: a copy of SmolLM2
given the family's real chat template (tests/fakes/templates/), thinking switched on the
dialect's way, its whole output forced by the `grammar` field to what a model of that family
writes (a thought, then the answer): OpenAI chat's reasoning_content, a Responses reasoning
item, an Anthropic thinking block before the text, Ollama's message.thinking, whole and
streamed. And the thinking budget: a thought the prompt opened ends after N tokens, with the
answer after it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest

from tests.conftest import Daemon

TEMPLATES = Path(__file__).parents[1] / "fakes" / "templates"
THOUGHT, ANSWER = "The user greets me.", "Hello there!"
# what each family writes when it thinks (after its generation prompt with thinking on)
FAMILIES = {
    "harmony": ("openai-gpt-oss-120b.jinja",
                f"<|channel|>analysis<|message|>{THOUGHT}<|end|>"
                f"<|start|>assistant<|channel|>final<|message|>{ANSWER}"),
    "glm": ("GLM-4.6.jinja", f"\n<think>{THOUGHT}</think>\n{ANSWER}"),
    # its generation prompt opens the thought: the output starts inside it
    "deepseek-v3.1": ("deepseek-ai-DeepSeek-V3.1.jinja", f"{THOUGHT}</think>{ANSWER}"),
    "qwen3": ("Qwen-Qwen3-0.6B.jinja", f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"),
}
HI = [{"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def models(daemon: Daemon) -> Iterator[dict[str, str]]:
    c = ollama.Client(host=daemon.url)
    names = {}
    for family, (template, _) in FAMILIES.items():
        names[family] = f"smollm2-think-{family.replace('.', '')}"
        c.create(model=names[family], from_="smollm2",
                 template=(TEMPLATES / template).read_text())
    yield names
    for name in names.values():
        c.delete(name)


def grammar(family: str) -> str:
    return "start: " + json.dumps(FAMILIES[family][1])


def events(api: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The streamed answer's events: SSE data, or Ollama's lines."""
    out = []
    with api.stream("POST", path, json={**body, "stream": True}, timeout=120) as s:
        assert s.status_code == 200, s.read()
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                out.append(json.loads(line[6:]))
            elif line.startswith("{"):
                out.append(json.loads(line))
    return out


def check(thought: str, answer: str) -> None:
    assert thought.strip() == THOUGHT, thought
    assert answer.strip() == ANSWER, answer


@pytest.mark.parametrize("family", list(FAMILIES))
def test_openai_chat_reasoning_content(api: httpx.Client, models: dict[str, str],
                                       family: str) -> None:
    body = {"model": models[family], "messages": HI, "max_tokens": 80, "temperature": 0,
            "reasoning_effort": "medium", "grammar": grammar(family)}
    r = api.post("/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    check(message.get("reasoning_content") or "", message["content"] or "")
    deltas = [e["choices"][0]["delta"] for e in events(api, "/v1/chat/completions", body)
              if e.get("choices")]
    thought = "".join(d.get("reasoning_content") or "" for d in deltas)
    answer = "".join(d.get("content") or "" for d in deltas)
    assert (thought, answer) == (message["reasoning_content"], message["content"])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_responses_reasoning_item(api: httpx.Client, models: dict[str, str],
                                  family: str) -> None:
    body = {"model": models[family], "input": HI, "max_output_tokens": 80, "temperature": 0,
            "store": False, "reasoning": {"effort": "medium"}, "grammar": grammar(family)}
    r = api.post("/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    output = r.json()["output"]
    assert [o["type"] for o in output] == ["reasoning", "message"], output
    check(output[0]["content"][0]["text"], output[1]["content"][0]["text"])
    streamed = events(api, "/v1/responses", body)
    thought = "".join(e["delta"] for e in streamed
                      if e.get("type") == "response.reasoning_text.delta")
    answer = "".join(e["delta"] for e in streamed
                     if e.get("type") == "response.output_text.delta")
    check(thought, answer)
    final = streamed[-1]["response"]["output"]
    assert [o["type"] for o in final] == ["reasoning", "message"]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_anthropic_thinking_block_before_the_text(api: httpx.Client, models: dict[str, str],
                                                  family: str) -> None:
    body = {"model": models[family], "messages": HI, "max_tokens": 200, "temperature": 0,
            "thinking": {"type": "enabled", "budget_tokens": 100},
            "grammar": grammar(family)}
    r = api.post("/v1/messages", json=body, timeout=120)
    assert r.status_code == 200, r.text
    content = r.json()["content"]
    assert [b["type"] for b in content] == ["thinking", "text"], content
    check(content[0]["thinking"], content[1]["text"])
    streamed = events(api, "/v1/messages", body)
    starts = [e["content_block"]["type"] for e in streamed
              if e.get("type") == "content_block_start"]
    assert starts == ["thinking", "text"]
    deltas = [e["delta"] for e in streamed if e.get("type") == "content_block_delta"]
    check("".join(d.get("thinking", "") for d in deltas if d["type"] == "thinking_delta"),
          "".join(d.get("text", "") for d in deltas if d["type"] == "text_delta"))


@pytest.mark.parametrize("family", list(FAMILIES))
def test_ollama_message_thinking(api: httpx.Client, models: dict[str, str],
                                 family: str) -> None:
    body = {"model": models[family], "messages": HI, "think": True, "stream": False,
            "options": {"num_predict": 80, "temperature": 0}, "grammar": grammar(family)}
    r = api.post("/api/chat", json=body, timeout=120)
    assert r.status_code == 200, r.text
    message = r.json()["message"]
    check(message.get("thinking") or "", message["content"])
    lines = events(api, "/api/chat", body)
    thought = "".join(e["message"].get("thinking") or "" for e in lines)
    answer = "".join(e["message"]["content"] for e in lines)
    assert (thought, answer) == (message["thinking"], message["content"])


# -- the thinking budget: DeepSeek V3.1's prompt opens the thought, SmolLM2 never ends it ----

N = 6


def tokens(api: httpx.Client, model: str, text: str) -> int:
    r = api.post("/tokenize", json={"model": model, "content": text}, timeout=60)
    assert r.status_code == 200, r.text
    return len(r.json()["tokens"])


def test_a_budget_ends_the_thought_and_the_answer_follows(api: httpx.Client,
                                                          models: dict[str, str]) -> None:
    model = models["deepseek-v3.1"]
    base = {"model": model, "messages": HI, "max_tokens": 40, "temperature": 0,
            "reasoning_effort": "high"}
    free = api.post("/v1/chat/completions", json=base, timeout=120).json()["choices"][0]
    # without a budget the whole output is thought: the model never writes </think>
    assert not free["message"]["content"] and free["message"]["reasoning_content"]
    r = api.post("/v1/chat/completions", json={**base, "reasoning_budget": N}, timeout=120)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    thought, answer = message["reasoning_content"], message["content"]
    assert 0 < tokens(api, model, thought) <= N
    assert free["message"]["reasoning_content"].startswith(thought)  # the same thought, cut
    assert answer and "</think>" not in answer
    # Anthropic's budget_tokens, streamed: the same split
    streamed = events(api, "/v1/messages", {
        "model": model, "messages": HI, "max_tokens": 40, "temperature": 0,
        "thinking": {"type": "enabled", "budget_tokens": N}})
    deltas = [e["delta"] for e in streamed if e.get("type") == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == thought
    assert "".join(d.get("text", "") for d in deltas) == answer
    # a budget of 0: no thought at all
    none = api.post("/v1/chat/completions", json={**base, "reasoning_budget": 0},
                    timeout=120).json()["choices"][0]["message"]
    assert not none.get("reasoning_content") and none["content"]


def test_a_budget_ends_a_thought_the_model_opened(api: httpx.Client,
                                                 models: dict[str, str]) -> None:
    """Qwen 3's prompt leaves the thought to the model: the budget counts from the `<think>`
    it writes (here as a grammar lets it: any thought, its end, then the answer)."""
    model = models["qwen3"]
    body = {"model": model, "messages": HI, "max_tokens": 80, "temperature": 0,
            "reasoning_effort": "high",
            "grammar": 'start: "<think>" /[a-z ]{1,300}/ "</think>" " Hello there!"'}
    free = api.post("/v1/chat/completions", json=body, timeout=120).json()
    long = free["choices"][0]["message"]["reasoning_content"]
    assert tokens(api, model, long) > N  # unbudgeted, the thought runs on
    r = api.post("/v1/chat/completions", json={**body, "reasoning_budget": N}, timeout=120)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert 0 < tokens(api, model, message["reasoning_content"]) <= N
    assert long.startswith(message["reasoning_content"])
    assert message["content"] == "Hello there!"  # (the blank after the thought: dropped)


def test_after_a_budget_the_answer_keeps_its_format(api: httpx.Client,
                                                   models: dict[str, str]) -> None:
    """The format's constraint waits for the thought's end: the end the budget forced
    starts it, and the answer is the schema's."""
    model = models["deepseek-v3.1"]
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    r = api.post("/v1/chat/completions", json={
        "model": model, "messages": HI, "max_tokens": 60, "temperature": 0,
        "reasoning_effort": "high", "reasoning_budget": 4,
        "response_format": {"type": "json_schema",
                            "json_schema": {"name": "n", "schema": schema, "strict": True}}},
        timeout=120)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert 0 < tokens(api, model, message["reasoning_content"]) <= 4
    assert isinstance(json.loads(message["content"])["n"], int)


def test_a_budgeted_request_leaves_its_batch_neighbour_as_it_was(
        api: httpx.Client, models: dict[str, str]) -> None:
    """Two requests on one runner, decoded in the same steps: the budget that forces one's
    tokens changes nothing of the other's."""
    base = {"model": models["deepseek-v3.1"], "max_tokens": 40, "temperature": 0,
            "reasoning_effort": "high"}
    a = {**base, "messages": HI}
    b = {**base, "messages": [{"role": "user", "content": "Tell me about cats."}]}

    def answer(body: dict[str, Any]) -> tuple[str, str]:
        r = api.post("/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        message = r.json()["choices"][0]["message"]
        return message.get("reasoning_content") or "", message["content"] or ""

    def together(first: dict[str, Any]) -> tuple[tuple[str, str], tuple[str, str]]:
        with ThreadPoolExecutor(2) as pool:
            fa, fb = pool.submit(answer, first), pool.submit(answer, b)
            return fa.result(), fb.result()

    # (against the same pair unbudgeted, not against b alone: a greedy answer alone and
    # one in a batch of two may part after a few tokens on this build, budget or none)
    answer(b)  # the prompt cache holds b's prompt for both runs alike
    free_a, beside_free = together(a)
    cut_a, beside_cut = together({**a, "reasoning_budget": 3})
    assert cut_a != free_a and cut_a[1]  # the budget applied: an answer after 3 tokens
    assert beside_cut == beside_free


def test_a_bad_budget_is_a_clear_error(api: httpx.Client, models: dict[str, str]) -> None:
    model = models["deepseek-v3.1"]
    r = api.post("/v1/chat/completions", json={"model": model, "messages": HI,
                                               "reasoning_budget": -7}, timeout=60)
    assert r.status_code == 400 and "reasoning_budget" in r.text
    r = api.post("/v1/messages", json={"model": model, "messages": HI, "max_tokens": 10,
                                       "thinking": {"type": "enabled", "budget_tokens": "50"}},
                 timeout=60)
    assert r.status_code == 400 and "budget_tokens" in r.text
