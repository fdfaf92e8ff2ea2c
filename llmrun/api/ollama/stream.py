"""Ollama's answers: NDJSON lines while streaming, one object when not, nanosecond stats;
an error before the first token is an HTTP error, after it a last `{"error"}` line."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any, Literal, cast

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmrun import jsonio
from llmrun.api.dialect import http_status
from llmrun.api.disconnect import unless_disconnected
from llmrun.api.events import EventStream, OutputStream, first_event, first_output
from llmrun.api.ollama.errors import error
from llmrun.request import ChatRequest, Chunk, Done, EngineError, Progress, Started, Stats, ToolCall
from llmrun.server.service import Service

# Ollama ends a turn with tool calls as "stop", the calls being in the message
DONE_REASONS = {"stop": "stop", "length": "length", "cancel": "stop", "error": "stop",
                "tool_calls": "stop"}


def now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def stats_fields(stats: Stats) -> dict[str, Any]:
    return {
        "done_reason": DONE_REASONS.get(stats.finish_reason, stats.finish_reason),
        "total_duration": stats.total_ns,
        "load_duration": stats.load_ns,
        "prompt_eval_count": stats.prompt_tokens,
        "prompt_eval_duration": stats.prompt_ns,
        "eval_count": stats.completion_tokens,
        "eval_duration": stats.generate_ns,
        **stats.context_notes(),
    }


Shape = Literal["chat", "generate"]


def _text(shape: Shape, text: str, thinking: str | None = None) -> dict[str, Any]:
    """Where the generated text goes: /api/chat's message, /api/generate's response; the
    model's thought (if it thinks) beside it."""
    extra = {"thinking": thinking} if thinking else {}
    if shape == "chat":
        return {"message": {"role": "assistant", "content": text, **extra}}
    return {"response": text, **extra}


async def load_only(service: Service, req: ChatRequest, shape: Shape) -> Response:
    """An empty prompt loads the model; with keep_alive 0 it unloads it."""
    unloading = req.keep_alive == 0  # ("0", "0s", 0...: parsed in the body)
    try:
        if unloading:
            await service.unload(req.model)
        else:
            await service.load(req)
    except EngineError as exc:
        return error(http_status(exc), exc.message, exc.retry_after)
    return JSONResponse({"model": req.model, "created_at": now(), **_text(shape, ""),
                         "done_reason": "unload" if unloading else "load", "done": True})


def _tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "function": {"index": i, "name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(calls)]


def _logprobs(chunk: Chunk) -> list[dict[str, Any]]:
    return [{"token": e.token, "logprob": e.logprob, "bytes": e.bytes,
             "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                              for t, lp in e.top]} for e in chunk.logprobs or []]


def _chunk_line(req: ChatRequest, chunk: Chunk, shape: Shape) -> bytes:
    obj: dict[str, Any] = {"model": req.model, "created_at": now(),
                           **_text(shape, chunk.text, chunk.thinking), "done": False}
    if chunk.tool_calls and shape == "chat":
        obj["message"]["tool_calls"] = _tool_calls(chunk.tool_calls)
    if chunk.logprobs is not None:
        obj["logprobs"] = _logprobs(chunk)
    return jsonio.dumps(obj) + b"\n"


def _done_obj(req: ChatRequest, stats: Stats, shape: Shape, content: str = "",
              thinking: str | None = None) -> dict[str, Any]:
    out = {"model": req.model, "created_at": now(), **_text(shape, content, thinking),
           "done": True}
    if stats.context is not None:
        out["context"] = stats.context
    return {**out, **stats_fields(stats)}


async def respond(req: ChatRequest, events: EventStream,
                  shape: Shape, request: Request | None = None) -> Response:
    """Errors before the first token are HTTP errors; after it, a final NDJSON error line.
    A non-streaming request whose client disconnects is cancelled."""
    if not req.stream:
        return await unless_disconnected(request, _first_then_collect(req, events, shape))
    # with `return_progress` the stream opens once the prompt has a slot, to say how far its
    # reading is; else with the first token
    first = await first_event(anext(events) if req.progress else first_output(events),
                              events.aclose, (EngineError,), _engine_error)
    if isinstance(first, Response):
        return first
    return StreamingResponse(_ndjson(req, first.result(), events, shape),
                             media_type="application/x-ndjson")


async def _first_then_collect(req: ChatRequest, events: EventStream,
                              shape: Shape) -> Response:
    first = await first_event(first_output(events), events.aclose, (EngineError,),
                              _engine_error)
    if isinstance(first, Response):
        return first
    return await _collect(req, first.result(), cast(OutputStream, events), shape)


def _engine_error(exc: EngineError) -> Response:
    return error(http_status(exc), exc.message, exc.retry_after)


async def _ndjson(req: ChatRequest, first: Started | Progress | Chunk | Done,
                  rest: EventStream, shape: Shape) -> AsyncIterator[bytes]:
    event: Started | Progress | Chunk | Done | None = first
    try:
        while event is not None:
            if isinstance(event, Chunk):
                yield _chunk_line(req, event, shape)
            elif isinstance(event, Progress):
                yield jsonio.dumps(_progress_obj(req, event, shape)) + b"\n"
            elif isinstance(event, Started):
                pass
            else:
                yield jsonio.dumps(_done_obj(req, event.stats, shape)) + b"\n"
                return
            event = await anext(rest, None)
    except EngineError as exc:
        yield json.dumps({"error": exc.message}).encode() + b"\n"
    finally:
        await rest.aclose()


def _progress_obj(req: ChatRequest, p: Progress, shape: Shape) -> dict[str, Any]:
    """A line with no text yet and how far the prompt's reading is, in llama-server's
    `prompt_progress` terms (`cache`: tokens the cache held; `processed` counts them)."""
    return {"model": req.model, "created_at": now(), **_text(shape, "", None), "done": False,
            "prompt_progress": {"total": p.total, "cache": p.cached, "processed": p.processed}}


async def _collect(req: ChatRequest, first: Chunk | Done,
                   rest: OutputStream, shape: Shape) -> Response:
    parts: list[str] = []
    thoughts: list[str] = []
    logprobs: list[dict[str, Any]] = []
    calls: list[ToolCall] = []
    event: Chunk | Done | None = first
    try:
        while isinstance(event, Chunk):
            parts.append(event.text)
            thoughts.append(event.thinking or "")
            logprobs += _logprobs(event)
            calls += event.tool_calls or []
            event = await anext(rest, None)
    except EngineError as exc:
        return error(http_status(exc), exc.message, exc.retry_after)
    finally:
        await rest.aclose()
    stats = event.stats if isinstance(event, Done) else Stats(finish_reason="error")
    body = _done_obj(req, stats, shape, "".join(parts), "".join(thoughts))
    if calls and shape == "chat":
        body["message"]["tool_calls"] = _tool_calls(calls)
    if req.logprobs is not None:
        body["logprobs"] = logprobs
    return JSONResponse(body)
