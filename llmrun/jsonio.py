"""JSON on the per-token paths (IPC frames, streamed chunks): orjson, with the standard library
for the few values orjson refuses.

orjson encodes a chunk about ten times faster than `json.dumps`, and every generated token
is encoded twice (runner -> daemon, daemon -> client) and decoded once. Where it refuses a
value the standard library accepts (an integer beyond 64 bits, nesting deeper than 255, a
non-string key) the standard library answers, so behaviour matches `json` except that a
non-finite float is written as null (valid JSON) rather than NaN/Infinity (which is not).
The daemon-runner messages are dataclasses (protocol.py), which orjson writes as objects: the
fallback writes them the same way.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import orjson


def dumps(obj: Any) -> bytes:
    """`obj` as compact UTF-8 JSON (no ASCII escaping)."""
    try:
        return orjson.dumps(obj, default=_model)
    except TypeError:  # orjson.JSONEncodeError: a value only the standard library writes
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False,
                          default=_fields).encode()


def _model(value: Any) -> Any:
    """A pydantic model (a protocol message's typed field) as its model_dump."""
    if hasattr(value, "model_dump") and not isinstance(value, type):
        return value.model_dump()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def _fields(value: Any) -> Any:
    """A dataclass's fields, for the standard library (orjson writes dataclasses itself), and
    a pydantic model's dump."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if hasattr(value, "model_dump") and not isinstance(value, type):
        return value.model_dump()
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:  # NaN/Infinity literals and nesting orjson refuses
        return json.loads(bytes(data) if isinstance(data, memoryview) else data)
