"""Tool calls as a small model writes them, through the real daemon and the
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


# -- a call the token limit cuts off ---------------------------------------------------------

# Tokens SmolLM2 gets (greedy) for a forced call of get_weather: `<tool_call>`, its name,
# then `"arguments": {\n  "` and no more: cut inside the arguments, every time.
CUT = 20
# ... and for the steered, fenced call of the few-shot messages (tool_choice auto: Ollama
# has no other): cut inside `"arguments": {"city": ...`
CUT_STEERED = 16


def cut_json(arguments: str) -> bool:
    """Arguments cut off: the start of a JSON object that does not parse."""
    try:
        json.loads(arguments)
    except ValueError:
        return arguments.startswith("{")
    return False


def test_a_forced_call_cut_off_comes_back_as_a_call_in_openai(oai: openai.OpenAI) -> None:
    """Chat completions: the partial call in `tool_calls`, finish_reason "length" (as
    OpenAI returns a call cut short); Responses: a function_call item with status
    "incomplete" in an incomplete response. Never the call's text in the content."""
    ask = [{"role": "user", "content": QUESTION}]
    kw: dict[str, Any] = {"model": MODEL, "messages": ask, "tools": OPENAI_TOOLS[:1],
                          "tool_choice": "required", "temperature": 0, "max_tokens": CUT}
    choice = oai.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "length" and not choice.message.content
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and cut_json(call.function.arguments)
    content, parts, finish = "", {}, None
    for chunk in oai.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            assert tc.function is not None
            parts[tc.index] = (tc.function.name, tc.function.arguments or "")
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "length" and content == "" and list(parts.values()) == \
        [("get_weather", call.function.arguments)]

    tool = {"type": "function", **OPENAI_TOOLS[0]["function"]}
    rkw: dict[str, Any] = {"model": MODEL, "input": QUESTION, "tools": [tool],
                           "tool_choice": "required", "temperature": 0,
                           "max_output_tokens": CUT}
    r = oai.responses.create(**rkw)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens" and r.output_text == ""
    (item,) = r.output
    assert item.type == "function_call" and item.status == "incomplete"
    assert item.name == "get_weather" and cut_json(item.arguments)
    events = list(oai.responses.create(**rkw, stream=True))
    kinds = [e.type for e in events]
    assert "response.output_text.delta" not in kinds and kinds[-1] == "response.incomplete"
    # the arguments are not whole: no function_call_arguments.done
    assert "response.function_call_arguments.done" not in kinds
    (item,) = events[-1].response.output  # type: ignore[union-attr]
    assert item.type == "function_call" and item.status == "incomplete"
    assert cut_json(item.arguments)  # type: ignore[union-attr]


def test_a_forced_call_cut_off_in_anthropic_is_an_incomplete_tool_use(
        an: anthropic.Anthropic) -> None:
    """Anthropic: the incomplete tool_use block its API ends a cut-off response with, and
    stop_reason "max_tokens" (never "tool_use"); `input` holds only what was written whole
    (here nothing), alike whole and streamed. No text block holds any of it."""
    tools = [{"name": "get_weather", "description": "Current weather in a city",
              "input_schema": WEATHER}]
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": CUT, "tools": tools,
                          "tool_choice": {"type": "any"},
                          "messages": [{"role": "user", "content": QUESTION}],
                          "extra_body": {"temperature": 0}}
    r = an.messages.create(**kw)
    assert r.stop_reason == "max_tokens"
    assert [(b.type, getattr(b, "name", None)) for b in r.content] == \
        [("tool_use", "get_weather")]
    with an.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.stop_reason == "max_tokens" and text == ""
    assert [(b.type, getattr(b, "name", None), getattr(b, "input", None))
            for b in final.content] == [("tool_use", "get_weather", r.content[0].input)]


def test_a_steered_call_cut_off_leaks_nothing_in_ollama(daemon: Daemon) -> None:
    """Ollama (tool_choice is auto there; its arguments must be an object, so a call cut
    short has no form): done_reason "length", nothing of the call in the content."""
    client = ollama.Client(host=daemon.url)
    kw: dict[str, Any] = {"model": MODEL, "tools": OPENAI_TOOLS,
                          "messages": [{"role": "system", "content": SYSTEM}, *messages()],
                          "options": {"temperature": 0, "num_predict": CUT_STEERED}}
    r = client.chat(**kw)
    assert r.done_reason == "length" and r.message.content == ""
    assert not r.message.tool_calls
    parts = list(client.chat(**kw, stream=True))
    assert parts[-1].done_reason == "length"
    assert "".join(p.message.content or "" for p in parts) == ""
    assert not any(p.message.tool_calls for p in parts)
