"""A chat format derived from the template (formats/derive.py) through the real daemon: a
copy of SmolLM2 given a template of no known family (the unit tests' OWN), its output
forced to calls in that template's pieces, read in the OpenAI dialect whole and streamed;
a call forced by tool_choice in the same pieces (Anthropic's "any"); and the derived
grammar checked against SmolLM2's vocabulary."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import ollama
import pytest

from llmrun.chat import formats
from llmrun.chat.tools import TemplateInfo, ToolPlan
from llmrun.request import Tool, ToolCall
from tests.conftest import Daemon
from tests.integration.test_formats import WEATHER, consumed, smollm2_tokenizer
from tests.unit.chat.test_formats_derived import OWN

__all__ = ["smollm2_tokenizer"]
CALL = ToolCall(id="a", name="get_weather", arguments={"city": "Zürich", "days": 3})
INFO = TemplateInfo("hermes", native=True, native_calls=True, native_results=True)


@pytest.fixture(scope="module")
def own(daemon: Daemon) -> Iterator[str]:
    c = ollama.Client(host=daemon.url)
    c.create(model="smollm2-own", from_="smollm2", template=OWN)
    yield "smollm2-own"
    c.delete("smollm2-own")


def written() -> str:
    return "Checking. " + formats.detect(OWN).write_calls([CALL], INFO)


def test_openai_reads_the_derived_format_whole_and_streamed(api: httpx.Client,
                                                            own: str) -> None:
    body: dict[str, Any] = {
        "model": own, "messages": [{"role": "user", "content": "Weather in Zürich?"}],
        "tools": [WEATHER], "max_tokens": 120, "temperature": 0,
        "grammar": "start: " + json.dumps(written())}
    r = api.post("/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    [call] = message["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == \
        ("get_weather", CALL.arguments)
    assert message["content"].strip() == "Checking."
    text, args = "", ""
    with api.stream("POST", "/v1/chat/completions", json={**body, "stream": True},
                    timeout=120) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text += delta.get("content") or ""
                for tc in delta.get("tool_calls") or []:
                    args += tc.get("function", {}).get("arguments") or ""
    assert text == message["content"] and json.loads(args) == CALL.arguments


def test_anthropic_forced_call_in_the_derived_pieces(api: httpx.Client, own: str) -> None:
    tool = {"name": "set_unit", "description": "Set the unit", "input_schema": {
        "type": "object", "properties": {"unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["unit"]}}
    r = api.post("/v1/messages", json={
        "model": own, "max_tokens": 100, "temperature": 0, "tools": [tool],
        "messages": [{"role": "user", "content": "Use celsius."}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}, timeout=120)
    assert r.status_code == 200, r.text
    uses = [b for b in r.json()["content"] if b["type"] == "tool_use"]
    assert [u["name"] for u in uses] == ["set_unit"]
    assert uses[0]["input"]["unit"] in ("celsius", "fahrenheit")


def test_the_derived_grammar_takes_the_pieces(smollm2_tokenizer: Any) -> None:
    fmt = formats.detect(OWN)
    weather = Tool(name="get_weather", parameters=WEATHER["function"]["parameters"])
    grammar = fmt.grammar(ToolPlan(INFO, [weather], "required", parallel=True))
    assert grammar is not None
    two = fmt.write_calls([CALL, CALL.model_copy(update={"arguments": {"city": "Oslo"}})], INFO)
    assert consumed(smollm2_tokenizer, grammar, two), (grammar, two)
    bad = fmt.write_calls([CALL.model_copy(update={"arguments": {"days": 3}})], INFO)
    assert not consumed(smollm2_tokenizer, grammar, bad)
