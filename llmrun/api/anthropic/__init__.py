"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`): what Claude Code
and the official `anthropic` SDKs speak.

Content blocks become the internal `Message`s (text flattened, `image` blocks into
`Message.images` (user turns and tool results only; api/images.py), `tool_use` into
`Message.tool_calls`, `tool_result` into `tool` turns, `thinking` dropped, every `system`
part folded into one leading system message); the answer goes back as content blocks, or as
Anthropic's named SSE events. Errors here always take Anthropic's shape,
`{"type": "error", "error": {"type": ..., "message": ...}}`, request validation included
(this package's `DIALECT` tells the daemon so for every path under `/v1/messages`).

The modules, each leaning only on those before it: `errors` (the error shape), `wire` (the
request bodies and `to_request`), `stream` (answering whole or as SSE), `routes`.

Usage follows Anthropic's arithmetic: `input_tokens + cache_read_input_tokens` is the whole
prompt, the second part being what the slot's KV cache already held (prefix reuse), so a
client that sums them (Claude Code's context meter does) sees the true prompt length.
"""


from __future__ import annotations

from llmrun.api.anthropic.errors import error_body, uncaught_engine_error, validation_error
from llmrun.api.anthropic.routes import router
from llmrun.api.anthropic.wire import CountBody, MessagesBody
from llmrun.api.dialect import Dialect

DIALECT = Dialect(
    name="anthropic", prefixes=("/v1/messages",),
    routers=lambda backends: [router(backends.service)],
    error_body=lambda status, message, _: error_body(status, message),
    validation_error=validation_error, engine_error=uncaught_engine_error)

__all__ = ["DIALECT", "CountBody", "MessagesBody", "router"]
