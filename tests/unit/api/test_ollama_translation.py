"""Ollama's dialect alone, no model and no daemon: /api/chat and /api/generate bodies into the
one ChatRequest (wire.py), and hand-built events into Ollama's answers (stream.py): the whole
object, the NDJSON lines, and errors before and after the first token."""

from __future__ import annotations

import base64
import re
from typing import Any

import pytest
from ollama import ChatResponse, GenerateResponse
from pydantic import ValidationError

from llmrun.api.ollama.stream import respond
from llmrun.api.ollama.wire import ChatBody, GenerateBody
from llmrun.request import (
    ChatRequest,
    Chunk,
    Done,
    EngineError,
    Message,
    Progress,
    Started,
    Stats,
    TokenLogprob,
    Tool,
    ToolCall,
)
from tests.unit.api.feed import Event, as_json, body, ndjson, run, stream_of

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(64))
B64 = base64.b64encode(PNG).decode()
STARTED = Started(prompt_tokens=12, cached_tokens=4, n_ctx=4096)
STATS = Stats(prompt_tokens=12, cached_tokens=4, completion_tokens=3, prompt_ns=1000,
              generate_ns=2000, load_ns=300, total_ns=5000)
TIMESTAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z$")


def chat(**kw: Any) -> ChatRequest:
    return ChatBody.model_validate({"model": "m", "messages": [{"role": "user",
                                                               "content": "hi"}], **kw}) \
        .to_request()


def generate(**kw: Any) -> ChatRequest:
    return GenerateBody.model_validate({"model": "m", **kw}).to_request()


def refused(make: Any, **kw: Any) -> str:
    with pytest.raises(EngineError) as info:
        make(**kw)
    assert info.value.code == "invalid_request"
    return info.value.message


# -- /api/chat's body ------------------------------------------------------------------------


def test_chat_messages_of_every_role() -> None:
    req = ChatBody.model_validate({"model": "qwen3", "messages": [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "look", "images": [B64], "thinking": "ignored"},
        {"role": "assistant", "content": "", "thinking": "they want weather",
         "tool_calls": [
             {"id": "c1", "function": {"name": "weather", "arguments": {"city": "Oslo"}}},
             {"function": {"name": "time", "arguments": "{\"tz\": \"CET\"}"}},
             {"function": {"name": "echo", "arguments": "not json"}},
             {"function": {"name": "list", "arguments": "[1, 2]"}}]},
        {"role": "tool", "content": "5 C", "tool_name": "weather"},
        {"role": "user", "content": "thanks", "tool_name": "dropped"},
    ]}).to_request()
    assert req.model == "qwen3"
    assert req.messages == [
        Message(role="system", content="be brief"),
        Message(role="user", content="look", images=[B64]),
        Message(role="assistant", content="", thinking="they want weather", tool_calls=[
            ToolCall(id="c1", name="weather", arguments={"city": "Oslo"}),
            # no id: numbered by position; arguments as JSON text are parsed
            ToolCall(id="call_1", name="time", arguments={"tz": "CET"}),
            # text that is not a JSON object is kept under "value"
            ToolCall(id="call_2", name="echo", arguments={"value": "not json"}),
            ToolCall(id="call_3", name="list", arguments={"value": [1, 2]})]),
        Message(role="tool", content="5 C", name="weather"),
        Message(role="user", content="thanks"),
    ]


def test_chat_images_are_canonical_base64_and_bad_ones_refused() -> None:
    wrapped = "\n".join([B64[:20], B64[20:]])
    req = chat(messages=[{"role": "user", "content": "x",
                          "images": [wrapped, f"data:image/png;base64,{B64}"]}])
    assert req.messages[0].images == [B64, B64]
    message = refused(chat, messages=[{"role": "user", "content": "x",
                                       "images": [B64, "***"]}])
    assert message.startswith("messages[0].images[1]: invalid base64")


def test_chat_tools_in_either_shape() -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"]}
    req = chat(tools=[
        {"type": "function", "function": {"name": "weather", "description": "Forecast",
                                          "parameters": schema}},
        {"name": "bare"},  # the function itself, as some clients send it
    ])
    assert req.tools == [Tool(name="weather", description="Forecast", parameters=schema),
                         Tool(name="bare", description="",
                              parameters={"type": "object", "properties": {}})]
    assert req.tool_choice == "auto"
    assert refused(chat, tools=[{"type": "function", "function": {"description": "x"}}]) \
        == "invalid field 'tools': each tool needs function.name"


def test_chat_format_json_schema_and_refusals() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert chat(format="json").format == "json"
    assert chat(format=schema).format == schema
    assert chat(format="").format is None and chat().format is None
    assert chat(format=schema).format_strict is True
    assert refused(chat, format="yaml") == \
        "invalid format 'yaml': use \"json\" or a JSON schema"
    assert "cannot both be given" in refused(chat, format="json", grammar="root ::= \"a\"")
    assert chat(grammar="root ::= \"a\"").grammar == "root ::= \"a\""


def test_chat_options_and_their_refusals() -> None:
    req = chat(options={"temperature": 0.2, "top_p": 0.5, "top_k": 7, "seed": 42,
                        "num_predict": 64, "num_ctx": 2048, "stop": ["\n\n", "END"],
                        "repeat_penalty": 1.3, "min_p": 0.05, "not_an_option": 1})
    o = req.options
    assert (o.temperature, o.top_p, o.top_k, o.seed) == (0.2, 0.5, 7, 42)
    assert (o.num_predict, o.num_ctx, o.stop) == (64, 2048, ["\n\n", "END"])
    assert (o.repeat_penalty, o.min_p) == (1.3, 0.05)
    assert o.frequency_penalty is None and o.typical_p is None  # unset: the model's defaults
    assert chat().options.temperature is None
    assert refused(chat, options={"temperature": -1}).startswith(
        "invalid options.temperature: Input should be greater than or equal to 0")
    assert refused(chat, options={"top_p": "high"}).startswith("invalid options.top_p:")


def test_chat_truncate_and_shift_go_over_the_options() -> None:
    req = chat(truncate=True, shift=False, options={"truncate": False, "shift": True})
    assert (req.options.truncate, req.options.shift) == (True, False)
    req = chat(options={"truncate": False, "shift": True})
    assert (req.options.truncate, req.options.shift) == (False, True)
    req = chat()
    assert (req.options.truncate, req.options.shift) == (None, None)


def test_chat_think_values() -> None:
    assert (chat().think, chat().think_required) == (None, False)
    assert (chat(think=True).think, chat(think=True).think_required) == (True, True)
    assert (chat(think=False).think, chat(think=False).think_required) == (False, False)
    assert (chat(think="high").think, chat(think="high").think_required) == ("high", True)
    assert refused(chat, think="max") == ("invalid think value 'max': use true, false, "
                                          "\"low\", \"medium\" or \"high\"")


def test_chat_stream_progress_and_logprobs_flags() -> None:
    assert chat().stream is True and chat(stream=False).stream is False
    assert chat(return_progress=True).progress is True
    assert chat(stream=False, return_progress=True).progress is False  # nothing to stream on
    assert chat().logprobs is None
    assert chat(logprobs=True).logprobs == 0
    assert chat(logprobs=True, top_logprobs=5).logprobs == 5
    assert chat(top_logprobs=5).logprobs is None  # top_logprobs alone asks for nothing
    with pytest.raises(ValidationError, match="top_logprobs"):
        chat(logprobs=True, top_logprobs=21)


def test_chat_malformed_bodies() -> None:
    for bad in ({"messages": []},  # no model
                {"model": "m", "messages": [{"role": "robot", "content": "x"}]},
                {"model": "m", "messages": [{"role": "user",
                                             "content": [{"type": "text", "text": "x"}]}]},
                {"model": "m", "messages": "hi"},
                {"model": "m", "stream": "maybe"},
                {"model": "m", "options": ["temperature"]}):
        with pytest.raises(ValidationError):
            ChatBody.model_validate(bad)


# -- /api/generate's body --------------------------------------------------------------------


def test_generate_system_prompt_and_images_become_turns() -> None:
    req = generate(prompt="describe", system="you see", images=[B64],
                   options={"num_predict": 9})
    assert req.messages == [Message(role="system", content="you see"),
                            Message(role="user", content="describe", images=[B64])]
    assert req.prompt is None and req.suffix is None
    assert req.return_context is True and req.options.num_predict == 9
    # images alone are a prompt: a user turn with no text
    assert generate(images=[B64]).messages == [Message(role="user", content="", images=[B64])]
    assert generate(prompt="").messages == []  # (the route loads the model instead)


def test_generate_raw_suffix_context_template() -> None:
    raw = generate(prompt="<|im_start|>user", raw=True)
    assert (raw.prompt, raw.return_context) == ("<|im_start|>user", False)
    fim = generate(prompt="def f(", suffix="):\n  pass")
    assert (fim.prompt, fim.suffix, fim.return_context) == ("def f(", "):\n  pass", True)
    assert generate(prompt="go on", context=[1, 2, 3]).context == [1, 2, 3]
    assert generate(prompt="x", context=[]).context is None
    assert generate(prompt="x", template="{{ .Prompt }}").template == "{{ .Prompt }}"
    assert generate(prompt="x", template="").template is None
    assert generate(prompt="x", think="low").think == "low"
    assert refused(generate, prompt="x", images=[B64], raw=True) == (
        "images need a chat template; raw prompts (`raw`, `suffix`) cannot carry images")
    assert refused(generate, prompt="x", format="xml").startswith("invalid format 'xml'")
    assert refused(generate, prompt="x", format={"type": "object"}, grammar="root ::= \"a\"") \
        == "give one of 'format' and 'grammar': each constrains the whole output"


# -- answers ---------------------------------------------------------------------------------


def answer(req: ChatRequest, shape: Any, *events: Event) -> tuple[Any, int, bytes, bool]:
    """(response, status, what it wrote, whether the event stream was closed)."""
    script, stream = stream_of(*events)

    async def go() -> tuple[Any, int, bytes]:
        response = await respond(req, stream, shape)
        return response, response.status_code, await body(response)

    response, status, raw = run(go())
    return response, status, raw, script.closed


def stamped(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` read by the Ollama SDK's type of its shape, then without its created_at, which
    must be an RFC 3339 UTC time."""
    (ChatResponse if "message" in obj else GenerateResponse).model_validate(obj)
    assert TIMESTAMP.match(obj.pop("created_at")), obj
    return obj


def done_fields(reason: str = "stop", **extra: Any) -> dict[str, Any]:
    return {"done": True, "done_reason": reason, "total_duration": 5000, "load_duration": 300,
            "prompt_eval_count": 12, "prompt_eval_duration": 1000, "eval_count": 3,
            "eval_duration": 2000, **extra}


def test_chat_streamed_thought_text_and_done() -> None:
    _, status, raw, closed = answer(
        chat(), "chat", STARTED, Chunk(text="", thinking="Hm."), Chunk(text="Hel"),
        Chunk(text="lo"), Done(stats=STATS))
    assert status == 200 and closed
    lines = [stamped(line) for line in ndjson(raw)]
    assert lines == [
        {"model": "m", "message": {"role": "assistant", "content": "", "thinking": "Hm."},
         "done": False},
        {"model": "m", "message": {"role": "assistant", "content": "Hel"}, "done": False},
        {"model": "m", "message": {"role": "assistant", "content": "lo"}, "done": False},
        {"model": "m", "message": {"role": "assistant", "content": ""}, **done_fields()},
    ]


def test_chat_whole_answer_joins_chunks_and_calls() -> None:
    calls = [ToolCall(id="call_a", name="weather", arguments={"city": "Oslo"}),
             ToolCall(id="call_b", name="time", arguments={})]
    response, status, raw, closed = answer(
        chat(stream=False), "chat", STARTED, Chunk(text="", thinking="need "),
        Chunk(text="", thinking="tools"), Chunk(text="Checking."),
        Chunk(text="", tool_calls=calls),
        Done(stats=STATS.model_copy(update={"finish_reason": "tool_calls"})))
    assert status == 200 and closed
    assert stamped(as_json(response, raw)) == {
        "model": "m",
        "message": {"role": "assistant", "content": "Checking.", "thinking": "need tools",
                    "tool_calls": [
                        {"id": "call_a", "function": {"index": 0, "name": "weather",
                                                      "arguments": {"city": "Oslo"}}},
                        {"id": "call_b", "function": {"index": 1, "name": "time",
                                                      "arguments": {}}}]},
        # Ollama ends a turn of tool calls as "stop"
        **done_fields("stop"),
    }


def test_chat_streamed_tool_call_line_and_length() -> None:
    call = ToolCall(id="call_x", name="f", arguments={"n": 1})
    _, _, raw, _ = answer(chat(), "chat", STARTED, Chunk(text="", tool_calls=[call]),
                          Done(stats=STATS.model_copy(update={"finish_reason": "length",
                                                              "truncated_messages": 2,
                                                              "truncated_tokens": 40})))
    first, last = (stamped(line) for line in ndjson(raw))
    assert first == {"model": "m", "done": False, "message": {
        "role": "assistant", "content": "",
        "tool_calls": [{"id": "call_x", "function": {"index": 0, "name": "f",
                                                     "arguments": {"n": 1}}}]}}
    # the turns dropped to fit the context are reported beside the stats
    assert last == {"model": "m", "message": {"role": "assistant", "content": ""},
                    **done_fields("length", truncated_messages=2, truncated_tokens=40)}


def test_done_reasons() -> None:
    for finish, reason in (("stop", "stop"), ("length", "length"), ("cancel", "stop"),
                           ("tool_calls", "stop"), ("error", "stop")):
        response, _, raw, _ = answer(
            chat(stream=False), "chat", Chunk(text="x"),
            Done(stats=Stats(finish_reason=finish)))
        assert as_json(response, raw)["done_reason"] == reason, finish


def test_generate_streamed_and_whole_with_context() -> None:
    done = Done(stats=STATS.model_copy(update={"context": [5, 6, 7]}))
    _, _, raw, _ = answer(generate(prompt="p"), "generate", STARTED,
                          Chunk(text="", thinking="t"), Chunk(text="ab"), done)
    assert [stamped(line) for line in ndjson(raw)] == [
        {"model": "m", "response": "", "thinking": "t", "done": False},
        {"model": "m", "response": "ab", "done": False},
        {"model": "m", "response": "", "context": [5, 6, 7], **done_fields()},
    ]
    response, _, raw, _ = answer(generate(prompt="p", stream=False), "generate", STARTED,
                                 Chunk(text="a"), Chunk(text="b"),
                                 # a call has no place in /api/generate's answer: left out
                                 Chunk(text="", tool_calls=[ToolCall(id="c", name="f")]),
                                 done)
    assert stamped(as_json(response, raw)) == {
        "model": "m", "response": "ab", "context": [5, 6, 7], **done_fields()}


def test_logprobs_streamed_and_whole() -> None:
    lp = [TokenLogprob(token="Hi", logprob=-0.25, bytes=[72, 105],
                       top=[("Hi", -0.25), ("Yo", -1.5)])]
    want = [{"token": "Hi", "logprob": -0.25, "bytes": [72, 105], "top_logprobs": [
        {"token": "Hi", "logprob": -0.25, "bytes": [72, 105]},
        {"token": "Yo", "logprob": -1.5, "bytes": [89, 111]}]}]
    _, _, raw, _ = answer(chat(logprobs=True, top_logprobs=2), "chat",
                          Chunk(text="Hi", logprobs=lp), Done(stats=STATS))
    assert ndjson(raw)[0]["logprobs"] == want
    assert "logprobs" not in ndjson(raw)[1]
    response, _, raw, _ = answer(chat(logprobs=True, top_logprobs=2, stream=False), "chat",
                                 Chunk(text="Hi", logprobs=lp), Chunk(text="!", logprobs=[]),
                                 Done(stats=STATS))
    assert as_json(response, raw)["logprobs"] == want
    response, _, raw, _ = answer(chat(stream=False), "chat", Chunk(text="Hi"),
                                 Done(stats=STATS))
    assert "logprobs" not in as_json(response, raw)  # not asked for


def test_progress_lines_before_the_text() -> None:
    _, _, raw, _ = answer(chat(return_progress=True), "chat", STARTED,
                          Progress(total=12, cached=4, processed=8),
                          Progress(total=12, cached=4, processed=12), Chunk(text="ok"),
                          Done(stats=STATS))
    lines = [stamped(line) for line in ndjson(raw)]
    assert lines[:2] == [
        {"model": "m", "message": {"role": "assistant", "content": ""}, "done": False,
         "prompt_progress": {"total": 12, "cache": 4, "processed": p}} for p in (8, 12)]
    assert lines[2]["message"]["content"] == "ok" and lines[3]["done"] is True


def test_an_error_before_the_first_token_is_an_http_error() -> None:
    for exc, status in ((EngineError("model 'm' not found", code="not_found"), 404),
                        (EngineError("prompt too long", code="prompt_too_long"), 400),
                        (EngineError("odd", code="upstream_refused",
                                     details={"status": 422}), 422)):
        for req in (chat(), chat(stream=False)):
            response, got, raw, closed = answer(req, "chat", STARTED, exc)
            assert (got, as_json(response, raw), closed) == (status, {"error": exc.message},
                                                             True)
    response, got, _, _ = answer(chat(), "chat", EngineError("queue full", code="busy",
                                                             retry_after=3))
    assert got == 503 and response.headers["retry-after"] == "3"


def test_an_error_after_the_first_token_ends_the_stream_with_an_error_line() -> None:
    _, status, raw, closed = answer(chat(), "chat", STARTED, Chunk(text="par"),
                                    EngineError("the runner died", code="runner_failed"))
    assert status == 200 and closed
    lines = ndjson(raw)
    assert stamped(lines[0])["message"]["content"] == "par"
    assert lines[1:] == [{"error": "the runner died"}]
    # whole: the answer so far is dropped for the error
    response, status, raw, _ = answer(chat(stream=False), "chat", Chunk(text="par"),
                                      EngineError("the runner died", code="runner_failed"))
    assert (status, as_json(response, raw)) == (500, {"error": "the runner died"})
