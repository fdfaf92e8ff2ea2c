"""Anthropic's routes: `/v1/messages` and `/v1/messages/count_tokens`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from llmrun.api.anthropic.errors import engine_error
from llmrun.api.anthropic.stream import respond
from llmrun.api.anthropic.wire import CountBody, MessagesBody
from llmrun.api.disconnect import unless_disconnected
from llmrun.api.images import fetched
from llmrun.request import EngineError
from llmrun.server.service import Service


def router(service: Service) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/messages", response_model=None)
    async def messages(body: MessagesBody, request: Request) -> Response:
        req = await fetched(body.to_request())
        # A client that gives up (Esc in Claude Code) during prefill or a non-streamed
        # answer cancels the work; once streaming, Starlette cancels the stream itself.
        return await unless_disconnected(request, respond(service, body, req))

    @api.post("/v1/messages/count_tokens", response_model=None)
    async def count_tokens(body: CountBody, request: Request) -> Response:
        req = await fetched(body.to_request())  # images count: the runner reads them
        try:
            n = await unless_disconnected(request, service.count_tokens(req))
            if isinstance(n, Response):
                return n
        except EngineError as exc:
            return engine_error(exc, body.model)
        return JSONResponse({"input_tokens": n})

    return api
