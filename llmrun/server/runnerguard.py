"""What one runner may send the daemon: its output is hostile input.

A runner parses untrusted model files, so the daemon assumes code running in it may say
anything on its channel. protocol.parse_reply checks each message's shape; this module adds
the bounds on its volume, checked as each frame arrives and before any event is queued, and
the check of a runner's Ready against the Load that started it. Past any bound the runner is
stopped, as one naming a request it was never given is (RunnerProcess): its requests fail
with a clear error, the daemon and the other runners go on.

Beyond one frame, what a request may be sent over its life (`EventQueue`, `answer_budget`):
only the kinds of event its request gets, and no more bytes than any answer to it could
take; what waits unread for slow clients is bounded per runner (`MAX_UNREAD`). And what an
agent acts on is checked as the runner checked it: each tool call against the request's
tools and schemas (`check_calls`, with chat/'s one checker), each embedding's numbers and
width (`check_vectors`).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from llmrun import jsonio, protocol
from llmrun.chat import tools
from llmrun.request import ChatRequest, Chunk
from llmrun.tokenbucket import TokenBucket

# Characters of text one event may carry. A decode step gives a request a few tokens (a
# draft model's run, at most a few dozen); the largest legitimate event is a prefill step's
# prompt logprobs (echo): n_batch tokens with up to 20 alternatives each, ~1 M characters
# at a batch of 8192. 4 Mi characters leaves room for that and still stops a runner that
# pours megabytes into one request's stream.
MAX_EVENT_TEXT = 4 << 20
# One-answer replies answer what the daemon sent (a prompt rendered back, a text's tokens, a
# batch's vectors): their size follows the request's, which the daemon bounded by the frame
# limit when sending it, and the runner splits embeddings itself (embedding_part). They are
# bounded by the frame limit alone.
UNBOUNDED_TEXT = frozenset().union(*(k.unbounded for k in protocol.KINDS.values()))
# Events one frame may carry: a step sends each busy sequence a chunk (a started, progress or
# done besides), and the engine's counters. 4096 is hundreds of times a usual slot count's
# needs; a runner with more slots gets 8 events for each.
MAX_EVENTS_PER_FRAME = 4096
EVENTS_PER_SLOT = 8
# Frames per second, as a token bucket. A runner sends a frame per engine step, a heartbeat
# a second while busy, and an oversized events frame in a few pieces. A step of a real model
# takes a millisecond or more (<= 1,000 frames a second); the tests' 1.5 MB model sent one
# every 0.24 ms (median) on one core. 20,000 a second, sustained, is 5x that and costs the
# daemon about a tenth of a core to read; a runner flooding it with millions of tiny frames
# is stopped within a second instead of taking the event loop from every other stream.
FRAME_RATE = 20_000.0
FRAME_BURST = 20_000.0


class RunnerAbuse(protocol.ProtocolError):
    """A runner sent more than a runner ever needs to (what, as a noun phrase): it is
    stopped."""


def text_size(value: Any) -> int:
    """The characters of every string in `value` (keys included), however nested."""
    if type(value) is str:
        return len(value)
    if type(value) is dict:
        return sum(len(k) + text_size(v) for k, v in value.items())
    if type(value) is list:
        return sum(text_size(v) for v in value)
    return 0


# What an event costs the daemon to hold, estimated in bytes from its decoded JSON: its
# characters, VALUE_BYTES for each value (a number, string, list or object) and EVENT_BYTES
# for the event itself. Measured with tracemalloc on orjson's output (CPython 3.11): a plain
# one-character chunk held in a queue takes 352 bytes (the estimate: 1 + 2 x 48 + 256), a
# float or int in a list 32-36, a short string in a list 59, a chunk with logprobs and the top
# 20 alternatives 7,950 (the estimate: 8,700).
VALUE_BYTES = 48
EVENT_BYTES = 256


def measure(value: Any) -> tuple[int, int]:
    """(characters of every string, keys included; values) in `value`, however nested, in
    one walk without recursion."""
    chars = values = 0
    stack = [value]
    while stack:
        v = stack.pop()
        values += 1
        t = type(v)
        if t is str:
            chars += len(v)
        elif t is dict:
            for k in v:
                chars += len(k)
            stack.extend(v.values())
        elif t is list:
            stack.extend(v)
    return chars, values


class Guard:
    """The volume bounds of one runner's channel: `frame()` for each frame as it arrives,
    `events()` for its events before they are queued. Each raises RunnerAbuse, saying which
    bound the runner passed."""

    def __init__(self, slots: int = 1, rate: float = FRAME_RATE, burst: float = FRAME_BURST,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_events = max(MAX_EVENTS_PER_FRAME, EVENTS_PER_SLOT * slots)
        self.rate = rate
        self._clock = clock
        self._frames = TokenBucket.full(rate, burst, clock())

    def frame(self, frame: Any) -> None:
        """One more frame, decoded but not yet checked by protocol.parse_reply: within the
        rate, and not more events than a frame may carry (counted before each is checked,
        which for a 64 MiB frame of tiny events would hold the event loop a second), or
        RunnerAbuse."""
        if not self._frames.take(1.0, self._clock()):
            raise RunnerAbuse(f"over {self.rate:g} frames a second")
        events = frame.get("events") if type(frame) is dict else None
        if type(events) is list and len(events) > self.max_events:
            raise RunnerAbuse(f"{len(events)} events in one frame (at most {self.max_events})")

    def events(self, events: list[tuple[str, str, Any]]) -> list[int]:
        """A frame's events (checked by protocol.parse_reply): none with more text than
        MAX_EVENT_TEXT, or RunnerAbuse; what each costs to hold (VALUE_BYTES). Plain text,
        nearly every event, costs a len(). One-answer replies are not walked (an embedding
        reply is a million numbers): only their own requests take them (EventQueue.kinds),
        whose reader is the daemon, which reads them at once."""
        sizes = []
        for _, kind, payload in events:
            if kind == "chunk" and len(payload) == 1:
                chars = len(payload["text"])
                size = chars + 2 * VALUE_BYTES + EVENT_BYTES
            elif kind in UNBOUNDED_TEXT:
                sizes.append(EVENT_BYTES)
                continue
            else:
                chars, values = measure(payload)
                size = chars + values * VALUE_BYTES + EVENT_BYTES
            if chars > MAX_EVENT_TEXT:
                raise RunnerAbuse(f"a {kind!r} event of {chars} characters (at most "
                                  f"{MAX_EVENT_TEXT})")
            sizes.append(size)
        return sizes


# -- a request's events over its life ------------------------------------------------------------
#
# The kinds of event each request gets (protocol.KINDS): the daemon sends a runner nothing
# else, so an event of another kind for it is a lie (an embedding reply sent to a chat
# stream would wait, unmeasured, on a client that reads slowly).
GENERATE_KINDS = protocol.KINDS["generate"].events


# The most an honest runner sends one generate request, in VALUE_BYTES' estimate: each token
# it may generate and each of the prompt's is an event or part of one. A token's piece is a
# few characters, its event 352 bytes held (a vocabulary's longest pieces: a few hundred
# characters); TOKEN_BYTES is over ten times that, and as much again for each logprob
# alternative asked (the top 20: 7,950 bytes a token, measured, under 22 x 4,096). A prompt's
# token costs PROMPT_TOKEN_BYTES at most without echo (its place in done's `context`, its
# share of the progress events), TOKEN_BYTES with logprobs when echoed; ANSWER_BYTES covers
# the rest (started, done, an error's message, a stop string). A tool call's arguments are
# the generated text again, parsed (each value at least a character of it): within the
# tokens' share. Generation ends after num_predict tokens, or once the context is full, or
# with `shift` after SHIFT_LIMIT contexts' worth (engine/sampling.py, which the daemon does
# not import; draft tokens stay within num_predict). A runner past its request's budget says
# more than any answer to that request could: it is stopped.
TOKEN_BYTES = 4096
PROMPT_TOKEN_BYTES = 256
ANSWER_BYTES = 1 << 20
SHIFT_LIMIT = 10
DRAFT_SLACK = 64  # tokens: a draft's last accepted run and the token after it


def answer_budget(req: ChatRequest, n_ctx: int) -> int:
    """The most bytes (estimated) an honest runner sends generate request `req` (merged with
    its Modelfile) over its life, on a runner whose context is `n_ctx` tokens."""
    o = req.options
    ceiling = n_ctx * (SHIFT_LIMIT if o.shift else 1)
    wanted = o.num_predict if o.num_predict is not None and o.num_predict > 0 else ceiling
    generated = min(wanted, ceiling) + DRAFT_SLACK
    alternatives = max(req.logprobs or 0, req.prompt_logprobs or 0)
    per_token = TOKEN_BYTES * (1 + (alternatives + 1 if req.logprobs is not None else 0))
    per_prompt_token = PROMPT_TOKEN_BYTES if req.prompt_logprobs is None \
        else TOKEN_BYTES * (alternatives + 2)
    return ANSWER_BYTES + generated * per_token + n_ctx * per_prompt_token


# Bytes (estimated) of events one runner's generate requests may hold unread. A client that
# reads more slowly than the model writes (or not at all) leaves its events waiting here;
# past this, the request holding the most is failed (too_large) and cancelled in the runner,
# never the runner: its clients, not it, are slow. Measured: 256 MiB holds ~760,000 plain
# tokens, or ~33,000 with the top 20 logprobs each, unread; with LLMRUN_MAX_LOADED_MODELS
# runners, what slow clients (or a runner writing for them) can make the daemon hold.
MAX_UNREAD = 256 << 20


@dataclass
class Unread:
    """The bytes (estimated) one runner's requests hold unread, all of them together."""

    total: int = 0


class EventQueue(asyncio.Queue[tuple[str, Any]]):
    """One request's events on their way to it: the `kinds` it gets, the bytes it was sent
    (`total`, within `budget` if it has one) and those waiting to be read (`waiting`, also
    counted in the runner's `unread` for a request whose reader is a client)."""

    def __init__(self, kinds: frozenset[str], budget: int | None = None,
                 unread: Unread | None = None) -> None:
        super().__init__()
        self.kinds = kinds
        self.budget = budget
        self.unread = unread
        self.total = 0
        self.waiting = 0
        self._sizes: deque[int] = deque()  # each queued event's, in order

    def over_budget(self, size: int) -> str:
        """Why an event of `size` bytes is more than this request can be sent ("" if not)."""
        if self.budget is not None and self.total + size > self.budget:
            return (f"more than any answer to its request could: over {self.budget} bytes "
                    "(its num_predict, context and logprobs allow no more)")
        return ""

    def add(self, event: tuple[str, Any], size: int) -> None:
        self.put_nowait(event)
        self._sizes[-1] = size
        self.total += size
        self.waiting += size
        if self.unread is not None:
            self.unread.total += size

    def _put(self, item: tuple[str, Any]) -> None:
        super()._put(item)
        self._sizes.append(0)  # (an error put by the daemon itself costs nothing)

    def _get(self) -> tuple[str, Any]:
        item = super()._get()
        size = self._sizes.popleft()
        self.waiting -= size
        if self.unread is not None:
            self.unread.total -= size
        return item

    def discard(self) -> None:
        """Drop what waits unread (its reader has gone, or will get an error instead)."""
        while not self.empty():
            self.get_nowait()


# -- what an agent acts on ------------------------------------------------------------------------


def check_calls(request: dict[str, Any], chunk: Chunk) -> str:
    """Why the tool calls in `chunk` are none the runner could have read for `request` (the
    Generate message's, as sent): "" when they are. The request is read back as the runner
    read it (its JSON round trip), and each call checked with the ToolCheck the runner read
    calls with (tools.call_check): a tool the request offers, arguments that are JSON data
    and valid under its schema (the runner checks the schema whether or not the client asked
    for strict output), at most one call when parallel calls are off; a call cut off by the
    token limit names an offered tool. Run off the event loop: a schema check is the
    runner's own cost, once per answer that calls."""
    req = ChatRequest.model_validate(jsonio.loads(jsonio.dumps(request)))
    check = tools.call_check(req)
    calls = chunk.tool_calls or []
    if len(calls) > 1 and not req.parallel_tool_calls:
        return f"{len(calls)} tool calls to a request that allows one"
    for call in calls:
        if call.name not in check.names:
            return f"a call of {call.name[:40]!r}, a tool its request did not offer"
        if not check.accepts(call.name, call.arguments):
            return f"a call of {call.name[:40]!r} whose arguments its schema refuses"
    partial = chunk.partial_call
    if partial is not None and partial.name not in check.names:
        return f"a call of {partial.name[:40]!r}, a tool its request did not offer"
    return ""


def check_vectors(vectors: list[list[Any]], width: int | None) -> tuple[str, int | None]:
    """(why `vectors`, an embedding reply, cannot be believed, or ""; the width they set).
    Each is a list of finite numbers (null stands for the NaN of a model that overflows in
    half precision, as the engine's JSON writes it, and is passed on as before), all of one
    width: `width` when the runner already set one. A string, boolean or list inside would
    reach a client's vector store, or fail far from here (a 500 writing base64). About 60 ms
    for a piece of 256 vectors of 4,096 (decoding its frame: 130 ms)."""
    for v in vectors:
        if width is None:
            width = len(v)
        if len(v) != width or not width:
            return f"embeddings of {len(v)} and {width} numbers from one model", width
        types = set(map(type, v))
        if not types <= _VECTOR_TYPES:
            return "an embedding holding what is not a number", width
        numbers = v if type(None) not in types else [x for x in v if x is not None]
        try:  # any NaN or infinity makes the sum one; an L2-normalised vector's is finite
            finite = math.isfinite(math.fsum(numbers))
        except OverflowError:  # (numbers past a double's range)
            finite = False
        if not finite:
            return "an embedding holding a number that is not finite", width
    return "", width


_VECTOR_TYPES = {float, int, type(None)}


# Ready.info, checked against the Load. What the daemon reads of it: n_ctx_seq (the context
# /api/ps shows), the sandbox claims (/api/ps, the daemon's warning), the RPC placement and the
# bytes measured per device (/api/ps). What it has its own truth for must agree with it; what
# only the runner can know is bounded, so a lie can show wrong numbers but nothing larger.
MAX_CLAIM_ITEMS = 64  # sandbox layers, missing layers, devices: a handful each
MAX_CLAIM_TEXT = 64 << 10  # characters of all the ready message's text (a few hundred, legit)


def check_ready(info: protocol.Info, load: protocol.Load, pid: int | None = None) -> str:
    """Why `info`, a runner's Ready, cannot be believed for `load` ("" when it can):
    the slots it has are those asked for, its context at most the one asked (the model's
    training context may cap it), devices only those it was told to use, an RPC placement
    only with workers, and sizes and lists within bounds. With `pid`, the confinement layers
    the kernel shows (seccomp, no_new_privs in /proc/<pid>/status) are checked there."""
    if info["n_slots"] != load.slots:
        return f"claims {info['n_slots']} slots, but {load.slots} were asked for"
    if not 1 <= info["n_ctx_seq"] <= load.ctx:
        return f"claims a context of {info['n_ctx_seq']} tokens, but {load.ctx} were asked for"
    if info["size"] < 0 or info["n_ctx_train"] < 0:
        return "claims a negative size"
    devices = info.get("devices") or {}
    if not devices.keys() <= set(load.device) or any(v < 0 for v in devices.values()):
        return f"claims memory on devices it was not given: {sorted(devices)[:8]}"
    if info.get("rpc") is not None and not load.rpc:
        return "claims an RPC placement, but it was given no RPC workers"
    claims = [*info.get("sandbox", []), *info.get("sandbox_missing", [])]
    if len(devices) > MAX_CLAIM_ITEMS or len(claims) > MAX_CLAIM_ITEMS \
            or text_size(dict(info)) > MAX_CLAIM_TEXT:
        return "is larger than any runner's"
    if pid is not None:
        return _kernel_disagrees(info.get("sandbox", []), pid)
    return ""


# Layers the kernel shows for a process, and what /proc/<pid>/status then says.
_KERNEL_SHOWN = {"seccomp": ("Seccomp", "2"), "no-new-privs": ("NoNewPrivs", "1")}


def _kernel_disagrees(layers: list[str], pid: int) -> str:
    shown = [layer for layer in layers if layer in _KERNEL_SHOWN]
    if not shown:
        return ""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return ""  # no /proc (or the runner is gone, which the next request finds)
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    for layer in shown:
        name, value = _KERNEL_SHOWN[layer]
        if name in fields and fields[name].strip() != value:
            return f"claims the {layer} layer, but the kernel says {name}: {fields[name].strip()}"
    return ""
