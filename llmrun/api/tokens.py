"""llama-server's token utilities, for a store of many models: `POST /tokenize`,
`/detokenize` and `/apply-template` take the `model` they apply to (llama-server has only
one). `/apply-template` takes an OpenAI chat request and answers with the prompt exactly as
the model would read it (its template, tools and the Modelfile's system prompt included).
Errors take the `{"error": message}` shape of Ollama's paths (`DIALECT`)."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, ValidationError

from llmrun.api.dialect import (
    Dialect,
    http_status,
    plain_engine_error,
    plain_error_body,
    plain_validation_error,
)
from llmrun.api.disconnect import unless_disconnected
from llmrun.api.images import fetched
from llmrun.api.openai.errors import ApiError
from llmrun.api.openai.wire import ChatCompletionBody, chat_requests
from llmrun.request import EngineError, KeepAlive, ModelRequest
from llmrun.server import work
from llmrun.server.service import Service


class TokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    content: str
    add_special: bool = False
    with_pieces: bool = False
    keep_alive: KeepAlive = None


class DetokenizeBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    tokens: list[int]
    keep_alive: KeepAlive = None


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


def router(service: Service) -> APIRouter:
    api = APIRouter()

    async def ask(request: Request, answer: Awaitable[dict[str, Any]]
                  ) -> dict[str, Any] | Response:
        try:
            return await unless_disconnected(request, answer)
        except EngineError as exc:
            return _error(http_status(exc), exc.message)

    @api.post("/tokenize", response_model=None)
    async def tokenize(body: TokenizeBody, request: Request) -> Response:
        req = ModelRequest(model=body.model, keep_alive=body.keep_alive)
        reply = await ask(request, service.tokens(req, work.Tokenizing(body.content,
                                                                      body.add_special)))
        if isinstance(reply, Response):
            return reply
        tokens = reply["tokens"]
        if body.with_pieces:
            return JSONResponse({"tokens": [{"id": t, "piece": p}
                                            for t, p in zip(tokens, reply["pieces"],
                                                            strict=True)]})
        return JSONResponse({"tokens": tokens})

    @api.post("/detokenize", response_model=None)
    async def detokenize(body: DetokenizeBody, request: Request) -> Response:
        req = ModelRequest(model=body.model, keep_alive=body.keep_alive)
        reply = await ask(request, service.tokens(req, work.Detokenizing(body.tokens)))
        return reply if isinstance(reply, Response) else JSONResponse(reply)

    @api.post("/apply-template", response_model=None)
    async def apply_template(body: ChatCompletionBody, request: Request) -> Response:
        try:
            req = await fetched(chat_requests(body)[0])  # images count: the runner reads them
        except ApiError as exc:
            return _error(exc.status, exc.message)
        except EngineError as exc:
            return _error(http_status(exc), exc.message)
        except ValidationError as exc:
            return _error(400, str(exc.errors()[0]["msg"]))
        reply = await ask(request, service.rendered(req))
        if isinstance(reply, Response):
            return reply
        return JSONResponse({"prompt": reply["prompt"], "prompt_tokens": len(reply["tokens"])})

    return api


# llama-server's routes, outside any prefix of a dialect, answer errors as it does
DIALECT = Dialect(
    name="llama-server", prefixes=("/tokenize", "/detokenize", "/apply-template"),
    routers=lambda backends: [router(backends.service)],
    error_body=plain_error_body, validation_error=plain_validation_error,
    engine_error=plain_engine_error)
