"""OpenAI's routes: `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`, `/v1/models`,
`/v1/audio/transcriptions` and `/v1/audio/translations` (transcribe.py);
and reranking, which OpenAI lacks, in the shapes its clients' neighbours use: llama-server's
and Jina's `/v1/rerank` (also `/rerank`, `/v1/reranking`), Cohere's `/v2/rerank`."""

from __future__ import annotations

import base64
import secrets
import struct
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from functools import partial
from typing import Any

from fastapi import APIRouter, Request, WebSocket
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from llmrun.api.disconnect import unless_disconnected
from llmrun.api.images import fetched
from llmrun.api.openai.errors import ApiError, api_error, error, invalid_value
from llmrun.api.openai.realtime import session as realtime_session
from llmrun.api.openai.stream import (
    Choices,
    chat_collect,
    chat_stream,
    completion_collect,
    completion_stream,
    start_choices,
)
from llmrun.api.openai.transcribe import Task, answer, parse, read
from llmrun.api.openai.wire import ChatCompletionBody, CompletionBody, EmbeddingBody, RerankBody
from llmrun.request import ChatRequest, EngineError, ModelRequest
from llmrun.server.service import Service
from llmrun.store import Manifest, StoreError

# -- embeddings and models ------------------------------------------------------------------


def _shorten(vector: list[float], dims: int) -> list[float]:
    """Truncate to `dims` and renormalise (what `dimensions` asks for)."""
    cut = vector[:dims]
    norm = sum(x * x for x in cut) ** 0.5
    return [x / norm for x in cut] if norm > 0 else cut


def _base64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def ranked(scores: list[float], texts: list[str], top_n: int | None,
           return_documents: bool) -> list[dict[str, Any]]:
    """Results by score, highest first (ties in the documents' order), the first `top_n`."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:top_n]
    return [{"index": i, "relevance_score": scores[i],
             **({"document": {"text": texts[i]}} if return_documents else {})}
            for i in order]


def model_object(m: Manifest) -> dict[str, Any]:
    owner = m.name.split("/")[1] if m.name.startswith("hf.co/") and m.name.count("/") >= 2 \
        else "library"
    return {"id": m.name, "object": "model", "created": int(m.modified_at.timestamp()),
            "owned_by": owner}


# -- routes ---------------------------------------------------------------------------------


async def _answer(request: Request, service: Service, reqs: list[ChatRequest], id_prefix: str,
                  collect: Callable[[Choices, str, int], Awaitable[Response]],
                  stream: Callable[[Choices, str, int], AsyncIterator[bytes]]) -> Response:
    """Start every choice, then answer whole (`collect`) or as SSE (`stream`), both given the
    running choices, the response id and its creation time."""

    async def respond() -> Response:
        started = await start_choices(service, reqs)
        if isinstance(started, Response):
            return started
        cid, created = f"{id_prefix}-{secrets.token_hex(12)}", int(time.time())
        if not reqs[0].stream:
            return await collect(started, cid, created)
        return StreamingResponse(stream(started, cid, created), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    # until the stream starts (or the whole answer is ready), a client that goes away cancels
    # the work; after that, Starlette cancels the stream itself
    return await unless_disconnected(request, respond())


async def _with_images(reqs: list[ChatRequest]) -> list[ChatRequest]:
    """The choices of one request with their image URLs downloaded, once for all of them
    (the choices share their messages)."""
    first = await fetched(reqs[0])
    if first is reqs[0]:
        return reqs
    return [first, *(r.model_copy(update={"messages": first.messages}) for r in reqs[1:])]


def router(service: Service) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionBody, request: Request) -> Response:
        body.log_extras()
        try:
            reqs = await _with_images(body.to_requests())
        except (ApiError, EngineError) as exc:
            return api_error(exc)
        except ValidationError as exc:
            return invalid_value(exc)

        return await _answer(request, service, reqs, "chatcmpl",
                             partial(chat_collect, body, reqs),
                             partial(chat_stream, body, reqs))

    async def speech(request: Request, task: Task) -> Response:
        try:
            t = parse(task, *await read(request))
        except ApiError as exc:
            return api_error(exc)
        return await unless_disconnected(request, answer(service, t))

    @api.websocket("/v1/realtime")
    async def realtime(ws: WebSocket) -> None:
        """OpenAI's Realtime API, its transcription intent only (realtime.py)."""
        await realtime_session(ws, service)

    @api.post("/v1/audio/transcriptions", response_model=None)
    async def transcriptions(request: Request) -> Response:
        return await speech(request, "transcribe")

    @api.post("/v1/audio/translations", response_model=None)
    async def translations(request: Request) -> Response:
        return await speech(request, "translate")

    @api.post("/v1/completions", response_model=None)
    async def completions(body: CompletionBody, request: Request) -> Response:
        body.log_extras()
        try:
            prompts, reqs = body.to_requests()
        except (ApiError, EngineError) as exc:
            return api_error(exc)
        except ValidationError as exc:
            return invalid_value(exc)

        return await _answer(request, service, reqs, "cmpl",
                             partial(completion_collect, body, prompts, reqs),
                             partial(completion_stream, body, prompts, reqs))

    @api.post("/v1/embeddings", response_model=None)
    async def embeddings(body: EmbeddingBody) -> Response:
        body.log_extras()
        raw = body.input
        if isinstance(raw, list) and raw and not isinstance(raw[0], str):
            return error(400, "inputs as token ids are not supported; send text", "input")
        inputs = [raw] if isinstance(raw, str) else [str(x) for x in raw]
        if not inputs or any(not x for x in inputs):
            return error(400, "'input' must be a non-empty string or a list of them", "input")
        req = ModelRequest(model=body.model, keep_alive=body.keep_alive)
        try:
            vectors, n_tokens, _, _ = await service.embed(req, inputs, True)
        except EngineError as exc:
            return api_error(exc)
        if body.dimensions:
            vectors = [_shorten(v, body.dimensions) for v in vectors]
        data = [{"object": "embedding", "index": i,
                 "embedding": _base64(v) if body.encoding_format == "base64" else v}
                for i, v in enumerate(vectors)]
        return JSONResponse({"object": "list", "data": data, "model": body.model,
                             "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})

    async def rerank(body: RerankBody,
                     shape: Callable[[list[dict[str, Any]], int], dict[str, Any]]) -> Response:
        """Rank the documents; `shape` makes the answer of the results and prompt tokens."""
        body.log_extras()
        try:
            texts = body.texts()
            req = ModelRequest(model=body.model, keep_alive=body.keep_alive)
            scores, n_tokens, _, _ = await service.rerank(req, body.query, texts)
        except (ApiError, EngineError) as exc:
            return api_error(exc)
        return JSONResponse(shape(ranked(scores, texts, body.top_n, body.return_documents),
                                  n_tokens))

    # llama-server's paths for one answer: Jina's shape with OpenAI's `usage`
    @api.post("/v1/rerank", response_model=None)
    @api.post("/v1/reranking", response_model=None)
    @api.post("/rerank", response_model=None)
    async def rerank_v1(body: RerankBody) -> Response:
        return await rerank(body, lambda results, n: {
            "model": body.model, "object": "list", "results": results,
            "usage": {"prompt_tokens": n, "total_tokens": n}})

    @api.post("/v2/rerank", response_model=None)
    async def rerank_v2(body: RerankBody) -> Response:  # Cohere's
        return await rerank(body, lambda results, n: {
            "id": str(uuid.uuid4()), "results": results,
            "meta": {"api_version": {"version": "2"}, "billed_units": {"search_units": 1},
                     "tokens": {"input_tokens": n, "output_tokens": 0}}})

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_object(m) for m in service.store.list()]}

    @api.get("/v1/models/{model_id:path}", response_model=None)
    async def model(model_id: str) -> Response:
        try:
            _, manifest = service.store.get(model_id)
        except StoreError as exc:
            status = 400 if isinstance(exc, ValueError) else 404
            return error(status, f"The model '{model_id}' does not exist" if status == 404
                         else str(exc), "model",
                         "model_not_found" if status == 404 else None)
        return JSONResponse(model_object(manifest))

    return api
