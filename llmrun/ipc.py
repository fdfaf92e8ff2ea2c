"""Framing for the daemon <-> runner channel: a 4-byte big-endian length, then JSON.

One frame per message. The runner sends all sequences' new text of a decode step in one
frame, so the per-token cost on the daemon side is one JSON parse per step, not per token.

Both sides check a frame's size before sending it: a receiver treats a frame over MAX_FRAME
as a broken channel, so an oversized message would take the runner (and every request on it)
down. The daemon answers such a request with 413; the runner splits what it can (an events
frame, an embedding reply) and fails the rest.
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any, cast

import orjson

from llmrun import jsonio
from llmrun.tokenbucket import TokenBucket

HEADER = struct.Struct(">I")
MAX_FRAME = 64 << 20  # read at call time (not imported by value): tests and Load.max_frame set it

# Exit statuses of a runner that ends itself because it can no longer serve: the daemon sees
# a dead runner (and starts a fresh one) instead of a live process whose requests hang.
EXIT_ENGINE_FAILED = 70  # the engine thread raised
EXIT_SERVE_FAILED = 71  # the loop reading the daemon's messages raised
EXIT_REASONS = {EXIT_ENGINE_FAILED: "its engine thread failed",
                EXIT_SERVE_FAILED: "its message loop failed"}

# How long a stopping runner may spend finishing the prompt states it has started writing
# (a 16k-token Gemma 3 state is ~58 MB: well under a second on a disk, several on a busy
# one); past it they are dropped whole. The daemon waits this long and a margin before it
# kills a runner it asked to stop.
STOP_SECONDS = 10.0


class ChannelClosed(ConnectionError):
    pass


class BadFrame(ChannelClosed):
    """What no peer of the protocol sends: a frame over MAX_FRAME, one that is not UTF-8
    JSON, or file descriptors. The channel is broken, and the daemon stops the runner."""


class FrameTooLarge(ValueError):
    """A message whose frame would exceed MAX_FRAME; nothing was sent."""

    def __init__(self, size: int) -> None:
        super().__init__(f"a message of {size} bytes exceeds the IPC frame limit of "
                         f"{MAX_FRAME} bytes")
        self.size = size


def encode(msg: object) -> bytes:
    """A message (llmrun.protocol's, or a dict) as a frame."""
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


def decode_length(header: bytes | bytearray) -> int:
    (n,) = HEADER.unpack(header)
    if n > MAX_FRAME:
        raise BadFrame(f"a frame of {n} bytes (over the limit of {MAX_FRAME})")
    return n


def loads_untrusted(body: bytes | bytearray | memoryview) -> Any:
    """A runner's frame body, decoded so that every string in it can be sent on to a client:
    BadFrame if it is not UTF-8 JSON. orjson refuses bytes that are not UTF-8 and lone
    surrogates (a \\ud800 escape); the standard library, which reads what orjson refuses
    for other reasons (nesting over 255, NaN), would turn such an escape into a string that
    fails to encode when a response is written, far from here: that is refused here."""
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError:
        pass
    try:
        value = json.loads(bytes(body).decode("utf-8"))
        json.dumps(value, ensure_ascii=False).encode("utf-8")  # a lone surrogate raises
    except UnicodeError:
        raise BadFrame("a frame whose text is not UTF-8 (or holds a lone surrogate)") from None
    except (ValueError, RecursionError) as exc:
        raise BadFrame(f"a frame that is not JSON ({type(exc).__name__})") from None
    return value


class SyncChannel:
    """Blocking side used inside the runner process (reader thread + engine thread)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()
        # The reader waits in poll() for input, never in a blocking recv(): a thread asleep
        # in recv() on a Unix socket is also woken each time the peer reads what this side
        # sent (the socket's "writable" wakeup is not filtered there), which in the runner
        # meant a wakeup of its reading thread for every token, taking a core from the
        # decode threads. poll() sleeps through those.
        self._readable = select.poll()
        self._readable.register(sock, select.POLLIN)

    def send(self, msg: object) -> None:
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
            self._readable.poll()
            chunk = self.sock.recv(n - len(buf))
            if not chunk:
                raise ChannelClosed("peer closed the channel")
            buf += chunk
        return bytes(buf)

    def recv(self) -> Any:
        """The next frame, decoded (llmrun.protocol checks what it holds)."""
        n = decode_length(self._read_exact(HEADER.size))
        return jsonio.loads(self._read_exact(n))


class FrameProtocol(asyncio.Protocol):
    """The daemon's side of the channel, on the event loop: frames are parsed as they arrive
    and handed to `on_message` from `data_received`. A runner sends a frame per engine step,
    so no reader task sits between the socket and the requests' queues (a task switch per
    frame, and its wakeup, is what a stream reader would cost on every token).

    `on_lost(exc)` is called once when the channel ends: the runner closed it (None), or it
    broke, or it sent what no runner sends (BadFrame: a frame over MAX_FRAME, not UTF-8
    JSON, file descriptors), or `on_message` raised.
    """

    def __init__(self, on_message: Callable[[Any], None],
                 on_lost: Callable[[BaseException | None], None]) -> None:
        self._on_message = on_message
        self._on_lost = on_lost
        self._buf = bytearray()
        self.transport: asyncio.Transport | None = None
        self._paused = False  # the socket's send buffer is full: writers wait in drain()
        self._drained: asyncio.Future[None] | None = None
        self._lost = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (uvloop's is no subclass)

    def data_received(self, data: bytes) -> None:
        if self._lost:
            return  # (broken: what still arrives is not read)
        try:
            if not self._buf and len(data) >= HEADER.size \
                    and decode_length(data[:HEADER.size]) == len(data) - HEADER.size:
                # one whole frame (nearly every read): parsed in place, no copy
                self._on_message(loads_untrusted(memoryview(data)[HEADER.size:]))
                return
            buf = self._buf
            buf += data
            while len(buf) >= HEADER.size:
                end = HEADER.size + decode_length(buf[:HEADER.size])
                if len(buf) < end:
                    break
                body = buf[HEADER.size:end]  # (a copy: orjson reads a bytearray as it is)
                del buf[:end]
                self._on_message(loads_untrusted(body))
        except Exception as exc:  # a frame over the limit, or a bug: the channel is broken
            self._lose(exc)
            if self.transport is not None:
                self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        self._lose(exc)

    def _lose(self, exc: BaseException | None) -> None:
        if self._lost:
            return
        self._lost = True
        if self._drained is not None and not self._drained.done():
            self._drained.set_exception(ChannelClosed("the channel closed"))
            self._drained.exception()  # (retrieved: no writer may be waiting)
        self._on_lost(exc)

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def write(self, frame: bytes) -> None:
        if self.transport is None or self._lost:
            raise ChannelClosed("the channel closed")
        self.transport.write(frame)

    async def drain(self) -> None:
        """Wait until the socket takes more (every writer waits on one future)."""
        if self._lost:
            raise ChannelClosed("the channel closed")
        if not self._paused:
            return
        if self._drained is None or self._drained.done():
            self._drained = asyncio.get_running_loop().create_future()
        await asyncio.shield(self._drained)  # a cancelled writer leaves it to the others

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


# Bytes read per wakeup (asyncio's stream transports read 256 KiB too).
READ_SIZE = 256 << 10
# Bytes a second read from one runner, as a token bucket; past it the daemon stops reading
# that runner for the moment (its sends wait; the event loop and the other runners go on).
# The bounds on events cap what one frame may hold, not how many large frames come: frames
# of late events for cancelled requests, each within every bound, could otherwise keep the
# event loop parsing. Generated text is kilobytes a second; an embedding batch on a fast GPU
# is the largest legit flow, ~100-200 MiB/s of JSON, slowed at worst, never stopped. Parsing
# 256 MiB/s costs about a quarter of a core at orjson's speed.
READ_RATE = 256 << 20
READ_BURST = 256 << 20
# Bytes waiting to be sent past which writers wait in drain(), and below which they go on.
WRITE_HIGH = 64 << 10
WRITE_LOW = 16 << 10


class SocketTransport:
    """The daemon's side of a runner's socket on the event loop, in place of asyncio's
    transport: the same reads (one per wakeup, at most READ_RATE bytes a second) but with
    recvmsg, so that file descriptors a runner passes (SCM_RIGHTS) are seen. With no room
    for ancillary data the kernel installs none of them here, closes them and says so
    (MSG_CTRUNC): the channel is broken (BadFrame) and the runner stopped. Writes are
    buffered; `protocol` is told to pause past WRITE_HIGH bytes waiting, as asyncio's
    transports do. add_reader and add_writer work the same on asyncio's loop and uvloop."""

    def __init__(self, sock: socket.socket, protocol: FrameProtocol,
                 rate: float = READ_RATE, burst: float = READ_BURST) -> None:
        self._loop = asyncio.get_running_loop()
        self._bytes = TokenBucket.full(rate, burst, self._loop.time())  # that may be read
        self._sock = sock
        self._fd = sock.fileno()
        self._protocol = protocol
        self._out = bytearray()
        self._paused = False
        self._closed = False
        sock.setblocking(False)
        protocol.connection_made(cast(asyncio.BaseTransport, self))
        self._loop.add_reader(self._fd, self._read_ready)

    def _read_ready(self) -> None:
        try:
            data, _, flags, _ = self._sock.recvmsg(READ_SIZE)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._lose(exc)
            return
        if flags & socket.MSG_CTRUNC:  # ancillary data (descriptors), dropped by the kernel
            self._lose(BadFrame("file descriptors on its channel"))
        elif not data:
            self._lose(None)
        else:
            self._spend(len(data))
            self._protocol.data_received(data)

    def _spend(self, n: int) -> None:
        """`n` bytes read: past the rate, reading waits until the bucket has refilled."""
        wait = self._bytes.spend(n, self._loop.time())
        if wait > 0:
            self._loop.remove_reader(self._fd)
            self._loop.call_later(wait, self._resume_reading)

    def _resume_reading(self) -> None:
        if not self._closed:
            self._loop.add_reader(self._fd, self._read_ready)

    def write(self, data: bytes) -> None:
        if self._closed:
            raise ChannelClosed("the channel closed")
        if not self._out:
            try:
                sent = self._sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self._lose(exc)
                raise ChannelClosed("the channel closed") from exc
            if sent == len(data):
                return
            self._loop.add_writer(self._fd, self._write_ready)
            data = data[sent:]
        self._out += data
        if not self._paused and len(self._out) > WRITE_HIGH:
            self._paused = True
            self._protocol.pause_writing()

    def _write_ready(self) -> None:
        try:
            sent = self._sock.send(self._out)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._lose(exc)
            return
        del self._out[:sent]
        if not self._out:
            self._loop.remove_writer(self._fd)
        if self._paused and len(self._out) <= WRITE_LOW:
            self._paused = False
            self._protocol.resume_writing()

    def abort(self) -> None:
        self._lose(None)

    def close(self) -> None:
        self._lose(None)

    def _lose(self, exc: Exception | None) -> None:
        if self._closed:
            return
        self._closed = True
        self._loop.remove_reader(self._fd)
        self._loop.remove_writer(self._fd)
        self._sock.close()
        self._out.clear()
        self._loop.call_soon(self._protocol.connection_lost, exc)
