"""OpenAI's request bodies, in the order of its reference; llama.cpp's extras
(`LlamaExtras`) are accepted as extra body fields, as llama-server does."""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)

MAX_N = 16


class Body(BaseModel):
    """Unknown fields are accepted (clients send vendor extras) and logged."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    def log_extras(self) -> None:
        if self.model_extra:
            log.info("ignoring unknown field(s): %s", ", ".join(sorted(self.model_extra)))


class LlamaExtras(Body):
    """llama.cpp options that OpenAI does not have, accepted as extra body fields."""

    num_ctx: int | None = Field(None, ge=1)
    top_k: int | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repeat_penalty: float | None = Field(None, ge=0.0)
    typical_p: float | None = Field(None, ge=0.0, le=1.0)
    repeat_last_n: int | None = Field(None, ge=-1)
    keep_alive: str | float | None = None
    # llama-server's structured output: a grammar (GBNF, or llguidance's Lark) or a JSON
    # schema the output must match; one of them, or response_format, per request
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None


class ContentPart(Body):
    type: str
    text: str | None = None
    image_url: dict[str, Any] | str | None = None  # {"url": ..., "detail": ...}


class FunctionCall(Body):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(Body):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None


class FunctionDef(Body):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(Body):
    type: Literal["function"] = "function"
    function: FunctionDef


class FunctionName(Body):
    name: str


class NamedToolChoice(Body):
    type: Literal["function"] = "function"
    function: FunctionName


class StreamOptions(Body):
    include_usage: bool = False


class JsonSchema(Body):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class ChatCompletionBody(LlamaExtras):
    """POST /v1/chat/completions, in the order of OpenAI's reference."""

    messages: list[ChatMessage] = Field(min_length=1)
    model: str
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # accepted, not applied
    logprobs: bool | None = None
    max_completion_tokens: int | None = Field(None, ge=1)
    max_tokens: int | None = Field(None, ge=1)
    n: int = Field(1, ge=1, le=MAX_N)
    parallel_tool_calls: bool | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    response_format: ResponseFormat | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    tools: list[ToolDef] | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    user: str | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    # llama-server's way to pass template variables; `enable_thinking` is the one used here
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionBody(LlamaExtras):
    """POST /v1/completions (legacy)."""

    model: str
    prompt: str | list[str] | list[int] | list[list[int]]
    best_of: int | None = Field(None, ge=1)
    echo: bool | None = False
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    logprobs: int | None = Field(None, ge=0, le=20)
    max_tokens: int | None = Field(None, ge=0)  # 0 with echo: score the prompt only
    n: int = Field(1, ge=1, le=MAX_N)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    user: str | None = None


class EmbeddingBody(Body):
    input: str | list[str] | list[int] | list[list[int]]
    model: str
    dimensions: int | None = Field(None, ge=1)
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    keep_alive: str | float | None = None
