"""JSON on the per-token paths (IPC frames, streamed chunks): orjson, with the standard library
for the few values orjson refuses.

orjson encodes a chunk about ten times faster than `json.dumps`, and every generated token
is encoded twice (runner -> daemon, daemon -> client) and decoded once. Where it refuses a
value the standard library accepts (an integer beyond 64 bits, nesting deeper than 255, a
non-string key) the standard library answers, so behaviour matches `json` except that a
non-finite float is written as null (valid JSON) rather than NaN/Infinity (which is not).
"""

from __future__ import annotations

import json
from typing import Any

import orjson


def dumps(obj: Any) -> bytes:
    """`obj` as compact UTF-8 JSON (no ASCII escaping)."""
    try:
        return orjson.dumps(obj)
    except TypeError:  # orjson.JSONEncodeError: a value only the standard library writes
        return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode()


def loads(data: bytes | bytearray | memoryview | str) -> Any:
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:  # NaN/Infinity literals and nesting orjson refuses
        return json.loads(bytes(data) if isinstance(data, memoryview) else data)
