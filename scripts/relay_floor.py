"""What the least a Python relay can cost per streamed token, beside a decode-like process.

A fake runner (a child process) sends one events frame every PERIOD seconds over a Unix
socket, as the engine does per step, and between frames either spins or streams a buffer
of --stream-mb through the caches (a decode reads all the weights once per token). A
minimal relay on uvloop turns each frame into an OpenAI-style SSE chunk on a TCP connection
to a reading client (another child). It prints the relay's CPU time per token: the floor
under what the daemon spends on the same path (docs/benchmarks.md, serving against llama-server).

    .venv/bin/python scripts/relay_floor.py --stream-mb 0     # runner spins: warm caches
    .venv/bin/python scripts/relay_floor.py --stream-mb 100   # runner streams: cold caches
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import time
from typing import Any

import numpy as np
import orjson
import uvloop

from llmrun.ipc import HEADER, encode


def runner(sock: socket.socket, tokens: int, period: float, stream_mb: int) -> None:
    buf = np.ones(stream_mb * (1 << 20) // 8) if stream_mb else None
    for _ in range(tokens):
        sock.sendall(encode({"type": "events", "events": [["r1", "chunk", {"text": " word"}]]}))
        until = time.perf_counter() + period
        while time.perf_counter() < until:
            if buf is not None:
                buf.sum()
    sock.close()


def client(port: int) -> None:
    s = socket.create_connection(("127.0.0.1", port))
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    while s.recv(65536):
        pass


class Relay(asyncio.Protocol):
    def __init__(self, out: asyncio.Transport, done: asyncio.Future[None]) -> None:
        self.out = out
        self.done = done
        self.buf = bytearray()

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while len(self.buf) >= HEADER.size:
            end = HEADER.size + HEADER.unpack_from(self.buf)[0]
            if len(self.buf) < end:
                return
            self.relay(orjson.loads(self.buf[HEADER.size:end]))
            del self.buf[:end]

    def relay(self, msg: dict[str, Any]) -> None:
        for _, _, payload in msg["events"]:
            chunk = orjson.dumps({
                "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
                "model": "bench", "choices": [{"index": 0, "delta": {"content": payload["text"]},
                                               "finish_reason": None}]})
            body = b"data: " + chunk + b"\n\n"
            self.out.write(b"%x\r\n%b\r\n" % (len(body), body))

    def connection_lost(self, exc: Exception | None) -> None:
        self.out.write(b"0\r\n\r\n")
        self.out.close()
        self.done.set_result(None)


async def main(args: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    ours, theirs = socket.socketpair()
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    if os.fork() == 0:
        theirs.close()
        client(server.getsockname()[1])
        os._exit(0)
    conn, _ = await loop.sock_accept(server)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    await loop.sock_recv(conn, 4096)
    out, _ = await loop.connect_accepted_socket(asyncio.Protocol, conn)
    out.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
              b"transfer-encoding: chunked\r\n\r\n")
    if os.fork() == 0:
        ours.close()
        runner(theirs, args.tokens, args.period, args.stream_mb)
        os._exit(0)
    theirs.close()
    done: asyncio.Future[None] = loop.create_future()
    t0 = time.process_time()
    await loop.connect_accepted_socket(lambda: Relay(out, done), ours)
    await done
    print(f"relay CPU per token: {(time.process_time() - t0) / args.tokens * 1e6:.0f} us "
          f"(runner {'streams ' + str(args.stream_mb) + ' MB' if args.stream_mb else 'spins'} "
          f"between tokens)")
    os.wait()
    os.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--period", type=float, default=0.007, help="seconds between tokens")
    parser.add_argument("--stream-mb", type=int, default=100)
    uvloop.run(main(parser.parse_args()))
