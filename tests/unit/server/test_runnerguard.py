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
from llmrun.server import runnerguard, work
from llmrun.server.loadspec import RunnerSpec
from llmrun.server.runnerguard import MAX_EVENT_TEXT, Guard, RunnerAbuse, check_ready
from llmrun.server.runners import RunnerProcess

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
            await handle.run(work.Embedding(["one", "two"], truncate=False))
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
            await handle.run(work.Reranking(ChatRequest(model="m", messages=[]), "q",
                                            ["one", "two"]))
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
        scores, n = await handle.run(work.Reranking(ChatRequest(model="m", messages=[]), "q",
                                                    docs))
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
    """Every field of a chunk is typed to its end but a tool call's arguments, which the
    daemon's reading of the call walks: nesting there past the stack is a lie too."""
    async def run() -> None:
        from llmrun.request import ChatRequest, Message

        handle = started_handle()
        deep = b"[" * 990 + b"]" * 990

        async def sent(msg: Any) -> None:
            handle._on_message(ipc.loads_untrusted(
                b'{"type":"events","events":[["' + msg.id.encode() + b'","chunk",{"text":"",'
                b'"tool_calls":[{"name":"f","arguments":{"a":' + deep + b"}}]}]]}"))

        handle._send = sent  # type: ignore[method-assign]
        req = ChatRequest(model="m", messages=[Message(role="user", content="hi")])
        with pytest.raises(EngineError):
            async for _ in handle.generate(req):
                pass
        assert not handle.alive
        assert handle._lost_task is not None
        await handle._lost_task

    asyncio.run(run())


def test_a_payload_its_request_cannot_read_stops_the_runner() -> None:
    """parse_reply checks logprobs' outer shape (a list of objects); what pydantic then
    cannot read is a lie."""
    async def run() -> None:
        from llmrun.request import ChatRequest, Message

        handle = started_handle()

        async def sent(msg: Any) -> None:
            handle._on_message({"type": "events", "events": [
                [msg.id, "chunk", {"text": "x", "logprobs": [{"token": [[]]}]}]]})

        handle._send = sent  # type: ignore[method-assign]
        req = ChatRequest(model="m", messages=[Message(role="user", content="hi")])
        with pytest.raises(EngineError, match="cannot read"):
            async for _ in handle.generate(req):
                pass
        assert not handle.alive
        assert handle._lost_task is not None
        await handle._lost_task

    asyncio.run(run())


# -- what an agent acts on: tool calls and embeddings, checked again by the daemon -------------

READ_FILE = {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"],
    "additionalProperties": False}}


def chat(**fields: Any) -> Any:
    from llmrun.request import ChatRequest, Message

    return ChatRequest(model="m", messages=[Message(role="user", content="hi")],
                       **{"tools": [READ_FILE], **fields})


def called(*calls: tuple[str, Any], partial: str | None = None) -> Any:
    from llmrun.request import Chunk

    return Chunk.model_validate({"text": "", "tool_calls": [
        {"id": f"call_{i}", "name": n, "arguments": a} for i, (n, a) in enumerate(calls)],
        **({"partial_call": {"id": "c", "name": partial, "arguments": '{"pa'}}
           if partial else {})})


@pytest.mark.parametrize(("fields", "chunk", "why"), [
    ({}, called(("read_file", {"path": "/a"})), ""),
    ({}, called(("run_shell", {"command": "rm"})), "did not offer"),
    ({}, called(("read_file", {"path": 5})), "schema refuses"),
    ({}, called(("read_file", {"path": "/a", "mode": "w"})), "schema refuses"),
    # the runner checks the schema whether or not the client asked for strict output
    ({"format_strict": False}, called(("read_file", {})), "schema refuses"),
    ({}, called(partial="read_file"), ""),
    ({}, called(partial="run_shell"), "did not offer"),
    ({"tool_choice": "none"}, called(("read_file", {"path": "/a"})), "did not offer"),
    ({"tools": []}, called(("read_file", {"path": "/a"})), "did not offer"),
    ({"parallel_tool_calls": False},
     called(("read_file", {"path": "/a"}), ("read_file", {"path": "/b"})), "allows one"),
    ({}, called(("read_file", {"path": "/a"}), ("read_file", {"path": "/b"})), ""),
])
def test_a_reported_call_is_checked_as_the_runner_checked_it(fields: dict[str, Any],
                                                              chunk: Any, why: str) -> None:
    got = runnerguard.check_calls(chat(**fields).model_dump(), chunk)
    assert (why in got and got) if why else got == ""


def test_the_daemon_checks_calls_against_the_schema_the_runner_got() -> None:
    """The runner reads the request's JSON: a schema number the client wrote as 1e999 (inf
    here) reaches it as null, whose check fails open there. The daemon, checking the schema
    as it was sent, agrees, and an honest runner is never stopped for a client's schema."""
    from llmrun.chat.toolcalls import ToolCheck

    tool = {"name": "f", "parameters": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": float("inf")}}}}
    req = chat(tools=[tool])
    sent = ipc.loads_untrusted(ipc.encode(req.model_dump())[ipc.HEADER.size:])
    assert ToolCheck({"f": sent["tools"][0]["parameters"]}).accepts("f", {"x": 1})  # runner
    assert runnerguard.check_calls(req.model_dump(), called(("f", {"x": 1}))) == ""


def chat_handle(events: Any) -> RunnerProcess:
    """A started handle whose runner answers each request with `events(request id)`."""
    handle = started_handle()

    async def sent(msg: Any) -> None:
        if isinstance(msg, protocol.Generate):
            handle._on_message({"type": "events", "events": events(msg.id)})

    handle._send = sent  # type: ignore[method-assign]
    return handle


def test_a_call_of_a_tool_never_offered_stops_the_runner() -> None:
    async def run() -> None:
        handle = chat_handle(lambda rid: [
            [rid, "chunk", {"text": "", "tool_calls": [
                {"id": "c", "name": "run_shell", "arguments": {"command": "rm -rf ~"}}]}],
            [rid, "done", {"finish_reason": "tool_calls"}]])
        with pytest.raises(EngineError, match="did not offer and was stopped") as err:
            async for _ in handle.generate(chat()):
                pass
        assert err.value.code == "runner_failed" and not handle.alive
        await handle._lost_task  # type: ignore[misc]

    asyncio.run(run())


def test_an_honest_call_passes() -> None:
    async def run() -> None:
        handle = chat_handle(lambda rid: [
            [rid, "chunk", {"text": "", "tool_calls": [
                {"id": "c", "name": "read_file", "arguments": {"path": "/a"}}]}],
            [rid, "done", {"finish_reason": "tool_calls"}]])
        got = [e async for e in handle.generate(chat())]
        assert got[0].tool_calls[0].arguments == {"path": "/a"}  # type: ignore[union-attr]
        assert handle.dead_reason is None

    asyncio.run(run())


def embed_handle(*replies: list[Any]) -> RunnerProcess:
    """A started handle whose runner answers each embed message with the next reply."""
    handle = started_handle()
    answers = iter(replies)

    async def sent(msg: Any) -> None:
        handle._on_message({"type": "events", "events": [
            [msg.id, "embedding", {"embeddings": next(answers), "prompt_tokens": 2}]]})

    handle._send = sent  # type: ignore[method-assign]
    return handle


@pytest.mark.parametrize(("replies", "why"), [
    ([[[0.5, "0.5"], [0.5, 0.5]]], "not a number"),
    ([[[0.5, True], [0.5, 0.5]]], "not a number"),
    ([[[0.5, [0.5]], [0.5, 0.5]]], "not a number"),
    ([[[0.5, float("nan")], [0.5, 0.5]]], "not finite"),  # (null is the engine's NaN)
    ([[[0.5, 1e308], [1e308, 0.5]]], ""),  # finite, however odd
    ([[[0.5, 10 ** 400], [0.5, 0.5]]], "not finite"),
    ([[[0.5, 0.5], [0.5, 0.5, 0.5]]], "numbers from one model"),
    ([[[], []]], "numbers from one model"),
    ([[[0.5, 0.5]]], "1 embeddings for 2 inputs"),
    ([[[0.5, 0.5]] * 3], "3 embeddings for 2 inputs"),
    ([[[0.5, None], [0.5, 0.5]], [[0.5, 0.5, 0.5], [0.5, 0.5, 0.5]]],
     "numbers from one model"),  # the width the runner's first reply set
])
def test_embeddings_are_finite_numbers_of_one_width_one_per_input(replies: list[Any],
                                                                  why: str) -> None:
    async def run() -> None:
        handle = embed_handle(*replies)
        for _ in replies[:-1]:
            assert len((await handle.run(work.Embedding(["one", "two"], truncate=False)))[0]) == 2
        if not why:
            await handle.run(work.Embedding(["one", "two"], truncate=False))
            assert handle.dead_reason is None
            return
        with pytest.raises(EngineError, match=f"{why}.* and was stopped"):
            await handle.run(work.Embedding(["one", "two"], truncate=False))
        assert not handle.alive
        await handle._lost_task  # type: ignore[misc]

    asyncio.run(run())


# -- a request's events over its life ------------------------------------------------------------


def test_an_answer_past_any_its_request_could_take_stops_the_runner() -> None:
    async def run() -> None:
        handle = started_handle()
        req = chat(options={"num_predict": 4})
        budget = runnerguard.answer_budget(req, handle.spec.n_ctx)
        chunk = ["r", "chunk", {"text": "F" * (64 << 10)}]  # each within every event bound
        q = handle._track("r", budget=budget, client=True)
        with pytest.raises(RunnerAbuse):
            for _ in range(budget // (64 << 10) + 1):
                handle._on_message({"type": "events", "events": [chunk]})
        assert budget < 4 << 20
        while q.qsize() > 1:  # what came within the budget, then the error
            q.get_nowait()
        assert "more than any answer to its request could" in await stopped_with(handle, q)

    asyncio.run(run())


@pytest.mark.parametrize("options", [{"num_predict": 128}, {}, {"shift": True}])
def test_an_honest_answer_fits_its_budget_with_room_to_spare(options: dict[str, Any]) -> None:
    """The largest an honest runner sends: every token with the top 20 alternatives, their
    pieces 16 characters (real vocabularies: 3-8 on average), the prompt echoed likewise."""
    n_ctx = 512
    req = chat(options=options, logprobs=20, prompt_logprobs=20)
    tokens = options.get("num_predict") or n_ctx * (10 if options.get("shift") else 1)

    def entry(i: int) -> dict[str, Any]:
        return {"token": "t" * 16, "logprob": -1.5, "bytes": [116] * 16, "id": i}

    token = {"text": "t" * 16, "logprobs": [{**entry(0), "top": [entry(i) for i in range(20)]}]}
    [size] = Guard().events([("r", "chunk", token)])
    honest = (tokens + n_ctx) * size + 1000 * tokens  # (and a tool call of it all, parsed)
    budget = runnerguard.answer_budget(req, n_ctx)
    assert honest * 2 < budget < honest * 20


def test_an_event_of_a_kind_its_request_never_gets_stops_the_runner() -> None:
    async def run() -> None:
        handle = started_handle()
        q = handle._track("r", client=True)
        with pytest.raises(RunnerAbuse):
            handle._on_message({"type": "events", "events": [
                ["r", "embedding", {"embeddings": [[0.5] * 100_000], "prompt_tokens": 1}]]})
        assert "'embedding' event to a request that gets none" in await stopped_with(handle, q)

    asyncio.run(run())


def test_a_client_that_reads_slowest_loses_its_answer_and_no_one_else_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """What waits unread for slow clients is bounded per runner: past it, the request that
    holds the most fails (too_large) and is cancelled in the runner; the runner, the other
    requests and their events go on."""
    monkeypatch.setattr(runnerguard, "MAX_UNREAD", 1 << 20)

    async def run() -> None:
        handle = started_handle()
        cancelled: list[str] = []

        async def sent(msg: Any) -> None:
            cancelled.append(msg.id)

        handle._send = sent  # type: ignore[method-assign]
        stalled = handle._track("slow", client=True)
        reading = handle._track("fast", client=True)
        piece = {"text": "x" * 1000}
        for _ in range(2000):  # ~2.6 MB for the stalled client, read as it comes for the other
            handle._on_message({"type": "events", "events": [["slow", "chunk", piece],
                                                             ["fast", "chunk", piece]]})
            assert reading.get_nowait() == ("chunk", piece)
        kind, payload = stalled.get_nowait()
        while kind == "chunk":  # what it held before it was failed was dropped
            kind, payload = stalled.get_nowait()
        assert kind == "error" and payload["code"] == "too_large" and stalled.empty()
        assert "unread" in payload["message"]
        assert handle._unread.total <= 1 << 20 and handle.dead_reason is None
        await asyncio.sleep(0)
        assert cancelled == ["slow"] and "slow" in handle._ended and "slow" not in handle._queues

    asyncio.run(run())


def test_what_a_reader_leaves_unread_is_not_counted_once_it_goes() -> None:
    async def run() -> None:
        handle = started_handle()
        handle._track("r", client=True)
        handle._on_message({"type": "events", "events": [["r", "chunk", {"text": "x" * 100}]]})
        assert handle._unread.total == 100 + 2 * runnerguard.VALUE_BYTES + runnerguard.EVENT_BYTES
        handle._end("r")  # the client went away
        assert handle._unread.total == 0

    asyncio.run(run())
