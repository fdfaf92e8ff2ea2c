"""Tool calls as a small model writes them (issue 20), through the real daemon and the
three SDKs: SmolLM2-135M, steered by a system prompt and few-shot messages into answering
with a fenced JSON call (not the `<tool_call>` tags its prompt asks for), with tool_choice
"auto", the default of every agent. The call must come back as a call, streamed or not,
with nothing of it in the content."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import ollama
import openai
import pytest

from tests.conftest import Daemon

MODEL = "smollm2"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
READ = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}
OPENAI_TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather "
                                      "in a city", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "read_file", "description": "Read a file",
                                      "parameters": READ}},
]
SYSTEM = "You call tools by answering with a JSON object in a ```json code block, like the " \
         "examples."


def fenced(name: str, args: dict[str, Any]) -> str:
    return "```json\n" + json.dumps({"name": name, "arguments": args}) + "\n```"


SHOTS = [
    ("What's the weather in Rome?", fenced("get_weather", {"city": "Rome"})),
    ("Please read the file docs/readme.txt", fenced("read_file", {"path": "docs/readme.txt"})),
    ("What's the weather in Berlin?", fenced("get_weather", {"city": "Berlin"})),
    ("Please read the file setup.py", fenced("read_file", {"path": "setup.py"})),
]
QUESTION = "What's the weather in Paris?"
EXPECTED = ("get_weather", {"city": "Paris"})


def messages() -> list[dict[str, str]]:
    out = []
    for q, a in SHOTS:
        out += [{"role": "user", "content": q}, {"role": "assistant", "content": a}]
    return [*out, {"role": "user", "content": QUESTION}]


def leaked(text: str) -> bool:
    """Whether any of the call's text reached the content."""
    return any(s in text for s in ("```", "{", "get_weather", "arguments"))


@pytest.fixture(scope="module")
def oai(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_openai_whole_and_streamed(oai: openai.OpenAI) -> None:
    ask = [{"role": "system", "content": SYSTEM}, *messages()]
    r = oai.chat.completions.create(model=MODEL, messages=ask, tools=OPENAI_TOOLS,  # type: ignore[arg-type]
                                    temperature=0, seed=1, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    calls = choice.message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [EXPECTED]
    assert not leaked(choice.message.content or "")
    content, parts, finish = "", {}, None
    for chunk in oai.chat.completions.create(model=MODEL, messages=ask, tools=OPENAI_TOOLS,  # type: ignore[arg-type]
                                             temperature=0, seed=1, max_tokens=60, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            part = parts.setdefault(tc.index, {"name": "", "arguments": ""})
            part["name"] += (tc.function.name or "") if tc.function else ""
            part["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and not leaked(content), content
    assert [(p["name"], json.loads(p["arguments"])) for p in parts.values()] == [EXPECTED]


def test_anthropic_whole_and_streamed(daemon: Daemon) -> None:
    client = anthropic.Anthropic(base_url=daemon.url, api_key="unused", max_retries=0)
    tools = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in OPENAI_TOOLS]
    kw: dict[str, Any] = {"model": MODEL, "system": SYSTEM, "messages": messages(),
                          "tools": tools, "max_tokens": 60,
                          "extra_body": {"temperature": 0}}  # recent SDKs: no argument
    r = client.messages.create(**kw)
    assert r.stop_reason == "tool_use"
    uses = [(b.name, b.input) for b in r.content if b.type == "tool_use"]
    assert uses == [EXPECTED]
    assert not any(leaked(b.text) for b in r.content if b.type == "text")
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and not leaked(text)
    assert [(b.name, b.input) for b in final.content if b.type == "tool_use"] == [EXPECTED]


def test_ollama_whole_and_streamed(daemon: Daemon) -> None:
    client = ollama.Client(host=daemon.url)
    kw: dict[str, Any] = {"model": MODEL, "tools": OPENAI_TOOLS,
                          "messages": [{"role": "system", "content": SYSTEM}, *messages()],
                          "options": {"temperature": 0, "num_predict": 60}}
    r = client.chat(**kw)
    calls = [(c.function.name, dict(c.function.arguments)) for c in r.message.tool_calls or []]
    assert calls == [EXPECTED] and not leaked(r.message.content or "")
    content, streamed = "", []
    for part in client.chat(**kw, stream=True):
        content += part.message.content or ""
        streamed += [(c.function.name, dict(c.function.arguments))
                     for c in part.message.tool_calls or []]
    assert streamed == [EXPECTED] and not leaked(content), content


def test_steering_makes_a_begun_call_valid(oai: openai.OpenAI) -> None:
    """The few-shot calls never give a `unit`; a tool that requires one gets it anyway once
    the model has begun the call, because the grammar takes over there (without steering
    the call fails its schema and comes back as text: test_toolcalls.py's near misses)."""
    strict = {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": strict}},
             OPENAI_TOOLS[1]]
    ask = [{"role": "system", "content": SYSTEM}, *messages()]
    r = oai.chat.completions.create(model=MODEL, messages=ask, tools=tools,  # type: ignore[arg-type]
                                    temperature=0, max_tokens=80)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message.content
    (call,) = choice.message.tool_calls or []
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and set(args) == {"city", "unit"}
    assert args["unit"] in ("celsius", "fahrenheit")


def test_a_schema_the_grammar_engine_refuses_leaves_auto_calls_unsteered(
        oai: openai.OpenAI) -> None:
    """A tool whose schema llguidance cannot compile (a broken regex) in auto mode: the
    request is answered as before steering existed (its calls read, not steered), not
    refused; the fenced call is still recognised, checked against the rest of the schema."""
    broken = {"type": "object", "properties": {"city": {"type": "string", "pattern": "(a"}},
              "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": broken}},
             OPENAI_TOOLS[1]]
    ask = [{"role": "system", "content": SYSTEM}, *messages()]
    r = oai.chat.completions.create(model=MODEL, messages=ask, tools=tools,  # type: ignore[arg-type]
                                    temperature=0, max_tokens=60)
    calls = r.choices[0].message.tool_calls or []
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [EXPECTED]
