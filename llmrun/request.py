"""The internal request and result types every layer shares.

Dialect modules (`llmrun/api/*`) translate their wire formats into `ChatRequest` and back
from the events `Started`, `Chunk`, `Done` (or an `EngineError` with its code); the engine sees
nothing else. Nothing here knows HTTP or llama.cpp.
"""

from __future__ import annotations

import math
import re
from typing import Annotated, Any, Literal

import pydantic_core
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from llmrun import config

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def duration_seconds(value: str | float) -> float:
    """Seconds to keep a model loaded, as Ollama's API writes them: `5m`, `1h30m`, `30s`,
    `250ms`, a number of seconds; negative means forever (math.inf), 0 unload once idle."""
    if isinstance(value, bool):  # JSON true is no duration (Python's bool is an int)
        raise ValueError(f"invalid keep_alive duration {value!r}")
    if isinstance(value, int):
        # (an integer past a float's range, which JSON may carry: as long as it can be)
        seconds = float(value) if abs(value) < 2**1000 else (math.inf if value > 0 else -math.inf)
    elif isinstance(value, float):
        seconds = value
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


def _keep_alive(value: Any) -> Any:
    if value is None or not isinstance(value, str | int | float):
        return value  # None: the daemon's LLMRUN_KEEP_ALIVE; other types: pydantic says why
    return duration_seconds(value)


# A request's keep_alive, parsed where it enters (every dialect's body): seconds (math.inf:
# forever), or None for the daemon's default. An invalid one is the body's 400.
KeepAlive = Annotated[float | None, BeforeValidator(_keep_alive)]


class RunnerOptions(BaseModel):
    """The options a runner is started with, named as Ollama names them (also Modelfile
    PARAMETERs): a change of any means another runner, as the `Runner` part of Ollama's
    options. The scheduler reads these alone (server/scheduler.spec_for).

    `None` means "not set here": the model's Modelfile, then llmrun's defaults apply.
    """

    model_config = ConfigDict(extra="forbid")

    num_ctx: int | None = Field(None, ge=1, description="Context tokens per request")
    num_batch: int | None = Field(None, ge=1)
    num_thread: int | None = Field(None, ge=0)
    # layers on the GPU, as Ollama's: unset (or negative) fitted to free memory, 0 the CPU
    # alone; main_gpu: the GPU (index among them) a model that fits on one goes to
    num_gpu: int | None = None
    main_gpu: int | None = Field(None, ge=0)
    # false reads the weights into memory instead of mapping the file (a file on a slow or
    # network disk, whose pages mapped would be read again after the kernel drops them)
    use_mmap: bool | None = None
    # the KV cache's element type (quantized halves or quarters its memory) and flash
    # attention, as Ollama's OLLAMA_KV_CACHE_TYPE and OLLAMA_FLASH_ATTENTION
    kv_cache_type: str | None = Field(None, pattern="^(f16|q8_0|q4_0)$")
    flash_attention: str | None = Field(None, pattern="^(auto|on|off)$")
    # a smaller model of the same vocabulary (a model in the store, by name), loaded beside
    # the model, whose guesses the model checks in the same decode; num_draft then defaults
    # to 8 (engine/draft.py)
    draft_model: str | None = Field(None, min_length=1, max_length=256)

    @field_validator("kv_cache_type", "flash_attention", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        if isinstance(value, bool):
            return "on" if value else "off"
        return config.choice_word(value) if isinstance(value, str) else value

    def runner(self) -> RunnerOptions:
        """The runner's part of these options alone."""
        return RunnerOptions.model_construct(
            **{k: getattr(self, k) for k in RunnerOptions.model_fields})


class Options(RunnerOptions):
    """Every option of a request: the runner's (RunnerOptions) and those each request may
    change without another runner (sampling, limits, stops, reranking, embedding)."""

    # when the prompt or the output outgrows num_ctx (None, false: a clear error; the output
    # stops with "length"): `truncate` drops the oldest turns, keeping the system prompt and
    # the last user turn; `shift` drops the oldest half of the context after num_keep
    # tokens and goes on generating (as Ollama's request fields of those names)
    truncate: bool | None = None
    shift: bool | None = None
    num_keep: int | None = None
    seed: int | None = None
    num_predict: int | None = Field(None, description="Max tokens to generate; -1 = no limit")
    top_k: int | None = Field(None, ge=0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    typical_p: float | None = Field(None, ge=0.0, le=1.0)
    temperature: float | None = Field(None, ge=0.0)
    repeat_last_n: int | None = Field(None, ge=-1)
    repeat_penalty: float | None = Field(None, ge=0.0)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: list[str] | None = None
    # speculative decoding: the most tokens (up to 16) guessed ahead per step by prompt
    # lookup and checked in the same decode; 0 (the default) is off. engine/draft.py
    # (or by draft_model's guesses: see RunnerOptions)
    num_draft: int | None = Field(None, ge=0, le=64)
    # reranking with a causal model (engine/rerank.py): a document's score is
    # p(yes) / (p(yes) + p(no)) at the end of a prompt that asks whether it meets the query.
    # `rerank` makes the model a reranker (setting any other rerank_ option does too: a
    # Modelfile that names the tokens means it); the prompt is the model's chat template over
    # Qwen3-Reranker's system and user turns, or `rerank_template` written raw, with
    # {query}, {document} and {instruction} in it; `rerank_yes` / `rerank_no` are the
    # answer tokens' text (one token each in the model's vocabulary)
    rerank: bool | None = None
    rerank_template: str | None = Field(None, min_length=1, max_length=16384)
    rerank_instruction: str | None = Field(None, min_length=1, max_length=4096)
    rerank_yes: str | None = Field(None, min_length=1, max_length=64)
    rerank_no: str | None = Field(None, min_length=1, max_length=64)
    # written before every text the model embeds, before tokenizing: the task prefix an
    # embedding model was trained with (nomic-embed-text's "search_query: ", E5's "query: ").
    # The daemon adds it (server/service.py); the runner sees prefixed texts
    embed_prefix: str | None = Field(None, min_length=1, max_length=4096)

    def reranks(self) -> bool:
        """Whether these options make the model a reranker (see `rerank`)."""
        if self.rerank is not None:
            return self.rerank
        return any(v is not None for v in (self.rerank_template, self.rerank_instruction,
                                           self.rerank_yes, self.rerank_no))

    def merged_over(self, base: Options) -> Options:
        """These options, with unset fields taken from `base`."""
        return base.model_copy(update=self.model_dump(exclude_none=True))


# Ollama's defaults for what a request and the Modelfile leave unset.
DEFAULT_OPTIONS = Options(
    seed=-1,
    num_predict=-1,
    top_k=40,
    top_p=0.9,
    min_p=0.0,
    typical_p=1.0,
    temperature=0.8,
    repeat_last_n=64,
    repeat_penalty=1.1,
    presence_penalty=0.0,
    frequency_penalty=0.0,
    stop=[],
)


class ToolCall(BaseModel):
    """A function call the model made; `arguments` is the parsed JSON object."""

    id: str
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class PartialCall(BaseModel):
    """A call the token limit cut off while the model was writing it: its name, and its
    arguments' text as far as it got (a prefix of a JSON object, not valid JSON itself).
    Each dialect reports it the way its own API reports a call cut short, never as text."""

    id: str
    name: str
    arguments: str = ""

    def written(self, cut_strings: bool = False) -> dict[str, Any]:
        """The arguments' members written whole (a string cut short left out, as jiter's
        partial mode, which the Anthropic SDK reads streamed `input_json_delta`s with,
        leaves it; `cut_strings`: kept as far as it got); {} when nothing is there."""
        try:
            value = pydantic_core.from_json(
                self.arguments, allow_partial="trailing-strings" if cut_strings else True)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


class Tool(BaseModel):
    """A function the model may call; `parameters` is its JSON schema."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object",
                                                                "properties": {}})


class NamedTool(BaseModel):
    name: str


# auto: the model decides; none: tools are hidden; required: it must call one (any);
# NamedTool: it must call that one. required/named are enforced by grammar.
ToolChoice = Literal["auto", "none", "required"] | NamedTool


class Message(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)  # assistant turns
    tool_call_id: str | None = None  # tool turns: which call this answers
    name: str | None = None  # tool turns: the function's name
    thinking: str | None = None  # assistant turns: the thought before the answer
    # image files (PNG, JPEG, ...), base64 as the dialects carry them, in order; a model
    # with a vision projector reads them before the message's text (as Ollama places them)
    images: list[str] = Field(default_factory=list)
    # sound files (WAV, MP3), base64, in order; a model whose projector encodes audio hears
    # them after the message's images and before its text
    audio: list[str] = Field(default_factory=list)


# Thinking: None leaves it to the model's template; an effort level implies on.
Think = bool | Literal["low", "medium", "high"] | None
# The most a thinking budget may be (a token count the engine compares with its own).
MAX_THINK_BUDGET = 2**31 - 1


class ChatRequest(BaseModel):
    """One chat turn to generate: what a dialect makes of its request, and (merged with the
    model's Modelfile by the service: its MESSAGEs first, its template, options and SYSTEM)
    what the runner receives. No second type crosses the IPC."""

    model: str
    messages: list[Message]
    options: Options = Field(default_factory=Options)
    stream: bool = True
    progress: bool = False  # a long prompt's reading reported as Progress events
    keep_alive: KeepAlive = None
    format: Format = None
    # False when the client asked for non-strict output (OpenAI json_schema or tools without
    # "strict": true): a schema keyword structured output cannot enforce is then a logged
    # warning, not a 400
    format_strict: bool = True
    # a client's own grammar (llama-server's `grammar`): llguidance's Lark dialect (may embed
    # `%json {...}` schemas), or GBNF (recognised by `::=`); forced tool calls build their own
    grammar: str | None = None
    logprobs: int | None = None  # None: none; 0: the sampled token's; k: and the top k
    prompt: str | None = None  # raw prompt instead of messages (no template)
    tools: list[Tool] = Field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    template: str | None = None  # overrides the model's chat template for this request
    think: Think = None
    think_required: bool = False  # a model that cannot think is an error (else: ignored)
    # most tokens a thought may take before the runner ends it (writes its end marker), the
    # answer following; None: no limit; 0: no thought (as think false)
    think_budget: int | None = Field(None, ge=0, le=MAX_THINK_BUDGET)
    # variables for the chat template, over those the runner sets (llama-server's
    # chat_template_kwargs: `enable_thinking` and the like)
    template_kwargs: dict[str, Any] = Field(default_factory=dict)
    suffix: str | None = None  # fill-in-the-middle: the text after the insertion point
    context: list[int] | None = None  # token ids of an earlier answer (Ollama's generate)
    return_context: bool = False  # report the prompt + output token ids when done
    prompt_logprobs: int | None = None  # logprobs of the prompt's own tokens (echo)
    # the client's stop strings come after the model's own (Modelfile) instead of replacing
    # them: Anthropic's stop_sequences, which never turn a model's end markers off
    stop_adds: bool = False
    # the model's default system prompt (Modelfile SYSTEM): set by the service when it merges
    # the model's defaults in, used by the template when the messages bring no system turn
    system: str | None = None
    # a realtime session's id (set by the daemon, never by a client): the runner keeps the
    # session's sequence in one slot between its requests, so each reads only what is new
    # (engine/slots.py)
    session: str | None = None

    @model_validator(mode="after")
    def _no_budget_no_thought(self) -> ChatRequest:
        """A thinking budget of 0 is thinking off: the template is told so and a thought
        the prompt opens is closed, rather than one the runner would end at once."""
        if self.think_budget == 0:
            self.think = False
        return self


Format = Literal["json"] | dict[str, Any] | None  # JSON mode, or a JSON schema


FinishReason = Literal["stop", "length", "cancel", "error", "tool_calls"]


class Stats(BaseModel):
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    prompt_ns: int = 0
    generate_ns: int = 0
    load_ns: int = 0  # filled in by the daemon: time this request waited for a model load
    total_ns: int = 0  # filled in by the daemon: from request received to done
    finish_reason: FinishReason = "stop"
    stop_sequence: str | None = None  # the stop string that ended generation, if one did
    context: list[int] | None = None  # prompt + output token ids, when the request asked
    truncated_messages: int = 0  # oldest messages dropped to fit num_ctx (`truncate`)
    truncated_tokens: int = 0  # the prompt tokens they took
    shifted_tokens: int = 0  # context tokens dropped while generating (`shift`)
    draft_tokens: int = 0  # tokens guessed ahead by prompt lookup (engine/draft.py)
    draft_accepted: int = 0  # of them, those that came true (output without a step each)

    def context_notes(self) -> dict[str, int]:
        """What was dropped to fit the context, for a response to say so (every dialect adds
        these to its usage; absent when nothing was)."""
        notes = {"truncated_messages": self.truncated_messages,
                 "truncated_tokens": self.truncated_tokens,
                 "shifted_tokens": self.shifted_tokens}
        return {k: v for k, v in notes.items() if v}


class TokenLogprob(BaseModel):
    token: str
    logprob: float | None  # None: a prompt's first token (nothing comes before it)
    bytes: list[int]
    top: list[tuple[str, float]] = Field(default_factory=list)


class Progress(BaseModel):
    """A long prompt being read, after each step that read part of it (only to requests that
    asked: `ChatRequest.progress`)."""

    total: int  # the prompt's tokens
    cached: int  # of them, those the slot or the prompt cache held
    processed: int  # of them, those in the slot now (cached included)


class Started(BaseModel):
    """A generate request's first event, sent when the runner places the sequence in a slot
    (before any chunk): the prompt's size, how much of it the slot's KV cache already held,
    and the context the request has. An error before it means nothing was generated."""

    prompt_tokens: int
    cached_tokens: int = 0
    n_ctx: int


class Chunk(BaseModel):
    """Some output. On the IPC a chunk is always a dict of these fields (only `text` when it is
    plain text, the per-token case)."""

    text: str
    logprobs: list[TokenLogprob] | None = None
    tool_calls: list[ToolCall] | None = None  # complete calls, parsed (never raw markup)
    partial_call: PartialCall | None = None  # a call the token limit cut off (finish "length")
    thinking: str | None = None  # part of the model's thought (text is then empty)
    prompt_logprobs: list[TokenLogprob] | None = None  # the prompt scored (text is empty)


class Done(BaseModel):
    stats: Stats


# What went wrong, as a code with its numbers rather than a sentence: an error event across the
# IPC carries `code`, `message` and the code's fields. The code says what happened and nothing
# of HTTP: the dialects give it a status (api/dialect.py http_status) and each words the codes
# it cares about from the fields (Anthropic's "prompt is too long: N tokens > M maximum").
ErrorCode = Literal[
    "invalid_request",  # the request itself is at fault (template, schema, option, nesting)
    "prompt_too_long",  # fields: prompt_tokens, n_ctx
    "not_found",  # no such model
    "too_large",  # a request or reply over a size limit (the IPC frame)
    "busy",  # the queue is full, or the server is stopping: retry (retry_after)
    "insufficient_memory",  # the model does not fit
    "runner_failed",  # the runner process died or its engine failed; a fresh one follows
    "upstream_refused",  # a remote model's server refused the request; fields: status (4xx)
    "upstream_failed",  # a remote model's server failed or broke off its answer
    "upstream_timeout",  # a remote model's server sent nothing for too long
    "internal",  # anything else: a bug, logged
]
ERROR_CODES: frozenset[str] = frozenset(ErrorCode.__args__)  # type: ignore[attr-defined]


def error_event(code: ErrorCode, message: str, **fields: Any) -> dict[str, Any]:
    """The payload of an error event: `code`, a `message` for logs and dialects that word
    nothing themselves, and the code's fields."""
    return {"code": code, "message": message, **fields}


class EngineError(Exception):
    """A request the engine cannot serve: `code` says what went wrong (ErrorCode), `details`
    holds its fields (prompt_tokens, n_ctx, ...), `retry_after` the seconds to wait before
    trying again where that helps (busy)."""

    def __init__(self, message: str, code: ErrorCode = "internal",
                 retry_after: int | None = None,
                 details: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code: ErrorCode = code
        self.retry_after = retry_after
        self.details = details or {}

    @classmethod
    def from_event(cls, payload: dict[str, Any]) -> EngineError:
        """The error an error event's payload (error_event) describes; a code this daemon
        does not know is `internal`."""
        fields = dict(payload)
        message = str(fields.pop("message", "") or "the model runner failed")
        code = fields.pop("code", None)
        retry_after = fields.pop("retry_after", None)
        return cls(message, code=code if code in ERROR_CODES else "internal",
                   retry_after=retry_after if isinstance(retry_after, int) else None,
                   details=fields)


def as_dict(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(exclude_none=True)


class ModelRequest(BaseModel):
    """A request that needs only a model (embed, rerank, tokenize, detokenize): which model,
    how long it stays loaded after, and the options that load it or shape the work."""

    model: str
    keep_alive: KeepAlive = None
    options: Options = Field(default_factory=Options)

    def stand_in(self) -> ChatRequest:
        """This request as a ChatRequest without messages: what the request bounds check
        (bounds.check_request) and the rerank prompt, which the runner renders with the
        model's chat template, read."""
        return ChatRequest(model=self.model, messages=[], keep_alive=self.keep_alive,
                           options=self.options)
