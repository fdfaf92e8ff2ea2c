"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`): what Claude Code
and the official `anthropic` SDKs speak.

Content blocks become the internal `Message`s (text flattened, `image` blocks into
`Message.images` (user turns and tool results only; api/images.py), `tool_use` into
`Message.tool_calls`, `tool_result` into `tool` turns, `thinking` dropped, every `system`
part folded into one leading system message); the answer goes back as content blocks, or as
Anthropic's named SSE events. Errors here always take Anthropic's shape,
`{"type": "error", "error": {"type": ..., "message": ...}}`, request validation included (the
route class below catches it, so the app's Ollama-shaped handler never sees these paths).

Usage follows Anthropic's arithmetic: `input_tokens + cache_read_input_tokens` is the whole
prompt, the second part being what the slot's KV cache already held (prefix reuse), so a
client that sums them (Claude Code's context meter does) sees the true prompt length.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import secrets
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Literal, cast

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from llmrun import jsonio
from llmrun.api.dialect import Dialect
from llmrun.api.disconnect import unless_disconnected
from llmrun.api.events import OutputStream, first_output
from llmrun.api.images import fetched, from_media_type, from_url
from llmrun.api.validation import describe_validation_error
from llmrun.request import (
    ChatRequest,
    Chunk,
    Done,
    EngineError,
    Message,
    NamedTool,
    Options,
    PartialCall,
    Started,
    Stats,
    Tool,
    ToolCall,
    ToolChoice,
)
from llmrun.server.service import Service
from llmrun.store import StoreError

log = logging.getLogger(__name__)

# HTTP status -> Anthropic's error type. A full queue (503 inside llmrun) is Anthropic's
# 529 overloaded_error, which its SDKs and Claude Code retry with backoff.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}

# Seconds to wait for a streamed answer's first token before the stream is committed to
# (errors before it are HTTP errors), then between the pings sent while a prompt is read.
PING_GRACE = 1.0
PING_EVERY = 5.0
# Sent while a request waits for a slot (queued, or its model loading), before message_start
# can say the prompt's size: an SSE comment, which every SSE parser skips.
WAITING = b": ping\n\n"

BILLING_HEADER = "x-anthropic-billing-header:"


# ---- wire models (fields in Anthropic's documented order) -------------------------------


class InMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    # `system` is not Anthropic's, but Claude Code sends it inside `messages`: folded in.
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class CountBody(BaseModel):
    """`/v1/messages/count_tokens`; unknown fields (Claude Code sends several) are ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[InMessage]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None  # {"type": "enabled" | "adaptive" | "disabled"}


class MessagesBody(CountBody):
    """`/v1/messages`."""

    max_tokens: int = Field(ge=1)
    metadata: dict[str, Any] | None = None
    # structured output: {"format": {"type": "json_schema", "schema": {...}}}; `effort` and
    # the rest are accepted and ignored. `output_format` is the same, from the older beta.
    output_config: dict[str, Any] | None = None
    output_format: dict[str, Any] | None = None
    stop_sequences: list[str] | None = None
    stream: bool = False
    # Sampling, as older API versions (and raw clients) send it; newer SDKs no longer do.
    temperature: float | None = Field(None, ge=0.0)
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)


# ---- errors ---------------------------------------------------------------------------


def error_body(status: int, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error(status: int, message: str, retry_after: int | None = None) -> JSONResponse:
    if status == 503:
        status = 529
    headers = {"retry-after": str(retry_after)} if retry_after else None
    return JSONResponse(error_body(status, message), status_code=status, headers=headers)


def engine_message(exc: EngineError, model: str) -> str:
    """An engine error in Anthropic's words: a prompt over the context says so the way
    Anthropic does ("prompt is too long: N tokens > M maximum"), which Claude Code
    recognises (it compacts the conversation), then names num_ctx."""
    if exc.code == "prompt_too_long":
        n, ctx = exc.details.get("prompt_tokens"), exc.details.get("n_ctx")
        return (f"prompt is too long: {n} tokens > {ctx} maximum (model '{model}' is served "
                f"with a context of {ctx} tokens, num_ctx; shorten the conversation or serve "
                f"the model with a larger num_ctx)")
    return exc.message


def engine_error(exc: EngineError, model: str) -> JSONResponse:
    return error(exc.status, engine_message(exc, model), exc.retry_after)


# ---- request: Anthropic -> ChatRequest --------------------------------------------------


def _invalid(message: str) -> EngineError:
    return EngineError(message, status=400, kind="invalid_request")


def _no_documents(model: str, where: str) -> EngineError:
    return _invalid(f"{where}: model '{model}' cannot read documents other than text "
                    "(PDFs, files); send the content as text")


def _image(block: dict[str, Any], where: str) -> str:
    """An image block's image: a `base64` source, or a `url` one (fetched only where
    LLMRUN_IMAGE_URLS allows it); Files API ids are refused (there is no Files API here)."""
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if isinstance(source, dict) and kind == "base64":
        return from_media_type(source.get("media_type"), source.get("data"), f"{where}.source")
    if isinstance(source, dict) and kind == "url":
        return from_url(source.get("url"), f"{where}.source.url")
    if kind == "file":
        raise _invalid(f"{where}.source: images by file_id are not supported (there is no "
                       "Files API here); send the image as a base64 source")
    raise _invalid(f"{where}.source: expected {{\"type\": \"base64\", \"media_type\": ..., "
                   "\"data\": ...} or {\"type\": \"url\", \"url\": ...}")


def _block_text(block: dict[str, Any], where: str, model: str,
                images: list[str] | None = None) -> str | None:
    """The text a user-side content block carries; None for blocks that are dropped
    (thinking) and for images, which go to `images` (None where images may not be: system
    text, assistant turns, as at Anthropic). Anything that cannot be expressed as text or an
    image is refused, never lost."""
    kind = block.get("type")
    if kind == "text":
        text = block.get("text")
        if not isinstance(text, str):
            raise _invalid(f"{where}.text: Field required")
        return text
    if kind in ("thinking", "redacted_thinking"):
        return None
    if kind == "image":
        if images is None:
            raise _invalid(f"{where}: image blocks are allowed only in user messages and in "
                           "tool_result content")
        images.append(_image(block, where))
        return None
    if kind == "document":
        source = block.get("source") or {}
        if source.get("type") == "text" and isinstance(source.get("data"), str):
            title = block.get("title")
            return f"{title}\n\n{source['data']}" if title else source["data"]
        if source.get("type") == "content" and isinstance(source.get("content"), list):
            return _join([_block_text(b, f"{where}.source.content.{i}", model, images) or ""
                          for i, b in enumerate(source["content"])
                          if isinstance(b, dict)])
        raise _no_documents(model, where)
    if kind == "search_result":
        parts = [block.get("title"), block.get("source")]
        parts += [b.get("text") for b in block.get("content") or [] if isinstance(b, dict)]
        return _join([p for p in parts if isinstance(p, str)])
    raise _invalid(f"{where}: content blocks of type {kind!r} are not supported here")


def _join(parts: list[str]) -> str:
    return "\n\n".join(p for p in parts if p)


def _content_text(content: str | list[Any], where: str, model: str,
                  images: list[str] | None = None) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for i, block in enumerate(content):
        if not isinstance(block, dict):
            raise _invalid(f"{where}.{i}: expected a content block object")
        text = _block_text(block, f"{where}.{i}", model, images)
        if text is not None:
            texts.append(text)
    return _join(texts)


def _tool_result(block: dict[str, Any], where: str, model: str,
                 names: dict[str, str]) -> Message:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise _invalid(f"{where}.tool_use_id: Field required")
    content = block.get("content")
    pictures: list[str] = []  # a tool may answer with images (a screenshot)
    text = "" if content is None else _content_text(content, f"{where}.content", model,
                                                    pictures)
    if block.get("is_error"):
        text = f"Error: {text}"
    return Message(role="tool", content=text, tool_call_id=call_id, name=names.get(call_id),
                   images=pictures)


def _tool_use(block: dict[str, Any], where: str) -> ToolCall:
    call_id, name, args = block.get("id"), block.get("name"), block.get("input")
    if not isinstance(call_id, str) or not isinstance(name, str):
        raise _invalid(f"{where}: a tool_use block needs 'id' and 'name'")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise _invalid(f"{where}.input: must be an object")
    return ToolCall(id=call_id, name=name, arguments=args)


def _without_billing_header(blocks: list[Any]) -> list[Any]:
    """Claude Code 2.1 starts `system` with a text block `x-anthropic-billing-header: ...`
    whose values change on every request. Anthropic's server takes it out of the prompt; left
    in, it would change the prompt's first tokens each turn and defeat the prefix cache."""
    return [b for b in blocks if not (isinstance(b, dict) and b.get("type") == "text"
                                      and str(b.get("text", "")).startswith(BILLING_HEADER))]


def to_messages(body: CountBody) -> list[Message]:
    """Anthropic's system and messages as the internal list: one leading system message
    (top-level `system`, then any `system`-role messages, in order), then the turns."""
    model = body.model
    system: list[str] = []
    if isinstance(body.system, list):
        system.append(_content_text(_without_billing_header(body.system), "system", model))
    elif body.system is not None:
        system.append(body.system)
    out: list[Message] = []
    names: dict[str, str] = {}  # tool_use id -> tool name, for the tool turns answering them
    for i, msg in enumerate(body.messages):
        where = f"messages.{i}.content"
        if msg.role == "system":
            system.append(_content_text(msg.content, where, model))
            continue
        if isinstance(msg.content, str):
            out.append(Message(role=msg.role, content=msg.content))
            continue
        texts: list[str] = []
        pictures: list[str] = []
        calls: list[ToolCall] = []
        for j, block in enumerate(msg.content):
            at = f"{where}.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if not isinstance(block, dict):
                raise _invalid(f"{at}: expected a content block object")
            if kind == "tool_use" and msg.role == "assistant":
                call = _tool_use(block, at)
                names[call.id] = call.name
                calls.append(call)
            elif kind == "tool_result" and msg.role == "user":
                if texts or pictures:  # keep the order: what came before the result first
                    out.append(Message(role="user", content=_join(texts), images=pictures))
                    texts, pictures = [], []
                out.append(_tool_result(block, at, model, names))
            elif kind in ("tool_use", "tool_result"):
                raise _invalid(f"{at}: a {kind} block belongs in a "
                               f"{'assistant' if kind == 'tool_use' else 'user'} message")
            else:
                text = _block_text(block, at, model,
                                   pictures if msg.role == "user" else None)
                if text is not None:
                    texts.append(text)
        if msg.role == "assistant":
            out.append(Message(role="assistant", content=_join(texts), tool_calls=calls))
        elif texts or pictures or not any(isinstance(b, dict) and b.get("type") == "tool_result"
                                          for b in msg.content):
            out.append(Message(role="user", content=_join(texts), images=pictures))
    if any(system):
        out.insert(0, Message(role="system", content=_join(system)))
    return out


def to_tools(body: CountBody) -> tuple[list[Tool], ToolChoice, bool]:
    """(tools, tool choice, parallel calls allowed). Server tools (web search, code
    execution, ... : a `type` other than `custom`) run at Anthropic, not here: ignored."""
    tools: list[Tool] = []
    for i, t in enumerate(body.tools or []):
        if t.get("type") not in (None, "custom"):
            log.info("ignoring server tool %r (%s)", t.get("name"), t.get("type"))
            continue
        name, schema = t.get("name"), t.get("input_schema")
        if not isinstance(name, str) or not name:
            raise _invalid(f"tools.{i}.name: Field required")
        if schema is None:
            schema = {"type": "object", "properties": {}}
        if not isinstance(schema, dict):
            raise _invalid(f"tools.{i}.input_schema: must be a JSON schema object")
        description = t.get("description")
        tools.append(Tool(name=name, description=description if isinstance(description, str)
                          else "", parameters=schema))
    choice_in = body.tool_choice or {"type": "auto"}
    parallel = not choice_in.get("disable_parallel_tool_use", False)
    kind = choice_in.get("type")
    choice: ToolChoice
    if kind == "auto":
        choice = "auto"
    elif kind == "none":
        choice = "none"
    elif kind == "any":
        if not tools:
            raise _invalid("tool_choice: type 'any' needs at least one tool in 'tools'")
        choice = "required"
    elif kind == "tool":
        name = choice_in.get("name")
        if not any(t.name == name for t in tools):
            raise _invalid(f"tool_choice.name: no tool named {name!r} in 'tools'")
        choice = NamedTool(name=str(name))
    else:
        raise _invalid(f"tool_choice.type: expected 'auto', 'any', 'tool' or 'none', "
                       f"got {kind!r}")
    return tools, choice, parallel


def _model_stops(service: Service, model: str) -> list[str]:
    """The model's own stop strings (Modelfile): a request's stop list would replace them,
    so the client's stop_sequences are added to these instead."""
    try:
        _, manifest = service.store.get(model)
    except StoreError:
        return []  # the chat itself reports the missing model
    return list(manifest.options().stop or [])


def to_format(body: MessagesBody) -> dict[str, Any] | None:
    """The JSON schema the answer must follow (structured output), if one was asked for."""
    fmt = (body.output_config or {}).get("format") or body.output_format
    if not fmt:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" \
            or not isinstance(fmt.get("schema"), dict):
        raise _invalid("output_config.format: expected {\"type\": \"json_schema\", "
                       "\"schema\": {...}}")
    return fmt["schema"]


def to_request(body: CountBody, service: Service) -> ChatRequest:
    tools, choice, parallel = to_tools(body)
    options = Options()
    stream = False
    fmt = None
    if isinstance(body, MessagesBody):
        stream = body.stream
        fmt = to_format(body)
        client_stops = [s for s in body.stop_sequences or [] if s]
        options = Options(
            num_predict=body.max_tokens,
            temperature=body.temperature,
            top_k=body.top_k,
            top_p=body.top_p,
            stop=[*_model_stops(service, body.model), *client_stops] if client_stops else None,
        )
    # strict: Anthropic's structured outputs promise the schema (forced tool inputs are held
    # to theirs the same way), so a keyword that cannot be enforced is a 400, never skipped
    return ChatRequest(model=body.model, messages=to_messages(body), options=options,
                       stream=stream, format=fmt, format_strict=True, tools=tools,
                       tool_choice=choice,
                       parallel_tool_calls=parallel, think=to_think(body))


def shows_thinking(body: CountBody) -> bool:
    """`thinking.display: "omitted"` (Claude Code sends it): think, but send no thoughts."""
    return (body.thinking or {}).get("display") != "omitted"


def to_think(body: CountBody) -> bool:
    """`thinking` enabled or adaptive turns thinking on for models that can think (others
    just answer: Claude Code asks for it on every request); absent or disabled, off."""
    return (body.thinking or {}).get("type") in ("enabled", "adaptive")


# ---- response: Chunk/Done -> Anthropic ----------------------------------------------------


def _message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def _signature(thinking: str) -> str:
    """Anthropic's clients carry a thinking block's `signature` back with it; llmrun drops
    past thoughts from the prompt, so this only has to be present and stable."""
    return "llmrun-" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


def _tool_id(call: ToolCall | PartialCall) -> str:
    return call.id or "toolu_" + secrets.token_hex(12)


def stop_reason(stats: Stats, body: MessagesBody, tool_calls: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence). `stop_sequence` only for a string the client sent;
    a stop string of the model's own (Modelfile) ends the turn as end_turn."""
    if tool_calls or stats.finish_reason == "tool_calls":
        return "tool_use", None
    if stats.finish_reason == "length":
        return "max_tokens", None
    if stats.stop_sequence and stats.stop_sequence in (body.stop_sequences or []):
        return "stop_sequence", stats.stop_sequence
    return "end_turn", None


def usage(stats: Stats) -> dict[str, int]:
    cached = min(stats.cached_tokens, stats.prompt_tokens)
    return {"input_tokens": stats.prompt_tokens - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": stats.completion_tokens,
            **stats.context_notes()}


def _sse(event: str, data: dict[str, Any]) -> bytes:
    return b"event: " + event.encode() + b"\ndata: " + jsonio.dumps({"type": event, **data}) \
        + b"\n\n"


async def _collect(body: MessagesBody, first: Chunk | Done, rest: OutputStream) -> Response:
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[ToolCall] = []
    cut: PartialCall | None = None
    show = shows_thinking(body)
    event: Chunk | Done | None = first
    try:
        while isinstance(event, Chunk):
            texts.append(event.text)
            if show:
                thoughts.append(event.thinking or "")
            calls += event.tool_calls or []
            cut = event.partial_call or cut
            event = await anext(rest, None)
    except EngineError as exc:
        return engine_error(exc, body.model)
    finally:
        await rest.aclose()
    stats = event.stats if isinstance(event, Done) else Stats(finish_reason="error")
    text = "".join(texts)
    thought = "".join(thoughts)
    content: list[dict[str, Any]] = []
    if thought:
        content.append({"type": "thinking", "thinking": thought,
                        "signature": _signature(thought)})
    if text or not (calls or cut):
        content.append({"type": "text", "text": text})
    content += [{"type": "tool_use", "id": _tool_id(c), "name": c.name, "input": c.arguments}
                for c in calls]
    if cut is not None:  # stop_reason max_tokens: `input` is what was written whole
        content.append(_cut_tool_use(cut))
    reason, sequence = stop_reason(stats, body, bool(calls))
    return JSONResponse({
        "id": _message_id(), "type": "message", "role": "assistant", "model": body.model,
        "content": content, "stop_reason": reason, "stop_sequence": sequence,
        "usage": usage(stats),
    })


def _cut_tool_use(cut: PartialCall) -> dict[str, Any]:
    """A call the token limit cut off, as Anthropic's API ends one: an incomplete tool_use
    block, the message's stop_reason "max_tokens" (its docs: a response cut off by
    max_tokens may hold an incomplete tool use block; retry with a higher max_tokens).
    `input` holds the members written whole, as the SDK's reader of a streamed block makes
    of the same text; a client that checks stop_reason runs nothing."""
    return {"type": "tool_use", "id": _tool_id(cut), "name": cut.name, "input": cut.written()}


def _close_thinking(index: int, thought: list[str]) -> list[bytes]:
    return [_sse("content_block_delta", {"index": index, "delta": {
                "type": "signature_delta", "signature": _signature("".join(thought))}}),
            _sse("content_block_stop", {"index": index})]


def _resolved(event: Started | Chunk | Done) -> asyncio.Future[Started | Chunk | Done]:
    future: asyncio.Future[Started | Chunk | Done] = asyncio.get_running_loop().create_future()
    future.set_result(event)
    return future


async def _stream(body: MessagesBody, started: Started | None,
                  first: asyncio.Future[Started | Chunk | Done],
                  rest: AsyncGenerator[Started | Chunk | Done, None]) -> AsyncIterator[bytes]:
    """Anthropic's event sequence: message_start, per block content_block_start / _delta /
    _stop, message_delta (stop reason, final usage), message_stop. `ping` events keep the
    connection alive while the first token is awaited (a long prompt being read).

    `started` None: the request still waits for a slot, and `first` is its Started to come;
    message_start needs the prompt's size, so until then SSE comments keep the connection
    open. Else `first` is the first event after Started."""
    index = -1  # of the last block started
    text_open = False
    thought: list[str] = []  # of the open thinking block
    any_calls = False
    show = shows_thinking(body)
    try:
        if started is None:
            yield WAITING
            while not (await asyncio.wait({first}, timeout=PING_EVERY))[0]:
                yield WAITING
            waited = first.result()
            if isinstance(waited, Started):
                started, first = waited, asyncio.ensure_future(anext(rest))
            else:  # ended before it had a slot (cancelled): nothing was read
                started, first = Started(prompt_tokens=0, n_ctx=0), _resolved(waited)
        # input_tokens is the whole prompt here (message_delta splits off the cached part)
        yield _sse("message_start", {"message": {
            "id": _message_id(), "type": "message", "role": "assistant", "model": body.model,
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": started.prompt_tokens, "cache_creation_input_tokens": 0,
                      "cache_read_input_tokens": 0, "output_tokens": 0}}})
        yield _sse("ping", {})
        while not (await asyncio.wait({first}, timeout=PING_EVERY))[0]:
            yield _sse("ping", {})
        event: Started | Chunk | Done | None = first.result()
        while isinstance(event, Chunk):
            if event.thinking and show:
                if not thought:
                    index += 1
                    yield _sse("content_block_start", {"index": index, "content_block": {
                        "type": "thinking", "thinking": "", "signature": ""}})
                thought.append(event.thinking)
                yield _sse("content_block_delta", {"index": index, "delta": {
                    "type": "thinking_delta", "thinking": event.thinking}})
            if thought and (event.text or event.tool_calls or event.partial_call):  # over
                for frame in _close_thinking(index, thought):
                    yield frame
                thought = []
            if event.text:
                if not text_open:
                    index += 1
                    text_open = True
                    yield _sse("content_block_start", {
                        "index": index, "content_block": {"type": "text", "text": ""}})
                yield _sse("content_block_delta", {
                    "index": index, "delta": {"type": "text_delta", "text": event.text}})
            for call in event.tool_calls or []:
                if text_open:
                    text_open = False
                    yield _sse("content_block_stop", {"index": index})
                index += 1
                any_calls = True
                yield _sse("content_block_start", {"index": index, "content_block": {
                    "type": "tool_use", "id": _tool_id(call), "name": call.name, "input": {}}})
                yield _sse("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta",
                    "partial_json": json.dumps(call.arguments, ensure_ascii=False)}})
                yield _sse("content_block_stop", {"index": index})
            if event.partial_call is not None:  # its partial JSON; stop_reason max_tokens
                if text_open:
                    text_open = False
                    yield _sse("content_block_stop", {"index": index})
                index += 1
                yield _sse("content_block_start", {"index": index, "content_block": {
                    **_cut_tool_use(event.partial_call), "input": {}}})
                if event.partial_call.arguments:
                    yield _sse("content_block_delta", {"index": index, "delta": {
                        "type": "input_json_delta",
                        "partial_json": event.partial_call.arguments}})
                yield _sse("content_block_stop", {"index": index})
            event = await anext(rest, None)
        if thought:  # the answer never came (cut short while thinking)
            for frame in _close_thinking(index, thought):
                yield frame
            thought = []
            index += 1
            text_open = True
            yield _sse("content_block_start", {
                "index": index, "content_block": {"type": "text", "text": ""}})
        if index == -1:  # nothing generated: still one (empty) text block, as non-streamed
            index, text_open = 0, True
            yield _sse("content_block_start", {
                "index": 0, "content_block": {"type": "text", "text": ""}})
        if text_open:
            yield _sse("content_block_stop", {"index": index})
        stats = event.stats if isinstance(event, Done) else Stats(finish_reason="error")
        reason, sequence = stop_reason(stats, body, any_calls)
        yield _sse("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                     "usage": usage(stats)})
        yield _sse("message_stop", {})
    except EngineError as exc:
        status = 529 if exc.status == 503 else exc.status
        yield _sse("error", {"error": error_body(status,
                                                 engine_message(exc, body.model))["error"]})
    finally:
        if not first.done():  # the client left during prefill: cancel the request
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await first
        await rest.aclose()


def router(service: Service) -> APIRouter:
    api = APIRouter()

    async def respond(body: MessagesBody, req: ChatRequest) -> Response:
        """Errors within the grace period are HTTP errors; later ones (the stream opened
        while the request waited for its slot or its first token) an `error` event. One trip:
        message_start's input_tokens comes from the stream's own Started event."""
        leased = asyncio.Event()
        # (no Progress: this request asks for none)
        events = cast("AsyncGenerator[Started | Chunk | Done, None]", service.chat(req, leased))
        if not req.stream:
            try:
                return await _collect(body, await first_output(events),
                                      cast(OutputStream, events))
            except EngineError as exc:
                return engine_error(exc, body.model)
        # What fails at once (a full queue, a prompt over the context) or while the model
        # loads is still an HTTP error; past the grace period after the load the stream
        # starts and pings while the request waits for a slot or its prompt is read.
        loop = asyncio.get_running_loop()
        first = asyncio.ensure_future(anext(events))
        started: Started | None = None
        try:
            loaded = asyncio.ensure_future(leased.wait())
            try:
                await asyncio.wait({first, loaded}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                loaded.cancel()
            deadline = loop.time() + PING_GRACE
            await asyncio.wait({first}, timeout=PING_GRACE)
            if first.done() and isinstance(got := first.result(), Started):
                started = got
                first = asyncio.ensure_future(anext(events))
                await asyncio.wait({first}, timeout=max(0.0, deadline - loop.time()))
            if first.done():
                first.result()
        except EngineError as exc:
            await events.aclose()
            return engine_error(exc, body.model)
        except BaseException:  # the client left (unless_disconnected cancels this)
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await first
            await events.aclose()
            raise
        return StreamingResponse(_stream(body, started, first, events),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    @api.post("/v1/messages", response_model=None)
    async def messages(body: MessagesBody, request: Request) -> Response:
        req = await fetched(to_request(body, service))
        # A client that gives up (Esc in Claude Code) during prefill or a non-streamed
        # answer cancels the work; once streaming, Starlette cancels the stream itself.
        return await unless_disconnected(request, respond(body, req))

    @api.post("/v1/messages/count_tokens", response_model=None)
    async def count_tokens(body: CountBody, request: Request) -> Response:
        req = await fetched(to_request(body, service))  # images count: the runner reads them
        try:
            n = await unless_disconnected(request, service.count_tokens(req))
            if isinstance(n, Response):
                return n
        except EngineError as exc:
            return engine_error(exc, body.model)
        return JSONResponse({"input_tokens": n})

    return api


def _validation_error(exc: RequestValidationError) -> Response:
    return error(400, describe_validation_error(exc, quote_field=False))


def _engine_error(exc: EngineError) -> Response:
    """An engine error no route caught (an image that cannot be fetched, a body that cannot
    become a request): Anthropic's shape, without the prompt-too-long wording."""
    return error(exc.status, exc.message, exc.retry_after)


DIALECT = Dialect(
    name="anthropic", prefixes=("/v1/messages",),
    routers=lambda backends: [router(backends.service)],
    error_body=lambda status, message, _: error_body(status, message),
    validation_error=_validation_error, engine_error=_engine_error)
