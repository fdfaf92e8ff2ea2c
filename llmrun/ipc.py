"""Framing for the daemon <-> runner channel: a 4-byte big-endian length, then JSON.

One frame per message. The runner sends all sequences' new text of a decode step in one
frame, so the per-token cost on the daemon side is one JSON parse per step, not per token.

Both sides check a frame's size before sending it: a receiver treats a frame over MAX_FRAME
as a broken channel, so an oversized message would take the runner (and every request on it)
down. The daemon answers such a request with 413; the runner splits what it can (an events
frame, an embedding reply) and fails the rest.
"""

from __future__ import annotations

import socket
import struct
import threading
from typing import Any

from llmrun import jsonio

HEADER = struct.Struct(">I")
MAX_FRAME = 64 << 20  # read at call time (not imported by value): tests and --max-frame set it

# Exit statuses of a runner that ends itself because it can no longer serve: the daemon sees
# a dead runner (and starts a fresh one) instead of a live process whose requests hang.
EXIT_ENGINE_FAILED = 70  # the engine thread raised
EXIT_SERVE_FAILED = 71  # the loop reading the daemon's messages raised
EXIT_REASONS = {EXIT_ENGINE_FAILED: "its engine thread failed",
                EXIT_SERVE_FAILED: "its message loop failed"}


class ChannelClosed(ConnectionError):
    pass


class FrameTooLarge(ValueError):
    """A message whose frame would exceed MAX_FRAME; nothing was sent."""

    def __init__(self, size: int) -> None:
        super().__init__(f"a message of {size} bytes exceeds the IPC frame limit of "
                         f"{MAX_FRAME} bytes")
        self.size = size


def encode(msg: dict[str, Any]) -> bytes:
    body = jsonio.dumps(msg)
    if len(body) > 0xFFFFFFFF:  # the header cannot even state its length
        raise FrameTooLarge(len(body))
    return HEADER.pack(len(body)) + body


def body_size(frame: bytes) -> int:
    return len(frame) - HEADER.size


def checked(frame: bytes) -> bytes:
    """`frame` if its body fits MAX_FRAME, else FrameTooLarge."""
    if body_size(frame) > MAX_FRAME:
        raise FrameTooLarge(body_size(frame))
    return frame


def decode_length(header: bytes) -> int:
    (n,) = HEADER.unpack(header)
    if n > MAX_FRAME:
        raise ChannelClosed(f"frame of {n} bytes exceeds the limit")
    return n


class SyncChannel:
    """Blocking side used inside the runner process (reader thread + engine thread)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, msg: dict[str, Any]) -> None:
        self.send_frame(encode(msg))

    def send_frame(self, frame: bytes) -> None:
        """Send an encoded message (FrameTooLarge if over the limit: the peer would drop
        the channel)."""
        checked(frame)
        with self._send_lock:
            self.sock.sendall(frame)

    def _read_exact(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ChannelClosed("peer closed the channel")
            buf += chunk
        return bytes(buf)

    def recv(self) -> dict[str, Any]:
        n = decode_length(self._read_exact(HEADER.size))
        return jsonio.loads(self._read_exact(n))
