"""Anthropic's dialect alone, no model and no daemon: Messages bodies into the one ChatRequest
(wire.py: system text, content blocks, tool use and results, tools and tool_choice,
structured output, thinking, sampling), and hand-built events into the answer (stream.py):
the whole message, the named SSE events of a stream, stop reasons, usage, and errors before
and after the first token. Bodies and events are also read by the Anthropic SDK's types."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from typing import Any

import pytest
from anthropic.types import Message as SdkMessage
from anthropic.types import RawMessageStreamEvent
from fastapi.responses import Response, StreamingResponse
from pydantic import TypeAdapter, ValidationError

from llmrun.api.anthropic.stream import respond
from llmrun.api.anthropic.wire import CountBody, MessagesBody
from llmrun.request import (
    ChatRequest,
    Chunk,
    Done,
    EngineError,
    Message,
    NamedTool,
    PartialCall,
    Started,
    Stats,
    Tool,
    ToolCall,
)
from tests.unit.api.feed import Event, FakeService, body, run, sse

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(64))
B64 = base64.b64encode(PNG).decode()
USER = [{"role": "user", "content": "hi"}]
STARTED = Started(prompt_tokens=30, cached_tokens=20, n_ctx=4096)
STATS = Stats(prompt_tokens=30, cached_tokens=20, completion_tokens=5)
USAGE = {"input_tokens": 10, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 20,
         "output_tokens": 5}
MESSAGE_ID = re.compile(r"^msg_[0-9a-f]{24}$")
SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}}}
STREAM_EVENT: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)


def messages_body(**kw: Any) -> MessagesBody:
    return MessagesBody.model_validate({"model": "claude", "messages": USER,
                                        "max_tokens": 100, **kw})


def request(**kw: Any) -> ChatRequest:
    return messages_body(**kw).to_request()


def refused(**kw: Any) -> str:
    with pytest.raises(EngineError) as info:
        request(**kw)
    assert info.value.code == "invalid_request"
    return info.value.message


def signature(thought: str) -> str:
    return "llmrun-" + hashlib.sha256(thought.encode()).hexdigest()[:32]


# -- the body --------------------------------------------------------------------------------


def test_system_text_in_one_leading_message() -> None:
    req = request(system=[{"type": "text", "text": "x-anthropic-billing-header: cc=1; v=2"},
                          {"type": "text", "text": "You are Claude Code."},
                          {"type": "text", "text": "Be brief.",
                           "cache_control": {"type": "ephemeral"}}],
                  messages=[{"role": "system", "content": "Later rules."}, *USER])
    # the billing header (new on every request) is dropped, as Anthropic's server drops it
    assert req.messages == [
        Message(role="system", content="You are Claude Code.\n\nBe brief.\n\nLater rules."),
        Message(role="user", content="hi")]
    assert request(system="plain").messages[0] == Message(role="system", content="plain")
    assert request(system="").messages == [Message(role="user", content="hi")]


def test_content_blocks_tool_use_and_results() -> None:
    req = request(messages=[
        {"role": "user", "content": [
            {"type": "text", "text": "What is in"},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": B64}},
            {"type": "text", "text": "and the weather?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "past thought", "signature": "s"},
            {"type": "redacted_thinking", "data": "xx"},
            {"type": "text", "text": "Checking."},
            {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"c": "Oslo"}},
            {"type": "tool_use", "id": "toolu_2", "name": "shot"}]},
        {"role": "user", "content": [
            {"type": "text", "text": "before"},
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "5 C"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "no camera"},
                         {"type": "image", "source": {"type": "base64",
                                                      "media_type": "image/png",
                                                      "data": B64}}]},
            {"type": "tool_result", "tool_use_id": "toolu_9"},
            {"type": "text", "text": "after"}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": []}]},
    ])
    assert req.messages == [
        Message(role="user", content="What is in\n\nand the weather?", images=[B64]),
        # past thoughts are dropped
        Message(role="assistant", content="Checking.", tool_calls=[
            ToolCall(id="toolu_1", name="weather", arguments={"c": "Oslo"}),
            ToolCall(id="toolu_2", name="shot", arguments={})]),
        # the text before a result first, each result a tool turn named by its call
        Message(role="user", content="before"),
        Message(role="tool", content="5 C", tool_call_id="toolu_1", name="weather"),
        Message(role="tool", content="Error: no camera", tool_call_id="toolu_2",
                name="shot", images=[B64]),
        Message(role="tool", content="", tool_call_id="toolu_9"),
        Message(role="user", content="after"),
        # a user turn of results alone adds no empty user turn
        Message(role="tool", content="", tool_call_id="toolu_1", name="weather"),
    ]


def test_documents_and_search_results_as_text() -> None:
    req = request(messages=[{"role": "user", "content": [
        {"type": "document", "title": "Notes",
         "source": {"type": "text", "media_type": "text/plain", "data": "line one"}},
        {"type": "document", "source": {"type": "content", "content": [
            {"type": "text", "text": "part a"}, {"type": "text", "text": "part b"}]}},
        {"type": "search_result", "title": "Result", "source": "https://example.com",
         "content": [{"type": "text", "text": "found"}]}]}])
    assert req.messages == [Message(role="user", content=(
        "Notes\n\nline one\n\npart a\n\npart b\n\nResult\n\nhttps://example.com\n\nfound"))]


def test_blocks_that_cannot_be_read_are_refused() -> None:
    def blocks(role: str, *content: Any) -> list[dict[str, Any]]:
        return [{"role": role, "content": list(content)}]

    pdf = {"type": "document", "source": {"type": "base64", "media_type": "application/pdf",
                                          "data": "JVBERi0="}}
    assert refused(messages=blocks("user", pdf)) == (
        "messages.0.content.0: model 'claude' cannot read documents other than text (PDFs, "
        "files); send the content as text")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": B64}}
    assert refused(messages=blocks("assistant", image)) == (
        "messages.0.content.0: image blocks are allowed only in user messages and in "
        "tool_result content")
    assert refused(messages=blocks("user", {"type": "image", "source": {
        "type": "file", "file_id": "f"}})).startswith(
        "messages.0.content.0.source: images by file_id are not supported")
    assert refused(messages=blocks("user", {"type": "image", "source": {
        "type": "base64", "media_type": "text/plain", "data": B64}})).startswith(
        "messages.0.content.0.source.media_type: expected an image type")
    assert refused(messages=blocks("user", {"type": "input_audio"})).startswith(
        "messages.0.content.0: the Messages API has no audio blocks")
    assert refused(messages=blocks("user", {"type": "tool_use", "id": "t", "name": "n"})) == \
        "messages.0.content.0: a tool_use block belongs in a assistant message"
    assert refused(messages=blocks("assistant", {"type": "tool_result",
                                                 "tool_use_id": "t"})) == \
        "messages.0.content.0: a tool_result block belongs in a user message"
    assert refused(messages=blocks("assistant", {"type": "tool_use", "name": "n"})) == \
        "messages.0.content.0: a tool_use block needs 'id' and 'name'"
    assert refused(messages=blocks("assistant", {"type": "tool_use", "id": "t", "name": "n",
                                                 "input": [1]})) == \
        "messages.0.content.0.input: must be an object"
    assert refused(messages=blocks("user", {"type": "tool_result"})) == \
        "messages.0.content.0.tool_use_id: Field required"
    assert refused(messages=blocks("user", {"type": "text"})) == \
        "messages.0.content.0.text: Field required"
    assert refused(messages=blocks("user", {"type": "container_upload"})) == \
        "messages.0.content.0: content blocks of type 'container_upload' are not supported here"


def test_tools_and_tool_choice() -> None:
    req = request(tools=[
        {"name": "weather", "description": "Forecast", "input_schema": SCHEMA},
        {"type": "custom", "name": "noargs"},
        {"type": "web_search_20250305", "name": "web_search", "max_uses": 3},  # Anthropic's
    ])
    assert req.tools == [Tool(name="weather", description="Forecast", parameters=SCHEMA),
                         Tool(name="noargs", description="",
                              parameters={"type": "object", "properties": {}})]
    assert (req.tool_choice, req.parallel_tool_calls) == ("auto", True)
    tools = [{"name": "weather", "input_schema": SCHEMA}]
    assert request(tools=tools, tool_choice={"type": "any"}).tool_choice == "required"
    assert request(tools=tools, tool_choice={"type": "none"}).tool_choice == "none"
    named = request(tools=tools, tool_choice={"type": "tool", "name": "weather",
                                              "disable_parallel_tool_use": True})
    assert (named.tool_choice, named.parallel_tool_calls) == (NamedTool(name="weather"), False)
    assert refused(tool_choice={"type": "any"}) == \
        "tool_choice: type 'any' needs at least one tool in 'tools'"
    assert refused(tools=tools, tool_choice={"type": "tool", "name": "time"}) == \
        "tool_choice.name: no tool named 'time' in 'tools'"
    assert refused(tools=tools, tool_choice={"type": "sometimes"}) == \
        "tool_choice.type: expected 'auto', 'any', 'tool' or 'none', got 'sometimes'"
    assert refused(tools=[{"input_schema": SCHEMA}]) == "tools.0.name: Field required"
    assert refused(tools=[{"name": "x", "input_schema": "object"}]) == \
        "tools.0.input_schema: must be a JSON schema object"


def test_structured_output_and_grammar() -> None:
    fmt = {"type": "json_schema", "schema": SCHEMA}
    assert request(output_config={"format": fmt, "effort": "high"}).format == SCHEMA
    assert request(output_format=fmt).format == SCHEMA  # the older beta's field
    assert request(output_config={"effort": "low"}).format is None
    assert request().format is None and request().format_strict is True
    assert refused(output_config={"format": {"type": "json_object"}}).startswith(
        "output_config.format: expected {\"type\": \"json_schema\"")
    assert refused(output_format=fmt, grammar="root ::= \"a\"") == (
        "`grammar` and `output_config.format` cannot both be given: one constraint per "
        "request")
    assert request(grammar="root ::= \"a\"").grammar == "root ::= \"a\""


def test_sampling_stops_and_stream() -> None:
    req = request(max_tokens=64, temperature=0.5, top_k=10, top_p=0.9,
                  stop_sequences=["\n\nHuman:", "", "END"], stream=True)
    o = req.options
    assert (o.num_predict, o.temperature, o.top_k, o.top_p) == (64, 0.5, 10, 0.9)
    # an empty stop string would stop at once: dropped; the model's own stops still apply
    assert (o.stop, req.stop_adds) == (["\n\nHuman:", "END"], True)
    assert req.stream is True and request().stream is False
    unset = request().options
    assert (unset.temperature, unset.top_k, unset.top_p, unset.stop, unset.seed) == \
        (None, None, None, None, None)
    assert request().logprobs is None


def test_thinking_switch() -> None:
    assert request().think is False
    assert request(thinking={"type": "disabled"}).think is False
    assert request(thinking={"type": "adaptive"}).think is True
    enabled = request(thinking={"type": "enabled", "budget_tokens": 2048})
    assert (enabled.think, enabled.think_budget) == (True, 2048)


def test_count_tokens_body_has_no_generation_settings() -> None:
    req = CountBody.model_validate({"model": "claude", "messages": USER, "system": "s",
                                    "tools": [{"name": "t"}], "stream": True,
                                    "max_tokens": 5}).to_request()
    assert req.messages == [Message(role="system", content="s"),
                            Message(role="user", content="hi")]
    assert [t.name for t in req.tools] == ["t"]
    assert (req.stream, req.options.num_predict, req.format) == (False, None, None)


def test_malformed_bodies() -> None:
    for bad in ({"max_tokens": 0}, {"max_tokens": None},
                {"messages": [{"role": "tool", "content": "x"}]},
                {"messages": [{"role": "user", "content": 5}]},
                {"messages": [{"role": "user"}]},
                {"messages": [{"role": "user", "content": ["bare text"]}]},
                {"temperature": -0.1}, {"top_p": 1.1}, {"top_k": -1},
                {"stop_sequences": "END"}, {"tool_choice": "auto"}):
        with pytest.raises(ValidationError):
            messages_body(**bad)
    with pytest.raises(ValidationError, match="max_tokens"):
        MessagesBody.model_validate({"model": "claude", "messages": USER})


# -- answers ---------------------------------------------------------------------------------


def answer(b: MessagesBody, *events: Event) -> tuple[Response, bytes, FakeService]:
    service = FakeService.of(*events)

    async def go() -> tuple[Response, bytes]:
        response = await respond(service, b, b.to_request())  # type: ignore[arg-type]
        return response, await body(response)

    response, raw = run(go())
    return response, raw, service


def whole(b: MessagesBody, *events: Event) -> dict[str, Any]:
    response, raw, service = answer(b, *events)
    assert response.status_code == 200 and not isinstance(response, StreamingResponse)
    assert service.closed
    obj = json.loads(raw)
    SdkMessage.model_validate(obj)
    assert MESSAGE_ID.match(obj.pop("id"))
    return dict(obj)


def streamed(b: MessagesBody, *events: Event) -> list[tuple[str | None, Any]]:
    """The stream's events as (name, data), each read by the SDK's event type (but pings
    and errors, which it reads apart); message_start's id checked and taken out."""
    response, raw, service = answer(b, *events)
    assert isinstance(response, StreamingResponse) and response.status_code == 200
    assert service.closed
    out = sse(raw)
    for name, data in out:
        assert name == data["type"]  # the event's name is its data's type
        if name not in ("ping", "error"):
            STREAM_EVENT.validate_python(data)
        if name == "message_start":
            assert MESSAGE_ID.match(data["message"].pop("id"))
    return out


def test_whole_message_with_thought_and_text() -> None:
    assert whole(messages_body(), STARTED, Chunk(text="", thinking="Let me "),
                 Chunk(text="", thinking="think."), Chunk(text="Hello"), Chunk(text="!"),
                 Done(stats=STATS)) == {
        "type": "message", "role": "assistant", "model": "claude",
        "content": [{"type": "thinking", "thinking": "Let me think.",
                     "signature": signature("Let me think.")},
                    {"type": "text", "text": "Hello!"}],
        "stop_reason": "end_turn", "stop_sequence": None,
        # the cached part of the prompt is a cache read, as Anthropic splits it
        "usage": USAGE}


def test_whole_message_with_tool_use() -> None:
    calls = [ToolCall(id="toolu_a", name="weather", arguments={"city": "Oslo"}),
             ToolCall(id="", name="time", arguments={})]
    out = whole(messages_body(), Chunk(text="", tool_calls=calls),
                Done(stats=STATS.model_copy(update={"finish_reason": "tool_calls"})))
    first, second = out["content"]
    assert first == {"type": "tool_use", "id": "toolu_a", "name": "weather",
                     "input": {"city": "Oslo"}}
    assert re.match(r"^toolu_[0-9a-f]{24}$", second.pop("id"))  # a call with no id gets one
    assert second == {"type": "tool_use", "name": "time", "input": {}}
    assert (out["stop_reason"], out["stop_sequence"]) == ("tool_use", None)
    # calls make the turn tool_use whatever the finish reason says
    out = whole(messages_body(), Chunk(text="On it. "), Chunk(text="", tool_calls=calls[:1]),
                Done(stats=STATS))
    assert [b["type"] for b in out["content"]] == ["text", "tool_use"]
    assert out["stop_reason"] == "tool_use"


def test_whole_message_with_a_call_cut_short() -> None:
    out = whole(messages_body(), Chunk(text="", partial_call=PartialCall(
        id="toolu_c", name="write", arguments="{\"path\": \"a.txt\", \"text\": \"once up")),
        Done(stats=STATS.model_copy(update={"finish_reason": "length"})))
    # the members written whole, as the SDK reads a streamed block cut there
    assert out["content"] == [{"type": "tool_use", "id": "toolu_c", "name": "write",
                               "input": {"path": "a.txt"}}]
    assert out["stop_reason"] == "max_tokens"


def test_stop_reasons() -> None:
    b = messages_body(stop_sequences=["END"])
    cases = [(Stats(finish_reason="length"), ("max_tokens", None)),
             (Stats(stop_sequence="END"), ("stop_sequence", "END")),
             # a stop string of the model's own (its Modelfile's) ends the turn
             (Stats(stop_sequence="<|im_end|>"), ("end_turn", None)),
             (Stats(finish_reason="cancel"), ("end_turn", None))]
    for stats, want in cases:
        out = whole(b, Chunk(text="x"), Done(stats=stats))
        assert (out["stop_reason"], out["stop_sequence"]) == want, stats


def test_whole_message_hides_thoughts_when_asked_and_is_never_empty() -> None:
    b = messages_body(thinking={"type": "adaptive", "display": "omitted"})
    out = whole(b, Chunk(text="", thinking="secret"), Chunk(text="Hi"), Done(stats=STATS))
    assert out["content"] == [{"type": "text", "text": "Hi"}]
    out = whole(messages_body(), Done(stats=Stats()))
    assert out["content"] == [{"type": "text", "text": ""}]


def test_streamed_message() -> None:
    call = ToolCall(id="toolu_a", name="weather", arguments={"city": "Zürich"})
    events = streamed(messages_body(stream=True), STARTED, Chunk(text="", thinking="Hm"),
                      Chunk(text="", thinking="m."), Chunk(text="Let me "),
                      Chunk(text="check."), Chunk(text="", tool_calls=[call]),
                      Done(stats=STATS.model_copy(update={"finish_reason": "tool_calls"})))
    assert events == [
        ("message_start", {"type": "message_start", "message": {
            "type": "message", "role": "assistant", "model": "claude", "content": [],
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 30, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 0, "output_tokens": 0}}}),
        ("ping", {"type": "ping"}),
        ("content_block_start", {"type": "content_block_start", "index": 0, "content_block": {
            "type": "thinking", "thinking": "", "signature": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {
            "type": "thinking_delta", "thinking": "Hm"}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {
            "type": "thinking_delta", "thinking": "m."}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 0, "delta": {
            "type": "signature_delta", "signature": signature("Hmm.")}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 0}),
        ("content_block_start", {"type": "content_block_start", "index": 1,
                                 "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 1,
                                 "delta": {"type": "text_delta", "text": "Let me "}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 1,
                                 "delta": {"type": "text_delta", "text": "check."}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 1}),
        ("content_block_start", {"type": "content_block_start", "index": 2, "content_block": {
            "type": "tool_use", "id": "toolu_a", "name": "weather", "input": {}}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 2, "delta": {
            "type": "input_json_delta", "partial_json": "{\"city\": \"Zürich\"}"}}),
        ("content_block_stop", {"type": "content_block_stop", "index": 2}),
        ("message_delta", {"type": "message_delta",
                           "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                           "usage": USAGE}),
        ("message_stop", {"type": "message_stop"}),
    ]


def test_streamed_call_cut_short() -> None:
    events = streamed(messages_body(stream=True), STARTED, Chunk(text="Writing"),
                      Chunk(text="", partial_call=PartialCall(
                          id="toolu_c", name="write", arguments="{\"path\": \"a")),
                      Done(stats=STATS.model_copy(update={"finish_reason": "length"})))
    assert [(n, d.get("index"), d.get("delta") or d.get("content_block"))
            for n, d in events[2:]] == [
        ("content_block_start", 0, {"type": "text", "text": ""}),
        ("content_block_delta", 0, {"type": "text_delta", "text": "Writing"}),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, {"type": "tool_use", "id": "toolu_c", "name": "write",
                                    "input": {}}),
        ("content_block_delta", 1, {"type": "input_json_delta",
                                    "partial_json": "{\"path\": \"a"}),
        ("content_block_stop", 1, None),
        ("message_delta", None, {"stop_reason": "max_tokens", "stop_sequence": None}),
        ("message_stop", None, None)]


def test_streamed_thought_cut_short_and_empty_answer() -> None:
    events = streamed(messages_body(stream=True), STARTED, Chunk(text="", thinking="long"),
                      Done(stats=STATS.model_copy(update={"finish_reason": "length"})))
    assert [(n, d.get("index"), d.get("delta") or d.get("content_block"))
            for n, d in events[2:-2]] == [
        ("content_block_start", 0, {"type": "thinking", "thinking": "", "signature": ""}),
        ("content_block_delta", 0, {"type": "thinking_delta", "thinking": "long"}),
        ("content_block_delta", 0, {"type": "signature_delta",
                                    "signature": signature("long")}),
        ("content_block_stop", 0, None),
        # the answer never came: still a text block, as the whole message has
        ("content_block_start", 1, {"type": "text", "text": ""}),
        ("content_block_stop", 1, None)]
    events = streamed(messages_body(stream=True), STARTED, Done(stats=Stats()))
    assert [(n, d.get("index")) for n, d in events[2:]] == [
        ("content_block_start", 0), ("content_block_stop", 0), ("message_delta", None),
        ("message_stop", None)]


def test_streamed_hidden_thoughts() -> None:
    b = messages_body(stream=True, thinking={"type": "enabled", "display": "omitted"})
    events = streamed(b, STARTED, Chunk(text="", thinking="secret"), Chunk(text="Hi"),
                      Done(stats=STATS))
    assert [(n, d.get("index"), d.get("delta") or d.get("content_block"))
            for n, d in events[2:-2]] == [
        ("content_block_start", 0, {"type": "text", "text": ""}),
        ("content_block_delta", 0, {"type": "text_delta", "text": "Hi"}),
        ("content_block_stop", 0, None)]


def test_streamed_thought_after_text_opens_a_block_of_its_own() -> None:
    """A thought that follows answer text (a model that thinks again before a call, or a
    remote model's interleaved reasoning) closes the text block first; text after it opens
    a new one: each block started, written and stopped in turn, as the SDK assembles them."""
    events = streamed(messages_body(stream=True), STARTED, Chunk(text="First."),
                      Chunk(text="", thinking="again"), Chunk(text="Then."),
                      Done(stats=STATS))
    assert [(n, d.get("index"), d.get("delta") or d.get("content_block"))
            for n, d in events[2:-2]] == [
        ("content_block_start", 0, {"type": "text", "text": ""}),
        ("content_block_delta", 0, {"type": "text_delta", "text": "First."}),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, {"type": "thinking", "thinking": "", "signature": ""}),
        ("content_block_delta", 1, {"type": "thinking_delta", "thinking": "again"}),
        ("content_block_delta", 1, {"type": "signature_delta",
                                    "signature": signature("again")}),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, {"type": "text", "text": ""}),
        ("content_block_delta", 2, {"type": "text_delta", "text": "Then."}),
        ("content_block_stop", 2, None)]


def test_an_error_before_the_first_token_is_an_http_error() -> None:
    too_long = EngineError("prompt is too long", code="prompt_too_long",
                           details={"prompt_tokens": 5000, "n_ctx": 4096})
    for stream in (False, True):
        response, raw, service = answer(messages_body(stream=stream), STARTED, too_long)
        assert response.status_code == 400 and service.closed
        assert json.loads(raw) == {"type": "error", "error": {
            "type": "invalid_request_error",
            "message": "prompt is too long: 5000 tokens > 4096 maximum (model 'claude' is "
                       "served with a context of 4096 tokens, num_ctx; shorten the "
                       "conversation or serve the model with a larger num_ctx)"}}
    # a full queue is Anthropic's 529, which its clients retry
    response, raw, _ = answer(messages_body(stream=True),
                              EngineError("queue full", code="busy", retry_after=4))
    assert (response.status_code, response.headers["retry-after"]) == (529, "4")
    assert json.loads(raw)["error"] == {"type": "overloaded_error", "message": "queue full"}
    response, raw, _ = answer(messages_body(), EngineError("no such model", code="not_found"))
    assert response.status_code == 404
    assert json.loads(raw)["error"] == {"type": "not_found_error", "message": "no such model"}


def test_an_error_after_the_first_token_is_an_error_event() -> None:
    events = streamed(messages_body(stream=True), STARTED, Chunk(text="par"),
                      EngineError("the runner died", code="runner_failed"))
    assert [n for n, _ in events] == ["message_start", "ping", "content_block_start",
                                      "content_block_delta", "error"]
    assert events[-1][1] == {"type": "error", "error": {"type": "api_error",
                                                        "message": "the runner died"}}
    response, raw, _ = answer(messages_body(), Chunk(text="par"),
                              EngineError("the runner died", code="runner_failed"))
    assert response.status_code == 500
    assert json.loads(raw)["error"] == {"type": "api_error", "message": "the runner died"}
