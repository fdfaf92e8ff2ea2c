"""Ollama's native API (`/api/*`): NDJSON streams, `{"error": ...}` bodies, nanosecond stats."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from llmrun import __version__
from llmrun.request import ChatRequest, Chunk, Done, EngineError, Message, Options, Stats
from llmrun.server.service import Service
from llmrun.store import Manifest

log = logging.getLogger(__name__)

DONE_REASONS = {"stop": "stop", "length": "length", "cancel": "stop", "error": "stop"}


class OllamaMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    thinking: str | None = None
    tool_name: str | None = None


class ChatBody(BaseModel):
    model: str
    messages: list[OllamaMessage] = []
    stream: bool = True
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | float | None = None
    tools: list[dict[str, Any]] | None = None
    think: bool | str | None = None


def error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def parse_options(raw: dict[str, Any] | None) -> Options:
    """Validate request options; unknown names are ignored with a warning, as Ollama does."""
    if not raw:
        return Options()
    known = {k: v for k, v in raw.items() if k in Options.model_fields}
    for k in raw.keys() - known.keys():
        log.warning("ignoring unknown option %r", k)
    try:
        return Options.model_validate(known)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise EngineError(f"invalid options.{field}: {first['msg']}", status=400) from None


def stats_fields(stats: Stats) -> dict[str, Any]:
    return {
        "done_reason": DONE_REASONS.get(stats.finish_reason, stats.finish_reason),
        "total_duration": stats.total_ns,
        "load_duration": stats.load_ns,
        "prompt_eval_count": stats.prompt_tokens,
        "prompt_eval_duration": stats.prompt_ns,
        "eval_count": stats.completion_tokens,
        "eval_duration": stats.generate_ns,
    }


def model_entry(m: Manifest) -> dict[str, Any]:
    d = m.details
    return {
        "name": m.name,
        "model": m.name,
        "modified_at": m.modified_at.isoformat(),
        "size": m.size,
        "digest": m.digest,
        "details": {
            "parent_model": "",
            "format": d.format,
            "family": d.family,
            "families": [d.family] if d.family else None,
            "parameter_size": d.parameter_size,
            "quantization_level": d.quantization_level,
        },
    }


def router(service: Service) -> APIRouter:
    api = APIRouter()

    @api.get("/api/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @api.get("/api/tags")
    async def tags() -> dict[str, Any]:
        return {"models": [model_entry(m) for m in service.store.list()]}

    @api.post("/api/chat", response_model=None)
    async def chat(body: ChatBody, request: Request) -> Response:
        if any(m.images for m in body.messages):
            return error(400, f"model '{body.model}' does not support images (it is text-only)")
        if body.format is not None:
            return error(400, "'format' (structured output) is not supported yet")
        try:
            req = ChatRequest(
                model=body.model,
                messages=[Message(role=m.role, content=m.content) for m in body.messages],
                options=parse_options(body.options),
                stream=body.stream,
                keep_alive=body.keep_alive,
            )
        except EngineError as exc:
            return error(exc.status, exc.message)
        if not req.messages:
            return await _load_only(service, req)
        events = service.chat(req)
        try:
            first = await anext(events)
        except EngineError as exc:
            return error(exc.status, exc.message)
        if not req.stream:
            return await _collect(req, first, events)
        return StreamingResponse(_ndjson(req, first, events), media_type="application/x-ndjson")

    return api


async def _load_only(service: Service, req: ChatRequest) -> Response:
    try:
        await service.load(req)
    except EngineError as exc:
        return error(exc.status, exc.message)
    unloading = req.keep_alive is not None and str(req.keep_alive).strip() in ("0", "0s", "0.0")
    return JSONResponse({
        "model": req.model,
        "created_at": now(),
        "message": {"role": "assistant", "content": ""},
        "done_reason": "unload" if unloading else "load",
        "done": True,
    })


def _chunk_line(req: ChatRequest, text: str) -> bytes:
    obj = {"model": req.model, "created_at": now(),
           "message": {"role": "assistant", "content": text}, "done": False}
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"


def _done_obj(req: ChatRequest, stats: Stats, content: str = "") -> dict[str, Any]:
    return {"model": req.model, "created_at": now(),
            "message": {"role": "assistant", "content": content},
            "done": True, **stats_fields(stats)}


async def _ndjson(req: ChatRequest, first: Chunk | Done,
                  rest: AsyncIterator[Chunk | Done]) -> AsyncIterator[bytes]:
    event: Chunk | Done | None = first
    try:
        while event is not None:
            if isinstance(event, Chunk):
                yield _chunk_line(req, event.text)
            else:
                yield json.dumps(_done_obj(req, event.stats)).encode() + b"\n"
                return
            event = await anext(rest, None)
    except EngineError as exc:
        yield json.dumps({"error": exc.message}).encode() + b"\n"
    finally:
        await rest.aclose()


async def _collect(req: ChatRequest, first: Chunk | Done,
                   rest: AsyncIterator[Chunk | Done]) -> Response:
    parts: list[str] = []
    event: Chunk | Done | None = first
    try:
        while isinstance(event, Chunk):
            parts.append(event.text)
            event = await anext(rest, None)
    except EngineError as exc:
        return error(exc.status, exc.message)
    finally:
        await rest.aclose()
    stats = event.stats if isinstance(event, Done) else Stats(finish_reason="error")
    return JSONResponse(_done_obj(req, stats, "".join(parts)))
