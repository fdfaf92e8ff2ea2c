"""OpenAI's error shape: `{"error": {"message", "type", "param", "code"}}`, for request
errors, engine errors and bodies that do not validate."""

from __future__ import annotations

from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from llmrun.api.dialect import http_status
from llmrun.request import EngineError


class ApiError(Exception):
    """A request error in OpenAI's terms."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _type_for(status: int) -> str:
    return {401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
            429: "rate_limit_error"}.get(status, "invalid_request_error" if status < 500
                                          else "server_error")


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _type_for(status), "param": param,
                      "code": code}}


def error(status: int, message: str, param: str | None = None,
          code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=headers)


def api_error(exc: ApiError | EngineError) -> JSONResponse:
    if isinstance(exc, ApiError):
        return error(exc.status, exc.message, exc.param, exc.code)
    status, message, param, code, headers = engine_error_fields(exc)
    return error(status, message, param, code, headers)


def engine_error_fields(exc: EngineError) -> tuple[int, str, str | None, str | None,
                                             dict[str, str] | None]:
    code = {"not_found": "model_not_found", "busy": "server_overloaded",
            "insufficient_memory": "insufficient_memory"}.get(exc.code)
    param = "model" if code == "model_not_found" else None
    headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
    return http_status(exc), exc.message, param, code, headers


def validation_error(exc: RequestValidationError) -> JSONResponse:
    """A request body that does not fit the models below: 400 naming the parameter."""
    errors = exc.errors()
    if not errors:
        return error(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return error(400, "We could not parse the JSON body of your request: "
                          f"{first.get('ctx', {}).get('error', first.get('msg'))}")
    loc = [p for p in first.get("loc", ()) if p != "body"]
    # union members appear in the location as type names ("str", "list[...]"): drop them
    param = ".".join(str(p) for p in loc if isinstance(p, int) or not _is_type_tag(str(p)))
    if first.get("type") == "missing":
        return error(400, f"Missing required parameter: '{param}'.", param or None)
    return error(400, f"Invalid value for '{param}': {first.get('msg')}", param or None)


def _is_type_tag(part: str) -> bool:
    """Pydantic names union members in error locations ("str", "list[str]", "ChatMessage");
    OpenAI's parameters are all lower-case words."""
    return part in {"str", "int", "float", "bool", "list", "dict"} or "[" in part \
        or part[:1].isupper()



def invalid_value(exc: ValidationError) -> JSONResponse:
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"])
    return error(400, f"Invalid value for '{param}': {first['msg']}", param or None)
