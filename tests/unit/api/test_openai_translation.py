"""OpenAI's dialect alone, no model and no daemon: chat completion and completion bodies into
ChatRequests (wire.py, one per choice), and hand-built events into the answer (stream.py):
the whole `chat.completion`, the `chat.completion.chunk` SSE frames ending with `[DONE]`,
usage, logprobs, tool calls, and errors before and after the first token. Each body is also
read by the OpenAI SDK's own types, as a client would read it."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from fastapi.responses import Response
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import ValidationError

from llmrun.api.openai.errors import ApiError
from llmrun.api.openai.stream import (
    FINGERPRINT,
    chat_collect,
    chat_stream,
    completion_collect,
    completion_stream,
    start_choices,
)
from llmrun.api.openai.wire import ChatCompletionBody, CompletionBody
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
    TokenLogprob,
    Tool,
    ToolCall,
)
from tests.unit.api.feed import Event, FakeService, Script, as_json, collect, run, sse

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(64))
B64 = base64.b64encode(PNG).decode()
USER = [{"role": "user", "content": "hi"}]
STARTED = Started(prompt_tokens=10, cached_tokens=6, n_ctx=4096)
STATS = Stats(prompt_tokens=10, cached_tokens=6, completion_tokens=4)
CID, CREATED = "chatcmpl-test", 1700000000
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}


def body(**kw: Any) -> ChatCompletionBody:
    return ChatCompletionBody.model_validate({"model": "gpt", "messages": USER, **kw})


def one(**kw: Any) -> ChatRequest:
    [req] = body(**kw).to_requests()
    return req


def api_error(make: Any, **kw: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        make(**kw)
    assert info.value.status == 400
    return info.value


def tool(name: str, strict: bool | None = None) -> dict[str, Any]:
    fn: dict[str, Any] = {"name": name, "description": f"{name} it", "parameters": WEATHER}
    if strict is not None:
        fn["strict"] = strict
    return {"type": "function", "function": fn}


# -- the chat body ---------------------------------------------------------------------------


def test_messages_of_every_role() -> None:
    req = one(messages=[
        {"role": "system", "content": "rules"},
        {"role": "developer", "content": "more rules"},
        {"role": "user", "content": [
            {"type": "text", "text": "what is"},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{B64}",
                                                "detail": "low"}},
            {"type": "text", "text": "this?"},
            {"type": "image_url", "image_url": f"data:image/png;base64,{B64}"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "look", "arguments": "{\"zoom\": 2}"}},
            {"type": "function", "function": {"name": "measure", "arguments": ""}},
            {"type": "function", "function": {"name": "obj", "arguments": {"k": [1]}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "a cat"},
        {"role": "tool", "tool_call_id": "call_3_1",
         "content": [{"type": "text", "text": "3 cm"}]},
        {"role": "function", "name": "legacy", "content": "old style"},
        {"role": "assistant", "content": [{"type": "text", "text": "A cat."},
                                          {"type": "refusal", "refusal": "no"}]},
    ])
    assert req.messages == [
        Message(role="system", content="rules"),
        Message(role="system", content="more rules"),
        Message(role="user", content="what is\nthis?", images=[B64, B64]),
        Message(role="assistant", content="", tool_calls=[
            ToolCall(id="call_1", name="look", arguments={"zoom": 2}),
            ToolCall(id="call_3_1", name="measure", arguments={}),  # no id: numbered
            ToolCall(id="call_3_2", name="obj", arguments={"k": [1]})]),
        # a tool result is named by the call it answers
        Message(role="tool", content="a cat", tool_call_id="call_1", name="look"),
        Message(role="tool", content="3 cm", tool_call_id="call_3_1", name="measure"),
        Message(role="tool", content="old style", name="legacy"),
        Message(role="assistant", content="A cat."),
    ]


def test_message_refusals_name_the_parameter() -> None:
    err = api_error(one, messages=[{"role": "tool", "content": "x"}])
    assert (err.message, err.param) == ("a 'tool' message needs 'tool_call_id'",
                                        "messages[0].tool_call_id")
    err = api_error(one, messages=[{"role": "assistant", "content": [
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{B64}"}}]}])
    assert err.param == "messages[0].content[0]"
    assert err.message.startswith("Image URLs are only allowed for messages with role 'user'")
    err = api_error(one, messages=[{"role": "user", "content": [{"type": "file"}]}])
    assert (err.message, err.param) == ("content parts of type 'file' are not supported",
                                        "messages[0].content[0].type")
    err = api_error(one, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}}]}])
    assert err.param == "messages[0].content[0].image_url"
    for args in ("[1, 2]", "{not json"):
        err = api_error(one, messages=[{"role": "assistant", "tool_calls": [
            {"id": "c", "function": {"name": "f", "arguments": args}}]}])
        assert (err.message, err.param) == ("function arguments must be a JSON object",
                                            "messages[0].tool_calls[0].function.arguments")


def test_tools_and_tool_choice() -> None:
    req = one(tools=[tool("weather"), {"type": "function", "function": {"name": "bare"}}])
    assert req.tools == [Tool(name="weather", description="weather it", parameters=WEATHER),
                         Tool(name="bare", description="",
                              parameters={"type": "object", "properties": {}})]
    assert (req.tool_choice, req.parallel_tool_calls) == ("auto", True)
    assert one(tools=[tool("w")], tool_choice="none").tool_choice == "none"
    assert one(tools=[tool("w")], tool_choice="required").tool_choice == "required"
    named = one(tools=[tool("w"), tool("x")],
                tool_choice={"type": "function", "function": {"name": "x"}})
    assert named.tool_choice == NamedTool(name="x")
    assert one(tools=[tool("w")], parallel_tool_calls=False).parallel_tool_calls is False
    err = api_error(one, tools=[tool("w")],
                    tool_choice={"type": "function", "function": {"name": "nope"}})
    assert (err.message, err.param) == (
        "tool_choice names the function 'nope', which is not in 'tools'", "tool_choice")
    err = api_error(one, tool_choice="required")
    assert (err.message, err.param) == ("tool_choice 'required' needs 'tools'", "tool_choice")


def test_strictness_of_what_is_enforced() -> None:
    # nothing forced: OpenAI's default (not strict) does not apply, the request stays strict
    assert one(tools=[tool("w")]).format_strict is True
    assert one(tools=[tool("w", True)], tool_choice="required").format_strict is True
    assert one(tools=[tool("w", True), tool("x")], tool_choice="required").format_strict \
        is False
    # a named tool: only its own flag counts
    assert one(tools=[tool("w", True), tool("x")],
               tool_choice={"type": "function", "function": {"name": "w"}}).format_strict
    schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": WEATHER}}
    assert one(response_format=schema).format_strict is False
    schema["json_schema"]["strict"] = True  # type: ignore[index]
    assert one(response_format=schema).format_strict is True
    assert one(json_schema=WEATHER).format_strict is True  # llama-server's: always strict


def test_response_format_json_schema_and_grammar() -> None:
    assert one().format is None and one().grammar is None
    assert one(response_format={"type": "text"}).format is None
    assert one(response_format={"type": "json_object"}).format == "json"
    assert one(response_format={"type": "json_schema",
                                "json_schema": {"name": "w", "schema": WEATHER}}).format \
        == WEATHER
    assert one(response_format={"type": "json_schema",
                                "json_schema": {"name": "w"}}).format == "json"
    assert one(json_schema=WEATHER).format == WEATHER
    grammar = one(grammar="root ::= \"yes\"")
    assert (grammar.grammar, grammar.format) == ("root ::= \"yes\"", None)
    err = api_error(one, response_format={"type": "json_schema"})
    assert (err.message, err.param) == (
        "response_format of type 'json_schema' needs 'json_schema'",
        "response_format.json_schema")
    err = api_error(one, response_format={"type": "json_object"}, grammar="root ::= \"a\"")
    assert (err.message, err.param) == (
        "give one of 'response_format' and 'grammar': each constrains the whole output",
        "grammar")
    assert api_error(one, json_schema=WEATHER, grammar="g").param == "grammar"
    # a text response_format constrains nothing: beside a grammar it is not a second one
    assert one(response_format={"type": "text"}, grammar="g").grammar == "g"


def test_sampling_options_and_llama_extras() -> None:
    o = one(temperature=0.3, top_p=0.8, seed=11, max_tokens=50, stop="END",
            presence_penalty=0.5, frequency_penalty=-0.5, top_k=20, min_p=0.1,
            repeat_penalty=1.2, typical_p=0.9, repeat_last_n=32, num_ctx=8192).options
    assert (o.temperature, o.top_p, o.seed, o.num_predict, o.stop) == \
        (0.3, 0.8, 11, 50, ["END"])
    assert (o.presence_penalty, o.frequency_penalty) == (0.5, -0.5)
    assert (o.top_k, o.min_p, o.repeat_penalty, o.typical_p, o.repeat_last_n, o.num_ctx) == \
        (20, 0.1, 1.2, 0.9, 32, 8192)
    # max_completion_tokens (the newer name) wins over max_tokens
    assert one(max_tokens=50, max_completion_tokens=7).options.num_predict == 7
    assert one(stop=["a", "b"]).options.stop == ["a", "b"]
    unset = one().options
    assert (unset.temperature, unset.top_p, unset.seed, unset.num_predict, unset.stop) == \
        (None, None, None, None, None)


def test_reasoning_settings() -> None:
    assert one().think is None
    assert one(reasoning_effort="low").think == "low"
    assert one(reasoning_effort="high").think == "high"
    assert one(reasoning_effort="none").think is False
    assert one(reasoning_effort="minimal").think is False
    assert one(chat_template_kwargs={"enable_thinking": False}).think is False
    assert one(chat_template_kwargs={"enable_thinking": "yes"}).think is None  # not a switch
    # reasoning_effort goes first
    assert one(reasoning_effort="medium",
               chat_template_kwargs={"enable_thinking": False}).think == "medium"


def test_stream_and_logprobs_flags() -> None:
    assert one().stream is False and one(stream=None).stream is False
    assert one(stream=True).stream is True
    assert one().logprobs is None
    assert one(logprobs=False).logprobs is None
    assert one(logprobs=True).logprobs == 0
    assert one(logprobs=True, top_logprobs=3).logprobs == 3
    err = api_error(one, top_logprobs=3)
    assert (err.message, err.param) == ("'top_logprobs' needs 'logprobs' set to true",
                                        "top_logprobs")


def test_n_choices_sample_with_successive_seeds() -> None:
    reqs = body(n=3, seed=5).to_requests()
    assert [r.options.seed for r in reqs] == [5, 6, 7]
    assert all(r.messages == reqs[0].messages for r in reqs)
    assert [r.options.seed for r in body(n=2).to_requests()] == [None, None]
    assert [r.options.seed for r in body(n=2, seed=-1).to_requests()] == [-1, -1]


def test_malformed_chat_bodies() -> None:
    for bad in ({"messages": []}, {"temperature": 2.5}, {"top_p": 1.5}, {"n": 17},
                {"n": 0}, {"max_tokens": 0}, {"top_logprobs": 21, "logprobs": True},
                {"messages": [{"role": "robot", "content": "x"}]},
                {"messages": [{"role": "user", "content": 5}]},
                {"tool_choice": "sometimes"},
                {"tools": [{"type": "function", "function": {"name": "x" * 65}}]},
                {"tools": [{"type": "function", "function": {"name": ""}}]},
                {"response_format": {"type": "xml"}},
                {"frequency_penalty": 3}):
        with pytest.raises(ValidationError):
            body(**bad)
    with pytest.raises(ValidationError):
        ChatCompletionBody.model_validate({"messages": USER})  # no model


def test_unknown_fields_are_kept_aside() -> None:
    b = body(vendor_extra=1, keep_alive="5m")
    assert b.model_extra == {"vendor_extra": 1}


# -- the completions body --------------------------------------------------------------------


def completion(**kw: Any) -> tuple[list[str], list[ChatRequest]]:
    return CompletionBody.model_validate({"model": "gpt", **kw}).to_requests()


def test_completion_prompts_times_choices() -> None:
    texts, reqs = completion(prompt=["a", "b"], n=2, seed=3, max_tokens=0, echo=True,
                             logprobs=2, suffix="end", stop="\n", temperature=0)
    assert texts == ["a", "a", "b", "b"]
    assert [(r.prompt, r.options.seed) for r in reqs] == [("a", 3), ("a", 4), ("b", 3),
                                                          ("b", 4)]
    r = reqs[0]
    assert (r.messages, r.suffix, r.logprobs, r.prompt_logprobs) == ([], "end", 2, 2)
    assert (r.options.num_predict, r.options.stop, r.options.temperature) == (0, ["\n"], 0)
    _, [plain] = completion(prompt="x")
    assert (plain.prompt, plain.logprobs, plain.prompt_logprobs, plain.suffix) == \
        ("x", None, None, None)
    _, [no_echo] = completion(prompt="x", logprobs=0)
    assert (no_echo.logprobs, no_echo.prompt_logprobs) == (0, None)
    err = api_error(completion, prompt=[1, 2, 3])
    assert (err.message, err.param) == ("prompts as token ids are not supported; send text",
                                        "prompt")
    assert api_error(completion, prompt=[]).message == "'prompt' is empty"
    assert api_error(completion, prompt="x", n=2, best_of=3).param == "best_of"
    with pytest.raises(ValidationError, match="item 1 is not a string"):
        completion(prompt=["a", None])


# -- answering: running the choices ----------------------------------------------------------


def answer_chat(b: ChatCompletionBody, *scripts: list[Event]) -> tuple[Response | bytes,
                                                                        FakeService]:
    """The response a chat body gets when its choices' events are `scripts` (the route's
    flow: start every choice, then collect or stream): a Response when whole (or refused),
    the stream's bytes when streamed."""
    reqs = b.to_requests()
    service = FakeService([Script(s) for s in scripts])

    async def go() -> Response | bytes:
        started = await start_choices(service, reqs)  # type: ignore[arg-type]
        if isinstance(started, Response):
            return started
        if not reqs[0].stream:
            return await chat_collect(b, reqs, started, CID, CREATED)
        return await collect(chat_stream(b, reqs, started, CID, CREATED))

    return run(go()), service


def whole(response: Response | bytes) -> dict[str, Any]:
    assert isinstance(response, Response) and response.status_code == 200
    obj = as_json(response, bytes(response.body))
    ChatCompletion.model_validate(obj)
    return dict(obj)


def frames(raw: Response | bytes) -> list[Any]:
    """The data of each SSE frame; every chunk read by the SDK's type."""
    assert isinstance(raw, bytes)
    out = []
    for name, data in sse(raw):
        assert name is None  # Chat Completions frames are unnamed
        if data != "[DONE]" and "error" not in data:
            ChatCompletionChunk.model_validate(data)
        out.append(data)
    return out


def chunk(delta: dict[str, Any], finish: str | None = None, index: int = 0,
          logprobs: Any = None, **extra: Any) -> dict[str, Any]:
    return {"id": CID, "object": "chat.completion.chunk", "created": CREATED, "model": "gpt",
            "system_fingerprint": FINGERPRINT,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                         "finish_reason": finish}], **extra}


USAGE = {"prompt_tokens": 10, "completion_tokens": 4, "total_tokens": 14,
         "prompt_tokens_details": {"cached_tokens": 6}}


def test_whole_answer_with_reasoning() -> None:
    response, service = answer_chat(body(), [STARTED, Chunk(text="", thinking="Let me "),
                                             Chunk(text="", thinking="see."),
                                             Chunk(text="Hello"), Chunk(text=" there"),
                                             Done(stats=STATS)])
    assert service.closed
    assert whole(response) == {
        "id": CID, "object": "chat.completion", "created": CREATED, "model": "gpt",
        "system_fingerprint": FINGERPRINT,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello there",
                                             "refusal": None,
                                             "reasoning_content": "Let me see."},
                     "logprobs": None, "finish_reason": "stop"}],
        "usage": USAGE,
    }


def test_whole_answer_with_tool_calls() -> None:
    calls = [ToolCall(id="call_a", name="weather", arguments={"city": "Zürich"}),
             ToolCall(id="call_b", name="time", arguments={})]
    lp = [TokenLogprob(token="<tool>", logprob=-0.1, bytes=[60])]
    response, _ = answer_chat(body(logprobs=True), [
        Chunk(text="", tool_calls=calls, logprobs=lp),
        Done(stats=STATS.model_copy(update={"finish_reason": "tool_calls"}))])
    [choice] = whole(response)["choices"]
    assert choice == {"index": 0, "message": {
        "role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": "call_a", "type": "function",
             "function": {"name": "weather", "arguments": "{\"city\": \"Zürich\"}"}},
            {"id": "call_b", "type": "function",
             "function": {"name": "time", "arguments": "{}"}}]},
        # a call's tokens are not content: their logprobs are left out
        "logprobs": {"content": [], "refusal": None}, "finish_reason": "tool_calls"}


def test_whole_answer_with_a_call_cut_short() -> None:
    response, _ = answer_chat(body(), [
        Chunk(text="Sure. "),
        Chunk(text="", partial_call=PartialCall(id="call_c", name="write",
                                                arguments="{\"text\": \"once up")),
        Done(stats=STATS.model_copy(update={"finish_reason": "length"}))])
    [choice] = whole(response)["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Sure. ", "refusal": None,
                                 "tool_calls": [{"id": "call_c", "type": "function",
                                                 "function": {"name": "write",
                                                              "arguments": "{\"text\": "
                                                                           "\"once up"}}]}
    assert choice["finish_reason"] == "length"


def test_whole_answer_logprobs() -> None:
    lps = [TokenLogprob(token="Hi", logprob=-0.5, bytes=[72, 105], top=[("Hi", -0.5),
                                                                       ("Hey", -1.0)]),
           TokenLogprob(token="!", logprob=-0.01, bytes=[33])]
    response, _ = answer_chat(body(logprobs=True, top_logprobs=2), [
        Chunk(text="Hi", logprobs=lps[:1]), Chunk(text="!", logprobs=lps[1:]),
        Done(stats=STATS)])
    [choice] = whole(response)["choices"]
    assert choice["logprobs"] == {"refusal": None, "content": [
        {"token": "Hi", "logprob": -0.5, "bytes": [72, 105], "top_logprobs": [
            {"token": "Hi", "logprob": -0.5, "bytes": [72, 105]},
            {"token": "Hey", "logprob": -1.0, "bytes": [72, 101, 121]}]},
        {"token": "!", "logprob": -0.01, "bytes": [33], "top_logprobs": []}]}


def test_finish_reasons() -> None:
    for finish, want in (("stop", "stop"), ("length", "length"), ("tool_calls", "tool_calls"),
                         ("cancel", "stop"), ("error", "stop")):
        response, _ = answer_chat(body(), [Chunk(text="x"),
                                           Done(stats=Stats(finish_reason=finish))])
        assert whole(response)["choices"][0]["finish_reason"] == want, finish


def test_n_choices_whole_count_the_prompt_once() -> None:
    response, service = answer_chat(body(n=2, seed=1), [
        Chunk(text="one"), Done(stats=Stats(prompt_tokens=10, completion_tokens=3))], [
        Chunk(text="two"), Done(stats=Stats(prompt_tokens=10, completion_tokens=5,
                                            finish_reason="length"))])
    out = whole(response)
    assert [(c["index"], c["message"]["content"], c["finish_reason"])
            for c in out["choices"]] == [(0, "one", "stop"), (1, "two", "length")]
    assert out["usage"] == {"prompt_tokens": 10, "completion_tokens": 8, "total_tokens": 18,
                            "prompt_tokens_details": {"cached_tokens": 0}}
    assert [r.options.seed for r in service.requests] == [1, 2] and service.closed


def test_streamed_answer() -> None:
    call = ToolCall(id="call_a", name="weather", arguments={"city": "Oslo"})
    raw, service = answer_chat(body(stream=True), [
        STARTED, Chunk(text="", thinking="hmm"), Chunk(text="Let me check."),
        Chunk(text="", tool_calls=[call]),
        Chunk(text="", partial_call=PartialCall(id="call_b", name="f", arguments="{\"a")),
        Done(stats=STATS.model_copy(update={"finish_reason": "tool_calls"}))])
    assert service.closed
    assert frames(raw) == [
        chunk({"role": "assistant", "content": ""}),
        chunk({"reasoning_content": "hmm"}),
        chunk({"content": "Let me check."}),
        chunk({"tool_calls": [{"index": 0, "id": "call_a", "type": "function", "function": {
            "name": "weather", "arguments": "{\"city\": \"Oslo\"}"}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "call_b", "type": "function", "function": {
            "name": "f", "arguments": "{\"a"}}]}),
        chunk({}, "tool_calls"),
        "[DONE]",
    ]


def test_streamed_usage_and_logprobs() -> None:
    lp = [TokenLogprob(token="A", logprob=-0.2, bytes=[65])]
    raw, _ = answer_chat(body(stream=True, stream_options={"include_usage": True},
                              logprobs=True), [
        Chunk(text="A", logprobs=lp), Chunk(text="", logprobs=lp),
        Done(stats=STATS.model_copy(update={"finish_reason": "length",
                                            "shifted_tokens": 100}))])
    content = [{"token": "A", "logprob": -0.2, "bytes": [65], "top_logprobs": []}]
    assert frames(raw) == [
        chunk({"role": "assistant", "content": ""}, usage=None),
        chunk({"content": "A"}, logprobs={"content": content, "refusal": None}, usage=None),
        # a token that wrote no text (held back) still reports its logprob
        chunk({"content": ""}, logprobs={"content": content, "refusal": None}, usage=None),
        chunk({}, "length", usage=None),
        {"id": CID, "object": "chat.completion.chunk", "created": CREATED, "model": "gpt",
         "system_fingerprint": FINGERPRINT, "choices": [],
         "usage": {**USAGE, "shifted_tokens": 100}},
        "[DONE]",
    ]


def test_streamed_n_choices_each_in_order() -> None:
    raw, _ = answer_chat(body(n=2, stream=True), [
        Chunk(text="a1"), Chunk(text="a2"), Done(stats=Stats())], [
        Chunk(text="b1"), Done(stats=Stats(finish_reason="length"))])
    out = frames(raw)
    assert out[:2] == [chunk({"role": "assistant", "content": ""}, index=i) for i in (0, 1)]
    assert out[-1] == "[DONE]"
    by_choice: dict[int, list[Any]] = {0: [], 1: []}
    for frame in out[2:-1]:
        [choice] = frame["choices"]
        by_choice[choice["index"]].append((choice["delta"], choice["finish_reason"]))
    assert by_choice == {0: [({"content": "a1"}, None), ({"content": "a2"}, None),
                             ({}, "stop")],
                         1: [({"content": "b1"}, None), ({}, "length")]}


def test_an_error_before_the_first_token_is_an_http_error() -> None:
    for stream in (False, True):
        response, service = answer_chat(
            body(stream=stream), [STARTED, EngineError("model 'gpt' not found",
                                                       code="not_found")])
        assert isinstance(response, Response) and response.status_code == 404
        assert json.loads(bytes(response.body)) == {"error": {
            "message": "model 'gpt' not found", "type": "invalid_request_error",
            "param": "model", "code": "model_not_found"}}
        assert service.closed
    response, _ = answer_chat(body(), [EngineError("full", code="busy", retry_after=2)])
    assert isinstance(response, Response)
    assert (response.status_code, response.headers["retry-after"]) == (503, "2")
    assert json.loads(bytes(response.body))["error"] == {
        "message": "full", "type": "server_error", "param": None, "code": "server_overloaded"}
    # one choice of several failing fails the request, and the others are cancelled
    response, service = answer_chat(body(n=2), [Chunk(text="ok"), Done(stats=Stats())],
                                    [EngineError("too long", code="prompt_too_long")])
    assert isinstance(response, Response) and response.status_code == 400
    assert service.closed


def test_an_error_after_the_first_token() -> None:
    raw, service = answer_chat(body(stream=True), [
        Chunk(text="par"), EngineError("the runner died", code="runner_failed")])
    assert frames(raw) == [
        chunk({"role": "assistant", "content": ""}), chunk({"content": "par"}),
        {"error": {"message": "the runner died", "type": "server_error", "param": None,
                   "code": None}}]  # and no [DONE]
    assert service.closed
    response, _ = answer_chat(body(), [Chunk(text="par"),
                                       EngineError("the runner died", code="runner_failed")])
    assert isinstance(response, Response) and response.status_code == 500
    assert json.loads(bytes(response.body))["error"]["message"] == "the runner died"


# -- completions' answers --------------------------------------------------------------------


def answer_completion(b: CompletionBody, *scripts: list[Event]) -> Response | bytes:
    prompts, reqs = b.to_requests()
    service = FakeService([Script(s) for s in scripts])

    async def go() -> Response | bytes:
        started = await start_choices(service, reqs)  # type: ignore[arg-type]
        assert not isinstance(started, Response)
        if not reqs[0].stream:
            return await completion_collect(b, prompts, reqs, started, "cmpl-t", CREATED)
        return await collect(completion_stream(b, prompts, reqs, started, "cmpl-t", CREATED))

    return run(go())


def cbody(**kw: Any) -> CompletionBody:
    return CompletionBody.model_validate({"model": "gpt", **kw})


def test_completion_whole_with_echo_and_logprobs() -> None:
    lps = [TokenLogprob(token=" wor", logprob=-0.5, bytes=[32], top=[(" wor", -0.5)]),
           TokenLogprob(token="ld", logprob=-0.1, bytes=[108])]
    response = answer_completion(cbody(prompt="Hello", echo=True, logprobs=1), [
        Chunk(text="", prompt_logprobs=[TokenLogprob(token="Hello", logprob=None,
                                                     bytes=[72])]),
        Chunk(text=" wor", logprobs=lps[:1]), Chunk(text="ld", logprobs=lps[1:]),
        Done(stats=Stats(prompt_tokens=1, completion_tokens=2, finish_reason="length"))])
    assert isinstance(response, Response)
    obj = json.loads(bytes(response.body))
    # (not read by the SDK's Completion type: it has token_logprobs as floats, where the
    # API's first prompt token, with nothing before it, has null)
    assert obj == {
        "id": "cmpl-t", "object": "text_completion", "created": CREATED, "model": "gpt",
        "system_fingerprint": FINGERPRINT,
        "choices": [{"text": "Hello world", "index": 0, "finish_reason": "length",
                     "logprobs": {"tokens": ["Hello", " wor", "ld"],
                                  "token_logprobs": [None, -0.5, -0.1],
                                  "top_logprobs": [{}, {" wor": -0.5}, {}],
                                  # offsets into the choice's text, the echoed prompt first
                                  "text_offset": [0, 5, 9]}}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}}


def test_completion_whole_usage_counts_each_prompt_once() -> None:
    response = answer_completion(cbody(prompt=["a", "b"], n=2), [
        Chunk(text="x"), Done(stats=Stats(prompt_tokens=3, completion_tokens=1))], [
        Chunk(text="y"), Done(stats=Stats(prompt_tokens=3, completion_tokens=2))], [
        Chunk(text="z"), Done(stats=Stats(prompt_tokens=5, completion_tokens=1))], [
        Chunk(text="w"), Done(stats=Stats(prompt_tokens=5, completion_tokens=4))])
    assert isinstance(response, Response)
    obj = json.loads(bytes(response.body))
    Completion.model_validate(obj)
    assert [(c["index"], c["text"], c["logprobs"]) for c in obj["choices"]] == \
        [(0, "x", None), (1, "y", None), (2, "z", None), (3, "w", None)]
    assert obj["usage"] == {"prompt_tokens": 8, "completion_tokens": 8, "total_tokens": 16}


def test_completion_streamed_with_echo() -> None:
    raw = answer_completion(cbody(prompt="Hi", echo=True, stream=True,
                                  stream_options={"include_usage": True}), [
        Chunk(text=" there"), Done(stats=Stats(prompt_tokens=1, completion_tokens=1))])
    assert isinstance(raw, bytes)

    def frame(text: str, finish: str | None = None) -> dict[str, Any]:
        return {"id": "cmpl-t", "object": "text_completion", "created": CREATED,
                "model": "gpt", "system_fingerprint": FINGERPRINT,
                "choices": [{"text": text, "index": 0, "logprobs": None,
                             "finish_reason": finish}], "usage": None}

    assert [data for _, data in sse(raw)] == [
        frame("Hi"), frame(" there"), frame("", "stop"),
        {"id": "cmpl-t", "object": "text_completion", "created": CREATED, "model": "gpt",
         "system_fingerprint": FINGERPRINT, "choices": [],
         "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}},
        "[DONE]"]
