"""Anthropic Messages API (/v1/messages): the official `anthropic` SDK and raw HTTP against the
real daemon and the real SmolLM2 model, plus the block conversion on its own (no model).

Recent SDKs no longer take `temperature` as an argument: greedy requests pass it through
`extra_body`, as raw clients (and older SDKs) send it on the wire.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from llmrun.api.anthropic.stream import _stream, stop_reason
from llmrun.api.anthropic.wire import CountBody, MessagesBody, to_messages, to_tools
from llmrun.request import (
    Chunk,
    Done,
    EngineError,
    Message,
    NamedTool,
    Started,
    Stats,
    ToolCall,
)
from tests.conftest import Daemon

MODEL = "smollm2"
GREEDY = {"temperature": 0}
HI = [{"role": "user", "content": "Say hi"}]
SKY = [{"role": "user", "content": "Why is the sky blue?"}]
CTX = 2048  # the test daemon's LLMRUN_CONTEXT_LENGTH



@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=daemon.url, api_key="x", max_retries=0,
                             timeout=120) as c:
        yield c


def create(client: anthropic.Anthropic, **kw: Any) -> anthropic.types.Message:
    kw.setdefault("model", MODEL)
    kw.setdefault("max_tokens", 16)
    kw.setdefault("messages", HI)
    kw["extra_body"] = {**GREEDY, **kw.get("extra_body", {})}
    return client.messages.create(**kw)


def prompt_total(usage: Any) -> int:
    """Anthropic's usage splits the prompt: uncached + read from cache (+ written to it)."""
    return (usage.input_tokens + (usage.cache_read_input_tokens or 0)
            + (usage.cache_creation_input_tokens or 0))


def count(client: anthropic.Anthropic, **kw: Any) -> int:
    kw.setdefault("model", MODEL)
    return client.messages.count_tokens(**kw).input_tokens


def sse_events(text: str) -> list[tuple[str, dict[str, Any]]]:
    """The named events of an SSE body; comments (`: ping` while a request waits for a
    slot) are skipped, as every SSE parser does."""
    out = []
    for frame in text.strip().split("\n\n"):
        if frame.startswith(":"):
            continue
        lines = dict(line.split(": ", 1) for line in frame.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


# ---- plain messages -----------------------------------------------------------------------


def test_message_text_and_truthful_usage(client: anthropic.Anthropic, api: httpx.Client) -> None:
    msg = create(client, messages=SKY)
    assert msg.id.startswith("msg_")
    assert msg.type == "message" and msg.role == "assistant" and msg.model == MODEL
    assert [b.type for b in msg.content] == ["text"]
    assert msg.content[0].text.strip()
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    assert msg.usage.output_tokens == 16
    assert msg.usage.cache_creation_input_tokens == 0
    ollama = api.post("/api/chat", json={"model": MODEL, "messages": SKY, "stream": False,
                                         "options": {"num_predict": 1}}).json()
    assert prompt_total(msg.usage) == ollama["prompt_eval_count"]
    assert count(client, messages=SKY) == ollama["prompt_eval_count"]


def test_prefix_reuse_is_reported_as_cache_read(client: anthropic.Anthropic) -> None:
    first = create(client, messages=SKY, max_tokens=2)
    again = create(client, messages=SKY, max_tokens=2)
    assert prompt_total(again.usage) == prompt_total(first.usage)
    assert again.usage.cache_read_input_tokens > 0  # the slot held this prompt already
    assert again.usage.input_tokens >= 1


def test_stream_matches_non_streamed(client: anthropic.Anthropic) -> None:
    full = create(client, messages=SKY, max_tokens=24)
    with client.messages.stream(model=MODEL, max_tokens=24, messages=SKY,
                                extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == full.content[0].text
    assert final.content[0].text == text
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 24
    assert prompt_total(final.usage) == prompt_total(full.usage)


def test_stream_event_sequence(daemon: Daemon) -> None:
    body = {"model": MODEL, "max_tokens": 5, "messages": HI, "stream": True, **GREEDY}
    r = httpx.post(daemon.url + "/v1/messages", json=body, timeout=120)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    names = [e for e, _ in events]
    assert names[:2] == ["message_start", "ping"]
    assert names[2] == "content_block_start" and names[-3:] == [
        "content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    for name, data in events:
        assert data["type"] == name
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] > 10
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert delta["usage"]["output_tokens"] == 5
    assert (delta["usage"]["input_tokens"] + delta["usage"]["cache_read_input_tokens"]
            == start["usage"]["input_tokens"])


def test_request_queued_behind_busy_slots_streams_comments_then_answers(
        daemon: Daemon, client: anthropic.Anthropic) -> None:
    """Both slots busy: a streamed request waits for one, its stream opened after the grace
    period with SSE comments (message_start needs the prompt's size, which comes when the
    request gets its slot); the SDK skips them. Closing the busy streams frees the slots."""
    n = count(client, messages=HI)
    # forced to run to the context's end: no early end of turn frees a slot by itself
    endless = {"model": MODEL, "messages": [{"role": "user", "content": "Tell a story"}],
               "format": {"type": "string", "minLength": 8000},
               "options": {"num_predict": 2000}}
    body = {"model": MODEL, "max_tokens": 5, "messages": HI, "stream": True, **GREEDY}
    with contextlib.ExitStack() as stack:
        api = stack.enter_context(httpx.Client(base_url=daemon.url, timeout=120))
        busy = [stack.enter_context(api.stream("POST", "/api/chat", json=endless))
                for _ in range(2)]  # the daemon's LLMRUN_NUM_PARALLEL
        # (the iterators stay referenced: one collected closes its response)
        lines = [r.iter_lines() for r in busy]
        for it in lines:
            assert json.loads(next(it))["done"] is False  # it holds a slot
        queued = stack.enter_context(api.stream("POST", "/v1/messages", json=body))
        assert queued.status_code == 200
        raw = queued.iter_bytes()
        head = next(raw)
        assert head.startswith(b": ping\n\n")  # before message_start: it has no slot yet
        with client.messages.stream(model=MODEL, max_tokens=5, messages=HI,
                                    extra_body=GREEDY) as sdk:  # queued as well
            for r in busy:
                r.close()
            text = "".join(sdk.text_stream)
            final = sdk.get_final_message()
        body_text = (head + b"".join(raw)).decode()
    events = sse_events(body_text)
    assert [e for e, _ in events][:2] == ["message_start", "ping"]
    assert events[0][1]["message"]["usage"]["input_tokens"] == n
    assert events[-1][0] == "message_stop"
    assert text and final.stop_reason == "max_tokens" and prompt_total(final.usage) == n


# ---- system prompts -------------------------------------------------------------------------


def test_system_string_and_blocks_with_cache_control(client: anthropic.Anthropic) -> None:
    words = "You are a pirate. Answer in one short sentence."
    as_string = create(client, system=words, max_tokens=12)
    as_blocks = create(client, max_tokens=12, system=[
        {"type": "text", "text": words, "cache_control": {"type": "ephemeral"}}])
    assert as_blocks.content[0].text == as_string.content[0].text
    assert prompt_total(as_blocks.usage) == prompt_total(as_string.usage)
    plain = create(client, max_tokens=12)
    assert plain.content[0].text != as_string.content[0].text  # the model saw it


def test_system_role_message_is_folded_into_the_system_prompt(
        client: anthropic.Anthropic, daemon: Daemon) -> None:
    reminder = "Always answer in French."
    folded = httpx.post(daemon.url + "/v1/messages/count_tokens", timeout=120, json={
        "model": MODEL, "system": [{"type": "text", "text": "Be brief."}],
        "messages": [{"role": "system", "content": [{"type": "text", "text": reminder}]},
                     *HI]}).json()["input_tokens"]
    joined = count(client, system=f"Be brief.\n\n{reminder}", messages=HI)
    without = count(client, system="Be brief.", messages=HI)
    assert folded == joined > without


# ---- what Claude Code sends -----------------------------------------------------------------

CLAUDE_CODE_TOOLS = ["Task", "Bash", "Glob", "Grep", "LS", "Read", "Edit", "MultiEdit",
                     "Write", "WebFetch", "TodoWrite", "WebSearch"]


def claude_code_tools(verbose: bool = True) -> list[dict[str, Any]]:
    if not verbose:  # the same 12 tools, one short parameter each
        return [{"name": name, "description": f"{name} tool.",
                 "input_schema": {"type": "object", "properties": {"arg": {"type": "string"}},
                                  "required": ["arg"]}} for name in CLAUDE_CODE_TOOLS]
    tools = []
    for name in CLAUDE_CODE_TOOLS:
        props = {
            f"{name.lower()}_{k}": {"type": t, "description": f"The {k} to use for {name}. "
                                   "Use absolute paths; never guess; see the docs. " * 3}
            for k, t in (("path", "string"), ("pattern", "string"), ("limit", "number"),
                         ("recursive", "boolean"))
        }
        props["items"] = {"type": "array", "items": {"type": "object", "properties": {
            "content": {"type": "string", "minLength": 1},
            "status": {"type": "string", "enum": ["pending", "in_progress", "completed"]}},
            "required": ["content", "status"], "additionalProperties": False}}
        tools.append({"name": name, "description": f"{name}: does {name.lower()} things. "
                      "Usage notes: be careful, check results, prefer specialised tools. " * 6,
                      "input_schema": {"$schema": "http://json-schema.org/draft-07/schema#",
                                       "type": "object", "properties": props,
                                       "required": [f"{name.lower()}_path"],
                                       "additionalProperties": False}})
    return tools


def claude_code_body(instructions: str, **extra: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "max_tokens": 32000,
        "system": [
            {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": instructions,
             "cache_control": {"type": "ephemeral", "ttl": "1h"}},
            {"type": "text", "text": "<env>Working directory: /tmp/project\nPlatform: linux"
                                     "</env>", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "<system-reminder>Context: none.</system-reminder>"},
                {"type": "text", "text": "Say hi", "cache_control": {"type": "ephemeral"}}]},
        ],
        "tools": claude_code_tools(),
        "metadata": {"user_id": "user_abc_account__session_123"},
        "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"},
        "stream": True,
        **extra,
    }


CC_HEADERS = {"anthropic-version": "2023-06-01", "x-api-key": "x",
              "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14,"
                                "context-management-2025-06-27"}


@pytest.mark.parametrize("verbose", [True, False], ids=["big-schemas", "small-schemas"])
def test_claude_code_shaped_request(daemon: Daemon, verbose: bool) -> None:
    """200 with truthful usage if it fits the 2048-token context, else a clear 400: never a
    500, never a silently cut prompt (rendered, the big schemas alone fill 2048)."""
    body = claude_code_body("Be concise. Use tools when needed. Reply briefly.",
                            temperature=0, tools=claude_code_tools(verbose))
    url = daemon.url + "/v1/messages?beta=true"
    n = httpx.post(daemon.url + "/v1/messages/count_tokens?beta=true", json=body,
                   headers=CC_HEADERS, timeout=120).json()["input_tokens"]
    r = httpx.post(url, json=body, headers=CC_HEADERS, timeout=300)
    if n >= CTX:
        assert r.status_code == 400, r.text
        err = r.json()
        assert err["type"] == "error"
        assert err["error"]["type"] == "invalid_request_error"
        assert f"prompt is too long: {n} tokens > {CTX} maximum" in err["error"]["message"]
        return
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert events[-1][0] == "message_stop"
    usage = events[-2][1]["usage"]
    assert usage["input_tokens"] + usage["cache_read_input_tokens"] == n
    assert events[0][1]["message"]["usage"]["input_tokens"] == n
    assert events[-2][1]["delta"]["stop_reason"] in ("end_turn", "tool_use", "max_tokens")


def test_claude_code_prompt_over_the_context_is_a_clear_400(daemon: Daemon) -> None:
    instructions = ("IMPORTANT: follow the user's instructions and the repository's "
                    "conventions; run the tests before you say you are done. ") * 120
    body = claude_code_body(instructions)
    n = httpx.post(daemon.url + "/v1/messages/count_tokens", json=body,
                   headers=CC_HEADERS, timeout=120).json()["input_tokens"]
    assert n > CTX
    r = httpx.post(daemon.url + "/v1/messages?beta=true", json=body, headers=CC_HEADERS,
                   timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"prompt is too long: {n} tokens > {CTX} maximum")
    assert "num_ctx" in error["message"]


def test_huge_max_tokens_and_claude_code_fields_without_tools(daemon: Daemon) -> None:
    body = claude_code_body("Be concise.", temperature=0, stream=False)
    del body["tools"]
    body["messages"].insert(0, {"role": "system", "content": [
        {"type": "text", "text": "Answer in one sentence."}]})
    r = httpx.post(daemon.url + "/v1/messages?beta=true", json=body, headers=CC_HEADERS,
                   timeout=300)
    assert r.status_code == 200, r.text
    msg = r.json()
    assert msg["stop_reason"] == "end_turn"  # max_tokens 32000 > context: not an error
    assert msg["content"][0]["text"].strip()
    n = httpx.post(daemon.url + "/v1/messages/count_tokens", json=body,
                   timeout=120).json()["input_tokens"]
    assert msg["usage"]["input_tokens"] + msg["usage"]["cache_read_input_tokens"] == n


def test_beta_client_header_and_unknown_fields(client: anthropic.Anthropic) -> None:
    msg = client.beta.messages.create(
        model=MODEL, max_tokens=4, messages=HI,
        betas=["interleaved-thinking-2025-05-14", "context-management-2025-06-27"],
        extra_body={**GREEDY, "context_management": {"edits": []},
                    "some_future_field": {"x": [1, 2]}},
        extra_headers={"anthropic-version": "2023-06-01"})
    assert msg.stop_reason == "max_tokens"
    assert msg.content[0].type == "text"


def test_thinking_blocks_are_accepted_and_dropped(client: anthropic.Anthropic) -> None:
    history = [*HI, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "The user greets me.", "signature": "abc"},
        {"type": "redacted_thinking", "data": "xyz"},
        {"type": "text", "text": "Hi!"}]}, {"role": "user", "content": "Again"}]
    plain = [*HI, {"role": "assistant", "content": "Hi!"}, {"role": "user", "content": "Again"}]
    assert count(client, messages=history) == count(client, messages=plain)
    msg = create(client, messages=history, max_tokens=4,
                 thinking={"type": "enabled", "budget_tokens": 1024})
    assert msg.content[0].type == "text"


# ---- stop reasons ---------------------------------------------------------------------------


def test_stop_sequence(client: anthropic.Anthropic) -> None:
    full = create(client, messages=SKY, max_tokens=24).content[0].text
    word = full.split()[3]
    msg = create(client, messages=SKY, max_tokens=24, stop_sequences=["zzzz", word])
    assert msg.stop_reason == "stop_sequence"
    assert msg.stop_sequence == word
    assert msg.content[0].text == full[: full.index(word)]
    with client.messages.stream(model=MODEL, max_tokens=24, messages=SKY,
                                stop_sequences=[word], extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", word)


def test_modelfile_stop_ends_the_turn(client: anthropic.Anthropic, api: httpx.Client) -> None:
    """A stop string of the model's own is the end of a turn, not a client stop sequence
    (Claude Code treats anything but end_turn/tool_use as a failure)."""
    full = create(client, messages=SKY, max_tokens=24).content[0].text
    word = full.split()[3]
    r = api.post("/api/create", json={"model": "smollm2-stop", "from": MODEL,
                                      "parameters": {"stop": [word]}, "stream": False})
    assert r.status_code == 200, r.text
    try:  # (the daemon is shared: leave its store as it was)
        msg = create(client, model="smollm2-stop", messages=SKY, max_tokens=24)
        assert (msg.stop_reason, msg.stop_sequence) == ("end_turn", None)
        assert msg.content[0].text == full[: full.index(word)]
        # the client's own stop sequences add to the model's, they do not replace them
        msg = create(client, model="smollm2-stop", messages=SKY, max_tokens=24,
                     stop_sequences=["zzzz"])
        assert (msg.stop_reason, msg.content[0].text) == ("end_turn", full[: full.index(word)])
    finally:
        api.request("DELETE", "/api/delete", json={"model": "smollm2-stop"})


def test_max_tokens_and_end_turn(client: anthropic.Anthropic) -> None:
    assert create(client, max_tokens=1).stop_reason == "max_tokens"
    msg = create(client, max_tokens=200)
    assert msg.stop_reason == "end_turn"
    assert msg.usage.output_tokens < 200


def test_structured_output(client: anthropic.Anthropic) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "integer"},
                                               "sure": {"type": "boolean"}},
              "required": ["answer", "sure"], "additionalProperties": False}
    msg = create(client, max_tokens=40, messages=[{"role": "user", "content": "2+2?"}],
                 output_config={"format": {"type": "json_schema", "schema": schema}})
    out = json.loads(msg.content[0].text)
    assert isinstance(out["answer"], int) and isinstance(out["sure"], bool)


# ---- errors ---------------------------------------------------------------------------------


def test_image_is_refused(client: anthropic.Anthropic) -> None:
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": "iVBORw0KGgo="}}
    with pytest.raises(anthropic.BadRequestError) as info:
        create(client, messages=[{"role": "user", "content": [
            {"type": "text", "text": "What is this?"}, image]}])
    assert info.value.status_code == 400
    body = info.value.body
    assert body["error"]["type"] == "invalid_request_error"
    # translated, then refused: SmolLM2 has no vision projector
    assert "image" in body["error"]["message"]


def test_unknown_model_is_404(client: anthropic.Anthropic) -> None:
    with pytest.raises(anthropic.NotFoundError) as info:
        create(client, model="claude-haiku-4-5-20251001")
    assert info.value.body["error"]["type"] == "not_found_error"
    assert info.value.body["type"] == "error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="no-such-model", messages=HI)


def test_validation_errors_have_anthropics_shape(daemon: Daemon) -> None:
    url = daemon.url + "/v1/messages"
    for body, needle in [
        ({"model": MODEL, "messages": HI}, "max_tokens"),
        ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "robot", "content": "x"}]},
         "messages.0.role"),
        ({"model": MODEL, "max_tokens": 0, "messages": HI}, "max_tokens"),
        ({"model": MODEL, "max_tokens": 5, "messages": HI, "tool_choice": {"type": "any"}},
         "tool_choice"),
    ]:
        r = httpx.post(url, json=body)
        assert r.status_code == 400, body
        assert r.json()["type"] == "error"
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert needle in r.json()["error"]["message"]
    r = httpx.post(url + "?beta=true", content=b"{not json")
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    # the Ollama paths keep their own error shape
    r = httpx.post(daemon.url + "/api/chat", json={"messages": []})
    assert r.status_code == 400 and isinstance(r.json()["error"], str)


def test_count_tokens(client: anthropic.Anthropic) -> None:
    n = count(client, messages=SKY)
    assert n == prompt_total(create(client, messages=SKY, max_tokens=1).usage)
    terse = count(client, messages=SKY, system="You are terse.")
    assert count(client, messages=SKY, system="You are terse. Answer in French.") > terse


# ---- tools ----------------------------------------------------------------------------------

WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {"city": {"type": "string", "description": "City name"},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"],
    },
}
TIME = {"name": "get_time", "description": "Get the current time in a timezone",
        "input_schema": {"type": "object", "properties": {"tz": {"type": "string"}},
                         "required": ["tz"]}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
JSON_TYPES = {"string": str, "number": (int, float), "integer": int, "boolean": bool,
              "object": dict, "array": list}


def check_input(schema: dict[str, Any], value: dict[str, Any]) -> None:
    assert isinstance(value, dict)
    for key in schema.get("required", []):
        assert key in value, f"missing {key}: {value}"
    for key, v in value.items():
        prop = schema["properties"].get(key)
        assert prop is not None, f"unexpected {key}: {value}"
        assert isinstance(v, JSON_TYPES[prop["type"]]), (key, v)
        if "enum" in prop:
            assert v in prop["enum"], (key, v)


@pytest.mark.parametrize("choice", [{"type": "any"}, {"type": "tool", "name": "get_weather"}])
def test_forced_tool_use(client: anthropic.Anthropic, choice: dict[str, Any]) -> None:
    msg = create(client, messages=ASK, tools=[TIME, WEATHER], tool_choice=choice,
                 max_tokens=64)
    assert msg.stop_reason == "tool_use"
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert uses
    for use in uses:
        assert use.id and use.name in ("get_weather", "get_time")
        check_input((WEATHER if use.name == "get_weather" else TIME)["input_schema"],
                    use.input)
    if choice["type"] == "tool":
        assert {u.name for u in uses} == {"get_weather"}


# ---- constraints ------------------------------------------------------------------------------

BOOK = {"name": "book_table", "description": "Book a table for a guest of a given age",
        "input_schema": {"type": "object", "additionalProperties": False,
                         "properties": {"age": {"type": "integer", "minimum": 0,
                                                "maximum": 150},
                                        "guest": {"type": "string", "maxLength": 8}},
                         "required": ["age", "guest"]}}
BOOK_ASK = [{"role": "user", "content": "Book a table for Bartholomew Maximilian Fitzgerald, "
                                        "who is 987654321987 years old."}]


@pytest.mark.parametrize("choice", [{"type": "any", "disable_parallel_tool_use": True},
                                    {"type": "tool", "name": "book_table",
                                     "disable_parallel_tool_use": True}])
def test_forced_tool_input_holds_bounds_and_max_length(client: anthropic.Anthropic,
                                                       choice: dict[str, Any]) -> None:
    msg = create(client, messages=BOOK_ASK, tools=[WEATHER, BOOK], tool_choice=choice,
                 max_tokens=60)
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert msg.stop_reason == "tool_use" and len(uses) == 1
    schemas = {"book_table": BOOK["input_schema"], "get_weather": WEATHER["input_schema"]}
    jsonschema.validate(uses[0].input, schemas[uses[0].name])
    if choice["type"] == "tool":
        assert uses[0].name == "book_table"


def test_structured_output_holds_bounds_and_refuses_what_it_cannot(
        client: anthropic.Anthropic) -> None:
    schema = BOOK["input_schema"]
    msg = create(client, max_tokens=40, messages=BOOK_ASK,
                 output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(msg.content[0].text), schema)
    unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(anthropic.BadRequestError) as info:  # always strict
        create(client, max_tokens=10, messages=BOOK_ASK,
               output_config={"format": {"type": "json_schema", "schema": unique}})
    assert "uniqueItems" in info.value.body["error"]["message"]


def test_tool_round_trip(client: anthropic.Anthropic) -> None:
    first = create(client, messages=ASK, tools=[WEATHER],
                   tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=64)
    use = next(b for b in first.content if b.type == "tool_use")
    history = [*ASK, {"role": "assistant", "content": [b.model_dump(exclude_none=True)
                                                       for b in first.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                             "content": "22 degrees celsius and sunny"}]}]
    final = create(client, messages=history, tools=[WEATHER], max_tokens=48)
    assert final.stop_reason in ("end_turn", "max_tokens")
    text = "".join(b.text for b in final.content if b.type == "text")
    assert text.strip()


def test_streamed_tool_use(client: anthropic.Anthropic) -> None:
    deltas: list[str] = []
    with client.messages.stream(model=MODEL, max_tokens=64, messages=ASK, tools=[WEATHER],
                                tool_choice={"type": "any"}, extra_body=GREEDY) as stream:
        for event in stream:
            if event.type == "content_block_delta" and event.delta.type == "input_json_delta":
                deltas.append(event.delta.partial_json)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    use = next(b for b in final.content if b.type == "tool_use")
    assert json.loads("".join(deltas)) == use.input
    check_input(WEATHER["input_schema"], use.input)


def test_tool_result_history_reaches_the_model(client: anthropic.Anthropic) -> None:
    """A hand-written tool exchange (works with or without the tool layer): the result's
    text is in the prompt, an error result is marked, and the model answers in text."""
    def history(result: Any, is_error: bool = False) -> list[dict[str, Any]]:
        return [*ASK, {"role": "assistant", "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
            {"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": is_error,
                 "content": result, "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "Summarise it."}]}]

    short = count(client, messages=history("sunny"), tools=[WEATHER])
    long = count(client, messages=history([{"type": "text", "text": "sunny"},
                                           {"type": "text", "text": "22 degrees, light wind"}]),
                 tools=[WEATHER])
    failed = count(client, messages=history("sunny", is_error=True), tools=[WEATHER])
    assert long > short and failed > short
    msg = create(client, messages=history("22 degrees celsius and sunny"), tools=[WEATHER],
                 max_tokens=24)
    assert msg.content[0].type == "text" and msg.content[0].text.strip()


def test_server_tools_are_ignored(client: anthropic.Anthropic) -> None:
    web = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
    msg = create(client, max_tokens=4, tools=[web])
    assert msg.content[0].type == "text"


# ---- conversion (no model) ------------------------------------------------------------------


def body(**kw: Any) -> CountBody:
    return CountBody.model_validate({"model": MODEL, **kw})


def test_conversion_folds_system_and_splits_tool_results() -> None:
    b = body(system=[{"type": "text", "text": "A", "cache_control": {"type": "ephemeral"}},
                     {"type": "text", "text": "B"}],
             messages=[
                 {"role": "user", "content": "hi"},
                 {"role": "system", "content": "C"},
                 {"role": "assistant", "content": [
                     {"type": "thinking", "thinking": "hmm", "signature": "s"},
                     {"type": "text", "text": "calling"},
                     {"type": "tool_use", "id": "t1", "name": "f", "input": {"x": 1}},
                     {"type": "tool_use", "id": "t2", "name": "g", "input": {}}]},
                 {"role": "user", "content": [
                     {"type": "tool_result", "tool_use_id": "t1", "content": "one"},
                     {"type": "tool_result", "tool_use_id": "t2", "is_error": True,
                      "content": [{"type": "text", "text": "boom"}]},
                     {"type": "text", "text": "and?"}]},
             ])
    assert to_messages(b) == [
        Message(role="system", content="A\n\nB\n\nC"),
        Message(role="user", content="hi"),
        Message(role="assistant", content="calling", tool_calls=[
            ToolCall(id="t1", name="f", arguments={"x": 1}), ToolCall(id="t2", name="g")]),
        Message(role="tool", content="one", tool_call_id="t1", name="f"),
        Message(role="tool", content="Error: boom", tool_call_id="t2", name="g"),
        Message(role="user", content="and?"),
    ]


def test_conversion_refuses_what_it_cannot_say_in_text() -> None:
    for content in ([{"type": "image", "source": {}}],
                    [{"type": "document", "source": {"type": "base64", "data": "x"}}],
                    [{"type": "mystery"}],
                    [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]):
        with pytest.raises(EngineError) as info:
            to_messages(body(messages=[{"role": "user", "content": content}]))
        assert info.value.code == "invalid_request"
    doc = {"type": "document", "title": "T", "source": {"type": "text", "data": "D"}}
    assert to_messages(body(messages=[{"role": "user", "content": [doc]}])) == [
        Message(role="user", content="T\n\nD")]


def test_tool_choice_mapping() -> None:
    tools = [WEATHER, {"type": "bash_20250124", "name": "bash"}]
    for choice, want in [(None, "auto"), ({"type": "auto"}, "auto"), ({"type": "none"}, "none"),
                         ({"type": "any"}, "required"),
                         ({"type": "tool", "name": "get_weather"},
                          NamedTool(name="get_weather"))]:
        got, picked, parallel = to_tools(body(messages=HI, tools=tools, tool_choice=choice))
        assert [t.name for t in got] == ["get_weather"]
        assert got[0].parameters == WEATHER["input_schema"]
        assert picked == want and parallel
    *_, parallel = to_tools(body(messages=HI, tools=tools, tool_choice={
        "type": "auto", "disable_parallel_tool_use": True}))
    assert not parallel
    with pytest.raises(EngineError):
        to_tools(body(messages=HI, tools=tools, tool_choice={"type": "tool", "name": "bash"}))


def test_stop_reason_mapping() -> None:
    asked = MessagesBody.model_validate({"model": MODEL, "max_tokens": 9, "messages": HI,
                                         "stop_sequences": ["END"]})
    for stats, calls, want in [
        (Stats(finish_reason="stop"), False, ("end_turn", None)),
        (Stats(finish_reason="stop", stop_sequence="END"), False, ("stop_sequence", "END")),
        # a stop string of the model's own (Modelfile), not the client's: end of turn
        (Stats(finish_reason="stop", stop_sequence="<end_of_turn>"), False, ("end_turn", None)),
        (Stats(finish_reason="length"), False, ("max_tokens", None)),
        (Stats(finish_reason="tool_calls"), True, ("tool_use", None)),
        (Stats(finish_reason="stop"), True, ("tool_use", None)),
    ]:
        assert stop_reason(stats, asked, calls) == want


def test_stream_framing_of_tool_calls_and_errors() -> None:
    req = MessagesBody.model_validate({"model": MODEL, "max_tokens": 9, "messages": HI})

    async def frames(events: list[Chunk | Done | EngineError]) -> list[tuple[str, Any]]:
        async def gen() -> AsyncIterator[Chunk | Done]:
            for e in events[1:]:
                if isinstance(e, EngineError):
                    raise e
                yield e
        first: asyncio.Future[Chunk | Done] = asyncio.get_running_loop().create_future()
        assert not isinstance(events[0], EngineError)
        first.set_result(events[0])
        started = Started(prompt_tokens=7, n_ctx=CTX)
        out = b"".join([f async for f in _stream(req, started, first, gen())]).decode()
        return sse_events(out)

    call = ToolCall(id="toolu_9", name="f", arguments={"a": "é"})
    got = asyncio.run(frames([Chunk(text="Hm. "), Chunk(text="", tool_calls=[call]),
                              Done(stats=Stats(prompt_tokens=7, completion_tokens=3,
                                               finish_reason="tool_calls"))]))
    assert [e for e, _ in got] == [
        "message_start", "ping", "content_block_start", "content_block_delta",
        "content_block_stop", "content_block_start", "content_block_delta",
        "content_block_stop", "message_delta", "message_stop"]
    assert got[5][1]["content_block"] == {"type": "tool_use", "id": "toolu_9", "name": "f",
                                          "input": {}}
    assert json.loads(got[6][1]["delta"]["partial_json"]) == {"a": "é"}
    assert got[8][1]["delta"]["stop_reason"] == "tool_use"

    got = asyncio.run(frames([Chunk(text="x"), EngineError("runner died", "runner_failed")]))
    assert got[-1] == ("error", {"type": "error", "error": {"type": "api_error",
                                                            "message": "runner died"}})


def test_stream_pings_while_the_first_token_is_awaited(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("llmrun.api.anthropic.stream.PING_EVERY", 0.05)
    req = MessagesBody.model_validate({"model": MODEL, "max_tokens": 9, "messages": HI})

    async def nothing() -> AsyncIterator[Chunk | Done]:
        return
        yield

    async def frames() -> list[str]:
        # a long prompt being read: the first token comes once the third ping has been sent
        # (an event, not a time, so a loaded event loop cannot make the count fall short)
        first: asyncio.Future[Chunk | Done] = asyncio.get_running_loop().create_future()
        started = Started(prompt_tokens=7, n_ctx=CTX)
        out: list[bytes] = []
        async for frame in _stream(req, started, first, nothing()):
            out.append(frame)
            if sum(f.startswith(b"event: ping\n") for f in out) == 3 and not first.done():
                first.set_result(Done(stats=Stats(prompt_tokens=7, finish_reason="stop")))
        return [e for e, _ in sse_events(b"".join(out).decode())]

    names = asyncio.run(frames())
    assert names[0] == "message_start"
    pings = names[1:names.index("content_block_start")]
    assert pings == ["ping"] * 3  # the first at once, then one each PING_EVERY
    assert names[-2:] == ["message_delta", "message_stop"]


def test_stream_of_a_queued_request_opens_with_comments_until_started() -> None:
    """Past the grace period a request still waiting for a slot gets its stream: SSE comments
    (which every parser skips) until Started says the prompt's size for message_start."""
    req = MessagesBody.model_validate({"model": MODEL, "max_tokens": 9, "messages": HI})

    async def rest() -> AsyncIterator[Started | Chunk | Done]:
        yield Chunk(text="Hi")
        yield Done(stats=Stats(prompt_tokens=42, cached_tokens=40, completion_tokens=1))

    async def frames(outcome: Started | EngineError) -> tuple[bytes, list[tuple[str, Any]]]:
        waiting: asyncio.Future[Started | Chunk | Done] = \
            asyncio.get_running_loop().create_future()
        stream = _stream(req, None, waiting, rest())
        head = await anext(stream)  # at once, before the request has a slot
        if isinstance(outcome, EngineError):
            waiting.set_exception(outcome)
        else:
            waiting.set_result(outcome)
        return head, sse_events(b"".join([f async for f in stream]).decode())

    head, got = asyncio.run(frames(Started(prompt_tokens=42, cached_tokens=40, n_ctx=CTX)))
    assert head == b": ping\n\n"
    assert [e for e, _ in got][:2] == ["message_start", "ping"]
    assert got[0][1]["message"]["usage"]["input_tokens"] == 42
    assert got[-2][1]["usage"]["input_tokens"] + got[-2][1]["usage"][
        "cache_read_input_tokens"] == 42
    assert got[-1][0] == "message_stop"
    # an error while it waited: an error event, worded from the code's fields
    too_long = EngineError("the prompt is 3000 tokens ...", code="prompt_too_long",
                           details={"prompt_tokens": 3000, "n_ctx": CTX})
    head, got = asyncio.run(frames(too_long))
    assert head == b": ping\n\n" and [e for e, _ in got] == ["error"]
    assert got[0][1]["error"]["type"] == "invalid_request_error"
    assert got[0][1]["error"]["message"].startswith(
        f"prompt is too long: 3000 tokens > {CTX} maximum")


def test_claude_codes_billing_header_is_kept_out_of_the_prompt() -> None:
    body = CountBody.model_validate({"model": MODEL, "messages": HI, "system": [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.39.c39; "
                                 "cc_entrypoint=cli; cch=56445;"},
        {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
    ]})
    msgs = to_messages(body)
    assert msgs[0] == Message(role="system", content="You are Claude Code.")
