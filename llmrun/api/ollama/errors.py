"""Ollama's error shape, `{"error": message}` (with `Retry-After` when the engine gives one),
and the status a store failure answers with."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from llmrun.store import CreateError, DigestError, InvalidName, ModelNotFound


def error(status: int, message: str, retry_after: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after else None
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def store_status(exc: BaseException | None) -> int:
    if isinstance(exc, ModelNotFound):
        return 404
    if isinstance(exc, InvalidName | DigestError | CreateError):
        return 400
    return 500
