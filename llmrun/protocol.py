"""The daemon <-> runner protocol: every message either side sends, typed, and the one place
each side checks what it receives.

The conversation on one channel (frames of llmrun.ipc; each message one JSON object):

    daemon                                  runner (python -m llmrun.engine.runner --fd N)
    Load          ------------------->      the first frame: files and load settings; the
                                            runner confines itself with what it names, then
                                            reads the model
                  <-------------------      Ready (its info: context, slots, sandbox, memory)
                                            or Fatal (why the model could not be loaded)
    Generate | Count | Tokenize |
    Detokenize | Embed | Rerank
                  (each with an id) ->
                  <-------------------      Events: every request's events of one engine
                                            step, [id, kind, payload] each; an empty list is
                                            a heartbeat (the engine is busy, not hung)
    Cancel (id)   ------------------->      the request ends (a "done", finish "cancel")
    Shutdown      ------------------->      the runner finishes its prompt-state writes, exits

An event's kind and payload ("engine" comes with the id ""): the generate events are the
pydantic models of request.py that the dialects read (one type on both sides; the engine
writes their fields as plain dicts, one per token), the others the TypedDicts below:

    started   request.Started: the first event of a generate request (the prompt's size)
    progress  request.Progress: a long prompt being read (only to requests that asked)
    chunk     request.Chunk: output; only `text` when it is plain text (the per-token case)
    done      request.Stats (less what the daemon fills in: DAEMON_STATS); the last event
    error     Error: request.error_event (a code, a message, the code's fields)
    count     CountReply      tokens   TokensReply      text   TextReply
    embedding Embedding, after any number of embedding_part (EmbeddingPart): a reply too
              large for one frame
    rerank    RerankReply: each document's score, in the order sent
    engine    the engine's step counters (batcher.EngineStats), for /metrics

Messages are dataclasses (orjson writes them as it writes a dict, fields in the order declared,
`type` first); event payloads are plain dicts, since the engine builds one per token.
`parse_command` (runner side) and `parse_reply` (daemon side) turn a decoded frame into these
types, checking its shape strictly: an unknown type or kind, a missing or
ill-typed field, or one the protocol does not have is a ProtocolError naming it. Each side
treats a ProtocolError as a broken peer: the runner exits (the daemon starts a fresh one); the
daemon stops a runner that sent one and fails its requests. A message's pydantic fields (the
ChatRequest of Generate, Count, Rerank) are written as their model_dump and validated back
into the model by parse_command (one that does not validate fails only its request:
RefusedRequest); payload members that pydantic models read later (logprobs, tool calls,
statistics) are checked here for their outer shape only. Each kind of work is one message
and one row of KINDS (the events it gets back).
"""

from __future__ import annotations

import typing
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal, NotRequired, TypedDict

from pydantic import BaseModel

from llmrun import config
from llmrun.protocolcheck import (
    MAX_INT,
    MODEL_DATA,
    Bad,
    Check,
    ProtocolError,
    RefusedRequest,
    builder,
    compile_check,
    counts,
    expected,
    fields_check,
    model_check,
    number,
    sane,
    typeddict_check,
    word,
)
from llmrun.request import ChatRequest, Chunk, Progress, Started, Stats

__all__ = ["MAX_INT", "MODEL_DATA", "ProtocolError", "RefusedRequest"]  # (theirs: protocolcheck's)

# -- daemon -> runner --------------------------------------------------------------------------

KvType = Literal["f16", "q8_0", "q4_0"]  # the KV cache's element type (engine/llama/)
FlashAttn = Literal["auto", "on", "off"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Lora:
    """A LoRA adapter GGUF applied to the model, at `scale`."""

    path: str
    scale: float = 1.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Load:
    """How to load the model: the first frame on the channel (server/loadspec.RunnerSpec, with
    the scheduler's placement and the prompt-cache directory the daemon prepared)."""

    type: Literal["load"] = "load"
    model: list[str]  # GGUF file; each part of a split model, in order
    ctx: int  # context tokens per sequence
    slots: int = 1
    threads: int = 1
    adaptive_threads: bool = False  # fewer threads while other processes keep cores busy
    batch: int = 512
    lora: list[Lora] = field(default_factory=list)
    mmproj: str | None = None  # a vision projector GGUF, for images in prompts
    # its sound is read in pieces of this length, each encoded on its own (the daemon reads
    # it from the projector's GGUF: media.SOUND_PIECE_SECONDS); None: whole
    sound_piece_seconds: float | None = None
    # a smaller model of the same vocabulary whose guesses are checked in the same decode
    # (speculative decoding); each part of a split one, in order
    draft_model: list[str] = field(default_factory=list)
    kv_type: KvType = "f16"
    flash_attn: FlashAttn = "auto"
    prompt_cache: str | None = None  # where long prompts' KV states are kept on disk
    prompt_cache_key: str = ""  # the model and load settings that directory's states fit
    # file name -> SHA-256 of each state file there the daemon checked (server/promptdirs.vet):
    # the only files of earlier runners this one may read
    prompt_cache_vouched: dict[str, str] = field(default_factory=dict)
    prompt_cache_size: int = 0  # bytes of states on disk at most (0: no prompt cache)
    prompt_cache_ram: int = 0  # bytes of states kept in memory at most
    prompt_cache_min: int = 1024  # tokens a prompt must add before its state is kept
    # prompt reading per step while others generate (config.parse_step_budget)
    step_budget: str = config.default("LLMRUN_STEP_BUDGET")
    rpc: list[str] = field(default_factory=list)  # RPC workers (host:port) to place layers on
    rpc_split: list[float] | None = None  # their shares of the layers (None: by free memory)
    gpu_layers: int = -1  # the last layers placed on `device` or the workers (-1: all)
    device: list[str] = field(default_factory=list)  # devices (as --list-devices names them)
    tensor_split: list[float] | None = None  # the share of the layers each device gets
    main_gpu: int = 0  # the device (index in `device`) holding every layer; -1: split
    debug: bool = False  # log every engine step (LLMRUN_DEBUG)
    mmap: bool = True  # the weights mapped from their files (use_mmap), else read in
    # the daemon's estimate of the memory this load needs (server/memory.estimate; 0:
    # unknown), from which the runner's address-space limit is set (engine/sandbox/limits.py)
    memory: int = 0
    max_frame: int  # the largest frame either side sends (ipc.MAX_FRAME: both must agree)


@dataclass(frozen=True, kw_only=True, slots=True)
class Generate:
    """Generate for `request`, merged with its model's Modelfile."""

    type: Literal["generate"] = "generate"
    id: str
    request: ChatRequest


@dataclass(frozen=True, kw_only=True, slots=True)
class Count:
    """Render `request` only: its prompt's length (`detail`: the prompt and its tokens too)."""

    type: Literal["count"] = "count"
    id: str
    request: ChatRequest
    detail: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Tokenize:
    type: Literal["tokenize"] = "tokenize"
    id: str
    text: str
    add_special: bool = False


@dataclass(frozen=True, kw_only=True, slots=True)
class Detokenize:
    # (ids outside the vocabulary, and booleans, are the runner's to refuse: an error event)
    type: Literal["detokenize"] = "detokenize"
    id: str
    tokens: list[int]


@dataclass(frozen=True, kw_only=True, slots=True)
class Embed:
    """Embed `inputs`, the piece of a larger batch that starts at `offset`."""

    type: Literal["embed"] = "embed"
    id: str
    inputs: list[str]
    truncate: bool = False
    offset: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Rerank:
    """Score `documents` for `query`, the piece of a larger list that starts at `offset`;
    `request` is the Modelfile merged over the client's options (messages empty): its options
    and template say how the prompt is written (engine/rerank.py); a model with rank pooling
    ignores them and scores with its head (engine/crossencoder.py)."""

    type: Literal["rerank"] = "rerank"
    id: str
    request: ChatRequest
    query: str
    documents: list[str]
    offset: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Cancel:
    type: Literal["cancel"] = "cancel"
    id: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Shutdown:
    type: Literal["shutdown"] = "shutdown"


Request = Generate | Count | Tokenize | Detokenize | Embed | Rerank
Command = Load | Request | Cancel | Shutdown

# -- runner -> daemon --------------------------------------------------------------------------


class Info(TypedDict):
    """What a loaded runner tells of itself (shown by `ps` and /api/ps)."""

    n_ctx_seq: int
    n_slots: int
    n_ctx_train: int
    has_template: bool
    vision: bool
    audio: NotRequired[bool]  # its projector encodes sound (absent: a runner before audio)
    size: int
    # the confinement layers that hold (sandbox.Confinement.info); absent in tests' hosts
    sandbox: NotRequired[list[str]]
    confined: NotRequired[bool]
    sandbox_missing: NotRequired[list[str]]
    rpc: NotRequired[dict[str, Any]]  # layers placed on RPC workers
    devices: NotRequired[dict[str, int]]  # bytes the model really took on each GPU


@dataclass(frozen=True, kw_only=True, slots=True)
class Ready:
    type: Literal["ready"] = "ready"
    info: Info


@dataclass(frozen=True, kw_only=True, slots=True)
class Fatal:
    """The model could not be loaded (or the runner refused to run unconfined): it exits."""

    type: Literal["fatal"] = "fatal"
    error: str


@dataclass(kw_only=True, slots=True)  # (not frozen: built for every step, 3x faster)
class Events:
    """Events of one engine step, in order: (request id, kind, payload) each."""

    type: Literal["events"] = "events"
    events: list[tuple[str, str, Any]]


Reply = Ready | Fatal | Events


class Error(TypedDict):
    """request.error_event: besides these, the code's own fields (numbers and words)."""

    code: str
    message: str


class CountReply(TypedDict):
    prompt_tokens: int
    n_ctx: int
    prompt: NotRequired[str]
    tokens: NotRequired[list[int]]


class TokensReply(TypedDict):
    tokens: list[int]
    pieces: list[str | list[int]]  # a token's text, or its bytes where not whole UTF-8


class TextReply(TypedDict):
    content: str


class Embedding(TypedDict):
    embeddings: list[list[Any]]
    prompt_tokens: int


class EmbeddingPart(TypedDict):
    embeddings: list[list[Any]]


class RerankReply(TypedDict):
    scores: list[float]  # each in [0, 1] (checked by the daemon, not here)
    prompt_tokens: int


# What of request.Stats the daemon fills in itself (a runner that sends them is broken).
DAEMON_STATS = ("load_ns", "total_ns")


# -- kinds of work -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Kind:
    """One kind of work a runner does: its message, and the events its requests get back
    (event kind -> payload type; every kind may get "error" too). `final`: the events that
    end it; `counted`: those whose counts must be zero or more (a /metrics counter would run
    backwards); `unbounded`: replies whose size follows the request's, whose text the daemon
    does not walk (runnerguard.UNBOUNDED_TEXT)."""

    message: type
    replies: dict[str, Any]
    final: frozenset[str]
    counted: frozenset[str] = frozenset()
    unbounded: frozenset[str] = frozenset()

    @property
    def events(self) -> frozenset[str]:
        """Every kind of event a request of this kind may be sent."""
        return frozenset(self.replies) | {"error"}


def _kind(message: type, replies: dict[str, Any], final: str, counted: Iterable[str] = (),
          unbounded: Iterable[str] = ()) -> Kind:
    return Kind(message, replies, frozenset({final}), frozenset(counted), frozenset(unbounded))


# Every kind of work, by its message's type: the one table the daemon's guard, this module's
# checks and the runner's dispatch (engine/host.py HANDLERS) read.
KINDS: dict[str, Kind] = {
    "generate": _kind(Generate, {"started": Started, "progress": Progress, "chunk": Chunk,
                                 "done": Stats}, "done", {"started", "progress", "done"}),
    "count": _kind(Count, {"count": CountReply}, "count", {"count"}, {"count"}),
    "tokenize": _kind(Tokenize, {"tokens": TokensReply}, "tokens", unbounded={"tokens"}),
    "detokenize": _kind(Detokenize, {"text": TextReply}, "text", unbounded={"text"}),
    # an embedding reply too large for one frame comes in parts (embedding_part), then the rest
    "embed": _kind(Embed, {"embedding_part": EmbeddingPart, "embedding": Embedding},
                   "embedding", {"embedding"}, {"embedding_part", "embedding"}),
    "rerank": _kind(Rerank, {"rerank": RerankReply}, "rerank", {"rerank"}),
}


def kind_of(msg: Request) -> Kind:
    return KINDS[msg.type]


# Event kinds that end a request (nothing more is sent for its id).
FINAL = frozenset({"error"}).union(*(k.final for k in KINDS.values()))
COUNTED = frozenset({"engine"}).union(*(k.counted for k in KINDS.values()))

# -- checking ----------------------------------------------------------------------------------


def _by_type(*classes: type) -> dict[str, Callable[[dict[str, Any]], Any]]:
    return {typing.get_type_hints(c)["type"].__args__[0]: builder(c) for c in classes}


_COMMANDS = _by_type(Load, *(k.message for k in KINDS.values()), Cancel, Shutdown)
_REPLIES = _by_type(Ready, Fatal)

PAYLOADS: dict[str, Check] = {
    event: model_check(payload, DAEMON_STATS if payload is Stats else ())
    if isinstance(payload, type) and issubclass(payload, BaseModel) else compile_check(payload)
    for k in KINDS.values() for event, payload in k.replies.items()
} | {
    "error": typeddict_check(Error, word),
    # the engine's counters: numbers, whichever the engine keeps
    "engine": fields_check({}, set(), number),
}


def _head(msg: Any, known: dict[str, Any], extra: tuple[str, ...] = ()) -> str:
    """A message's type, if the frame is an object of a type in `known` (or `extra`)."""
    if type(msg) is not dict:
        raise expected("an object", msg).error("message")
    kind = msg.get("type")
    if kind not in known and kind not in extra:
        raise ProtocolError(f"unknown message type {str(kind)[:40]!r}" if kind is not None
                            else "message: missing type")
    return str(kind)


def parse_command(msg: Any) -> Command:
    """A decoded frame from the daemon as the message it is (ProtocolError if it is none)."""
    kind = _head(msg, _COMMANDS)
    try:
        command: Command = _COMMANDS[kind](msg)
    except Bad as bad:
        raise bad.error(kind) from None
    return command


def _event(event: Any) -> None:
    if type(event) is not list or len(event) != 3:
        raise expected("[id, kind, payload]", event)
    rid, kind, payload = event
    if type(rid) is not str:
        raise expected("a string id", rid)
    check = PAYLOADS.get(kind) if type(kind) is str else None
    if check is None:
        raise Bad(f"unknown event kind {str(kind)[:40]!r}")
    if kind == "chunk" and type(payload) is dict and len(payload) == 1 \
            and type(payload.get("text")) is str:
        return  # plain text: nearly every event, checked without a call
    try:
        check(payload)
        sane(payload)
        if kind in COUNTED:
            counts(payload)
    except Bad as bad:
        bad.path.append(f" ({kind})")
        raise


def parse_reply(msg: Any) -> Reply:
    """A decoded frame from a runner as the message it is (ProtocolError if it is none):
    what a runner sends is checked here, and only here, before the daemon reads it."""
    kind = _head(msg, _REPLIES, ("events",))
    try:
        if kind != "events":
            reply: Reply = _REPLIES[kind](msg)
            return reply
        if len(msg) != 2:
            fields_check({"type": str, "events": list[Any]}, {"events"})(msg)
        events = msg["events"]
        if type(events) is not list:
            raise expected("a list", events)
        for i, event in enumerate(events):
            try:
                _event(event)
            except Bad as bad:
                bad.path.append(f"[{i}]")
                raise
    except Bad as bad:
        raise bad.error(kind) from None
    return Events(events=events)
