"""Keep-alive durations as Ollama's API writes them (`5m`, `1h30m`, `30s`, seconds, negative
for forever) and the `expires_at` that /api/ps shows for them."""

from __future__ import annotations

import math
import re
from datetime import UTC, datetime, timedelta

from llmrun import config

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse(value: str | float | int | None) -> float:
    """Seconds to keep a model loaded: `5m`, `1h30m`, `30s`, a number of seconds;
    negative means forever (math.inf), 0 means unload once idle."""
    if value is None:
        value = config.keep_alive()
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = value.strip().lower()
        try:
            seconds = float(text)
        except ValueError:
            sign = -1.0 if text.startswith("-") else 1.0
            body = text[1:] if text[:1] in "+-" else text
            parts = _DURATION.findall(body)
            if not parts or "".join(n + u for n, u in parts) != body:
                raise ValueError(f"invalid keep_alive duration {value!r}") from None
            seconds = sign * sum(float(n) * _UNITS[u] for n, u in parts)
    if math.isnan(seconds):
        raise ValueError(f"invalid keep_alive duration {value!r}")
    return math.inf if seconds < 0 else seconds


def expires_at_iso(remaining: float) -> str:
    """The moment `remaining` seconds from now (inf: forever), as Ollama's /api/ps shows it."""
    if math.isinf(remaining):
        return "2318-01-01T00:00:00Z"  # "forever", far in the future as Ollama shows it
    when = datetime.now(UTC) + timedelta(seconds=max(0.0, remaining))
    return when.isoformat().replace("+00:00", "Z")
