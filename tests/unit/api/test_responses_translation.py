"""The Responses API's dialect alone, no model and no daemon: request bodies into the one
ChatRequest (wire.py: instructions and input items, tools with namespaces and custom tools,
tool_choice, text.format, reasoning, sampling), and hand-built events into the response
(stream.py): its output items whole, the numbered event stream, status and usage, and errors
after the first token. Responses and events are also read by the OpenAI SDK's types."""

from __future__ import annotations

import asyncio
import base64
import re
from typing import Any, get_args

import pytest
from openai.types.responses import Response as SdkResponse
from openai.types.responses import ResponseStreamEvent
from pydantic import ValidationError

from llmrun.api.events import first_output
from llmrun.api.openai.errors import ApiError
from llmrun.api.openai.responses.stream import Answer, collect, stream
from llmrun.api.openai.responses.wire import ResponsesBody
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
from tests.unit.api.feed import Event, run, sse, stream_of
from tests.unit.api.feed import collect as read_all

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(64))
B64 = base64.b64encode(PNG).decode()
DATA_URL = f"data:image/png;base64,{B64}"
SCHEMA = {"type": "object", "properties": {"q": {"type": "string"}}}
EMPTY = {"type": "object", "properties": {}}
STATS = Stats(prompt_tokens=20, cached_tokens=8, completion_tokens=6)
USAGE = {"input_tokens": 20, "input_tokens_details": {"cached_tokens": 8,
                                                      "cache_write_tokens": 0},
         "output_tokens": 6, "output_tokens_details": {"reasoning_tokens": 0},
         "total_tokens": 26}
# the SDK's event type of each event name (validated one by one: the union's errors list
# every member)
EVENT_TYPES: dict[str, Any] = {
    get_args(cls.model_fields["type"].annotation)[0]: cls
    for cls in get_args(get_args(ResponseStreamEvent)[0])}


def responses_body(**kw: Any) -> ResponsesBody:
    return ResponsesBody.model_validate({"model": "gpt-5", "input": "hi", **kw})


def request(earlier: list[dict[str, Any]] | None = None, **kw: Any) -> ChatRequest:
    return responses_body(**kw).to_request(earlier or [])[0]


def api_error(**kw: Any) -> ApiError:
    with pytest.raises(ApiError) as info:
        request(**kw)
    assert info.value.status == 400
    return info.value


def function(name: str, **kw: Any) -> dict[str, Any]:
    return {"type": "function", "name": name, "parameters": SCHEMA, **kw}


# -- the body --------------------------------------------------------------------------------


def test_input_items_into_messages() -> None:
    earlier = [{"type": "message", "role": "user", "content": "earlier question"},
               {"type": "message", "role": "assistant",
                "content": [{"type": "output_text", "text": "earlier answer"}]}]
    req = request(earlier, instructions="Be terse.", input=[
        {"role": "developer", "content": "Use tools."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "environment"},
            {"type": "input_image", "image_url": DATA_URL, "detail": "auto"}]},
        {"role": "user", "content": "the task"},  # a second user item: one turn
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Looking."}, {"type": "refusal", "refusal": ""}]},
        {"type": "function_call", "call_id": "call_1", "name": "search",
         "arguments": "{\"q\": \"x\"}"},
        {"type": "function_call", "call_id": "call_2", "name": "open", "namespace": "fs",
         "arguments": ""},
        {"type": "function_call_output", "call_id": "call_1", "output": "found"},
        {"type": "function_call_output", "call_id": "call_2", "output": [
            {"type": "input_text", "text": "page"},
            {"type": "input_image", "image_url": {"url": DATA_URL}}]},
        {"type": "web_search_call", "id": "ws_1", "status": "completed"},
        {"type": "custom_tool_call", "call_id": "call_3", "name": "patch", "input": "*** x"},
        {"type": "custom_tool_call_output", "call_id": "call_3", "output": "applied"},
    ])
    assert req.messages == [
        # every system and developer text in one leading turn
        Message(role="system", content="Be terse.\n\nUse tools."),
        Message(role="user", content="earlier question"),
        Message(role="assistant", content="earlier answer"),
        Message(role="user", content="environment\n\nthe task", images=[B64]),
        # the calls after an assistant message are that turn's; a thought is not fed back
        Message(role="assistant", content="Looking.", tool_calls=[
            ToolCall(id="call_1", name="search", arguments={"q": "x"}),
            ToolCall(id="call_2", name="fs.open", arguments={})]),
        Message(role="tool", content="found", tool_call_id="call_1", name="search"),
        Message(role="tool", content="page", tool_call_id="call_2", name="fs.open",
                images=[B64]),
        Message(role="assistant", content="", tool_calls=[
            ToolCall(id="call_3", name="patch", arguments={"input": "*** x"})]),
        Message(role="tool", content="applied", tool_call_id="call_3", name="patch"),
    ]
    assert request().messages == [Message(role="user", content="hi")]


def test_input_items_refused_with_their_place() -> None:
    def refused(*items: Any) -> tuple[str, str | None]:
        err = api_error(input=list(items))
        return err.message, err.param

    image = {"type": "input_image", "image_url": DATA_URL}
    assert refused({"role": "assistant", "content": [image]}) == (
        "input_image parts are allowed only in user messages and in tool call outputs",
        "input[0].content[0]")
    assert refused({"role": "system", "content": [image]})[1] == "input[0].content[0]"
    assert refused({"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}) \
        == ("input_image by 'file_id' is not supported (there is no Files API here); send "
            "the image as a data URL in 'image_url'", "input[0].content[0].file_id")
    assert refused({"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}) \
        == ("model 'gpt-5' does not support input_file parts (it is text-only)",
            "input[0].content[0]")
    assert refused({"role": "user", "content": [{"type": "video"}]}) == (
        "content parts of type 'video' are not supported", "input[0].content[0].type")
    assert refused({"role": "tool", "content": "x"}) == ("unknown message role 'tool'",
                                                          "input[0].role")
    assert refused({"type": "item_reference", "id": "msg_1"})[1] == "input[0]"
    assert refused({"type": "compaction"}) == (
        "input items of type 'compaction' are not supported", "input[0].type")
    assert refused({"type": "function_call", "name": "f"}) == (
        "a function_call item needs 'name' and 'call_id'", "input[0]")
    assert refused({"type": "function_call_output", "output": "x"}) == (
        "a function_call_output item needs 'call_id'", "input[0].call_id")
    assert refused({"type": "function_call", "call_id": "c", "name": "f",
                    "arguments": "[1]"}) == ("function arguments must be a JSON object",
                                             "input[0].arguments")
    assert refused({"role": "user", "content": 5}) == (
        "'content' must be a string or a list of parts", "input[0].content")


def test_tools_namespaces_custom_and_hosted() -> None:
    body = responses_body(tools=[
        function("search", description="Search", strict=True),
        {"type": "namespace", "name": "fs", "tools": [function("open"), function("close")]},
        {"type": "custom", "name": "patch", "description": "Apply a patch"},
        {"type": "custom", "name": "digits",
         "format": {"type": "grammar", "syntax": "regex", "definition": "[0-9]+"}},
        {"type": "custom", "name": "lark",
         "format": {"type": "grammar", "syntax": "lark", "definition": "start: \"a\""}},
        {"type": "web_search"},  # OpenAI's own: dropped
    ])
    req, mapping = body.to_request([])

    def custom(pattern: str | None = None) -> dict[str, Any]:
        text: dict[str, Any] = {"type": "string",
                                "description": "the tool's whole input, as text"}
        if pattern:
            text["pattern"] = pattern
        return {"type": "object", "required": ["input"], "properties": {"input": text}}

    assert req.tools == [
        Tool(name="search", description="Search", parameters=SCHEMA),
        Tool(name="fs.open", description="", parameters=SCHEMA),
        Tool(name="fs.close", description="", parameters=SCHEMA),
        Tool(name="patch", description="Apply a patch", parameters=custom()),
        Tool(name="digits", description="", parameters=custom("[0-9]+")),
        Tool(name="lark", description="", parameters=custom()),  # (only regex is enforced)
    ]
    assert mapping.names == {"search": (None, "search", "function"),
                             "fs.open": ("fs", "open", "function"),
                             "fs.close": ("fs", "close", "function"),
                             "patch": (None, "patch", "custom"),
                             "digits": (None, "digits", "custom"),
                             "lark": (None, "lark", "custom")}
    assert api_error(tools=[{"type": "function"}]).param == "tools[0].name"
    assert api_error(tools=[{"type": "shell"}]).message == \
        "tools of type 'shell' are not supported"
    assert api_error(tools=[{"type": "namespace", "tools": []}]).param == "tools[0].name"
    assert request(tools=[{"type": "function", "name": "bare"}]).tools == [
        Tool(name="bare", description="", parameters=EMPTY)]


def test_tool_choice() -> None:
    tools = [function("search"), {"type": "namespace", "name": "fs",
                                  "tools": [function("open")]}]
    assert request(tools=tools).tool_choice == "auto"
    assert request(tools=tools, tool_choice="none").tool_choice == "none"
    assert request(tools=tools, tool_choice="required").tool_choice == "required"
    assert request(tools=tools, tool_choice={"type": "function", "name": "search"}) \
        .tool_choice == NamedTool(name="search")
    assert request(tools=tools, tool_choice={"type": "function", "name": "open",
                                             "namespace": "fs"}).tool_choice == \
        NamedTool(name="fs.open")
    assert request(tools=tools, tool_choice={"type": "allowed_tools", "mode": "required",
                                             "tools": []}).tool_choice == "required"
    assert request(tools=tools, tool_choice={"type": "allowed_tools", "mode": "auto",
                                             "tools": []}).tool_choice == "auto"
    assert request(tools=tools, tool_choice={"type": "web_search_preview"}).tool_choice \
        == "auto"
    assert request(tools=tools, parallel_tool_calls=False).parallel_tool_calls is False
    err = api_error(tools=tools, tool_choice={"type": "function", "name": "open"})
    assert (err.message, err.param) == (
        "tool_choice names the tool 'open', which is not in 'tools'", "tool_choice")
    assert api_error(tool_choice="always").message == "unknown tool_choice 'always'"
    assert api_error(tool_choice="required").message == "tool_choice 'required' needs tools"


def test_text_format_and_strictness() -> None:
    assert request().format is None
    assert request(text={"format": {"type": "text"}}).format is None
    assert request(text={"verbosity": "low"}).format is None
    assert request(text={"format": {"type": "json_object"}}).format == "json"
    loose = request(text={"format": {"type": "json_schema", "name": "s", "schema": SCHEMA}})
    assert (loose.format, loose.format_strict) == (SCHEMA, False)
    strict = request(text={"format": {"type": "json_schema", "name": "s", "schema": SCHEMA,
                                      "strict": True}})
    assert (strict.format, strict.format_strict) == (SCHEMA, True)
    # forced tools count: each one enforced must be strict
    assert request(tools=[function("a", strict=True)], tool_choice="required").format_strict
    assert not request(tools=[function("a", strict=True), function("b")],
                       tool_choice="required").format_strict
    assert request(tools=[function("a", strict=True), function("b")],
                   tool_choice={"type": "function", "name": "a"}).format_strict
    assert request(tools=[function("b")]).format_strict  # nothing forced
    err = api_error(text={"format": {"type": "json_schema", "name": "s"}})
    assert (err.message, err.param) == ("text.format of type 'json_schema' needs 'schema'",
                                        "text.format.schema")
    assert api_error(text={"format": {"type": "yaml"}}).param == "text.format.type"
    assert request(grammar="root ::= \"a\"").grammar == "root ::= \"a\""


def test_sampling_reasoning_and_stream() -> None:
    req = request(max_output_tokens=128, temperature=0.4, top_p=0.7, seed=9, top_k=5,
                  min_p=0.02, num_ctx=16384, stream=True)
    o = req.options
    assert (o.num_predict, o.temperature, o.top_p, o.seed, o.top_k, o.min_p, o.num_ctx) == \
        (128, 0.4, 0.7, 9, 5, 0.02, 16384)
    assert o.stop is None and req.stream is True
    assert (request().stream, request(stream=None).stream) == (False, False)
    unset = request().options
    assert (unset.num_predict, unset.temperature, unset.top_p, unset.seed) == \
        (None, None, None, None)
    assert request().think is None
    assert request(reasoning={"effort": "high", "summary": "auto"}).think == "high"
    assert request(reasoning={"effort": "minimal"}).think is False
    assert request(reasoning={"effort": "none"}).think is False
    assert request(reasoning={"summary": "auto"}).think is None


def test_malformed_bodies() -> None:
    for bad in ({"max_output_tokens": 0}, {"temperature": 2.1}, {"top_p": -0.1},
                {"input": 5}, {"input": {"role": "user"}}, {"input": ["text"]},
                {"tools": "all"},
                {"reasoning_budget": -2}):
        with pytest.raises(ValidationError):
            responses_body(**bad)
    with pytest.raises(ValidationError, match="model"):
        ResponsesBody.model_validate({"input": "hi"})


def test_call_items_go_back_under_the_clients_names() -> None:
    _, mapping = responses_body(tools=[
        function("search"), {"type": "namespace", "name": "fs", "tools": [function("open")]},
        {"type": "custom", "name": "patch"}]).to_request([])
    item = mapping.item(ToolCall(id="call_abc", name="fs.open", arguments={"path": "ä"}))
    assert re.match(r"^fc_[0-9a-f]{24}$", item.pop("id"))
    assert item == {"type": "function_call", "status": "completed", "call_id": "call_abc",
                    "name": "open", "arguments": "{\"path\": \"ä\"}", "namespace": "fs"}
    item = mapping.item(ToolCall(id="7", name="patch", arguments={"input": "*** Begin"}))
    assert re.match(r"^ctc_[0-9a-f]{24}$", item.pop("id"))
    assert re.match(r"^call_[0-9a-f]{24}$", item.pop("call_id"))  # an id of OpenAI's shape
    assert item == {"type": "custom_tool_call", "status": "completed", "name": "patch",
                    "input": "*** Begin"}
    # a call cut off by the token limit: its text as far as it got
    item = mapping.item(PartialCall(id="call_p", name="search", arguments="{\"q\": \"ab"))
    assert (item["status"], item["arguments"], item["name"]) == \
        ("incomplete", "{\"q\": \"ab", "search")
    item = mapping.item(PartialCall(id="call_p", name="patch",
                                    arguments="{\"input\": \"*** Be"))
    assert (item["type"], item["status"], item["input"]) == \
        ("custom_tool_call", "incomplete", "*** Be")
    # a name the model made up is passed on as a function call
    assert mapping.item(ToolCall(id="call_z", name="other"))["type"] == "function_call"


# -- answers ---------------------------------------------------------------------------------


def answer_of(**kw: Any) -> Answer:
    body = responses_body(**kw)
    _, mapping = body.to_request([])
    return Answer(body, mapping, id="resp_test", created=1700000000)


def whole(answer: Answer, *events: Event) -> tuple[dict[str, Any], Stats, bool]:
    script, rest = stream_of(*events)

    async def go() -> tuple[dict[str, Any], Stats]:
        try:
            return await collect(answer, await first_output(rest), rest)
        finally:
            await rest.aclose()

    response, stats = run(go())
    SdkResponse.model_validate(response)
    return response, stats, script.closed


def ids_out(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The items without their random ids, each checked for its type's prefix."""
    prefixes = {"reasoning": "rs_", "message": "msg_", "function_call": "fc_",
                "custom_tool_call": "ctc_"}
    out = []
    for item in items:
        item = dict(item)
        assert re.match(rf"^{prefixes[item['type']]}[0-9a-f]{{24}}$", item.pop("id")), item
        out.append(item)
    return out


def text_message(text: str) -> dict[str, Any]:
    return {"type": "message", "role": "assistant", "status": "completed",
            "content": [{"type": "output_text", "text": text, "annotations": [],
                         "logprobs": []}]}


def test_whole_response() -> None:
    answer = answer_of(instructions="Be brief.", reasoning={"effort": "low"},
                       temperature=0.5, max_output_tokens=50, metadata={"k": "v"})
    response, stats, _ = whole(answer, Started(prompt_tokens=20, n_ctx=4096),
                               Chunk(text="", thinking="Think"), Chunk(text="", thinking="ing"),
                               Chunk(text="Hel"), Chunk(text="lo"), Done(stats=STATS))
    assert stats == STATS
    output = response.pop("output")
    assert response == {
        "id": "resp_test", "object": "response", "created_at": 1700000000,
        "status": "completed", "error": None, "incomplete_details": None,
        "instructions": "Be brief.", "max_output_tokens": 50, "model": "gpt-5",
        "parallel_tool_calls": True, "previous_response_id": None,
        "reasoning": {"effort": "low", "summary": None}, "store": True, "temperature": 0.5,
        "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [],
        "top_p": None, "truncation": "disabled", "usage": USAGE, "user": None,
        "metadata": {"k": "v"}}
    assert ids_out(output) == [
        # no summary asked for: the thought is the item's content only
        {"type": "reasoning", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Thinking"}]},
        text_message("Hello")]
    assert answer.output == output


def test_whole_response_with_calls_and_summary() -> None:
    answer = answer_of(reasoning={"effort": "high", "summary": "auto"},
                       tools=[function("search"), {"type": "custom", "name": "patch"}])
    response, _, closed = whole(
        answer, Chunk(text="", thinking="plan"),
        Chunk(text="", tool_calls=[ToolCall(id="call_1", name="search", arguments={"q": "a"}),
                                   ToolCall(id="call_2", name="patch",
                                            arguments={"input": "diff"})]),
        Done(stats=STATS.model_copy(update={"finish_reason": "tool_calls"})))
    assert closed and response["status"] == "completed"
    assert ids_out(response["output"]) == [
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "plan"}],
         "content": [{"type": "reasoning_text", "text": "plan"}]},
        # calls without text: no message item
        {"type": "function_call", "status": "completed", "call_id": "call_1",
         "name": "search", "arguments": "{\"q\": \"a\"}"},
        {"type": "custom_tool_call", "status": "completed", "call_id": "call_2",
         "name": "patch", "input": "diff"}]


def test_whole_response_cut_short_and_empty() -> None:
    response, _, _ = whole(answer_of(), Chunk(text="Once upon"),
                           Done(stats=STATS.model_copy(update={"finish_reason": "length"})))
    assert (response["status"], response["incomplete_details"]) == \
        ("incomplete", {"reason": "max_output_tokens"})
    assert ids_out(response["output"]) == [text_message("Once upon")]
    response, _, _ = whole(answer_of(), Done(stats=Stats()))
    assert ids_out(response["output"]) == [text_message("")]
    # cut short while thinking: the thought alone
    response, _, _ = whole(answer_of(), Chunk(text="", thinking="hmm"),
                           Done(stats=Stats(finish_reason="length")))
    assert [item["type"] for item in response["output"]] == ["reasoning"]


def streamed(answer: Answer, *events: Event) -> tuple[list[dict[str, Any]], list[Any], bool]:
    """(the events' data, in order, each checked against its name, its number and the SDK's
    type; the responses given to on_done; whether the event stream was closed)."""
    script, rest = stream_of(*events)
    finals: list[Any] = []

    async def go() -> bytes:
        first = asyncio.ensure_future(first_output(rest))
        return await read_all(stream(answer, first, rest, finals.append))

    frames = sse(run(go()))
    out = []
    for n, (name, data) in enumerate(frames):
        assert (name, data["sequence_number"]) == (data["type"], n)
        if name != "response.failed":  # (its error code is llmrun's: see the test below)
            EVENT_TYPES[name].model_validate(data)
        out.append(data)
    return out, finals, script.closed


def shape(events: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    """Each event as (type, output_index, its payload without ids)."""
    out: list[tuple[Any, ...]] = []
    for e in events:
        payload = {k: v for k, v in e.items()
                   if k not in ("type", "sequence_number", "item_id", "output_index",
                                "response")}
        if "item" in payload:
            payload["item"] = {k: v for k, v in payload["item"].items() if k != "id"}
        out.append((e["type"], e.get("output_index"), payload))
    return out


def test_streamed_response() -> None:
    answer = answer_of(tools=[function("search")])
    call = ToolCall(id="call_1", name="search", arguments={"q": "a"})
    events, finals, closed = streamed(
        answer, Chunk(text="", thinking="plan"), Chunk(text="Hel"), Chunk(text="lo"),
        Chunk(text="", tool_calls=[call]), Done(stats=STATS))
    assert closed
    assert [e["response"]["status"] for e in events[:2]] == ["in_progress", "in_progress"]
    assert events[0]["response"]["output"] == [] and events[0]["response"]["usage"] is None
    message = text_message("Hello")
    fc = {"type": "function_call", "status": "completed", "call_id": "call_1",
          "name": "search", "arguments": "{\"q\": \"a\"}"}
    assert shape(events) == [
        ("response.created", None, {}),
        ("response.in_progress", None, {}),
        ("response.output_item.added", 0, {"item": {"type": "reasoning", "summary": [],
                                                    "content": []}}),
        ("response.reasoning_text.delta", 0, {"content_index": 0, "delta": "plan"}),
        ("response.reasoning_text.done", 0, {"content_index": 0, "text": "plan"}),
        ("response.output_item.done", 0, {"item": {
            "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": "plan"}]}}),
        ("response.output_item.added", 1, {"item": {"type": "message", "role": "assistant",
                                                    "status": "in_progress",
                                                    "content": []}}),
        ("response.content_part.added", 1, {"content_index": 0, "part": {
            "type": "output_text", "text": "", "annotations": [], "logprobs": []}}),
        ("response.output_text.delta", 1, {"content_index": 0, "delta": "Hel",
                                           "logprobs": []}),
        ("response.output_text.delta", 1, {"content_index": 0, "delta": "lo",
                                           "logprobs": []}),
        ("response.output_text.done", 1, {"content_index": 0, "text": "Hello",
                                          "logprobs": []}),
        ("response.content_part.done", 1, {"content_index": 0,
                                           "part": message["content"][0]}),
        ("response.output_item.done", 1, {"item": message}),
        ("response.output_item.added", 2, {"item": {**fc, "arguments": "",
                                                    "status": "in_progress"}}),
        ("response.function_call_arguments.delta", 2, {"delta": "{\"q\": \"a\"}"}),
        ("response.function_call_arguments.done", 2, {"arguments": "{\"q\": \"a\"}",
                                                      "name": "search"}),
        ("response.output_item.done", 2, {"item": fc}),
        ("response.completed", None, {}),
    ]
    # an item's events all name it
    added = {e["output_index"]: e["item"]["id"] for e in events
             if e["type"] == "response.output_item.added"}
    assert all(e["item_id"] == added[e["output_index"]] for e in events if "item_id" in e)
    final = events[-1]["response"]
    assert (final["status"], final["usage"]) == ("completed", USAGE)
    assert [item["id"] for item in final["output"]] == [added[0], added[1], added[2]]
    assert ids_out(final["output"]) == [
        {"type": "reasoning", "summary": [],
         "content": [{"type": "reasoning_text", "text": "plan"}]}, message, fc]
    assert finals == [final]  # what is stored is what was sent


def test_streamed_summary_and_text_before_thought() -> None:
    events, _, _ = streamed(answer_of(reasoning={"effort": "low", "summary": "auto"}),
                            Chunk(text="Sure."), Chunk(text="", thinking="why"),
                            Done(stats=STATS))
    assert [(t, i) for t, i, _ in shape(events)] == [
        ("response.created", None), ("response.in_progress", None),
        ("response.output_item.added", 0), ("response.content_part.added", 0),
        ("response.output_text.delta", 0), ("response.output_text.done", 0),
        ("response.content_part.done", 0), ("response.output_item.done", 0),
        ("response.output_item.added", 1), ("response.reasoning_summary_part.added", 1),
        ("response.reasoning_summary_text.delta", 1), ("response.reasoning_text.delta", 1),
        ("response.reasoning_summary_text.done", 1),
        ("response.reasoning_summary_part.done", 1), ("response.reasoning_text.done", 1),
        ("response.output_item.done", 1), ("response.completed", None)]
    assert events[-2]["item"]["summary"] == [{"type": "summary_text", "text": "why"}]


def test_streamed_cut_short_call_and_empty_answer() -> None:
    answer = answer_of(tools=[function("search")])
    events, _, _ = streamed(answer, Chunk(text="", partial_call=PartialCall(
        id="call_p", name="search", arguments="{\"q\": \"a")),
        Done(stats=STATS.model_copy(update={"finish_reason": "length"})))
    # no .done for arguments that never came whole
    assert [t for t, _, _ in shape(events)] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.output_item.done",
        "response.incomplete"]
    assert events[3]["delta"] == "{\"q\": \"a"
    assert events[4]["item"]["status"] == "incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    events, _, _ = streamed(answer_of(), Done(stats=Stats()))
    assert [t for t, _, _ in shape(events)][2:] == [
        "response.output_item.added", "response.content_part.added",
        "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.completed"]
    assert ids_out(events[-1]["response"]["output"]) == [text_message("")]


def test_an_error_after_the_first_token_fails_the_response() -> None:
    events, finals, closed = streamed(answer_of(), Chunk(text="par"),
                                      EngineError("the runner died", code="runner_failed"))
    assert closed and finals == []  # a failed response is not stored
    assert [e["type"] for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", "response.output_text.delta", "response.failed"]
    failed = events[-1]["response"]
    assert (failed["status"], failed["error"], failed["usage"]) == (
        "failed", {"code": "server_error", "message": "the runner died"}, None)
    events, _, _ = streamed(answer_of(), Chunk(text="x"),
                            EngineError("bad schema", code="invalid_request"))
    assert events[-1]["response"]["error"] == {"code": "invalid_request_error",
                                               "message": "bad schema"}
