"""The daemon's default keep-alive (LLMRUN_KEEP_ALIVE) and the `expires_at` that /api/ps
shows for a keep-alive. A request's own is parsed where it enters (request.KeepAlive)."""

from __future__ import annotations

import math
from datetime import UTC, datetime, timedelta

from llmrun import config
from llmrun.request import duration_seconds


def seconds(requested: float | None) -> float:
    """A request's keep-alive in seconds (math.inf: forever), LLMRUN_KEEP_ALIVE where it names
    none."""
    return duration_seconds(config.keep_alive()) if requested is None else requested


def expires_at_iso(remaining: float) -> str:
    """The moment `remaining` seconds from now (inf: forever), as Ollama's /api/ps shows it."""
    if math.isinf(remaining):
        return "2318-01-01T00:00:00Z"  # "forever", far in the future as Ollama shows it
    when = datetime.now(UTC) + timedelta(seconds=max(0.0, remaining))
    return when.isoformat().replace("+00:00", "Z")
