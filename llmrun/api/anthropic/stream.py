"""Anthropic's answers: one message of content blocks, or the named SSE events of a stream
(message_start, content blocks, message_delta, message_stop) with pings while a prompt is
read; `respond` decides which errors are still HTTP errors."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import secrets
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmrun import jsonio
from llmrun.api.anthropic.errors import engine_error, engine_message, error_body
from llmrun.api.anthropic.wire import MessagesBody, shows_thinking
from llmrun.api.dialect import http_status
from llmrun.api.events import OutputStream, first_event, first_output
from llmrun.request import (
    ChatRequest,
    Chunk,
    Done,
    EngineError,
    PartialCall,
    Started,
    Stats,
    ToolCall,
)
from llmrun.server.service import Service

# Seconds to wait for a streamed answer's first token before the stream is committed to
# (errors before it are HTTP errors), then between the pings sent while a prompt is read.
PING_GRACE = 1.0
PING_EVERY = 5.0
# Sent while a request waits for a slot (queued, or its model loading), before message_start
# can say the prompt's size: an SSE comment, which every SSE parser skips.
WAITING = b": ping\n\n"


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
                    if text_open:  # a thought after answer text (a remote model's)
                        text_open = False
                        yield _sse("content_block_stop", {"index": index})
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
        status = 529 if http_status(exc) == 503 else http_status(exc)
        yield _sse("error", {"error": error_body(status,
                                                 engine_message(exc, body.model))["error"]})
    finally:
        if not first.done():  # the client left during prefill: cancel the request
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await first
        await rest.aclose()


async def respond(service: Service, body: MessagesBody, req: ChatRequest) -> Response:
    """Errors within the grace period are HTTP errors; later ones (the stream opened
    while the request waited for its slot or its first token) an `error` event. One trip:
    message_start's input_tokens comes from the stream's own Started event."""
    leased = asyncio.Event()
    # (no Progress: this request asks for none)
    events = cast("AsyncGenerator[Started | Chunk | Done, None]", service.chat(req, leased))
    def on_error(exc: EngineError) -> Response:
        return engine_error(exc, body.model)

    if not req.stream:
        output = await first_event(first_output(events), events.aclose, (EngineError,),
                                   on_error)
        if isinstance(output, Response):
            return output
        return await _collect(body, output.result(), cast(OutputStream, events))
    # What fails at once (a full queue, a prompt over the context) or while the model
    # loads is still an HTTP error; past the grace period after the load the stream
    # starts and pings while the request waits for a slot or its prompt is read.
    loop = asyncio.get_running_loop()
    deadline = loop.time() + PING_GRACE

    async def loaded_and_grace(first: asyncio.Future[Started | Chunk | Done]) -> None:
        nonlocal deadline
        loaded: asyncio.Future[Any] = asyncio.ensure_future(leased.wait())
        try:
            await asyncio.wait({first, loaded}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            loaded.cancel()
        deadline = loop.time() + PING_GRACE
        await asyncio.wait({first}, timeout=PING_GRACE)

    async def rest_of_grace(first: asyncio.Future[Started | Chunk | Done]) -> None:
        await asyncio.wait({first}, timeout=max(0.0, deadline - loop.time()))

    first = await first_event(anext(events), events.aclose, (EngineError,), on_error,
                              loaded_and_grace)
    if isinstance(first, Response):
        return first
    started: Started | None = None
    if first.done() and isinstance(got := first.result(), Started):
        started = got  # and within what is left of the grace period, the first output
        first = await first_event(anext(events), events.aclose, (EngineError,), on_error,
                                  rest_of_grace)
        if isinstance(first, Response):
            return first
    return StreamingResponse(_stream(body, started, first, events),
                             media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache"})
