"""The dialects the daemon speaks, listed once: their routes, and the shape of an error
for any path (`error_body`), which refusals given before a route runs use too."""

from __future__ import annotations

from typing import Any

from llmrun.api import anthropic, ollama, openai, tokens
from llmrun.api.dialect import Dialect, dialect_for

# in the order their routes are added; a path's dialect is the longest prefix it matches
DIALECTS: tuple[Dialect, ...] = (ollama.DIALECT, anthropic.DIALECT, openai.DIALECT,
                                 tokens.DIALECT)


def dialect(path: str) -> Dialect:
    return dialect_for(DIALECTS, path)


def error_body(path: str, status: int, message: str, code: str | None = None) -> dict[str, Any]:
    """An error body in the shape of the dialect the path belongs to. `code` is OpenAI's."""
    return dialect(path).error_body(status, message, code)
