"""Ollama's native API (`/api/*`): NDJSON streams, `{"error": ...}` bodies, nanosecond stats.

The modules, each leaning only on those before it: `errors` (the error shape), `wire` (the
request bodies and `to_request`), `stream` (answering whole or as NDJSON), `routes`.
"""

from __future__ import annotations

from llmrun.api.dialect import (
    Dialect,
    plain_engine_error,
    plain_error_body,
    plain_validation_error,
)
from llmrun.api.ollama.routes import router, store_router

DIALECT = Dialect(
    name="ollama", prefixes=("/",),
    routers=lambda backends: [router(backends.service),
                              store_router(backends.store, backends.devices)],
    error_body=plain_error_body, validation_error=plain_validation_error,
    engine_error=plain_engine_error)

__all__ = ["DIALECT", "router", "store_router"]
