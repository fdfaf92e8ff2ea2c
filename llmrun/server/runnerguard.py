"""What one runner may send the daemon: its output is hostile input.

A runner parses untrusted model files, so the daemon assumes code running in it may say
anything on its channel. protocol.parse_reply checks each message's shape; this module adds
the bounds on its volume, checked as each frame arrives and before any event is queued, and
the check of a runner's Ready against the Load that started it. Past any bound the runner is
stopped, as one naming a request it was never given is (RunnerProcess): its requests fail
with a clear error, the daemon and the other runners go on.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llmrun import protocol
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
UNBOUNDED_TEXT = frozenset({"count", "tokens", "text", "embedding", "embedding_part"})
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

    def events(self, events: list[tuple[str, str, Any]]) -> None:
        """A frame's events (checked by protocol.parse_reply): none with more text than
        MAX_EVENT_TEXT, or RunnerAbuse. Plain text, nearly every event, costs a len()."""
        for _, kind, payload in events:
            if kind == "chunk" and len(payload) == 1:
                size = len(payload["text"])
            elif kind in UNBOUNDED_TEXT:
                continue
            else:
                size = text_size(payload)
            if size > MAX_EVENT_TEXT:
                raise RunnerAbuse(f"a {kind!r} event of {size} characters (at most "
                                  f"{MAX_EVENT_TEXT})")


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
