"""OpenAI's Responses API (`/v1/responses`): what Codex CLI and the newer OpenAI SDKs speak.

A request's `instructions` and `input` items become the internal `ChatRequest`: messages
(every system and developer text folded into one leading system message, as templates expect
it first), `input_image` parts into `Message.images` (user turns and tool outputs only;
api/images.py), `function_call` / `custom_tool_call` items into assistant tool calls and their
`*_output` items into tool turns; `reasoning` items are dropped (the model's own thought is not
fed back, as with the other dialects). Tools: `function` as is; a `namespace` group's
functions flattened under qualified names (`namespace.name`) and mapped back when called;
`custom` (free-form) tools as functions of one string argument, `input`, returned as
`custom_tool_call` items; built-in tools the daemon cannot run (`web_search`, ...) dropped
with a log line.

The answer is a list of output items (`reasoning`, `message`, `function_call`), whole or as
the Responses event stream, every event numbered (`sequence_number`). With `store` (OpenAI's
default) the response is kept on disk (server/responsestore.py) so that
`previous_response_id` can continue the conversation and `GET`/`DELETE /v1/responses/{id}`
work. Errors take OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, cast

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field

from llmrun import jsonio
from llmrun.api.disconnect import unless_disconnected
from llmrun.api.events import OutputStream, first_output
from llmrun.api.images import fetched, from_url
from llmrun.api.openai.errors import ApiError, _engine_error, api_error, error
from llmrun.api.openai.translate import _arguments
from llmrun.api.openai.wire import LlamaExtras
from llmrun.request import (
    ChatRequest,
    Chunk,
    Done,
    EngineError,
    Format,
    Message,
    NamedTool,
    Options,
    PartialCall,
    Stats,
    Think,
    Tool,
    ToolCall,
    ToolChoice,
)
from llmrun.server.responsestore import NotStored, ResponseStore, new_id
from llmrun.server.service import Service

log = logging.getLogger(__name__)

# Built-in tools OpenAI runs on its side; a local daemon has none of them.
HOSTED_TOOLS = ("web_search", "web_search_preview", "file_search", "computer_use_preview",
                "code_interpreter", "image_generation", "mcp", "local_shell")
KEEPALIVE_SECONDS = 10.0  # an SSE comment this often while a long prompt is read
_KEEPALIVE = b": waiting for the model\n\n"
TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")


class ResponsesBody(LlamaExtras):
    """POST /v1/responses (and /v1/responses/input_tokens), in the order of OpenAI's
    reference; unknown fields are accepted and logged (Codex sends several)."""

    model: str
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    seed: int | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    truncation: str | None = None
    user: str | None = None


@dataclass
class ToolMap:
    """What the model sees each tool as, and how its calls go back to the client."""

    # the model's name for a tool -> (namespace or None, the client's name, "function"|"custom")
    names: dict[str, tuple[str | None, str, str]] = field(default_factory=dict)

    def item(self, call: ToolCall | PartialCall) -> dict[str, Any]:
        """The output item of a call the model made; of one the token limit cut off, an
        item with status "incomplete" and its arguments (or input) as far as they got."""
        namespace, name, kind = self.names.get(call.name, (None, call.name, "function"))
        call_id = call.id if call.id.startswith("call_") else f"call_{secrets.token_hex(12)}"
        if isinstance(call, PartialCall):
            status, args, written = "incomplete", call.arguments, call.written(cut_strings=True)
            other = ""
        else:
            status, written = "completed", call.arguments
            args = json.dumps(call.arguments, ensure_ascii=False)
            other = json.dumps(call.arguments)
        if kind == "custom":
            text = written.get("input")
            return {"id": f"ctc_{secrets.token_hex(12)}", "type": "custom_tool_call",
                    "status": status, "call_id": call_id, "name": name,
                    "input": text if isinstance(text, str) else other}
        item = {"id": f"fc_{secrets.token_hex(12)}", "type": "function_call",
                "status": status, "call_id": call_id, "name": name, "arguments": args}
        if namespace is not None:
            item["namespace"] = namespace
        return item


# -- the request ----------------------------------------------------------------------------


def _part_text(part: Any, where: str, model: str,
               images: list[str] | None = None) -> str | None:
    """A part's text; None for a refusal and for an image, which goes to `images` (None
    where images may not be: instructions, system and developer text, the model's own
    turns)."""
    if isinstance(part, str):
        return part
    if not isinstance(part, dict):
        raise ApiError(400, "a content part must be an object", where)
    kind = part.get("type")
    if kind in TEXT_PARTS:
        text = part.get("text")
        return text if isinstance(text, str) else ""
    if kind == "input_image":
        if images is None:
            raise ApiError(400, "input_image parts are allowed only in user messages and in "
                                "tool call outputs", where)
        images.append(_image(part, where))
        return None
    if kind in ("input_file", "input_audio"):
        raise ApiError(400, f"model '{model}' does not support {kind} parts (it is "
                            "text-only)", where)
    if kind == "refusal":
        return None
    raise ApiError(400, f"content parts of type '{kind}' are not supported", f"{where}.type")


def _image(part: dict[str, Any], where: str) -> str:
    """An `input_image` part's image: `image_url` a data URL (or an http(s) one, fetched only
    where LLMRUN_IMAGE_URLS allows it); a `file_id` is refused (there is no Files API here).
    `detail` is for OpenAI's tiling: the model's projector sizes images itself."""
    if part.get("image_url") is None and part.get("file_id") is not None:
        raise ApiError(400, "input_image by 'file_id' is not supported (there is no Files "
                            "API here); send the image as a data URL in 'image_url'",
                       f"{where}.file_id")
    url = part.get("image_url")
    if isinstance(url, dict):  # Chat Completions' shape, which some clients send here too
        url = url.get("url")
    try:
        return from_url(url, f"{where}.image_url")
    except EngineError as exc:
        raise ApiError(exc.status, exc.message, f"{where}.image_url") from None


def _content(content: Any, where: str, model: str, images: list[str] | None = None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ApiError(400, "'content' must be a string or a list of parts", where)
    texts = [_part_text(p, f"{where}[{j}]", model, images) for j, p in enumerate(content)]
    return "\n".join(t for t in texts if t is not None)


def _model_name(name: str, namespace: Any) -> str:
    """The name the model knows a called tool by (a namespace's functions are qualified)."""
    if isinstance(namespace, str) and namespace:
        return f"{namespace}.{name}"
    return name


def to_messages(body: ResponsesBody, earlier: list[dict[str, Any]],
                tools: ToolMap) -> list[Message]:
    """The conversation: `earlier` items (from previous_response_id), then `input`."""
    system: list[str] = [body.instructions] if body.instructions else []
    out: list[Message] = []
    names: dict[str, str] = {}  # call_id -> the model's name of the tool, for tool turns
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) \
        else body.input
    for i, item in enumerate([*earlier, *items]):
        where = f"input[{i - len(earlier)}]" if i >= len(earlier) else "previous_response_id"
        if not isinstance(item, dict):
            raise ApiError(400, "an input item must be an object", where)
        kind = item.get("type") or ("message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            pictures: list[str] = []
            text = _content(item.get("content"), f"{where}.content", body.model,
                            pictures if role == "user" else None)
            if role in ("system", "developer"):
                system.append(text)
            elif role in ("user", "assistant"):
                out.append(Message(role=role, content=text, images=pictures))
            else:
                raise ApiError(400, f"unknown message role {role!r}", f"{where}.role")
        elif kind in ("function_call", "custom_tool_call"):
            name = item.get("name")
            call_id = item.get("call_id") or item.get("id")
            if not isinstance(name, str) or not isinstance(call_id, str):
                raise ApiError(400, f"a {kind} item needs 'name' and 'call_id'", where)
            args = _arguments(item.get("arguments", "{}"), f"{where}.arguments") \
                if kind == "function_call" else {"input": str(item.get("input", ""))}
            model_name = _model_name(name, item.get("namespace"))
            names[call_id] = model_name
            call = ToolCall(id=call_id, name=model_name, arguments=args)
            if out and out[-1].role == "assistant":  # one turn: its text, then its calls
                out[-1] = out[-1].model_copy(update={"tool_calls": [*out[-1].tool_calls, call]})
            else:
                out.append(Message(role="assistant", content="", tool_calls=[call]))
        elif kind in ("function_call_output", "custom_tool_call_output"):
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise ApiError(400, f"a {kind} item needs 'call_id'", f"{where}.call_id")
            output = item.get("output")
            pictures = []  # a tool may answer with images (a screenshot)
            text = output if isinstance(output, str) else \
                _content(output, f"{where}.output", body.model, pictures)
            out.append(Message(role="tool", content=text, tool_call_id=call_id,
                               name=names.get(call_id), images=pictures))
        elif kind == "item_reference":
            raise ApiError(400, "item references are not supported; send the items, or "
                                "previous_response_id", where)
        elif kind == "reasoning" or kind in {f"{t}_call" for t in HOSTED_TOOLS}:
            continue  # a thought, or a hosted tool's run: nothing the model reads back
        else:
            raise ApiError(400, f"input items of type {kind!r} are not supported",
                           f"{where}.type")
    if any(system):
        out.insert(0, Message(role="system", content="\n\n".join(s for s in system if s)))
    return _merged(out)


def _merged(messages: list[Message]) -> list[Message]:
    """Consecutive user messages as one (Codex sends its environment and the task as two,
    and many chat templates insist that roles alternate)."""
    out: list[Message] = []
    for m in messages:
        if out and m.role == "user" and out[-1].role == "user":
            out[-1] = out[-1].model_copy(
                update={"content": "\n\n".join(t for t in (out[-1].content, m.content) if t),
                        "images": [*out[-1].images, *m.images]})
        else:
            out.append(m)
    return out


def to_tools(body: ResponsesBody) -> tuple[list[Tool], ToolChoice, ToolMap, bool]:
    """(tools the model sees, tool choice, how calls map back, whether forced ones are
    strict)."""
    tools: list[Tool] = []
    mapping = ToolMap()
    strict: dict[str, bool] = {}
    dropped: list[str] = []

    def add(spec: dict[str, Any], namespace: str | None, where: str) -> None:
        kind = spec.get("type", "function")
        name = spec.get("name")
        if kind in HOSTED_TOOLS:
            dropped.append(kind)
            return
        if kind not in ("function", "custom"):
            raise ApiError(400, f"tools of type {kind!r} are not supported", f"{where}.type")
        if not isinstance(name, str) or not name:
            raise ApiError(400, "a tool needs a 'name'", f"{where}.name")
        model_name = _model_name(name, namespace)
        if kind == "custom":
            text: dict[str, Any] = {"type": "string",
                                    "description": "the tool's whole input, as text"}
            fmt = spec.get("format") or {}
            if fmt.get("type") == "grammar" and fmt.get("syntax") == "regex" and \
                    isinstance(fmt.get("definition"), str):
                text["pattern"] = fmt["definition"]  # enforced whenever calls are
            elif fmt.get("type") == "grammar":
                log.info("responses: custom tool %r: only regex grammars are enforced; "
                         "its %s grammar is not", name, fmt.get("syntax"))
            params: dict[str, Any] = {"type": "object", "required": ["input"],
                                      "properties": {"input": text}}
        else:
            params = spec.get("parameters") or {"type": "object", "properties": {}}
        tools.append(Tool(name=model_name, description=spec.get("description") or "",
                          parameters=params))
        mapping.names[model_name] = (namespace, name, kind)
        strict[model_name] = spec.get("strict") is True

    for i, spec in enumerate(body.tools or []):
        if not isinstance(spec, dict):
            raise ApiError(400, "a tool must be an object", f"tools[{i}]")
        if spec.get("type") == "namespace":
            group = spec.get("name")
            if not isinstance(group, str) or not group:
                raise ApiError(400, "a namespace needs a 'name'", f"tools[{i}].name")
            for j, inner in enumerate(spec.get("tools") or []):
                if not isinstance(inner, dict):
                    raise ApiError(400, "a tool must be an object", f"tools[{i}].tools[{j}]")
                add(inner, group, f"tools[{i}].tools[{j}]")
        else:
            add(spec, None, f"tools[{i}]")
    if dropped:
        log.info("responses: dropping hosted tools the daemon cannot run: %s",
                 ", ".join(sorted(set(dropped))))
    choice = _tool_choice(body.tool_choice, mapping)
    if choice == "required" and not tools:
        raise ApiError(400, "tool_choice 'required' needs tools", "tool_choice")
    forced = [n for n in mapping.names if (isinstance(choice, NamedTool) and n == choice.name)
              or choice == "required"]
    return tools, choice, mapping, all(strict[n] for n in forced)


def _tool_choice(raw: str | dict[str, Any] | None, mapping: ToolMap) -> ToolChoice:
    if raw is None or raw in ("auto", "none", "required"):
        return raw or "auto"  # type: ignore[return-value]
    if isinstance(raw, str):
        raise ApiError(400, f"unknown tool_choice {raw!r}", "tool_choice")
    kind = raw.get("type")
    if kind in ("function", "custom"):
        name = _model_name(str(raw.get("name", "")), raw.get("namespace"))
        if name not in mapping.names:
            raise ApiError(400, f"tool_choice names the tool '{name}', which is not in "
                                "'tools'", "tool_choice")
        return NamedTool(name=name)
    if kind == "allowed_tools":
        return "required" if raw.get("mode") == "required" else "auto"
    return "auto"  # a hosted tool: the daemon runs none of them


def to_format(body: ResponsesBody) -> tuple[Format, bool]:
    fmt = (body.text or {}).get("format")
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None, True
    if fmt["type"] == "json_object":
        return "json", True
    if fmt["type"] == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise ApiError(400, "text.format of type 'json_schema' needs 'schema'",
                           "text.format.schema")
        return schema, fmt.get("strict") is True
    raise ApiError(400, f"unknown text.format type {fmt['type']!r}", "text.format.type")


def to_think(body: ResponsesBody) -> Think:
    effort = (body.reasoning or {}).get("effort")
    if effort in ("none", "minimal"):
        return False
    return effort if effort in ("low", "medium", "high") else None


def to_request(body: ResponsesBody, earlier: list[dict[str, Any]]) -> tuple[ChatRequest, ToolMap]:
    tools, choice, mapping, strict = to_tools(body)
    fmt, fmt_strict = to_format(body)
    values: dict[str, Any] = {  # (each checked by Options)
        "temperature": body.temperature, "top_p": body.top_p,
        "num_predict": body.max_output_tokens, "seed": body.seed,
        "num_ctx": body.num_ctx, "top_k": body.top_k, "min_p": body.min_p,
        "repeat_penalty": body.repeat_penalty, "typical_p": body.typical_p,
        "repeat_last_n": body.repeat_last_n}
    req = ChatRequest(
        model=body.model, messages=to_messages(body, earlier, mapping),
        options=Options(**{k: v for k, v in values.items() if v is not None}),
        stream=bool(body.stream), keep_alive=body.keep_alive, format=fmt,
        format_strict=fmt_strict and strict, grammar=body.grammar, tools=tools,
        tool_choice=choice, parallel_tool_calls=body.parallel_tool_calls is not False,
        think=to_think(body))
    return req, mapping


# -- the answer -----------------------------------------------------------------------------


def usage(stats: Stats) -> dict[str, Any]:
    return {"input_tokens": stats.prompt_tokens,
            "input_tokens_details": {"cached_tokens": stats.cached_tokens},
            "output_tokens": stats.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": stats.prompt_tokens + stats.completion_tokens,
            **stats.context_notes()}


@dataclass
class Answer:
    """A response being built: its object, and the output items as they complete."""

    body: ResponsesBody
    tools: ToolMap
    id: str = field(default_factory=new_id)
    created: int = field(default_factory=lambda: int(time.time()))
    output: list[dict[str, Any]] = field(default_factory=list)

    def response(self, status: str, stats: Stats | None = None,
                 failure: dict[str, Any] | None = None) -> dict[str, Any]:
        b = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status, "error": failure, "incomplete_details": incomplete,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "model": b.model, "output": list(self.output),
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": (b.reasoning or {}).get("effort"),
                          "summary": (b.reasoning or {}).get("summary")},
            "store": b.store is not False, "temperature": b.temperature,
            "text": b.text or {"format": {"type": "text"}},
            "tool_choice": b.tool_choice or "auto", "tools": b.tools or [],
            "top_p": b.top_p, "truncation": b.truncation or "disabled",
            "usage": usage(stats) if stats is not None else None,
            "user": b.user, "metadata": b.metadata or {},
        }


def _status(stats: Stats) -> str:
    return "incomplete" if stats.finish_reason == "length" else "completed"


def reasoning_item(thought: str, summary: bool) -> dict[str, Any]:
    return {"id": f"rs_{secrets.token_hex(12)}", "type": "reasoning",
            "summary": [{"type": "summary_text", "text": thought}] if summary else [],
            "content": [{"type": "reasoning_text", "text": thought}]}


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": f"msg_{secrets.token_hex(12)}", "type": "message", "role": "assistant",
            "status": status, "content": [] if status != "completed" else
            [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _summary(body: ResponsesBody) -> bool:
    return bool((body.reasoning or {}).get("summary"))


async def collect(answer: Answer, first: Chunk | Done,
                  rest: AsyncIterator[Chunk | Done]) -> tuple[dict[str, Any], Stats]:
    thought: list[str] = []
    text: list[str] = []
    calls: list[ToolCall | PartialCall] = []
    event: Chunk | Done | None = first
    while isinstance(event, Chunk):
        thought.append(event.thinking or "")
        text.append(event.text)
        calls += event.tool_calls or []
        calls += [event.partial_call] if event.partial_call is not None else []
        event = await anext(rest, None)
    stats = event.stats if isinstance(event, Done) else Stats(finish_reason="error")
    if any(thought):
        answer.output.append(reasoning_item("".join(thought), _summary(answer.body)))
    if "".join(text) or not (calls or any(thought)):  # (cut short while thinking: none)
        answer.output.append(message_item("".join(text)))
    answer.output += [answer.tools.item(c) for c in calls]
    return answer.response(_status(stats), stats), stats


class Events:
    """The Responses event stream's frames, numbered in order."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, kind: str, data: dict[str, Any]) -> bytes:
        frame = b"event: " + kind.encode() + b"\ndata: " + jsonio.dumps(
            {"type": kind, "sequence_number": self.n, **data}) + b"\n\n"
        self.n += 1
        return frame


async def stream(answer: Answer, first: asyncio.Future[Chunk | Done], rest: OutputStream,
                 on_done: Callable[[dict[str, Any]], None] | None = None
                 ) -> AsyncIterator[bytes]:
    """response.created, in_progress, then per output item: output_item.added, its parts and
    deltas, output_item.done; then response.completed (or .incomplete, or .failed)."""
    ev = Events()
    summary = _summary(answer.body)
    open_item: dict[str, Any] | None = None  # the reasoning or message item being written
    parts: list[str] = []
    stats: Stats | None = None

    def close() -> list[bytes]:
        nonlocal open_item, parts
        if open_item is None:
            return []
        item, index, text = open_item, len(answer.output), "".join(parts)
        frames: list[bytes] = []
        if item["type"] == "reasoning":
            item = reasoning_item(text, summary) | {"id": item["id"]}
            if summary:
                frames += [
                    ev("response.reasoning_summary_text.done", {
                        "item_id": item["id"], "output_index": index, "summary_index": 0,
                        "text": text}),
                    ev("response.reasoning_summary_part.done", {
                        "item_id": item["id"], "output_index": index, "summary_index": 0,
                        "part": {"type": "summary_text", "text": text}})]
            frames.append(ev("response.reasoning_text.done", {
                "item_id": item["id"], "output_index": index, "content_index": 0,
                "text": text}))
        else:
            item = message_item(text) | {"id": item["id"]}
            part = item["content"][0]
            frames += [
                ev("response.output_text.done", {
                    "item_id": item["id"], "output_index": index, "content_index": 0,
                    "text": text, "logprobs": []}),
                ev("response.content_part.done", {
                    "item_id": item["id"], "output_index": index, "content_index": 0,
                    "part": part})]
        frames.append(ev("response.output_item.done", {"output_index": index, "item": item}))
        answer.output.append(item)
        open_item, parts = None, []
        return frames

    def start(kind: str) -> list[bytes]:
        nonlocal open_item
        index = len(answer.output)
        if kind == "reasoning":
            open_item = {"id": f"rs_{secrets.token_hex(12)}", "type": "reasoning",
                         "summary": [], "content": []}
            frames = [ev("response.output_item.added", {"output_index": index,
                                                        "item": open_item})]
            if summary:
                frames.append(ev("response.reasoning_summary_part.added", {
                    "item_id": open_item["id"], "output_index": index, "summary_index": 0,
                    "part": {"type": "summary_text", "text": ""}}))
            return frames
        open_item = message_item("", "in_progress")
        return [ev("response.output_item.added", {"output_index": index, "item": open_item}),
                ev("response.content_part.added", {
                    "item_id": open_item["id"], "output_index": index, "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": [],
                             "logprobs": []}})]

    try:
        yield ev("response.created", {"response": answer.response("in_progress")})
        yield ev("response.in_progress", {"response": answer.response("in_progress")})
        while not (await asyncio.wait({first}, timeout=KEEPALIVE_SECONDS))[0]:
            yield _KEEPALIVE  # a comment: the prompt is still being read
        event: Chunk | Done | None = first.result()
        while isinstance(event, Chunk):
            index = len(answer.output)
            if event.thinking:
                if open_item is None or open_item["type"] != "reasoning":
                    for frame in [*close(), *start("reasoning")]:
                        yield frame
                    index = len(answer.output)
                parts.append(event.thinking)
                assert open_item is not None
                if summary:
                    yield ev("response.reasoning_summary_text.delta", {
                        "item_id": open_item["id"], "output_index": index,
                        "summary_index": 0, "delta": event.thinking})
                yield ev("response.reasoning_text.delta", {
                    "item_id": open_item["id"], "output_index": index, "content_index": 0,
                    "delta": event.thinking})
            if event.text:
                if open_item is None or open_item["type"] != "message":
                    for frame in [*close(), *start("message")]:
                        yield frame
                    index = len(answer.output)
                parts.append(event.text)
                assert open_item is not None
                yield ev("response.output_text.delta", {
                    "item_id": open_item["id"], "output_index": index, "content_index": 0,
                    "delta": event.text, "logprobs": []})
            calls: list[ToolCall | PartialCall] = [
                *(event.tool_calls or []), *([event.partial_call] if event.partial_call else [])]
            for call in calls:
                for frame in close():
                    yield frame
                item = answer.tools.item(call)
                index = len(answer.output)
                key = "input" if item["type"] == "custom_tool_call" else "arguments"
                yield ev("response.output_item.added", {
                    "output_index": index, "item": {**item, key: "", "status": "in_progress"}})
                kind = "custom_tool_call_input" if key == "input" else "function_call_arguments"
                yield ev(f"response.{kind}.delta", {"item_id": item["id"],
                                                    "output_index": index,
                                                    "delta": item[key]})
                if item["status"] == "completed":  # a call cut off has no whole arguments
                    yield ev(f"response.{kind}.done", {
                        "item_id": item["id"], "output_index": index, key: item[key],
                        "name": item["name"]})
                yield ev("response.output_item.done", {"output_index": index, "item": item})
                answer.output.append(item)
            event = await anext(rest, None)
        if open_item is None and not answer.output:  # nothing generated: one empty message
            for frame in start("message"):
                yield frame
        for frame in close():
            yield frame
        stats = event.stats if isinstance(event, Done) else Stats(finish_reason="error")
        status = _status(stats)
        final = answer.response(status, stats)
        if on_done is not None:
            on_done(final)
        yield ev(f"response.{status}", {"response": final})
    except (EngineError, ApiError) as exc:
        if isinstance(exc, EngineError):
            status_code, message, _, code, _ = _engine_error(exc)
        else:
            status_code, message, code = exc.status, exc.message, exc.code
        failure = {"code": code or ("server_error" if status_code >= 500 else
                                    "invalid_request_error"), "message": message}
        yield ev("response.failed", {"response": answer.response("failed", stats, failure)})
    finally:
        if not first.done():  # the client left while the prompt was read: cancel it
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await first
        await rest.aclose()


# -- the routes -----------------------------------------------------------------------------


def _not_stored(response_id: str, param: str | None = None) -> JSONResponse:
    return error(404, f"Response with id '{response_id}' not found.", param)


def router(service: Service, store: ResponseStore) -> APIRouter:
    api = APIRouter()

    def prepare(body: ResponsesBody) -> tuple[ChatRequest, ToolMap, list[dict[str, Any]]]:
        body.log_extras()
        earlier = store.conversation(body.previous_response_id) \
            if body.previous_response_id else []
        req, mapping = to_request(body, earlier)
        return req, mapping, earlier

    @api.post("/v1/responses", response_model=None)
    async def create(body: ResponsesBody, request: Request) -> Response:
        try:
            req, mapping, _ = prepare(body)
            req = await fetched(req)
        except NotStored:
            return _not_stored(body.previous_response_id or "", "previous_response_id")
        except (ApiError, EngineError) as exc:
            return api_error(exc)
        answer = Answer(body, mapping)
        items = [{"type": "message", "role": "user", "content": body.input}] \
            if isinstance(body.input, str) else body.input

        def keep(response: dict[str, Any]) -> None:
            if body.store is not False:
                try:
                    store.save(response, items, body.previous_response_id)
                except OSError as exc:  # the answer still goes out; only continuing fails
                    log.warning("responses: could not store %s: %s", response["id"], exc)

        async def respond() -> Response:
            events = service.chat(req)
            if not req.stream:
                try:
                    response, _ = await collect(answer, await first_output(events),
                                                cast(OutputStream, events))
                except (EngineError, ApiError) as exc:
                    return api_error(exc)
                finally:
                    await events.aclose()
                keep(response)
                return JSONResponse(response)
            # what fails before the first output (an unknown model, a full queue, a prompt
            # over the context) is still an HTTP error
            first = asyncio.ensure_future(first_output(events))
            try:
                await asyncio.wait({first}, timeout=KEEPALIVE_SECONDS)
                if first.done():
                    first.result()
            except (EngineError, ApiError) as exc:
                await events.aclose()
                return api_error(exc)
            except BaseException:
                first.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await first
                await events.aclose()
                raise
            return StreamingResponse(stream(answer, first, cast(OutputStream, events), keep),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})

        return await unless_disconnected(request, respond())

    @api.post("/v1/responses/input_tokens", response_model=None)
    async def input_tokens(body: ResponsesBody, request: Request) -> Response:
        try:
            req, _, _ = prepare(body)
            req = await fetched(req)  # images count: the runner reads them
            n = await unless_disconnected(request, service.count_tokens(req))
        except NotStored:
            return _not_stored(body.previous_response_id or "", "previous_response_id")
        except (ApiError, EngineError) as exc:
            return api_error(exc)
        if isinstance(n, Response):
            return n
        return JSONResponse({"object": "response.input_tokens", "input_tokens": n})

    @api.get("/v1/responses/{response_id}", response_model=None)
    async def get(response_id: str) -> Response:
        try:
            return JSONResponse(store.get(response_id))
        except NotStored:
            return _not_stored(response_id)

    @api.get("/v1/responses/{response_id}/input_items", response_model=None)
    async def input_items(response_id: str) -> Response:
        try:
            items = store.input_items(response_id)
        except NotStored:
            return _not_stored(response_id)
        data = [{"id": item.get("id") or f"msg_{i}", **item} for i, item in enumerate(items)]
        return JSONResponse({"object": "list", "data": data, "has_more": False,
                             "first_id": data[0]["id"] if data else None,
                             "last_id": data[-1]["id"] if data else None})

    @api.delete("/v1/responses/{response_id}", response_model=None)
    async def delete(response_id: str) -> Response:
        try:
            store.delete(response_id)
        except NotStored:
            return _not_stored(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    return api


__all__ = ["ResponsesBody", "router", "to_request"]
