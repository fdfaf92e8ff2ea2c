"""The OpenAI API against the real daemon and SmolLM2, through the official `openai` SDK.

SmolLM2-135M was not trained for tools: tests of "auto" never demand that it picks one;
"required" and named tools are enforced by grammar, so those must always give valid calls.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import struct
import subprocess
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.conftest import Daemon, wait_until

MODEL = "smollm2"
GREEDY: dict[str, Any] = {"temperature": 0, "seed": 1}
HELLO = [{"role": "user", "content": "Say hello."}]
WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
                  "required": ["city"]}
TOOLS: list[Any] = [
    {"type": "function", "function": {"name": "get_weather",
                                      "description": "Get the current weather in a city",
                                      "parameters": WEATHER_SCHEMA}},
    {"type": "function", "function": {
        "name": "convert", "description": "Convert an amount between currencies",
        "parameters": {"type": "object", "properties": {
            "amount": {"type": "number"},
            "currency": {"type": "string", "enum": ["EUR", "USD", "GBP"]}},
            "required": ["amount", "currency"]}}},
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="any", max_retries=0,
                       timeout=120) as c:
        yield c


# -- chat -----------------------------------------------------------------------------------


def test_chat_and_stream_agree(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=12, **GREEDY)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    (choice,) = whole.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert choice.message.content and choice.finish_reason in ("stop", "length")
    assert whole.usage and whole.usage.prompt_tokens > 0
    assert 0 < whole.usage.completion_tokens <= 12
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    chunks = list(client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=12, stream=True,
        stream_options={"include_usage": True}, **GREEDY))
    *deltas, last = chunks
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert deltas[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in deltas)
    assert text == choice.message.content
    assert deltas[-1].choices[0].finish_reason == choice.finish_reason
    assert all(c.usage is None for c in deltas)
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.completion_tokens == whole.usage.completion_tokens


def test_chat_content_parts_system_roles_stop_and_extras(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, max_tokens=40, stop=["."], user="someone",
        messages=[{"role": "developer", "content": "You answer in one sentence."},
                  {"role": "user", "content": [{"type": "text", "text": "What is the sun?"},
                                               {"type": "text", "text": "Be brief."}]}],
        extra_body={"top_k": 1, "repeat_penalty": 1.0, "min_p": 0.0, "num_ctx": 2048},
        presence_penalty=0.0, frequency_penalty=0.0, top_p=1.0, **GREEDY)
    choice = r.choices[0]
    assert choice.message.content and "." not in choice.message.content
    assert choice.finish_reason == "stop"


def test_n_choices(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, n=2,
                                       temperature=1.0, seed=7)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.content for c in r.choices)
    assert r.usage and 2 <= r.usage.completion_tokens <= 16  # both choices' tokens
    seen: dict[int, str] = {0: "", 1: ""}
    finished = set()
    for chunk in client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=8, n=2,
                                                stream=True, temperature=1.0, seed=7):
        for c in chunk.choices:
            seen[c.index] += c.delta.content or ""
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1} and all(seen.values())
    # the same seed gives the same choices, streamed or not
    assert [seen[0], seen[1]] == [c.message.content for c in r.choices]


def test_logprobs(client: openai.OpenAI) -> None:
    # logprobs are the model's raw distribution: without a repeat penalty, greedy picks the top
    raw = {"repeat_penalty": 1.0}
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=6, logprobs=True,
                                       top_logprobs=3, extra_body=raw, **GREEDY)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.content and len(lp.content) == r.usage.completion_tokens
    assert "".join(t.token for t in lp.content) == r.choices[0].message.content
    for t in lp.content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3
        # greedy: the sampled token is the most likely one
        assert t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)
    streamed = [c.choices[0].logprobs for c in client.chat.completions.create(
        model=MODEL, messages=HELLO, max_tokens=6, logprobs=True, top_logprobs=2, stream=True,
        extra_body=raw, **GREEDY) if c.choices and c.choices[0].logprobs]
    assert sum(len(x.content or []) for x in streamed) == len(lp.content)


def test_response_format_json_schema(client: openai.OpenAI) -> None:
    schema = {"type": "object", "additionalProperties": False,
              "properties": {"city": {"type": "string", "maxLength": 24},
                             "population": {"type": "integer"},
                             "capital": {"type": "boolean"},
                             "continent": {"enum": ["Africa", "Asia", "Europe", "America",
                                                    "Oceania"]}},
              "required": ["city", "population", "capital", "continent"]}
    prompts = ["Describe Paris.", "Describe Tokyo.", "Describe Lagos.", "Tell me about Lima.",
               "A city in Australia?", "Describe Berlin as JSON.", "Where is Cairo?",
               "Describe a small town.", "Largest city in Canada?", "Describe Mumbai."]
    for prompt in prompts:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=120,
            response_format={"type": "json_schema",
                             "json_schema": {"name": "city", "schema": schema, "strict": True}},
            **GREEDY)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), schema)
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=60,
                                       response_format={"type": "json_object"}, **GREEDY)
    if r.choices[0].finish_reason == "stop":
        json.loads(r.choices[0].message.content or "")


# -- tools ----------------------------------------------------------------------------------


def calls_of(r: Any) -> list[tuple[str, dict[str, Any]]]:
    msg = r.choices[0].message
    return [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls or []]


@pytest.mark.parametrize("question", ["What is the weather in Paris?",
                                      "Convert 20 euros to dollars.", "Hi there!"])
def test_tool_choice_required_gives_valid_calls(client: openai.OpenAI, question: str) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], tools=TOOLS,
        tool_choice="required", max_tokens=120, **GREEDY)
    choice = r.choices[0]
    calls = calls_of(r)
    assert calls and choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    for name, args in calls:
        jsonschema.validate(args, SCHEMAS[name])
    ids = [c.id for c in choice.message.tool_calls or []]
    assert all(i.startswith("call_") for i in ids) and len(set(ids)) == len(ids)


def test_named_tool_and_no_parallel_calls(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "What is the weather in Rome?"}],
        tools=TOOLS, tool_choice={"type": "function", "function": {"name": "convert"}},
        parallel_tool_calls=False, max_tokens=120, **GREEDY)
    (call,) = calls_of(r)
    assert call[0] == "convert" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(call[1], SCHEMAS["convert"])


def test_tool_round_trip(client: openai.OpenAI) -> None:
    messages: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                       tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=120, **GREEDY)
    msg = r.choices[0].message
    assert msg.tool_calls and r.choices[0].finish_reason == "tool_calls"
    call = msg.tool_calls[0]
    messages.append(msg.model_dump(exclude_none=True))
    messages.append({"role": "tool", "tool_call_id": call.id,
                     "content": json.dumps({"temperature_c": 18, "sky": "sunny"})})
    # tools still offered ("auto"), as agents do; SmolLM2 rambles on after its first
    # sentence, so the answer ends at a newline
    final = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                           max_tokens=80, stop=["\n"], **GREEDY)
    assert final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.content and not final.choices[0].message.tool_calls
    # the result reached the prompt: the second turn is longer than the first by more than
    # the call itself
    assert final.usage and r.usage
    assert final.usage.prompt_tokens > r.usage.prompt_tokens + r.usage.completion_tokens


def test_tool_call_streamed_as_deltas(client: openai.OpenAI) -> None:
    contents: list[str] = []
    parts: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo, please."}],
            tools=TOOLS, tool_choice="required", max_tokens=120, stream=True, **GREEDY):
        delta = chunk.choices[0].delta
        contents.append(delta.content or "")
        for tc in delta.tool_calls or []:
            p = parts.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            p["id"] += tc.id or ""
            if tc.function:
                p["name"] += tc.function.name or ""
                p["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and parts
    assert not any("<tool_call>" in c or "tool_call" in c for c in contents)
    assert "".join(contents).strip() == ""
    for p in parts.values():
        assert p["id"].startswith("call_")
        jsonschema.validate(json.loads(p["arguments"]), SCHEMAS[p["name"]])


def test_tool_choice_auto_and_none(client: openai.OpenAI) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    r = client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, max_tokens=60,
                                       **GREEDY)
    choice = r.choices[0]
    if choice.message.tool_calls:  # the model may or may not call: both are fine
        assert choice.finish_reason == "tool_calls"
        for name, args in calls_of(r):
            assert name in SCHEMAS and isinstance(args, dict)
    else:
        assert "<tool_call>" not in (choice.message.content or "") or \
            choice.finish_reason == "length"
    hidden = client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS,
                                            tool_choice="none", max_tokens=60, **GREEDY)
    plain = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=60, **GREEDY)
    # "none" hides the tools entirely: the prompt is the same as without them
    assert hidden.usage and plain.usage
    assert hidden.usage.prompt_tokens == plain.usage.prompt_tokens
    assert not hidden.choices[0].message.tool_calls


# -- constraints: bounds in forced calls, raw grammars, JSON mode, strictness ----------------

# A tool whose arguments an unconstrained model breaks: a bounded integer, a short string.
BOOK = {"type": "function", "function": {
    "name": "book_table", "description": "Book a table for a guest of a given age",
    "strict": True,
    "parameters": {"type": "object", "additionalProperties": False,
                   "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 150},
                                  "guest": {"type": "string", "maxLength": 8}},
                   "required": ["age", "guest"]}}}
BOOK_ASK = [{"role": "user", "content": "Book a table for Bartholomew Maximilian Fitzgerald, "
                                        "who is 987654321987 years old."}]


@pytest.mark.parametrize("choice", ["required", {"type": "function",
                                                 "function": {"name": "book_table"}}])
def test_forced_call_holds_bounds_and_max_length(client: openai.OpenAI, choice: Any) -> None:
    # one call: a greedy small model repeats calls until the limit when it may make several
    r = client.chat.completions.create(model=MODEL, messages=BOOK_ASK, tools=[*TOOLS, BOOK],
                                       tool_choice=choice, parallel_tool_calls=False,
                                       max_tokens=60, **GREEDY)
    calls = calls_of(r)
    assert calls and r.choices[0].finish_reason == "tool_calls"
    schemas = {**SCHEMAS, "book_table": BOOK["function"]["parameters"]}
    for name, args in calls:
        jsonschema.validate(args, schemas[name])
    if not isinstance(choice, str):
        assert {name for name, _ in calls} == {"book_table"}


def test_raw_grammar_gbnf_and_lark(client: openai.OpenAI) -> None:
    """llama-server's `grammar` field (an extra body field in the SDK): GBNF or Lark."""
    gbnf = 'root ::= ("yes" | "no") " " [0-9] [0-9]'
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=10,
                                       extra_body={"grammar": gbnf}, **GREEDY)
    text = r.choices[0].message.content or ""
    assert r.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"(yes|no) [0-9]{2}", text), text
    lark = 'start: "ID-" /[A-Z]{3}/'
    done = client.completions.create(model=MODEL, prompt="The code is", max_tokens=10,
                                     extra_body={"grammar": lark}, **GREEDY)
    code = done.choices[0].text
    assert done.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"ID-[A-Z]{3}", code), code


def test_llama_server_json_schema_field(client: openai.OpenAI) -> None:
    schema = BOOK["function"]["parameters"]
    r = client.chat.completions.create(model=MODEL, messages=BOOK_ASK, max_tokens=40,
                                       extra_body={"json_schema": schema}, **GREEDY)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content or ""), schema)
    done = client.completions.create(model=MODEL, prompt="A guest, as JSON:", max_tokens=40,
                                     extra_body={"json_schema": schema}, **GREEDY)
    assert done.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(done.choices[0].text), schema)


def test_json_object_is_an_object(client: openai.OpenAI) -> None:
    """JSON mode answers an object (OpenAI's promise), even when asked for a list."""
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "List three colours as JSON."}],
        max_tokens=30, response_format={"type": "json_object"}, **GREEDY)
    text = r.choices[0].message.content or ""
    assert text.startswith("{"), text
    if r.choices[0].finish_reason == "stop":  # an open object may run past the limit
        assert isinstance(json.loads(text), dict)


def test_strict_refuses_what_it_cannot_enforce(client: openai.OpenAI) -> None:
    """A keyword the engine cannot enforce: 400 naming it when the client asked for strict
    output (json_schema `strict`, function `strict`); skipped, with a warning, when not."""
    schema = {"type": "object", "properties": {
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5},
                 "maxItems": 2, "uniqueItems": True}}, "required": ["tags"],
        "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=30,
                                       response_format=fmt, **GREEDY)  # type: ignore[arg-type]
    assert "uniqueItems" in bad.value.message
    tool = {"type": "function", "function": {"name": "tag", "parameters": schema,
                                             "strict": True}}
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=30,
                                       tools=[tool], tool_choice="required", **GREEDY)
    assert "uniqueItems" in bad.value.message
    lenient = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema}}
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=40,
                                       response_format=lenient, **GREEDY)  # type: ignore
    out = json.loads(r.choices[0].message.content or "")
    assert len(out["tags"]) <= 2 and all(len(t) <= 5 for t in out["tags"])  # the rest holds
    loose = {"type": "function", "function": {"name": "tag", "parameters": schema}}
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=40,
                                       tools=[loose], tool_choice="required",
                                       parallel_tool_calls=False, **GREEDY)
    (call,) = calls_of(r)
    assert len(call[1]["tags"]) <= 2
    with pytest.raises(openai.BadRequestError) as bad:  # two constraints: which one?
        client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=5,
                                       response_format={"type": "json_object"},
                                       extra_body={"grammar": 'root ::= "x"'})
    assert bad.value.param == "grammar"


# -- completions ----------------------------------------------------------------------------


def test_completions(client: openai.OpenAI) -> None:
    prompt = "The capital of France is"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, **GREEDY)
    assert r.object == "text_completion" and r.choices[0].text
    assert r.usage and 0 < r.usage.prompt_tokens < 10
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, echo=True,
                                       **GREEDY)
    assert echoed.choices[0].text == prompt + r.choices[0].text
    many = client.completions.create(model=MODEL, prompt=[prompt, "Once upon a time"],
                                     max_tokens=6, **GREEDY)
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == r.choices[0].text[:len(many.choices[0].text)]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, stream=True, **GREEDY) if c.choices)
    assert streamed == r.choices[0].text


def test_completions_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=5,
                                  logprobs=2, echo=True, **GREEDY)
    lp = r.choices[0].logprobs
    assert lp and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    # echo: the prompt's tokens (scored; the first has nothing before it), then the 5 new
    n = r.usage.prompt_tokens + 5
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert all(len(t) <= 2 for t in lp.top_logprobs)
    assert lp.text_offset[0] == 0 and lp.token_logprobs[0] is None
    assert lp.text_offset[r.usage.prompt_tokens] == len("One, two, three,")
    text = r.choices[0].text
    for tok, off in zip(lp.tokens, lp.text_offset, strict=True):
        assert text[off:off + len(tok)] == tok


# -- embeddings and models ------------------------------------------------------------------


def test_embeddings(client: openai.OpenAI) -> None:
    floats = client.embeddings.create(model=MODEL, input=["hello world", "goodbye"],
                                      encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1]
    assert floats.usage.prompt_tokens > 0
    vec = floats.data[0].embedding
    assert abs(sum(x * x for x in vec) - 1.0) < 1e-3
    # asked for explicitly, base64 comes back as the string: little-endian float32
    b64 = client.embeddings.create(model=MODEL, input="hello world", encoding_format="base64")
    data = base64.b64decode(str(b64.data[0].embedding))
    assert list(struct.unpack(f"<{len(data) // 4}f", data)) == pytest.approx(vec, abs=1e-6)
    # when the SDK picks base64 itself (no encoding_format), it decodes it the same way
    default = client.embeddings.create(model=MODEL, input="hello world")
    assert default.data[0].embedding == pytest.approx(vec, abs=1e-6)
    short = client.embeddings.create(model=MODEL, input="hello world", dimensions=32)
    s = short.data[0].embedding
    assert len(s) == 32 and abs(sum(x * x for x in s) - 1.0) < 1e-3
    norm = sum(x * x for x in vec[:32]) ** 0.5
    assert s == pytest.approx([x / norm for x in vec[:32]], abs=1e-5)


def test_models(client: openai.OpenAI, daemon: Daemon) -> None:
    ids = [m.id for m in client.models.list()]
    assert "smollm2:latest" in ids
    m = client.models.retrieve("smollm2")
    assert m.id == "smollm2:latest" and m.object == "model" and m.created > 0
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.code == "model_not_found"
    # names with slashes (hf.co/...) are one path parameter
    r = httpx.post(daemon.url + "/api/copy", json={"source": "smollm2",
                                                   "destination": "hf.co/someone/smol:q4"})
    assert r.status_code == 200
    try:
        got = client.models.retrieve("hf.co/someone/smol:q4")
        assert got.id == "hf.co/someone/smol:q4" and got.owned_by == "someone"
    finally:
        httpx.request("DELETE", daemon.url + "/api/delete",
                      json={"model": "hf.co/someone/smol:q4"})


# -- errors ---------------------------------------------------------------------------------


def test_error_shapes(client: openai.OpenAI, daemon: Daemon) -> None:
    with pytest.raises(openai.NotFoundError) as nf:
        client.chat.completions.create(model="no-such-model", messages=HELLO)
    assert nf.value.status_code == 404 and nf.value.code == "model_not_found"
    assert nf.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=HELLO, temperature=5)
    assert bad.value.param == "temperature" and bad.value.type == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}])
    assert "image" in bad.value.message  # SmolLM2 has no vision projector
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=HELLO, tools=TOOLS,
                                       tool_choice={"type": "function",
                                                    "function": {"name": "nope"}})
    assert bad.value.param == "tool_choice"
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=MODEL, prompt="x", suffix="y")
    assert "does not support insert" in bad.value.message  # SmolLM2 has no FIM tokens
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=[])
    assert bad.value.param == "messages"
    # raw bodies: missing fields and broken JSON, in OpenAI's shape (not Ollama's)
    r = httpx.post(daemon.url + "/v1/chat/completions", json={"messages": HELLO})
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"
    r = httpx.post(daemon.url + "/v1/embeddings", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    # the Ollama API keeps its own shape
    r = httpx.post(daemon.url + "/api/chat", json={"messages": HELLO})
    assert r.status_code == 400 and isinstance(r.json()["error"], str)


def test_error_after_the_stream_began(client: openai.OpenAI, daemon: Daemon) -> None:
    """A runner that dies mid-stream: an SSE error frame (the SDK raises it), no [DONE]."""
    story = [{"role": "user", "content": "Write a long story about dragons."}]
    stream = client.chat.completions.create(model=MODEL, messages=story, max_tokens=2000,
                                            stream=True, **GREEDY)
    with pytest.raises(openai.APIError) as err:
        for i, _ in enumerate(stream):
            if i == 2:
                assert daemon.proc is not None
                pids = subprocess.run(["pgrep", "-P", str(daemon.proc.pid)],
                                      capture_output=True, text=True).stdout.split()
                assert pids, "expected a runner process under the daemon"
                for pid in pids:
                    os.kill(int(pid), signal.SIGKILL)
    assert "SIGKILL" in err.value.message
    # the daemon survived: the next request gets a fresh runner
    r = client.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=4, **GREEDY)
    assert r.choices[0].message.content


def test_disconnect_cancels_every_choice(daemon: Daemon) -> None:
    body = {"model": MODEL, "stream": True, "n": 2, "max_tokens": 2000,
            "messages": [{"role": "user", "content": "Write a long story about dragons."}]}
    with httpx.stream("POST", daemon.url + "/v1/chat/completions", json=body,
                      timeout=60) as r:
        frames = (line for line in r.iter_lines() if line.startswith("data: "))
        for _ in range(6):
            next(frames)
        busy = httpx.get(daemon.url + "/api/ps").json()["models"][0]["slots_busy"]
        assert busy == 2
    wait_until(lambda: httpx.get(daemon.url + "/api/ps").json()["models"][0]["slots_busy"] == 0,
               what="the choices kept decoding after the client went away")


def test_echo_scores_the_prompt_like_plain_llama_cpp(client: openai.OpenAI,
                                                     smollm2_path: Any) -> None:
    """`echo` with `logprobs` (and max_tokens 0: what evaluation harnesses send) scores each
    prompt token given the ones before it; compared with llama-cpp-python's own logits."""
    import numpy as np
    from llama_cpp import Llama

    prompt = "The capital of France is Paris. The capital of Italy is Rome."
    out = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2,
                                    max_tokens=0, temperature=0)
    choice = out.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length"
    lp = choice.logprobs
    assert lp is not None and "".join(lp.tokens) == prompt
    assert lp.token_logprobs[0] is None and lp.text_offset[0] == 0
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(lp.tokens)

    llm = Llama(model_path=str(smollm2_path), n_ctx=512, n_threads=1, logits_all=True,
                flash_attn=True, verbose=False)
    tokens = llm.tokenize(prompt.encode(), add_bos=False, special=True)
    assert [llm.detokenize([t]).decode() for t in tokens] == lp.tokens
    llm.eval(tokens)
    logits = np.array(llm.scores[: len(tokens)], dtype=np.float64)
    logz = np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1)) + logits.max(1)
    ref = [float(logits[i, tokens[i + 1]] - logz[i]) for i in range(len(tokens) - 1)]
    assert lp.token_logprobs[1:] == pytest.approx(ref, abs=1e-4)
    for i, top in enumerate(lp.top_logprobs[1:]):
        assert len(top) == 2 and max(top.values()) == pytest.approx(
            float(logits[i].max() - logz[i]), abs=1e-4)

    # a prompt of a single token: only that token, with nothing to be scored against
    one = client.completions.create(model=MODEL, prompt="The", echo=True, logprobs=1,
                                    max_tokens=0, temperature=0)
    assert one.usage.prompt_tokens == 1
    assert one.choices[0].logprobs.tokens == ["The"]
    assert one.choices[0].logprobs.token_logprobs == [None]

    # streamed: the prompt arrives once, with the same scores, then the answer
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1,
                                            max_tokens=3, temperature=0, stream=True))
    first = chunks[0].choices[0]
    assert first.text == prompt
    assert first.logprobs.token_logprobs[1:] == pytest.approx(ref, abs=1e-4)
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) == 4
