"""Thinking in every dialect, on SmolLM2 given a thinking template (ChatML plus Qwen 3's
`enable_thinking` switch, opening `<think>` in the generation prompt): Ollama's `think` and
`message.thinking`, OpenAI's `reasoning_effort` and `reasoning_content`, Anthropic's `thinking`
blocks and `thinking_delta` events.

What the model thinks is checked against the same prompt run raw (greedy): the thought is the
text up to `</think>`, the answer what follows it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.conftest import Daemon

MODEL = "smollm2-think"
TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}")
PROMPT = "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"
HI = [{"role": "user", "content": "Say hi"}]
N = 12
GREEDY = {"temperature": 0, "seed": 1}


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[ollama.Client]:
    c = ollama.Client(host=daemon.url)
    c.create(model=MODEL, from_="smollm2", template=TEMPLATE)
    yield c
    c.delete(MODEL)


def raw(client: ollama.Client, prompt: str) -> str:
    return client.generate(model=MODEL, raw=True, prompt=prompt,
                           options={"num_predict": N, **GREEDY}).response


@pytest.fixture(scope="module")
def thought(client: ollama.Client) -> tuple[str, str]:
    """(thinking, answer) the model gives when it thinks."""
    out = raw(client, PROMPT + "<think>\n")
    thinking, _, answer = out.partition("</think>")
    assert thinking.strip()
    return thinking, answer.lstrip()


@pytest.fixture(scope="module")
def unthought(client: ollama.Client) -> str:
    """The answer when thinking is switched off (the template closes an empty thought)."""
    return raw(client, PROMPT + "<think>\n\n</think>\n\n")


def test_ollama_chat_thinks_when_asked(client: ollama.Client, thought: tuple[str, str]) -> None:
    r = client.chat(model=MODEL, messages=HI, think=True, options={"num_predict": N, **GREEDY})
    assert (r.message.thinking, r.message.content) == thought
    parts = list(client.chat(model=MODEL, messages=HI, think=True, stream=True,
                             options={"num_predict": N, **GREEDY}))
    assert "".join(p.message.thinking or "" for p in parts) == thought[0]
    assert "".join(p.message.content for p in parts) == thought[1]
    assert all(not (p.message.thinking and p.message.content) for p in parts)
    # left unset, a thinking model thinks (its template's default), as with Ollama
    r = client.chat(model=MODEL, messages=HI, options={"num_predict": N, **GREEDY})
    assert (r.message.thinking or "", r.message.content) == thought


def test_ollama_think_false_and_generate(client: ollama.Client, thought: tuple[str, str],
                                         unthought: str) -> None:
    r = client.chat(model=MODEL, messages=HI, think=False, options={"num_predict": N, **GREEDY})
    assert not r.message.thinking and r.message.content == unthought
    g = client.generate(model=MODEL, prompt="Say hi", think=True,
                        options={"num_predict": N, **GREEDY})
    assert (g.thinking, g.response) == thought


def test_a_model_that_cannot_think(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="smollm2", messages=HI, think=True, options={"num_predict": 1})
    assert err.value.status_code == 400 and "does not support thinking" in str(err.value)
    r = client.chat(model="smollm2", messages=HI, think=False, options={"num_predict": 2})
    assert r.message.content and not r.message.thinking
    assert "thinking" in client.show(MODEL).capabilities
    assert "thinking" not in client.show("smollm2").capabilities


def test_openai_reasoning_content(daemon: Daemon, thought: tuple[str, str],
                                  unthought: str) -> None:
    oa = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0)
    kw: dict[str, Any] = {"model": MODEL, "messages": HI, "max_tokens": N, **GREEDY}
    msg = oa.chat.completions.create(reasoning_effort="low", **kw).choices[0].message
    assert (msg.model_extra or {}).get("reasoning_content") == thought[0]
    assert (msg.content or "") == thought[1]
    deltas = [c.choices[0].delta for c in oa.chat.completions.create(
        reasoning_effort="high", stream=True, **kw) if c.choices]
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) \
        == thought[0]
    off = oa.chat.completions.create(extra_body={"chat_template_kwargs":
                                                 {"enable_thinking": False}}, **kw)
    assert off.choices[0].message.content == unthought


def test_anthropic_thinking_blocks(daemon: Daemon, thought: tuple[str, str],
                                   unthought: str) -> None:
    ac = anthropic.Anthropic(base_url=daemon.url, api_key="x", max_retries=0)
    kw: dict[str, Any] = {"model": MODEL, "messages": HI, "max_tokens": N,
                          "extra_body": GREEDY}
    msg = ac.messages.create(thinking={"type": "enabled", "budget_tokens": 1024}, **kw)
    assert msg.content[0].type == "thinking"
    assert msg.content[0].thinking == thought[0] and msg.content[0].signature
    assert msg.content[1].type == "text" and msg.content[1].text == thought[1]
    # the SDK's stream helper checks the event order and assembles the same blocks
    with ac.messages.stream(thinking={"type": "enabled", "budget_tokens": 1024}, **kw) as s:
        kinds = [e.delta.type for e in s if e.type == "content_block_delta"]
        final = s.get_final_message()
    assert "thinking_delta" in kinds and kinds.count("signature_delta") == 1
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in msg.content]
    # display "omitted" (what Claude Code sends): the model thinks, the thought is not sent
    quiet = ac.messages.create(thinking={"type": "adaptive", "display": "omitted"}, **kw)
    assert [b.type for b in quiet.content] == ["text"] and quiet.content[0].text == thought[1]
    # without `thinking` the model is told not to think
    plain = ac.messages.create(**kw)
    assert [b.type for b in plain.content] == ["text"] and plain.content[0].text == unthought


def test_anthropic_thinking_is_ignored_by_a_model_that_cannot_think(daemon: Daemon) -> None:
    r = httpx.post(daemon.url + "/v1/messages", json={
        "model": "smollm2", "max_tokens": 4, "messages": HI, "temperature": 0,
        "thinking": {"type": "adaptive"}}, timeout=120)
    assert r.status_code == 200, r.text
    assert [b["type"] for b in r.json()["content"]] == ["text"]


def test_responses_reasoning_items(daemon: Daemon, thought: tuple[str, str],
                                   unthought: str) -> None:
    oa = openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0)
    kw: dict[str, Any] = {"model": MODEL, "input": HI, "max_output_tokens": N,
                          "temperature": 0, "store": False}
    r = oa.responses.create(reasoning={"effort": "low", "summary": "auto"}, **kw)
    # a message item follows when the answer began within the N tokens
    assert [o.type for o in r.output] == ["reasoning"] + (["message"] if thought[1] else [])
    assert r.output[0].summary[0].text == thought[0]  # type: ignore[union-attr]
    assert r.output_text == thought[1]
    events = list(oa.responses.create(reasoning={"effort": "high", "summary": "auto"},
                                      stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added"
    assert "response.reasoning_summary_text.delta" in kinds
    if thought[1]:
        assert kinds.index("response.reasoning_text.done") < kinds.index(
            "response.output_text.delta")
    final = events[-1].response  # type: ignore[union-attr]
    assert [o.type for o in final.output] == [o.type for o in r.output]
    summary = "".join(e.delta for e in events  # type: ignore[union-attr]
                      if e.type == "response.reasoning_summary_text.delta")
    assert summary == thought[0]
    off = oa.responses.create(reasoning={"effort": "none"}, **kw)
    assert [o.type for o in off.output] == ["message"] and off.output_text == unthought
