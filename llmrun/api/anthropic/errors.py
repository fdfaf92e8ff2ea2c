"""Anthropic's error shape, `{"type": "error", "error": {"type", "message"}}`, for request
errors, engine errors (a prompt over the context worded as Claude Code recognises it) and
bodies that do not validate."""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from llmrun.api.dialect import http_status
from llmrun.api.validation import describe_validation_error
from llmrun.request import EngineError

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
    return error(http_status(exc), engine_message(exc, model), exc.retry_after)


def validation_error(exc: RequestValidationError) -> Response:
    return error(400, describe_validation_error(exc, quote_field=False))


def uncaught_engine_error(exc: EngineError) -> Response:
    """An engine error no route caught (an image that cannot be fetched, a body that cannot
    become a request): Anthropic's shape, without the prompt-too-long wording."""
    return error(http_status(exc), exc.message, exc.retry_after)
