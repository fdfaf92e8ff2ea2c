"""One sentence for a request that failed validation, naming the field; each dialect wraps
it in its own error shape."""

from __future__ import annotations

from fastapi.exceptions import RequestValidationError


def describe_validation_error(exc: RequestValidationError, quote_field: bool = True) -> str:
    errors = exc.errors()
    if not errors:
        return "invalid request"
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"invalid JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if not loc:
        return f"invalid request body: {first.get('msg')}"
    field = ".".join(loc)
    return f"invalid field '{field}': {first.get('msg')}" if quote_field \
        else f"{field}: {first.get('msg')}"
