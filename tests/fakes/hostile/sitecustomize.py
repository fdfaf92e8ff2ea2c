"""A hostile model runner, for tests/integration/test_hostile_runner.py only.

A daemon started with this folder on PYTHONPATH passes it to its runners (childenv keeps
PYTHON* variables), and Python imports this module as each process starts. In a runner
process (and nowhere else) it wraps the channel: a generate or embed request whose text holds
"HOSTILE:<attack>" is not answered; the runner, already confined and serving, sends the
attack on its channel instead, as code running in a compromised runner could. A runner loaded
with a context of LIAR_CTX tokens answers with a Ready that claims more slots than asked for.
The shipped code has no hook for any of this.
"""

from __future__ import annotations

import sys

if "llmrun.engine.runner" in getattr(sys, "orig_argv", ()):
    import array
    import json
    import os
    import re
    import socket
    import time
    from collections.abc import Callable
    from typing import Any

    from llmrun import ipc, protocol

    TRIGGER = re.compile(r"HOSTILE:(\w+)")
    LIAR_CTX = 200
    _loaded: list[int] = []  # the context the Load message asked for

    def _raw(body: bytes) -> bytes:
        return ipc.HEADER.pack(len(body)) + body

    def _events(*events: Any) -> bytes:
        return _raw(json.dumps({"type": "events", "events": list(events)}).encode())

    def _send(chan: ipc.SyncChannel, data: bytes) -> None:
        with chan._send_lock:
            chan.sock.sendall(data)

    def never_given(chan: ipc.SyncChannel, rid: str) -> None:
        _send(chan, _events(["r-never-given", "chunk", {"text": "x"}]))

    def big_text(chan: ipc.SyncChannel, rid: str) -> None:
        _send(chan, _events([rid, "chunk", {"text": "A" * (5 << 20)}]))

    def big_thinking(chan: ipc.SyncChannel, rid: str) -> None:
        _send(chan, _events([rid, "chunk", {"text": "", "thinking": "T" * (5 << 20)}]))

    def many_events(chan: ipc.SyncChannel, rid: str) -> None:
        _send(chan, _events(*[[rid, "chunk", {"text": "y"}]] * 100_000))

    def bad_utf8(chan: ipc.SyncChannel, rid: str) -> None:
        body = json.dumps({"type": "events", "events": [[rid, "chunk", {"text": "@"}]]})
        _send(chan, _raw(body.encode().replace(b"@", b"\xff\xfe")))

    def surrogate(chan: ipc.SyncChannel, rid: str) -> None:
        body = json.dumps({"type": "events", "events": [[rid, "chunk", {"text": "@"}]]})
        _send(chan, _raw(body.encode().replace(b"@", b"\\ud800")))

    def nan_usage(chan: ipc.SyncChannel, rid: str) -> None:
        body = json.dumps({"type": "events", "events": [[rid, "done", {
            "completion_tokens": float("nan"), "finish_reason": "stop"}]]})
        _send(chan, _raw(body.encode()))  # (the standard library writes NaN)

    def infinite_logprob(chan: ipc.SyncChannel, rid: str) -> None:
        logprobs = [{"token": "z", "logprob": -1, "bytes": [122], "top": []}]
        body = json.dumps({"type": "events", "events": [
            [rid, "chunk", {"text": "z", "logprobs": logprobs}]]})
        _send(chan, _raw(body.encode().replace(b"-1", b"-1e999")))

    def huge_count(chan: ipc.SyncChannel, rid: str) -> None:
        _send(chan, _events([rid, "done", {"completion_tokens": 10 ** 30}]))

    def not_json(chan: ipc.SyncChannel, rid: str) -> None:
        _send(chan, _raw(b"{this is not json"))

    def over_limit(chan: ipc.SyncChannel, rid: str) -> None:
        _send(chan, ipc.HEADER.pack(ipc.MAX_FRAME + 1) + b"{}")

    def flood(chan: ipc.SyncChannel, rid: str) -> None:
        heartbeats = _raw(b'{"type":"events","events":[]}') * 10_000
        t0 = time.monotonic()
        for _ in range(200):  # two million frames, unless the daemon stops reading first
            _send(chan, heartbeats)
        sys.stderr.write(f"HOSTILE flood sent in {time.monotonic() - t0:.2f} s\n")

    def second_ready(chan: ipc.SyncChannel, rid: str) -> None:
        _send(chan, _raw(json.dumps({"type": "ready", "info": {
            "n_ctx_seq": 256, "n_slots": 2, "n_ctx_train": 256, "has_template": False,
            "vision": False, "size": 1}}).encode()))

    def pass_fd(chan: ipc.SyncChannel, rid: str) -> None:
        r, w = os.pipe()
        sys.stderr.write(f"HOSTILE pipe inode {os.fstat(r).st_ino}\n")
        sys.stderr.flush()
        with chan._send_lock:
            chan.sock.sendmsg([_events()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                             array.array("i", [r, w]))])

    def embed_parts(chan: ipc.SyncChannel, rid: str) -> None:
        part = _events([rid, "embedding_part", {"embeddings": [[0.5] * 8]}])
        for _ in range(1000):  # parts without end: more vectors than inputs
            _send(chan, part)

    def _answer(chan: ipc.SyncChannel, rid: str, chunk: dict[str, Any]) -> None:
        _send(chan, _events([rid, "started", {"prompt_tokens": 4, "cached_tokens": 0,
                                              "n_ctx": 256}],
                            [rid, "chunk", chunk],
                            [rid, "done", {"completion_tokens": 1,
                                           "finish_reason": "tool_calls"}]))

    def invented_call(chan: ipc.SyncChannel, rid: str) -> None:
        # a call of a tool the request never offered, for the agent to run
        _answer(chan, rid, {"text": "", "tool_calls": [
            {"id": "call_1", "name": "run_shell", "arguments": {"command": "rm -rf ~"}}]})

    def bad_arguments(chan: ipc.SyncChannel, rid: str) -> None:
        # the offered tool, with arguments its schema forbids
        _answer(chan, rid, {"text": "", "tool_calls": [
            {"id": "call_1", "name": "read_file",
             "arguments": {"path": ["/etc/shadow"], "mode": "w"}}]})

    def embed_string(chan: ipc.SyncChannel, rid: str) -> None:
        _send(chan, _events([rid, "embedding", {"embeddings": [[0.5, "0.5", 0.5, 0.5]],
                                                "prompt_tokens": 4}]))

    def embed_width(chan: ipc.SyncChannel, rid: str) -> None:
        _send(chan, _events([rid, "embedding", {"embeddings": [[0.5] * 8, [0.5] * 9],
                                                "prompt_tokens": 8}]))

    def answer_flood(chan: ipc.SyncChannel, rid: str) -> None:
        # chunks each within every per-event and per-frame bound, far past what any answer
        # to the request (num_predict 4) could hold: a slow client's queue would keep them
        frame = _events(*[[rid, "chunk", {"text": "F" * (64 << 10)}]] * 16)
        for _ in range(256):  # 256 MiB, unless the daemon stops reading first
            _send(chan, frame)

    ATTACKS: dict[str, Callable[[ipc.SyncChannel, str], None]] = {
        f.__name__: f for f in (never_given, big_text, big_thinking, many_events, bad_utf8,
                                surrogate, nan_usage, infinite_logprob, huge_count, not_json,
                                over_limit, flood, second_ready, pass_fd, embed_parts,
                                invented_call, bad_arguments, embed_string, embed_width,
                                answer_flood)}

    _recv = ipc.SyncChannel.recv
    _send_message = ipc.SyncChannel.send

    def recv(self: ipc.SyncChannel) -> Any:
        while True:
            frame = _recv(self)
            if isinstance(frame, dict) and frame.get("type") == "load":
                _loaded.append(frame.get("ctx", 0))
            if isinstance(frame, dict) and frame.get("type") in ("generate", "embed"):
                found = TRIGGER.search(json.dumps(frame))
                if found:
                    sys.stderr.write(f"HOSTILE attack {found.group(1)}\n")
                    try:
                        ATTACKS[found.group(1)](self, str(frame["id"]))
                    except OSError as exc:  # the daemon stopped reading: it cut us off
                        sys.stderr.write(f"HOSTILE cut off: {exc!r}\n")
                    continue
            return frame

    def send(self: ipc.SyncChannel, msg: object) -> None:
        if isinstance(msg, protocol.Ready) and LIAR_CTX in _loaded:
            msg = protocol.Ready(info={**msg.info, "n_slots": msg.info["n_slots"] + 7})
        _send_message(self, msg)

    ipc.SyncChannel.recv = recv  # type: ignore[method-assign]
    ipc.SyncChannel.send = send  # type: ignore[method-assign]
