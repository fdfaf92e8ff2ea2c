"""Framing for the daemon <-> runner channel: a 4-byte big-endian length, then JSON.

One frame per message. The runner sends all sequences' new text of a decode step in one
frame, so the per-token cost on the daemon side is one JSON parse per step, not per token.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
from typing import Any

HEADER = struct.Struct(">I")
MAX_FRAME = 64 << 20


class ChannelClosed(ConnectionError):
    pass


def encode(msg: dict[str, Any]) -> bytes:
    body = json.dumps(msg, separators=(",", ":"), ensure_ascii=False).encode()
    return HEADER.pack(len(body)) + body


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
        data = encode(msg)
        with self._send_lock:
            self.sock.sendall(data)

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
        return json.loads(self._read_exact(n))
