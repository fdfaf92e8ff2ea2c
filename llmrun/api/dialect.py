"""What each dialect offers the daemon: one `Dialect` record.

A record names the paths the dialect answers (`prefix`), builds its routes from the daemon's
`Backends`, and says how it words an error (the body of any status, a request body that
does not validate, an engine error no route caught). The daemon lists the records once and
picks the record whose prefix is the longest match for a path, so refusals given before any
route runs (keys, limits, unknown routes) come in the caller's shape.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from llmrun.api.validation import describe_validation_error
from llmrun.request import EngineError
from llmrun.server.fit import Device
from llmrun.server.responsestore import ResponseStore
from llmrun.server.service import Service
from llmrun.store import Store


@dataclass(frozen=True)
class Backends:
    """What the routes of every dialect are built on."""

    service: Service
    store: Store
    devices: Callable[[], list[Device]]  # the devices as last listed (no new listing)
    responses: ResponseStore  # stored answers of the Responses API


@dataclass(frozen=True)
class Dialect:
    """One API dialect as the daemon sees it."""

    name: str
    prefixes: tuple[str, ...]  # the paths it answers; ("/",) for the one that takes the rest
    routers: Callable[[Backends], list[APIRouter]]
    # (status, message, code): `code` is OpenAI's machine-readable one, others ignore it
    error_body: Callable[[int, str, str | None], dict[str, Any]]
    validation_error: Callable[[RequestValidationError], Response]
    engine_error: Callable[[EngineError], Response]


def dialect_for(dialects: tuple[Dialect, ...], path: str) -> Dialect:
    """The dialect with the longest prefix that `path` starts with (Anthropic's
    `/v1/messages` within OpenAI's `/v1/`)."""
    return max(((len(p), d) for d in dialects for p in d.prefixes if path.startswith(p)),
               key=lambda match: match[0])[1]


# The shape Ollama and llama-server's extras share: `{"error": message}`.


def plain_error_body(_: int, message: str, __: str | None = None) -> dict[str, Any]:
    return {"error": message}


def plain_validation_error(exc: RequestValidationError) -> Response:
    return JSONResponse({"error": describe_validation_error(exc)}, status_code=400)


def plain_engine_error(exc: EngineError) -> Response:
    return JSONResponse({"error": exc.message}, status_code=http_status(exc))


# An engine error's HTTP status, the same in every dialect (each words it its own way). 507
# for a model that does not fit is Ollama's; 502 and 504 are a gateway's, which a daemon
# fronting a remote model is.
HTTP_STATUS: dict[str, int] = {
    "invalid_request": 400, "prompt_too_long": 400, "not_found": 404, "too_large": 413,
    "busy": 503, "insufficient_memory": 507, "runner_failed": 500, "internal": 500,
    "upstream_failed": 502, "upstream_timeout": 504,
}


def http_status(exc: EngineError) -> int:
    """The status `exc` is answered with: its code's, or for a remote server's refusal the
    4xx that server gave."""
    if exc.code == "upstream_refused":
        status = exc.details.get("status")
        return status if isinstance(status, int) and 400 <= status < 500 else 502
    return HTTP_STATUS.get(exc.code, 500)
