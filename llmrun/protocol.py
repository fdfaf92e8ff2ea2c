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

An event's kind and payload (the TypedDicts below; "engine" comes with the id ""):

    started   Started: the first event of a generate request (the prompt's size)
    progress  Progress: a long prompt being read (only to requests that asked)
    chunk     Chunk: output; only `text` when it is plain text (the per-token case)
    done      Done: the statistics; the request's last event
    error     Error: request.error_event (a code, a message, the code's fields)
    count     CountReply      tokens   TokensReply      text   TextReply
    embedding Embedding, after any number of embedding_part (EmbeddingPart): a reply too
              large for one frame
    rerank    RerankReply: each document's score, in the order sent
    engine    the engine's step counters (batcher.EngineStats), for /metrics

Messages are dataclasses (orjson writes them as it writes a dict, fields in the order declared,
`type` first); event payloads are plain dicts described by TypedDicts, since the engine builds
one per token. `parse_command` (runner side) and `parse_reply` (daemon side) turn a decoded
frame into these types, checking its shape strictly: an unknown type or kind, a missing or
ill-typed field, or one the protocol does not have is a ProtocolError naming it. Each side
treats a ProtocolError as a broken peer: the runner exits (the daemon starts a fresh one); the
daemon stops a runner that sent one and fails its requests. Requests (ChatRequest) and
payload members that pydantic models read later (logprobs, tool calls, statistics) are checked
here for their outer shape only.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, NotRequired, TypedDict, Union

from llmrun import config

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
    """How to load the model: the first frame on the channel (server/runners.RunnerSpec, with
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
    """Generate for `request`: a ChatRequest (model_dump) merged with its model's Modelfile."""

    type: Literal["generate"] = "generate"
    id: str
    request: dict[str, Any]


@dataclass(frozen=True, kw_only=True, slots=True)
class Count:
    """Render `request` only: its prompt's length (`detail`: the prompt and its tokens too)."""

    type: Literal["count"] = "count"
    id: str
    request: dict[str, Any]
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
    `request` is a ChatRequest (model_dump, messages empty) merged with the Modelfile, whose
    options and template say how the prompt is written (engine/rerank.py); a model with
    rank pooling ignores them and scores with its head (engine/crossencoder.py)."""

    type: Literal["rerank"] = "rerank"
    id: str
    request: dict[str, Any]
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


class Started(TypedDict):
    prompt_tokens: int
    cached_tokens: int
    n_ctx: int


class Progress(TypedDict):
    total: int
    cached: int
    processed: int


class Chunk(TypedDict):
    """request.Chunk's fields; members are read by that model."""

    text: str
    logprobs: NotRequired[list[Any] | None]
    tool_calls: NotRequired[list[Any] | None]
    partial_call: NotRequired[dict[str, Any] | None]
    thinking: NotRequired[str | None]
    prompt_logprobs: NotRequired[list[Any] | None]


class Done(TypedDict):
    """request.Stats's fields, as the engine fills them."""

    prompt_tokens: NotRequired[int]
    cached_tokens: NotRequired[int]
    completion_tokens: NotRequired[int]
    prompt_ns: NotRequired[int]
    generate_ns: NotRequired[int]
    finish_reason: NotRequired[str]
    stop_sequence: NotRequired[str | None]
    context: NotRequired[list[int] | None]
    truncated_messages: NotRequired[int]
    truncated_tokens: NotRequired[int]
    shifted_tokens: NotRequired[int]
    draft_tokens: NotRequired[int]
    draft_accepted: NotRequired[int]


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


# Event kinds that end a request (nothing more is sent for its id).
FINAL = frozenset({"done", "error", "embedding", "count", "tokens", "text", "rerank"})

# -- checking ----------------------------------------------------------------------------------


class ProtocolError(ValueError):
    """A frame that is not a message of this protocol (what is wrong, and where)."""


class _Bad(Exception):
    """A check's failure on its way out: `path` is filled in by the containers it passes
    through, so a frame that checks out formats no string at all (the events of every step
    pass here)."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what
        self.path: list[str] = []

    def error(self, where: str) -> ProtocolError:
        path = "".join(p if p.startswith(("[", " ")) else f".{p}" for p in reversed(self.path))
        return ProtocolError(f"{where}{path}: {self.what}")


Check = Callable[[Any], None]


def _expected(what: str, value: Any) -> _Bad:
    shown = repr(value)[:40] if isinstance(value, str | int | float | None) \
        else type(value).__name__
    return _Bad(f"expected {what}, got {shown}")


# The largest integer a float holds exactly (and JavaScript clients read exactly): counts,
# ids and sizes are far below it, so a number past it is a runner that lies.
MAX_INT = 1 << 53


def _scalar(kind: type, what: str) -> Check:
    def check(value: Any) -> None:
        # exact types: a JSON true is no integer here, an integer is a float's value
        if type(value) is not kind and not (kind is float and type(value) is int):
            raise _expected(what, value)
        if kind is int or kind is float:
            _in_range(value)
    return check


def _in_range(value: Any) -> None:
    """A number a dialect's JSON and /metrics can carry: finite, and an integer within
    MAX_INT (the standard library's fallback reads NaN, Infinity and any integer)."""
    if type(value) is float and not math.isfinite(value):
        raise _expected("a finite number", value)
    if type(value) is int and not -MAX_INT <= value <= MAX_INT:
        raise _expected(f"a number within {MAX_INT}", value)


_CHECKS: dict[Any, Check] = {
    str: _scalar(str, "a string"), int: _scalar(int, "an integer"),
    bool: _scalar(bool, "a boolean"), float: _scalar(float, "a number"),
}


def _any(value: Any) -> None:
    pass


def _compile(tp: Any) -> Check:
    """The check of a value of type `tp` (as the dataclasses and TypedDicts above use them)."""
    if tp in _CHECKS:
        return _CHECKS[tp]
    if tp is Any:
        return _any
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is NotRequired:
        return _compile(args[0])
    if origin is Literal:
        choices = frozenset(args)

        def literal(value: Any) -> None:
            if type(value) is not str or value not in choices:
                raise _expected(f"one of {sorted(choices)}", value)
        return literal
    if origin in (Union, types.UnionType):
        options = [_compile(a) for a in args if a is not type(None)]
        nullable = type(None) in args
        what = " or ".join(str(a).replace("typing.", "") for a in args)

        def union(value: Any) -> None:
            if value is None and nullable:
                return
            for option in options:
                try:
                    option(value)
                    return
                except _Bad:
                    pass
            raise _expected(what, value)
        return union
    if origin is list:
        # int-lists: a plain type test per item, no call (token ids: thousands per message)
        if tp == list[int]:
            def ints(value: Any) -> None:
                if type(value) is not list or not all(isinstance(v, int) for v in value):
                    raise _expected("a list of integers", value)
            return ints
        item = _compile(args[0])

        def listed(value: Any) -> None:
            if type(value) is not list:
                raise _expected("a list", value)
            if item is not _any:
                for i, v in enumerate(value):
                    try:
                        item(v)
                    except _Bad as bad:
                        bad.path.append(f"[{i}]")
                        raise
        return listed
    if origin is dict:
        values = _compile(args[1])

        def mapping(value: Any) -> None:
            if type(value) is not dict:
                raise _expected("an object", value)
            if values is not _any:
                _members(value, {}, values)
        return mapping
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _object(tp)
    if typing.is_typeddict(tp):
        return _typeddict(tp)
    raise TypeError(f"no check for {tp!r}")


def _members(value: dict[str, Any], checks: dict[str, Check], extra: Check | None) -> None:
    for name, v in value.items():
        c = checks.get(name, extra)
        if c is None:
            raise _Bad(f"unknown field {str(name)[:40]!r}")
        try:
            c(v)
        except _Bad as bad:
            bad.path.append(str(name)[:40])
            raise


def _fields(hints: dict[str, Any], required: set[str], extra: Check | None = None) -> Check:
    """The check of an object with these fields (`extra`: what any other field may hold;
    None: no other field)."""
    checks = {name: _compile(tp) for name, tp in hints.items()}
    needed = frozenset(required)

    def check(value: Any) -> None:
        if type(value) is not dict:
            raise _expected("an object", value)
        if not needed <= value.keys():
            raise _Bad(f"missing {', '.join(sorted(needed - value.keys()))}")
        _members(value, checks, extra)
    return check


def _typeddict(tp: Any, extra: Check | None = None) -> Check:
    """The check of a TypedDict's fields. (Its own __required_keys__ is wrong on Python 3.11
    when annotations are strings, as here: every key reads as required.)"""
    hints = typing.get_type_hints(tp, include_extras=True)
    required = {k for k, v in hints.items() if typing.get_origin(v) is not NotRequired}
    return _fields(hints, required, extra)


def _object(cls: type) -> Check:
    """The check of a dataclass's fields (which then builds it: see _builder)."""
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    required = {f.name for f in fields if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING}
    return _fields({f.name: hints[f.name] for f in fields}, required)


def _builder(cls: type) -> Callable[[dict[str, Any]], Any]:
    """Check a frame against dataclass `cls` and build it (nested dataclasses too)."""
    check = _object(cls)
    hints = typing.get_type_hints(cls)
    nested = {name: typing.get_args(hint)[0] for name, hint in hints.items()
              if typing.get_origin(hint) is list
              and dataclasses.is_dataclass(typing.get_args(hint)[0])}

    def build(msg: dict[str, Any]) -> Any:
        check(msg)
        kwargs = {k: v for k, v in msg.items() if k != "type"}
        for name, item in nested.items():
            if name in kwargs:
                kwargs[name] = [item(**v) for v in kwargs[name]]
        return cls(**kwargs)
    return build


def _by_type(*classes: type) -> dict[str, Callable[[dict[str, Any]], Any]]:
    return {typing.get_type_hints(c)["type"].__args__[0]: _builder(c) for c in classes}


_COMMANDS = _by_type(Load, Generate, Count, Tokenize, Detokenize, Embed, Rerank, Cancel,
                     Shutdown)
_REPLIES = _by_type(Ready, Fatal)


def _number(value: Any) -> None:
    if type(value) not in (int, float):
        raise _expected("a number", value)
    _in_range(value)


def _word(value: Any) -> None:
    if value is not None and type(value) not in (str, int, float, bool):
        raise _expected("a number, a string, a boolean or null", value)
    if type(value) in (int, float):
        _in_range(value)


# What the model computed or wrote, carried as data: a tool call's arguments may hold any
# number (-5, 1e300), and an embedding of a model that overflows in half precision a NaN
# (written as null, as before). The dialects write them as they are: no counts to check.
MODEL_DATA = frozenset({"tool_calls", "partial_call", "embeddings"})


def _sane(value: Any) -> None:
    """What a runner reports, whatever its declared shape (logprobs and tool calls are read
    later by pydantic): every float finite (NaN is no JSON a client can read), every integer
    within MAX_INT. (Token ids may be negative: an image's positions are stand-in ids.)"""
    if type(value) is int:
        if not -MAX_INT <= value <= MAX_INT:
            raise _expected(f"a number within {MAX_INT}", value)
    elif type(value) is float:
        if not math.isfinite(value):
            raise _expected("a finite number", value)
    elif type(value) is dict:
        for k, v in value.items():
            if k not in MODEL_DATA:
                _sane(v)
    elif type(value) is list:
        for v in value:
            _sane(v)


def _counts(payload: Any) -> None:
    """The counts of a statistics event (tokens, nanoseconds, steps) are zero or more: a
    negative one would run a /metrics counter backwards (prometheus raises)."""
    for v in payload.values():
        if type(v) in (int, float) and v < 0:
            raise _expected("a count of zero or more", v)


COUNTED = frozenset({"started", "progress", "done", "engine", "rerank", "embedding",
                     "count"})


PAYLOADS: dict[str, Check] = {
    "started": _compile(Started), "progress": _compile(Progress), "chunk": _compile(Chunk),
    "done": _compile(Done), "count": _compile(CountReply), "tokens": _compile(TokensReply),
    "text": _compile(TextReply), "embedding": _compile(Embedding),
    "embedding_part": _compile(EmbeddingPart), "rerank": _compile(RerankReply),
    "error": _typeddict(Error, _word),
    # the engine's counters: numbers, whichever the engine keeps
    "engine": _fields({}, set(), _number),
}


def _head(msg: Any, known: dict[str, Any], extra: tuple[str, ...] = ()) -> str:
    """A message's type, if the frame is an object of a type in `known` (or `extra`)."""
    if type(msg) is not dict:
        raise _expected("an object", msg).error("message")
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
    except _Bad as bad:
        raise bad.error(kind) from None
    return command


def _event(event: Any) -> None:
    if type(event) is not list or len(event) != 3:
        raise _expected("[id, kind, payload]", event)
    rid, kind, payload = event
    if type(rid) is not str:
        raise _expected("a string id", rid)
    check = PAYLOADS.get(kind) if type(kind) is str else None
    if check is None:
        raise _Bad(f"unknown event kind {str(kind)[:40]!r}")
    if kind == "chunk" and type(payload) is dict and len(payload) == 1 \
            and type(payload.get("text")) is str:
        return  # plain text: nearly every event, checked without a call
    try:
        check(payload)
        _sane(payload)
        if kind in COUNTED:
            _counts(payload)
    except _Bad as bad:
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
            _fields({"type": str, "events": list[Any]}, {"events"})(msg)
        events = msg["events"]
        if type(events) is not list:
            raise _expected("a list", events)
        for i, event in enumerate(events):
            try:
                _event(event)
            except _Bad as bad:
                bad.path.append(f"[{i}]")
                raise
    except _Bad as bad:
        raise bad.error(kind) from None
    return Events(events=events)
