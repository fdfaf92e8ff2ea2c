"""The internal request and result types every layer shares.

Dialect modules (`llmrun/api/*`) translate their wire formats into `ChatRequest` and back
from `Chunk`/`Done`; the engine sees nothing else. Nothing here knows HTTP or llama.cpp.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class Options(BaseModel):
    """Generation and load options, named as Ollama names them (also Modelfile PARAMETERs).

    `None` means "not set here": the model's Modelfile defaults, then llmrun's defaults apply.
    """

    model_config = ConfigDict(extra="forbid")

    # load-time: a change means a different runner
    num_ctx: int | None = Field(None, ge=1, description="Context tokens per request")
    num_batch: int | None = Field(None, ge=1)
    num_thread: int | None = Field(None, ge=0)
    num_gpu: int | None = None
    use_mmap: bool | None = None
    # per request
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

    def merged_over(self, base: Options) -> Options:
        """These options, with unset fields taken from `base`."""
        return base.model_copy(update=self.model_dump(exclude_none=True))


LOAD_OPTIONS = ("num_ctx", "num_batch", "num_thread", "num_gpu", "use_mmap")

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


# Thinking: None leaves it to the model's template; an effort level implies on.
Think = bool | Literal["low", "medium", "high"] | None


class ChatRequest(BaseModel):
    """One chat turn to generate, after the dialect layer and the model's defaults."""

    model: str
    messages: list[Message]
    options: Options = Field(default_factory=Options)
    stream: bool = True
    keep_alive: str | float | None = None
    format: Format = None
    # False when the client asked for non-strict output (OpenAI json_schema or tools without
    # "strict": true): a schema keyword structured output cannot enforce is then a logged
    # warning, not a 400
    format_strict: bool = True
    grammar: str | None = None  # a client's own grammar (llama-server's `grammar`): Lark or GBNF
    logprobs: int | None = None
    prompt: str | None = None  # raw prompt instead of messages (no template)
    tools: list[Tool] = Field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    template: str | None = None  # overrides the model's chat template for this request
    think: Think = None
    think_required: bool = False  # a model that cannot think is an error (else: ignored)
    suffix: str | None = None  # fill-in-the-middle: the text after the insertion point
    context: list[int] | None = None  # token ids of an earlier answer (Ollama's generate)
    return_context: bool = False
    prompt_logprobs: int | None = None  # logprobs of the prompt's own tokens (echo)


Format = Literal["json"] | dict[str, Any] | None  # JSON mode, or a JSON schema


class GenerateJob(BaseModel):
    """What the daemon sends a runner: everything needed to render and decode one sequence."""

    messages: list[Message] = Field(default_factory=list)
    prompt: str | None = None  # raw prompt text: no chat template (generate raw, completions)
    template: str | None = None  # overrides the GGUF's chat template
    system: str | None = None  # the model's default system prompt
    options: Options
    format: Format = None
    format_strict: bool = True  # see ChatRequest.format_strict
    # a raw grammar: llguidance's Lark dialect (may embed `%json {...}` schemas), or GBNF
    # (recognised by `::=`, converted to Lark); forced tool calls build their own
    grammar: str | None = None
    logprobs: int | None = None  # None: none; 0: the sampled token's; k: and the top k
    tools: list[Tool] = Field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    think: Think = None
    think_required: bool = False
    suffix: str | None = None
    context: list[int] | None = None
    return_context: bool = False  # report the prompt + output token ids when done
    prompt_logprobs: int | None = None  # score the prompt: None off, k: with the top k


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
    context: list[int] | None = None  # prompt + output token ids, when the job asked


class TokenLogprob(BaseModel):
    token: str
    logprob: float | None  # None: a prompt's first token (nothing comes before it)
    bytes: list[int]
    top: list[tuple[str, float]] = Field(default_factory=list)


class Chunk(BaseModel):
    text: str
    logprobs: list[TokenLogprob] | None = None
    tool_calls: list[ToolCall] | None = None  # complete calls, parsed (never raw markup)
    thinking: str | None = None  # part of the model's thought (text is then empty)
    prompt_logprobs: list[TokenLogprob] | None = None  # the prompt scored (text is empty)


class Done(BaseModel):
    stats: Stats


class EngineError(Exception):
    """A request the engine cannot serve; `status` is the HTTP status a dialect should use."""

    def __init__(self, message: str, status: int = 500, kind: str = "server_error",
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.kind = kind
        self.retry_after = retry_after  # seconds, for 503 "busy" answers


def as_dict(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(exclude_none=True)
