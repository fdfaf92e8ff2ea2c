"""OpenAI's API: `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`, `/v1/models`;
reranking (`/v1/rerank`, `/rerank`, `/v1/reranking`, Cohere's `/v2/rerank`) in its error shape.

Streams are server-sent events (`data: {...}` frames ending with `data: [DONE]`); errors are
`{"error": {"message", "type", "param", "code"}}`. Requests translate straight into the
internal `ChatRequest`; `n` choices run as n concurrent requests (parallel sequences in the
engine). llama.cpp sampling extras (`top_k`, `min_p`, `repeat_penalty`, `typical_p`,
`repeat_last_n`, `num_ctx`) are accepted as extra body fields, as llama-server does.

The modules, each leaning only on those before it: `errors` (the error shape), `wire` (the
request bodies and their `to_requests`), `stream` (running the choices and answering whole
or as SSE), `routes`. `responses`, the Responses API (`/v1/responses`), is OpenAI's too: it
shares the error shape and the body's llama.cpp extras, and the record below mounts it.
"""

from __future__ import annotations

from llmrun.api.dialect import Dialect
from llmrun.api.openai import responses
from llmrun.api.openai.errors import ApiError, api_error, error, error_body, validation_error
from llmrun.api.openai.routes import model_object, router
from llmrun.api.openai.stream import FINGERPRINT, FINISH_REASONS, Choices, sse
from llmrun.api.openai.wire import (
    MAX_N,
    ChatCompletionBody,
    CompletionBody,
    EmbeddingBody,
    RerankBody,
    chat_requests,
    completion_requests,
)

DIALECT = Dialect(
    name="openai", prefixes=("/v1/", "/rerank", "/v2/rerank"),
    routers=lambda backends: [router(backends.service),
                              responses.router(backends.service, backends.responses)],
    error_body=lambda status, message, code: error_body(status, message, None, code),
    validation_error=validation_error, engine_error=api_error)

__all__ = [
    "DIALECT",
    "FINGERPRINT",
    "FINISH_REASONS",
    "MAX_N",
    "ApiError",
    "ChatCompletionBody",
    "Choices",
    "CompletionBody",
    "EmbeddingBody",
    "RerankBody",
    "api_error",
    "chat_requests",
    "completion_requests",
    "error",
    "error_body",
    "model_object",
    "router",
    "sse",
    "validation_error",
]
