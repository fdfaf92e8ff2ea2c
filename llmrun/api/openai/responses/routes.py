"""The Responses API's routes: `/v1/responses` (create, get, delete, input items) and
`/v1/responses/input_tokens`."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from llmrun.api.disconnect import unless_disconnected
from llmrun.api.events import OutputStream, first_event, first_output
from llmrun.api.images import fetched
from llmrun.api.openai.errors import ApiError, api_error, error
from llmrun.api.openai.responses.stream import KEEPALIVE_SECONDS, Answer, collect, stream
from llmrun.api.openai.responses.wire import ResponsesBody, ToolMap
from llmrun.request import (
    ChatRequest,
    EngineError,
)
from llmrun.server.responsestore import NotStored, ResponseStore
from llmrun.server.service import Service

log = logging.getLogger(__name__)


def _not_stored(response_id: str, param: str | None = None) -> JSONResponse:
    return error(404, f"Response with id '{response_id}' not found.", param)


def router(service: Service, store: ResponseStore) -> APIRouter:
    api = APIRouter()

    def prepare(body: ResponsesBody) -> tuple[ChatRequest, ToolMap, list[dict[str, Any]]]:
        body.log_extras()
        earlier = store.conversation(body.previous_response_id) \
            if body.previous_response_id else []
        req, mapping = body.to_request(earlier)
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
            # over the context) is still an HTTP error; past KEEPALIVE_SECONDS the stream
            # opens and keeps the connection alive while the prompt is read
            first = await first_event(
                first_output(events), events.aclose, (EngineError, ApiError), api_error,
                lambda first: asyncio.wait({first}, timeout=KEEPALIVE_SECONDS))
            if isinstance(first, Response):
                return first
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

