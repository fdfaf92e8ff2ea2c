"""What the daemon takes from a runner, whose output is hostile input: the bounds on its
volume (server/runnerguard), its Ready checked against its Load, and the channel's refusal of
frames that are not UTF-8 JSON or that pass file descriptors (ipc). No runner process: the
daemon's handle is driven with frames as a runner would send them."""

from __future__ import annotations

import array
import asyncio
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from llmrun import ipc, protocol
from llmrun.request import EngineError
from llmrun.server import runnerguard
from llmrun.server.runnerguard import MAX_EVENT_TEXT, Guard, RunnerAbuse, check_ready
from llmrun.server.runners import RunnerProcess, RunnerSpec

# -- the bounds --------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def heartbeat() -> dict[str, Any]:
    return {"type": "events", "events": []}


def test_frames_past_the_rate_stop_the_runner_and_a_legit_pace_never_does() -> None:
    clock = Clock()
    guard = Guard(rate=1000, burst=1000, clock=clock)
    for _ in range(100_000):  # 100 s of a frame a millisecond: a real model's fastest
        clock.now += 0.001
        guard.frame(heartbeat())
    clock.now += 1.0  # idle a second: the bucket full again
    for _ in range(1000):  # a burst
        guard.frame(heartbeat())
    with pytest.raises(RunnerAbuse, match="over 1000 frames a second"):
        guard.frame(heartbeat())
    clock.now += 0.5  # refilled at the rate, no more than the burst
    for _ in range(500):
        guard.frame(heartbeat())
    with pytest.raises(RunnerAbuse):
        guard.frame(heartbeat())


def test_events_per_frame_are_counted_before_any_is_read() -> None:
    guard = Guard()
    guard.frame({"type": "events", "events": [["r", "chunk", {"text": "x"}]] * 4096})
    with pytest.raises(RunnerAbuse, match="4097 events in one frame"):
        guard.frame({"type": "events", "events": [0] * 4097})  # (not even events)
    many_slots = Guard(slots=1024)  # 8 each: a step of every sequence, with room to spare
    many_slots.frame({"type": "events", "events": [0] * 8192})
    guard.frame({"type": "ready", "info": {}})  # (what is no events frame is parse_reply's)


@pytest.mark.parametrize("payload", [
    {"text": "a" * (MAX_EVENT_TEXT + 1)},
    {"text": "", "thinking": "t" * (MAX_EVENT_TEXT + 1)},
    {"text": "", "partial_call": {"name": "f", "arguments": "{" * MAX_EVENT_TEXT}},
    {"text": "x", "logprobs": [{"token": "t" * (MAX_EVENT_TEXT // 2), "top": [
        {"token": "u" * (MAX_EVENT_TEXT // 2)}]}]},
])
def test_an_event_with_more_text_than_any_step_makes_stops_the_runner(payload: Any) -> None:
    with pytest.raises(RunnerAbuse, match="'chunk' event of"):
        Guard().events([("r1", "chunk", payload)])


def test_text_within_the_bound_and_one_answer_replies_pass() -> None:
    guard = Guard()
    guard.events([("r1", "chunk", {"text": "a" * MAX_EVENT_TEXT}),
                  ("r1", "done", {"completion_tokens": 3, "finish_reason": "stop"})])
    # replies as large as what the daemon asked: the frame limit bounds them
    guard.events([("c1", "count", {"prompt_tokens": 1, "n_ctx": 8, "prompt": "p" * (9 << 20)}),
                  ("e1", "embedding_part", {"embeddings": [[0.1] * 1000] * 100})])
    with pytest.raises(RunnerAbuse, match="'error' event"):
        guard.events([("r1", "error", {"code": "x", "message": "m" * (MAX_EVENT_TEXT + 1)})])


# -- Ready against Load ------------------------------------------------------------------------


def load(**fields: Any) -> protocol.Load:
    return protocol.Load(**{"model": ["/m.gguf"], "ctx": 4096, "slots": 4, "max_frame": 1 << 20,
                            **fields})


def info(**fields: Any) -> protocol.Info:
    base = {"n_ctx_seq": 4096, "n_slots": 4, "n_ctx_train": 8192, "has_template": True,
            "vision": False, "size": 1 << 20, "sandbox": ["no-core-dumps", "landlock"],
            "confined": False, "sandbox_missing": ["seccomp: unavailable"]}
    return protocol.Info(**{**base, **fields})  # type: ignore[typeddict-item]


def test_a_ready_that_agrees_with_its_load_passes() -> None:
    assert check_ready(info(), load()) == ""
    assert check_ready(info(n_ctx_seq=2048), load()) == ""  # capped by the model's training
    assert check_ready(info(devices={"CUDA0": 5 << 30}), load(device=["CUDA0"])) == ""
    assert check_ready(info(rpc={"layers": 3}), load(rpc=["h:1"])) == ""


@pytest.mark.parametrize(("claim", "said"), [
    ({"n_slots": 64}, "claims 64 slots, but 4 were asked for"),
    ({"n_ctx_seq": 1 << 20}, "claims a context of 1048576 tokens, but 4096 were asked for"),
    ({"n_ctx_seq": 0}, "claims a context of 0 tokens"),
    ({"size": -1}, "negative size"),
    ({"devices": {"CUDA7": 1}}, "devices it was not given"),
    ({"rpc": {"layers": 3}}, "RPC placement, but it was given no RPC workers"),
    ({"sandbox": ["x"] * 65}, "larger than any runner's"),
    ({"sandbox_missing": ["x" * (64 << 10)]}, "larger than any runner's"),
])
def test_a_ready_that_claims_what_it_was_not_given_is_refused(claim: dict[str, Any],
                                                               said: str) -> None:
    assert said in check_ready(info(**claim), load())


def status_field(name: str) -> str:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(name + ":"):
            return line.split(":", 1)[1].strip()
    return ""


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc")
def test_sandbox_claims_the_kernel_shows_are_checked_there() -> None:
    """This test process is not confined by the runner's sandbox: what it claims of itself
    is checked against /proc/<pid>/status."""
    pid = os.getpid()
    says = check_ready(info(sandbox=["seccomp"], confined=True), load(), pid)
    assert (says == "") == (status_field("Seccomp") == "2")
    if says:
        assert "claims the seccomp layer, but the kernel says Seccomp:" in says
    says = check_ready(info(sandbox=["no-new-privs"]), load(), pid)
    assert (says == "") == (status_field("NoNewPrivs") == "1")
    assert check_ready(info(sandbox=["landlock"]), load(), pid) == ""  # (not shown there)


# -- frames that are not UTF-8 JSON ------------------------------------------------------------


@pytest.mark.parametrize("body", [b'"\xff\xfe"', b'"\\ud800"', b'["a\\udc00b"]', b"{nope",
                                  b"[" * 5000])
def test_a_frame_that_is_not_utf8_json_breaks_the_channel(body: bytes) -> None:
    with pytest.raises(ipc.BadFrame):
        ipc.loads_untrusted(body)


def test_what_orjson_refuses_for_other_reasons_is_still_read() -> None:
    assert ipc.loads_untrusted(b'"\\ud83d\\ude00"') == "\U0001f600"  # a surrogate pair
    nested = b"[" * 300 + b"]" * 300  # deeper than orjson reads: a tool call's arguments
    assert ipc.loads_untrusted(nested) is not None
    assert ipc.loads_untrusted(b"[NaN]")[0] != 0  # (for protocol.parse_reply to refuse)


# -- the daemon's handle -----------------------------------------------------------------------


def started_handle() -> RunnerProcess:
    """A handle past its runner's Ready (no process)."""
    handle = RunnerProcess(RunnerSpec((Path("m.gguf"),), 512, 2, 1), Path("runner.log"))
    handle._ready = asyncio.get_running_loop().create_future()
    handle._ready.set_result(protocol.Fatal(error="(started)"))
    return handle


async def stopped_with(handle: RunnerProcess, q: asyncio.Queue[tuple[str, Any]]) -> str:
    kind, payload = q.get_nowait()
    assert kind == "error" and payload["code"] == "runner_failed"
    assert not handle.alive and "stopped" in payload["message"]
    assert handle._lost_task is not None
    await handle._lost_task
    return str(payload["message"])


def test_an_oversized_event_stops_the_runner_before_anything_is_queued() -> None:
    async def run() -> None:
        handle = started_handle()
        q = handle._track("r1")
        with pytest.raises(RunnerAbuse):
            handle._on_message({"type": "events", "events": [
                ["r1", "chunk", {"text": "fine"}],
                ["r1", "chunk", {"text": "a" * (MAX_EVENT_TEXT + 1)}]]})
        assert "characters" in await stopped_with(handle, q)
        assert q.empty()  # not even the event before it

    asyncio.run(run())


def test_a_flood_of_tiny_frames_stops_the_runner() -> None:
    async def run() -> None:
        handle = started_handle()
        handle._guard = Guard(clock=lambda: 0.0)  # all of them at once
        q = handle._track("r1")
        with pytest.raises(RunnerAbuse):
            for _ in range(int(runnerguard.FRAME_BURST) + 1):
                handle._on_message(heartbeat())
        assert "frames a second" in await stopped_with(handle, q)

    asyncio.run(run())


def test_a_broken_frame_stops_the_runner_at_once() -> None:
    """A frame over the limit or not UTF-8 JSON: the runner is killed now, not waited for
    as one that exits by itself is."""
    async def run() -> None:
        handle = started_handle()
        q = handle._track("r1")
        handle._on_lost(ipc.BadFrame("a frame whose text is not UTF-8"))
        assert "not UTF-8" in await stopped_with(handle, q)

    asyncio.run(run())


def test_embedding_parts_past_the_inputs_stop_the_runner() -> None:
    async def run() -> None:
        handle = started_handle()

        async def sent(msg: Any) -> None:
            rid = msg.id
            for _ in range(3):
                handle._on_message({"type": "events", "events": [
                    [rid, "embedding_part", {"embeddings": [[0.5, 0.5]]}]]})

        handle._send = sent  # type: ignore[method-assign]
        with pytest.raises(EngineError, match="more embeddings"):
            await handle.embed(["one", "two"], truncate=False)
        assert not handle.alive

    asyncio.run(run())


@pytest.mark.parametrize("scores", [[0.5], [0.5, 0.5, 0.5], [0.5, 1.5], [0.5, -0.1]])
def test_rerank_scores_that_do_not_fit_the_documents_stop_the_runner(
        scores: list[float]) -> None:
    """One score per document sent, each a probability: anything else is a broken runner."""
    from llmrun.request import ChatRequest

    async def run() -> None:
        handle = started_handle()

        async def sent(msg: Any) -> None:
            handle._on_message({"type": "events", "events": [
                [msg.id, "rerank", {"scores": scores, "prompt_tokens": 4}]]})

        handle._send = sent  # type: ignore[method-assign]
        with pytest.raises(EngineError, match="rerank scores"):
            await handle.rerank(ChatRequest(model="m", messages=[]), "q", ["one", "two"])
        assert not handle.alive

    asyncio.run(run())


def test_a_long_rerank_goes_in_pieces_and_comes_back_in_order() -> None:
    from llmrun.request import ChatRequest

    async def run() -> None:
        handle = started_handle()
        pieces: list[tuple[int, int, str]] = []

        async def sent(msg: Any) -> None:
            pieces.append((msg.offset, len(msg.documents), msg.query))
            handle._on_message({"type": "events", "events": [
                [msg.id, "rerank", {"scores": [int(d) / 1000 for d in msg.documents],
                                    "prompt_tokens": len(msg.documents)}]]})

        handle._send = sent  # type: ignore[method-assign]
        docs = [str(i) for i in range(600)]
        scores, n = await handle.rerank(ChatRequest(model="m", messages=[]), "q", docs)
        assert scores == [i / 1000 for i in range(600)] and n == 600
        assert pieces == [(0, 256, "q"), (256, 256, "q"), (512, 88, "q")]
        assert handle.dead_reason is None

    asyncio.run(run())


# -- descriptors passed on the channel ---------------------------------------------------------


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="reads Linux's /proc")
def test_descriptors_passed_break_the_channel_and_never_reach_the_daemon() -> None:
    async def run() -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        got: list[Any] = []
        lost: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
        proto = ipc.FrameProtocol(got.append, lost.set_result)
        ipc.SocketTransport(ours, proto)
        theirs.sendall(ipc.encode(heartbeat()))
        await asyncio.sleep(0.05)
        assert got == [heartbeat()]
        r, w = os.pipe()
        before = open_fds()
        theirs.sendmsg([ipc.encode(heartbeat())],
                       [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [r, w] * 8))])
        exc = await asyncio.wait_for(lost, 5)
        assert isinstance(exc, ipc.BadFrame) and "file descriptors" in str(exc)
        assert open_fds() <= before  # none was installed here (and the socket is closed)
        assert got == [heartbeat()]
        with pytest.raises(ipc.ChannelClosed):
            proto.write(b"x")
        for fd in (r, w):
            os.close(fd)
        theirs.close()

    asyncio.run(run())


def test_the_transport_writes_everything_in_order_and_writers_wait_for_room() -> None:
    async def run() -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        lost: asyncio.Future[BaseException | None] = asyncio.get_running_loop().create_future()
        proto = ipc.FrameProtocol(lambda m: None, lost.set_result)
        ipc.SocketTransport(ours, proto)
        frames = [ipc.encode({"type": "cancel", "id": f"r{i}", "pad": "x" * 50_000})
                  for i in range(100)]  # 5 MB: far more than the socket holds
        theirs.setblocking(False)
        received = bytearray()

        async def reader() -> None:
            loop = asyncio.get_running_loop()
            while len(received) < sum(map(len, frames)):
                received.extend(await loop.sock_recv(theirs, 1 << 16))

        reading = asyncio.create_task(reader())
        for frame in frames:
            proto.write(frame)
            await proto.drain()
        await asyncio.wait_for(reading, 10)
        assert bytes(received) == b"".join(frames)
        theirs.close()  # the runner gone: the channel ends, without an error
        assert await asyncio.wait_for(lost, 5) is None

    asyncio.run(run())


def test_a_runner_sending_faster_than_the_read_rate_waits_and_loses_nothing() -> None:
    async def run() -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        got: list[Any] = []
        proto = ipc.FrameProtocol(got.append, lambda exc: None)
        ipc.SocketTransport(ours, proto, rate=4 << 20, burst=256 << 10)
        frames = [ipc.encode({"type": "events", "events": [["r", "chunk", {"text": "x" * 4000}]]})
                  for _ in range(500)]  # 2 MB: half a second at 4 MiB/s, past the burst
        loop = asyncio.get_running_loop()
        theirs.setblocking(False)
        t0 = loop.time()
        await loop.sock_sendall(theirs, b"".join(frames))
        while len(got) < len(frames):
            await asyncio.sleep(0.01)
        assert loop.time() - t0 > 0.3
        assert len(got) == 500
        theirs.close()

    asyncio.run(run())


def test_nesting_past_the_stack_stops_the_runner() -> None:
    async def run() -> None:
        handle = started_handle()
        q = handle._track("r1")
        deep = b"[" * 990 + b"]" * 990
        frame = ipc.loads_untrusted(b'{"type":"events","events":[["r1","chunk",{"text":"",'
                                    b'"logprobs":' + deep + b"}]]}")
        with pytest.raises(RecursionError):
            handle._on_message(frame)
        assert "malformed" in await stopped_with(handle, q)

    asyncio.run(run())


def test_a_payload_its_request_cannot_read_stops_the_runner() -> None:
    """parse_reply checks logprobs' outer shape; what pydantic then cannot read is a lie."""
    async def run() -> None:
        from llmrun.request import ChatRequest, Message

        handle = started_handle()

        async def sent(msg: Any) -> None:
            handle._on_message({"type": "events", "events": [
                [msg.id, "chunk", {"text": "x", "logprobs": [[[]]]}]]})

        handle._send = sent  # type: ignore[method-assign]
        req = ChatRequest(model="m", messages=[Message(role="user", content="hi")])
        with pytest.raises(EngineError, match="cannot read"):
            async for _ in handle.generate(req):
                pass
        assert not handle.alive
        assert handle._lost_task is not None
        await handle._lost_task

    asyncio.run(run())
