"""OpenAI's API: `/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`, `/v1/models`.

Streams are server-sent events (`data: {...}` frames ending with `data: [DONE]`); errors are
`{"error": {"message", "type", "param", "code"}}`. Requests translate straight into the
internal `ChatRequest`; `n` choices run as n concurrent requests (parallel sequences in the
engine). llama.cpp sampling extras (`top_k`, `min_p`, `repeat_penalty`, `typical_p`,
`repeat_last_n`, `num_ctx`) are accepted as extra body fields, as llama-server does.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import secrets
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmrun import __version__
from llmrun.api.disconnect import unless_disconnected
from llmrun.request import (
    ChatRequest,
    Chunk,
    Done,
    EngineError,
    Format,
    Message,
    NamedTool,
    Options,
    Stats,
    Think,
    TokenLogprob,
    Tool,
    ToolCall,
    ToolChoice,
)
from llmrun.server.service import Service
from llmrun.store import Manifest, StoreError

log = logging.getLogger(__name__)

FINISH_REASONS = {"stop": "stop", "length": "length", "tool_calls": "tool_calls",
                  "cancel": "stop", "error": "stop"}
FINGERPRINT = f"llmrun-{__version__}"
MAX_N = 16


# -- errors ---------------------------------------------------------------------------------


class ApiError(Exception):
    """A request error in OpenAI's terms."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _type_for(status: int) -> str:
    return {401: "authentication_error", 403: "permission_error", 404: "invalid_request_error",
            429: "rate_limit_error"}.get(status, "invalid_request_error" if status < 500
                                          else "server_error")


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _type_for(status), "param": param,
                      "code": code}}


def error(status: int, message: str, param: str | None = None,
          code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status,
                        headers=headers)


def api_error(exc: ApiError | EngineError) -> JSONResponse:
    if isinstance(exc, ApiError):
        return error(exc.status, exc.message, exc.param, exc.code)
    status, message, param, code, headers = _engine_error(exc)
    return error(status, message, param, code, headers)


def _engine_error(exc: EngineError) -> tuple[int, str, str | None, str | None,
                                             dict[str, str] | None]:
    code = {"not_found": "model_not_found", "overloaded": "server_overloaded",
            "insufficient_memory": "insufficient_memory"}.get(exc.kind)
    if exc.status == 404 and code is None:
        code = "model_not_found"
    param = "model" if code == "model_not_found" else None
    retry = getattr(exc, "retry_after", None)
    headers = {"Retry-After": str(retry)} if retry else None
    return exc.status, exc.message, param, code, headers


def validation_error(exc: RequestValidationError) -> JSONResponse:
    """A request body that does not fit the models below: 400 naming the parameter."""
    errors = exc.errors()
    if not errors:
        return error(400, "invalid request")
    first = errors[0]
    if first.get("type") == "json_invalid":
        return error(400, "We could not parse the JSON body of your request: "
                          f"{first.get('ctx', {}).get('error', first.get('msg'))}")
    loc = [p for p in first.get("loc", ()) if p != "body"]
    # union members appear in the location as type names ("str", "list[...]"): drop them
    param = ".".join(str(p) for p in loc if isinstance(p, int) or not _is_type_tag(str(p)))
    if first.get("type") == "missing":
        return error(400, f"Missing required parameter: '{param}'.", param or None)
    return error(400, f"Invalid value for '{param}': {first.get('msg')}", param or None)


def _is_type_tag(part: str) -> bool:
    """Pydantic names union members in error locations ("str", "list[str]", "ChatMessage");
    OpenAI's parameters are all lower-case words."""
    return part in {"str", "int", "float", "bool", "list", "dict"} or "[" in part \
        or part[:1].isupper()


# -- wire models ----------------------------------------------------------------------------


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


# -- translation to the internal request ----------------------------------------------------


def _options(body: ChatCompletionBody | CompletionBody, max_tokens: int | None) -> Options:
    stop = [body.stop] if isinstance(body.stop, str) else body.stop
    values = {
        "temperature": body.temperature, "top_p": body.top_p, "num_predict": max_tokens,
        "stop": stop, "seed": body.seed, "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty, "num_ctx": body.num_ctx,
        "top_k": body.top_k, "min_p": body.min_p, "repeat_penalty": body.repeat_penalty,
        "typical_p": body.typical_p, "repeat_last_n": body.repeat_last_n,
    }
    return Options(**{k: v for k, v in values.items() if v is not None})


def _text(content: str | list[ContentPart] | None, param: str, model: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.type == "text":
            texts.append(part.text or "")
        elif part.type in ("image_url", "input_image", "image"):
            raise ApiError(400, f"model '{model}' does not support images (it is text-only)",
                           f"{param}[{j}]")
        elif part.type != "refusal":
            raise ApiError(400, f"content parts of type '{part.type}' are not supported",
                           f"{param}[{j}].type")
    return "\n".join(texts)


def _arguments(raw: str | dict[str, Any], param: str) -> dict[str, Any]:
    if isinstance(raw, dict):
        return raw
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
        text = _text(m.content, param, body.model)
        if m.role in ("system", "developer"):
            out.append(Message(role="system", content=text))
        elif m.role == "user":
            out.append(Message(role="user", content=text))
        elif m.role == "assistant":
            calls = []
            for j, c in enumerate(m.tool_calls or []):
                args = _arguments(c.function.arguments,
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
        return False if effort in ("none", "minimal") else effort
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
    )
    return _replicate(base, body.n)


def _replicate(base: ChatRequest, n: int) -> list[ChatRequest]:
    """n copies; with a fixed seed, choice i samples with seed + i (else all n would match)."""
    out = [base]
    for i in range(1, n):
        seed = base.options.seed
        opts = base.options.model_copy(update={"seed": seed + i}) if seed is not None \
            and seed >= 0 else base.options
        out.append(base.model_copy(update={"options": opts}))
    return out


# -- running n choices ----------------------------------------------------------------------


@dataclass
class Choices:
    """n requests running concurrently; their events arrive on one queue, tagged with the
    choice's index. `start()` returns once every choice produced its first event, so errors
    that come before any output can still be HTTP errors."""

    service: Service
    reqs: list[ChatRequest]
    queue: asyncio.Queue[tuple[int, Chunk | Done | Exception]] = field(
        default_factory=asyncio.Queue)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    buffered: list[tuple[int, Chunk | Done]] = field(default_factory=list)

    async def _pump(self, index: int) -> None:
        events = self.service.chat(self.reqs[index])
        try:
            async for event in events:
                self.queue.put_nowait((index, event))
        except Exception as exc:  # reported to the reader, which fails the response
            self.queue.put_nowait((index, exc))
        finally:
            await events.aclose()

    async def start(self) -> None:
        self.tasks = [asyncio.create_task(self._pump(i)) for i in range(len(self.reqs))]
        waiting = set(range(len(self.reqs)))
        try:
            while waiting:
                index, event = await self.queue.get()
                if isinstance(event, Exception):
                    raise event
                waiting.discard(index)
                self.buffered.append((index, event))
        except BaseException:
            await self.close()
            raise

    async def events(self) -> AsyncIterator[tuple[int, Chunk | Done]]:
        """Every event until each choice is done; raises the first error."""
        done = sum(isinstance(e, Done) for _, e in self.buffered)
        for item in self.buffered:
            yield item
        self.buffered = []
        while done < len(self.reqs):
            index, event = await self.queue.get()
            if isinstance(event, Exception):
                raise event
            done += isinstance(event, Done)
            yield index, event

    async def close(self) -> None:
        """Cancel what still runs (each choice's request is cancelled in the runner)."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def _stats_total(stats: Sequence[Stats]) -> dict[str, Any]:
    """OpenAI's usage: the prompt counted once, completions of every choice added up."""
    prompt = stats[0].prompt_tokens if stats else 0
    completion = sum(s.completion_tokens for s in stats)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": stats[0].cached_tokens if stats else 0}}


def sse(obj: dict[str, Any] | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
    return f"data: {data}\n\n".encode()


async def _start(service: Service, reqs: list[ChatRequest]) -> Choices | JSONResponse:
    choices = Choices(service, reqs)
    try:
        await choices.start()
    except (EngineError, ApiError) as exc:
        return api_error(exc)
    return choices


def _stream_error(exc: Exception) -> bytes:
    if isinstance(exc, EngineError):
        status, message, param, code, _ = _engine_error(exc)
        return sse(error_body(status, message, param, code))
    log.exception("stream failed", exc_info=exc)
    return sse(error_body(500, f"internal error: {type(exc).__name__}"))


# -- chat completions -----------------------------------------------------------------------


def _chat_logprobs(entries: list[TokenLogprob]) -> list[dict[str, Any]]:
    return [{"token": e.token, "logprob": e.logprob, "bytes": e.bytes,
             "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                              for t, lp in e.top]} for e in entries]


def _tool_call_out(call: ToolCall) -> dict[str, Any]:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name,
                         "arguments": json.dumps(call.arguments, ensure_ascii=False)}}


@dataclass
class ChatChoice:
    text: list[str] = field(default_factory=list)
    thinking: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    stats: Stats | None = None


async def _chat_collect(body: ChatCompletionBody, reqs: list[ChatRequest],
                        choices: Choices, cid: str, created: int) -> Response:
    acc = [ChatChoice() for _ in reqs]
    try:
        async for index, event in choices.events():
            c = acc[index]
            if isinstance(event, Done):
                c.stats = event.stats
                continue
            c.text.append(event.text)
            c.thinking.append(event.thinking or "")
            if not event.tool_calls:  # the tokens of a call are not content
                c.logprobs += _chat_logprobs(event.logprobs or [])
            c.calls += event.tool_calls or []
    except (EngineError, ApiError) as exc:
        return api_error(exc)
    finally:
        await choices.close()
    out = []
    for i, c in enumerate(acc):
        stats = c.stats or Stats(finish_reason="error")
        content = "".join(c.text)
        message: dict[str, Any] = {"role": "assistant",
                                   "content": content if content or not c.calls else None,
                                   "refusal": None}
        if c.calls:
            message["tool_calls"] = [_tool_call_out(t) for t in c.calls]
        if any(c.thinking):  # the field llama-server, vLLM and DeepSeek use
            message["reasoning_content"] = "".join(c.thinking)
        out.append({"index": i, "message": message,
                    "logprobs": {"content": c.logprobs, "refusal": None}
                    if reqs[i].logprobs is not None else None,
                    "finish_reason": FINISH_REASONS.get(stats.finish_reason, "stop")})
    return JSONResponse({
        "id": cid, "object": "chat.completion", "created": created, "model": body.model,
        "system_fingerprint": FINGERPRINT, "choices": out,
        "usage": _stats_total([c.stats for c in acc if c.stats is not None]),
    })


async def _chat_stream(body: ChatCompletionBody, reqs: list[ChatRequest], choices: Choices,
                       cid: str, created: int) -> AsyncIterator[bytes]:
    usage = bool(body.stream_options and body.stream_options.include_usage)

    def frame(index: int, delta: dict[str, Any], finish: str | None = None,
              logprobs: list[dict[str, Any]] | None = None) -> bytes:
        obj: dict[str, Any] = {
            "id": cid, "object": "chat.completion.chunk", "created": created,
            "model": body.model, "system_fingerprint": FINGERPRINT,
            "choices": [{"index": index, "delta": delta,
                         "logprobs": {"content": logprobs, "refusal": None}
                         if logprobs is not None else None,
                         "finish_reason": finish}],
        }
        if usage:
            obj["usage"] = None
        return sse(obj)

    stats: list[Stats | None] = [None] * len(reqs)
    n_calls = [0] * len(reqs)
    try:
        for i in range(len(reqs)):
            yield frame(i, {"role": "assistant", "content": ""})
        async for index, event in choices.events():
            if isinstance(event, Done):
                stats[index] = event.stats
                yield frame(index, {}, FINISH_REASONS.get(event.stats.finish_reason, "stop"))
                continue
            if event.thinking:
                yield frame(index, {"reasoning_content": event.thinking})
            lps = _chat_logprobs(event.logprobs) if event.logprobs is not None else None
            if event.text or (lps and not event.tool_calls):
                yield frame(index, {"content": event.text}, logprobs=lps)
            if event.tool_calls:
                deltas = []
                for call in event.tool_calls:
                    deltas.append({"index": n_calls[index], **_tool_call_out(call)})
                    n_calls[index] += 1
                yield frame(index, {"tool_calls": deltas})
        if usage:
            yield sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                       "model": body.model, "system_fingerprint": FINGERPRINT, "choices": [],
                       "usage": _stats_total([s for s in stats if s is not None])})
        yield sse("[DONE]")
    except Exception as exc:
        yield _stream_error(exc)
    finally:
        await choices.close()


# -- completions ----------------------------------------------------------------------------


def completion_requests(body: CompletionBody) -> tuple[list[str], list[ChatRequest]]:
    """(prompt of each choice, request of each choice): choice p*n + j is prompt p's j-th."""
    if body.best_of is not None and body.best_of != body.n:
        raise ApiError(400, "'best_of' other than 'n' is not supported", "best_of")
    raw = body.prompt
    if isinstance(raw, list) and raw and not isinstance(raw[0], str):
        raise ApiError(400, "prompts as token ids are not supported; send text", "prompt")
    prompts = [raw] if isinstance(raw, str) else list(raw)  # type: ignore[arg-type]
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


class LegacyLogprobs:
    """The completions API's logprobs: parallel lists, offsets into the choice's text."""

    def __init__(self, offset: int) -> None:
        self.offset = offset

    def add(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
        for e in entries:
            out["tokens"].append(e.token)
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append(dict(e.top))
            out["text_offset"].append(self.offset)
            self.offset += len(e.token)
        return out


async def _completion_collect(body: CompletionBody, prompts: list[str],
                              reqs: list[ChatRequest], choices: Choices, cid: str,
                              created: int) -> Response:
    texts = [[p] if body.echo else [] for p in prompts]
    lps = [LegacyLogprobs(len(p) if body.echo else 0) for p in prompts]
    merged: list[dict[str, list[Any]]] = [
        {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for _ in prompts]
    stats: list[Stats | None] = [None] * len(reqs)
    try:
        async for index, event in choices.events():
            if isinstance(event, Done):
                stats[index] = event.stats
                continue
            texts[index].append(event.text)
            for entries, log in ((event.prompt_logprobs, LegacyLogprobs(0)),
                                 (event.logprobs, lps[index])):
                if entries is not None:
                    for k, v in log.add(entries).items():
                        merged[index][k] += v
    except (EngineError, ApiError) as exc:
        return api_error(exc)
    finally:
        await choices.close()
    out = [{"text": "".join(texts[i]), "index": i,
            "logprobs": merged[i] if body.logprobs is not None else None,
            "finish_reason": FINISH_REASONS.get((s or Stats()).finish_reason, "stop")}
           for i, s in enumerate(stats)]
    done = [s for s in stats if s is not None]
    return JSONResponse({
        "id": cid, "object": "text_completion", "created": created, "model": body.model,
        "system_fingerprint": FINGERPRINT, "choices": out, "usage": _usage_per_prompt(done,
                                                                                    body.n)})


def _usage_per_prompt(stats: list[Stats], n: int) -> dict[str, Any]:
    """Each distinct prompt counted once, every completion counted."""
    prompt = sum(s.prompt_tokens for s in stats[::n])
    completion = sum(s.completion_tokens for s in stats)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


async def _completion_stream(body: CompletionBody, prompts: list[str], reqs: list[ChatRequest],
                             choices: Choices, cid: str, created: int) -> AsyncIterator[bytes]:
    usage = bool(body.stream_options and body.stream_options.include_usage)

    def frame(index: int, text: str, finish: str | None = None,
              logprobs: dict[str, Any] | None = None) -> bytes:
        obj: dict[str, Any] = {
            "id": cid, "object": "text_completion", "created": created, "model": body.model,
            "system_fingerprint": FINGERPRINT,
            "choices": [{"text": text, "index": index, "logprobs": logprobs,
                         "finish_reason": finish}]}
        if usage:
            obj["usage"] = None
        return sse(obj)

    lps = [LegacyLogprobs(len(p) if body.echo else 0) for p in prompts]
    stats: list[Stats | None] = [None] * len(reqs)
    scoring = body.echo and body.logprobs is not None
    try:
        if body.echo and not scoring:
            for i, p in enumerate(prompts):
                yield frame(i, p)
        async for index, event in choices.events():
            if isinstance(event, Chunk) and event.prompt_logprobs is not None:
                # echo with logprobs: the prompt, scored
                yield frame(index, prompts[index],
                            logprobs=LegacyLogprobs(0).add(event.prompt_logprobs))
                continue
            if isinstance(event, Done):
                stats[index] = event.stats
                yield frame(index, "", FINISH_REASONS.get(event.stats.finish_reason, "stop"))
                continue
            yield frame(index, event.text, logprobs=lps[index].add(event.logprobs)
                        if event.logprobs is not None else None)
        if usage:
            yield sse({"id": cid, "object": "text_completion", "created": created,
                       "model": body.model, "system_fingerprint": FINGERPRINT, "choices": [],
                       "usage": _usage_per_prompt([s for s in stats if s is not None],
                                                  body.n)})
        yield sse("[DONE]")
    except Exception as exc:
        yield _stream_error(exc)
    finally:
        await choices.close()


# -- embeddings and models ------------------------------------------------------------------


def _shorten(vector: list[float], dims: int) -> list[float]:
    """Truncate to `dims` and renormalise (what `dimensions` asks for)."""
    cut = vector[:dims]
    norm = sum(x * x for x in cut) ** 0.5
    return [x / norm for x in cut] if norm > 0 else cut


def _base64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode()


def model_object(m: Manifest) -> dict[str, Any]:
    owner = m.name.split("/")[1] if m.name.startswith("hf.co/") and m.name.count("/") >= 2 \
        else "library"
    return {"id": m.name, "object": "model", "created": int(m.modified_at.timestamp()),
            "owned_by": owner}


# -- routes ---------------------------------------------------------------------------------


async def _answer(request: Request, service: Service, reqs: list[ChatRequest], id_prefix: str,
                  collect: Callable[[Choices, str, int], Awaitable[Response]],
                  stream: Callable[[Choices, str, int], AsyncIterator[bytes]]) -> Response:
    """Start every choice, then answer whole (`collect`) or as SSE (`stream`), both given the
    running choices, the response id and its creation time."""

    async def respond() -> Response:
        started = await _start(service, reqs)
        if isinstance(started, JSONResponse):
            return started
        cid, created = f"{id_prefix}-{secrets.token_hex(12)}", int(time.time())
        if not reqs[0].stream:
            return await collect(started, cid, created)
        return StreamingResponse(stream(started, cid, created), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    # until the stream starts (or the whole answer is ready), a client that goes away cancels
    # the work; after that, Starlette cancels the stream itself
    return await unless_disconnected(request, respond())


def router(service: Service) -> APIRouter:
    api = APIRouter()

    @api.post("/v1/chat/completions", response_model=None)
    async def chat_completions(body: ChatCompletionBody, request: Request) -> Response:
        body.log_extras()
        try:
            reqs = chat_requests(body)
        except (ApiError, EngineError) as exc:
            return api_error(exc)
        except ValidationError as exc:
            return _invalid(exc)

        return await _answer(request, service, reqs, "chatcmpl",
                             partial(_chat_collect, body, reqs),
                             partial(_chat_stream, body, reqs))

    @api.post("/v1/completions", response_model=None)
    async def completions(body: CompletionBody, request: Request) -> Response:
        body.log_extras()
        try:
            prompts, reqs = completion_requests(body)
        except (ApiError, EngineError) as exc:
            return api_error(exc)
        except ValidationError as exc:
            return _invalid(exc)

        return await _answer(request, service, reqs, "cmpl",
                             partial(_completion_collect, body, prompts, reqs),
                             partial(_completion_stream, body, prompts, reqs))

    @api.post("/v1/embeddings", response_model=None)
    async def embeddings(body: EmbeddingBody) -> Response:
        body.log_extras()
        raw = body.input
        if isinstance(raw, list) and raw and not isinstance(raw[0], str):
            return error(400, "inputs as token ids are not supported; send text", "input")
        inputs = [raw] if isinstance(raw, str) else [str(x) for x in raw]
        if not inputs or any(not x for x in inputs):
            return error(400, "'input' must be a non-empty string or a list of them", "input")
        req = ChatRequest(model=body.model, messages=[], keep_alive=body.keep_alive)
        try:
            vectors, n_tokens, _, _ = await service.embed(req, inputs, True)
        except EngineError as exc:
            return api_error(exc)
        if body.dimensions:
            vectors = [_shorten(v, body.dimensions) for v in vectors]
        data = [{"object": "embedding", "index": i,
                 "embedding": _base64(v) if body.encoding_format == "base64" else v}
                for i, v in enumerate(vectors)]
        return JSONResponse({"object": "list", "data": data, "model": body.model,
                             "usage": {"prompt_tokens": n_tokens, "total_tokens": n_tokens}})

    @api.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_object(m) for m in service.store.list()]}

    @api.get("/v1/models/{model_id:path}", response_model=None)
    async def model(model_id: str) -> Response:
        try:
            _, manifest = service.store.get(model_id)
        except StoreError as exc:
            status = 400 if isinstance(exc, ValueError) else 404
            return error(status, f"The model '{model_id}' does not exist" if status == 404
                         else str(exc), "model",
                         "model_not_found" if status == 404 else None)
        return JSONResponse(model_object(manifest))

    return api


def _invalid(exc: ValidationError) -> JSONResponse:
    first = exc.errors()[0]
    param = ".".join(str(p) for p in first["loc"])
    return error(400, f"Invalid value for '{param}': {first['msg']}", param or None)
