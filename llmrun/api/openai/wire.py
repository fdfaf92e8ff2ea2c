"""OpenAI's request bodies, in the order of its reference, and how each becomes internal
requests (`to_requests`: one per choice); llama.cpp's extras (`LlamaExtras`) are accepted as
extra body fields, as llama-server does."""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field

from llmrun.api.dialect import http_status
from llmrun.api.images import from_audio, from_url
from llmrun.api.openai.errors import ApiError
from llmrun.request import (
    MAX_THINK_BUDGET,
    ChatRequest,
    EngineError,
    Format,
    KeepAlive,
    Message,
    NamedTool,
    Options,
    Think,
    Tool,
    ToolCall,
    ToolChoice,
)

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
    keep_alive: KeepAlive = None
    # llama-server's structured output: a grammar (GBNF, or llguidance's Lark) or a JSON
    # schema the output must match; one of them, or response_format, per request
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None


class ContentPart(Body):
    type: str
    text: str | None = None
    image_url: dict[str, Any] | str | None = None  # {"url": ..., "detail": ...}
    input_audio: dict[str, Any] | None = None  # {"data": base64, "format": "wav" | "mp3"}


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
    # llama-server's: variables for the chat template (over the runner's own thinking
    # switch), and the most tokens a thought may take (-1: no limit; 0: no thought)
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_budget: int | None = Field(None, ge=-1, le=MAX_THINK_BUDGET)

    def to_requests(self) -> list[ChatRequest]:
        """One internal request per choice (`n`)."""
        return chat_requests(self)


def _one_error_for_a_bad_item(value: Any) -> Any:
    """A prompt or input list holding an item that no alternative takes (null, an object, a
    list inside a list of lists) as one error, not one per item and alternative: pydantic
    reports each item against each of the union's four shapes, and 32,000 nulls made 96,001
    errors that took the event loop about a second to collect and word (the body's value
    bound, daemon/jsonshape.py, admits that many). Anything else goes to pydantic as it is."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            bad = item is None or isinstance(item, dict) or (
                isinstance(item, list)
                and any(x is None or isinstance(x, dict | list | str) for x in item))
            if bad:
                raise ValueError(f"item {i} is not a string, a token id or a list of token "
                                 "ids")
    return value


# what /v1/completions' `prompt` and /v1/embeddings' `input` take
PromptList = Annotated[str | list[str] | list[int] | list[list[int]],
                       BeforeValidator(_one_error_for_a_bad_item)]


class CompletionBody(LlamaExtras):
    """POST /v1/completions (legacy)."""

    model: str
    prompt: PromptList
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

    def to_requests(self) -> tuple[list[str], list[ChatRequest]]:
        """The prompts, and one internal request per prompt and choice."""
        return completion_requests(self)


class EmbeddingBody(Body):
    input: PromptList
    model: str
    dimensions: int | None = Field(None, ge=1)
    encoding_format: Literal["float", "base64"] = "float"
    user: str | None = None
    keep_alive: KeepAlive = None


class RerankBody(Body):
    """POST /v1/rerank (llama-server's and Jina's shape; also /rerank, /v1/reranking) and
    /v2/rerank (Cohere's): documents are strings or objects with a `text`."""

    model: str
    query: str
    documents: list[Any]
    top_n: int | None = Field(None, ge=1)
    return_documents: bool = False
    keep_alive: KeepAlive = None

    def texts(self) -> list[str]:
        """The documents' texts, in order; ApiError (400) naming the first that is neither a
        string nor an object with a string `text`."""
        out = []
        for i, doc in enumerate(self.documents):
            text = doc.get("text") if isinstance(doc, dict) else doc
            if not isinstance(text, str):
                raise ApiError(400, f"'documents[{i}]' must be a string or an object with a "
                                    "string 'text'", f"documents.{i}")
            out.append(text)
        return out


# -- translation to the internal request ----------------------------------------------------


def _options(body: ChatCompletionBody | CompletionBody, max_tokens: int | None) -> Options:
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    values: dict[str, Any] = {  # (each checked by Options)
        "temperature": body.temperature, "top_p": body.top_p, "num_predict": max_tokens,
        "stop": stop, "seed": body.seed, "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty, "num_ctx": body.num_ctx,
        "top_k": body.top_k, "min_p": body.min_p, "repeat_penalty": body.repeat_penalty,
        "typical_p": body.typical_p, "repeat_last_n": body.repeat_last_n,
    }
    return Options(**{k: v for k, v in values.items() if v is not None})


def _content(content: str | list[ContentPart] | None, param: str,
             role: str) -> tuple[str, list[str], list[str]]:
    """A message's text (its text parts joined), images (its `image_url` parts, in order)
    and sound files (its `input_audio` parts). Only user messages carry them, as at OpenAI:
    elsewhere one is a 400, never dropped."""
    if content is None or isinstance(content, str):
        return content or "", [], []
    texts: list[str] = []
    pictures: list[str] = []
    sounds: list[str] = []
    for j, part in enumerate(content):
        if part.type == "text":
            texts.append(part.text or "")
        elif part.type == "image_url":
            if role != "user":
                raise ApiError(400, "Image URLs are only allowed for messages with role "
                                    f"'user', but this message with role '{role}' contains "
                                    "an image URL.", f"{param}[{j}]")
            pictures.append(_image(part, f"{param}[{j}].image_url"))
        elif part.type == "input_audio":
            where = f"{param}[{j}].input_audio"
            if role != "user":
                raise ApiError(400, "Audio content parts are only allowed for messages with "
                                    f"role 'user', not '{role}'", where)
            audio = part.input_audio if isinstance(part.input_audio, dict) else {}
            try:
                sounds.append(from_audio(audio.get("data"), audio.get("format"), where))
            except EngineError as exc:
                raise ApiError(http_status(exc), exc.message, where) from None
        elif part.type != "refusal":
            raise ApiError(400, f"content parts of type '{part.type}' are not supported",
                           f"{param}[{j}].type")
    return "\n".join(texts), pictures, sounds


def _image(part: ContentPart, param: str) -> str:
    """An `image_url` part's image: `{"url": ..., "detail": ...}` (`detail` is for OpenAI's
    tiling; the model's projector sizes images itself), or the URL alone as some clients
    send it."""
    url = part.image_url.get("url") if isinstance(part.image_url, dict) else part.image_url
    try:
        return from_url(url, param)
    except EngineError as exc:
        raise ApiError(http_status(exc), exc.message, param) from None


def tool_arguments(raw: Any, param: str) -> dict[str, Any]:
    """A call's arguments (a JSON object, or its text) as a dict; 400 naming `param`."""
    if isinstance(raw, dict):
        return raw
    if not isinstance(raw, str):
        raise ApiError(400, "'arguments' must be a JSON string", param)
    try:
        value = json.loads(raw) if raw.strip() else {}
    except json.JSONDecodeError:
        raise ApiError(400, "function arguments must be a JSON object", param) from None
    if not isinstance(value, dict):
        raise ApiError(400, "function arguments must be a JSON object", param)
    return value


def _messages(body: ChatCompletionBody) -> list[Message]:
    out: list[Message] = []
    names: dict[str, str] = {}  # tool call id -> function name, to name tool results
    for i, m in enumerate(body.messages):
        param = f"messages[{i}].content"
        text, pictures, sounds = _content(m.content, param, m.role)
        if m.role in ("system", "developer"):
            out.append(Message(role="system", content=text))
        elif m.role == "user":
            out.append(Message(role="user", content=text, images=pictures, audio=sounds))
        elif m.role == "assistant":
            calls = []
            for j, c in enumerate(m.tool_calls or []):
                args = tool_arguments(c.function.arguments,
                                  f"messages[{i}].tool_calls[{j}].function.arguments")
                call_id = c.id or f"call_{i}_{j}"
                names[call_id] = c.function.name
                calls.append(ToolCall(id=call_id, name=c.function.name, arguments=args))
            out.append(Message(role="assistant", content=text, tool_calls=calls))
        elif m.role == "tool":
            if not m.tool_call_id:
                raise ApiError(400, "a 'tool' message needs 'tool_call_id'",
                               f"messages[{i}].tool_call_id")
            out.append(Message(role="tool", content=text, tool_call_id=m.tool_call_id,
                               name=m.name or names.get(m.tool_call_id)))
        else:  # "function": the deprecated predecessor of "tool"
            out.append(Message(role="tool", content=text, name=m.name))
    return out


def _tools(body: ChatCompletionBody) -> tuple[list[Tool], ToolChoice]:
    tools = [Tool(name=t.function.name, description=t.function.description or "",
                  parameters=t.function.parameters or {"type": "object", "properties": {}})
             for t in body.tools or []]
    choice: ToolChoice
    if isinstance(body.tool_choice, NamedToolChoice):
        name = body.tool_choice.function.name
        if name not in {t.name for t in tools}:
            raise ApiError(400, f"tool_choice names the function '{name}', which is not in "
                                "'tools'", "tool_choice")
        choice = NamedTool(name=name)
    else:
        choice = body.tool_choice or "auto"
        if choice == "required" and not tools:
            raise ApiError(400, "tool_choice 'required' needs 'tools'", "tool_choice")
    return tools, choice


def _constraint(body: ChatCompletionBody | CompletionBody) -> tuple[Format, str | None]:
    """(format, raw grammar) from `response_format` (chat only) or llama-server's `grammar`
    / `json_schema`; asking for two of them is ambiguous, as llama-server also says."""
    rf = getattr(body, "response_format", None)
    given = [name for name, value in (("response_format", rf and rf.type != "text"),
                                      ("json_schema", body.json_schema is not None),
                                      ("grammar", body.grammar is not None)) if value]
    if len(given) > 1:
        raise ApiError(400, f"give one of {' and '.join(repr(g) for g in given)}: each "
                            "constrains the whole output", given[1])
    if body.grammar is not None:
        return None, body.grammar
    if body.json_schema is not None:
        return body.json_schema, None
    if rf is None or rf.type == "text":
        return None, None
    if rf.type == "json_object":
        return "json", None  # compiled as any JSON object, as OpenAI's JSON mode answers
    if rf.json_schema is None:
        raise ApiError(400, "response_format of type 'json_schema' needs 'json_schema'",
                       "response_format.json_schema")
    return rf.json_schema.schema_ or "json", None


def _strict(body: ChatCompletionBody, choice: ToolChoice) -> bool:
    """Whether every schema this request enforces was marked `strict: true`. OpenAI's
    default is not strict: a keyword structured output cannot enforce is then skipped with
    a logged warning, where a strict schema gets a 400 naming it. Forced tools (required:
    all, named: that one) and a `json_schema` response format count; llama-server's
    `json_schema` field has no such flag and is strict, as `format` is in Ollama's API."""
    flags: list[bool] = []
    if isinstance(choice, NamedTool) or choice == "required":
        flags += [t.function.strict is True for t in body.tools or []
                  if not isinstance(choice, NamedTool) or t.function.name == choice.name]
    rf = body.response_format
    if rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
        flags.append(rf.json_schema.strict is True)
    return all(flags)


def _think(body: ChatCompletionBody) -> Think:
    """`reasoning_effort` (OpenAI), or `chat_template_kwargs.enable_thinking` (llama-server);
    for a model that cannot think both are ignored, as OpenAI ignores them for such models."""
    effort = body.reasoning_effort
    if effort is not None:
        return False if effort == "none" or effort == "minimal" else effort
    enable = (body.chat_template_kwargs or {}).get("enable_thinking")
    return enable if isinstance(enable, bool) else None


def chat_requests(body: ChatCompletionBody) -> list[ChatRequest]:
    """One internal request per choice (`n`)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise ApiError(400, "'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
    tools, choice = _tools(body)
    fmt, grammar = _constraint(body)
    base = ChatRequest(
        model=body.model,
        messages=_messages(body),
        options=_options(body, body.max_completion_tokens or body.max_tokens),
        stream=bool(body.stream),
        keep_alive=body.keep_alive,
        format=fmt,
        format_strict=_strict(body, choice),
        grammar=grammar,
        logprobs=(body.top_logprobs or 0) if body.logprobs else None,
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls is not False,
        think=_think(body),
        think_budget=_budget(body),
        template_kwargs=body.chat_template_kwargs or {},
    )
    return _replicate(base, body.n)


def _budget(body: ChatCompletionBody) -> int | None:
    """llama-server's `reasoning_budget` (its --reasoning-budget, per request): -1 none."""
    budget = body.reasoning_budget
    return None if budget is None or budget < 0 else budget


def _replicate(base: ChatRequest, n: int) -> list[ChatRequest]:
    """n copies; with a fixed seed, choice i samples with seed + i (else all n would match)."""
    out = [base]
    for i in range(1, n):
        seed = base.options.seed
        opts = base.options.model_copy(update={"seed": seed + i}) if seed is not None \
            and seed >= 0 else base.options
        out.append(base.model_copy(update={"options": opts}))
    return out


# -- completions ----------------------------------------------------------------------------


def completion_requests(body: CompletionBody) -> tuple[list[str], list[ChatRequest]]:
    """(prompt of each choice, request of each choice): choice p*n + j is prompt p's j-th."""
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError(400, "'best_of' other than 'n' is not supported", "best_of")
    raw = body.prompt
    if isinstance(raw, list) and raw and not isinstance(raw[0], str):
        raise ApiError(400, "prompts as token ids are not supported; send text", "prompt")
    prompts = [raw] if isinstance(raw, str) else list(raw)
    if not prompts:
        raise ApiError(400, "'prompt' is empty", "prompt")
    options = _options(body, body.max_tokens)
    fmt, grammar = _constraint(body)
    texts: list[str] = []
    reqs: list[ChatRequest] = []
    for prompt in prompts:
        base = ChatRequest(model=body.model, messages=[], prompt=str(prompt), options=options,
                           format=fmt, grammar=grammar,
                           stream=bool(body.stream), keep_alive=body.keep_alive,
                           logprobs=body.logprobs, suffix=body.suffix or None,
                           prompt_logprobs=body.logprobs if body.echo else None)
        for req in _replicate(base, body.n):
            texts.append(str(prompt))
            reqs.append(req)
    return texts, reqs
