"""The daemon's handle on a runner, without a process: how it turns event frames into a
request's stream."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmrun import ipc, jsonio, protocol
from llmrun.request import ChatRequest, Chunk, Done, Message, Started, error_event
from llmrun.server.fit import Placement
from llmrun.server.loadspec import RunnerSpec
from llmrun.server.runners import RunnerProcess
from tests.conftest import Daemon, runner_pids


def handle_with(events: list[tuple[str, Any]]) -> RunnerProcess:
    """A handle whose next request finds `events` already waiting, as when the client reads
    slower than the runner writes."""
    handle = RunnerProcess(RunnerSpec((Path("m.gguf"),), 512, 1, 1), Path("runner.log"))
    track = handle._track

    def prefilled(req_id: str, *args: Any, **kwargs: Any) -> asyncio.Queue[tuple[str, Any]]:
        q = track(req_id, *args, **kwargs)
        for event in events:
            q.put_nowait(event)
        return q

    async def sent(msg: dict[str, Any]) -> None:
        pass

    handle._track = prefilled  # type: ignore[method-assign]
    handle._send = sent  # type: ignore[method-assign]
    return handle


async def stream(handle: RunnerProcess) -> list[Any]:
    req = ChatRequest(model="m", messages=[Message(role="user", content="hi")])
    return [event async for event in handle.generate(req)]


def test_waiting_plain_text_goes_out_as_one_chunk_and_nothing_else_merges() -> None:
    logprobs = [{"token": "c", "logprob": -0.5, "bytes": [99], "top": []}]
    handle = handle_with([
        ("started", {"prompt_tokens": 3, "cached_tokens": 0, "n_ctx": 512}),
        ("chunk", {"text": "a"}), ("chunk", {"text": "b"}),
        ("chunk", {"text": "c", "logprobs": logprobs}),  # carries more than text: alone
        ("chunk", {"text": "d"}), ("chunk", {"text": ""}), ("chunk", {"text": "é"}),
        ("chunk", {"text": "", "thinking": "hm"}),
        ("chunk", {"text": "e"}),
        ("done", {"completion_tokens": 7, "finish_reason": "stop"}),
    ])
    events = asyncio.run(stream(handle))
    assert isinstance(events[0], Started)
    chunks = events[1:-1]
    assert [(c.text, c.logprobs is not None, c.thinking) for c in chunks] == [
        ("ab", False, None), ("c", True, None), ("dé", False, None), ("", False, "hm"),
        ("e", False, None)]
    assert all(isinstance(c, Chunk) for c in chunks)
    assert isinstance(events[-1], Done) and events[-1].stats.completion_tokens == 7
    assert not handle._queues  # the request's queue is gone


def test_an_error_after_waiting_text_still_ends_the_stream_with_the_text_first() -> None:
    handle = handle_with([
        ("chunk", {"text": "x"}), ("chunk", {"text": "y"}),
        ("error", error_event("internal", "boom")),
    ])
    got: list[Any] = []

    async def run() -> BaseException | None:
        try:
            async for event in handle.generate(
                    ChatRequest(model="m", messages=[Message(role="user", content="hi")])):
                got.append(event)
        except Exception as exc:  # the error event, raised
            return exc
        return None

    exc = asyncio.run(run())
    assert [c.text for c in got] == ["xy"]
    assert exc is not None and "boom" in str(exc)


# -- the daemon's end of the channel ---------------------------------------------------------


def channel() -> tuple[ipc.FrameProtocol, list[dict[str, Any]], list[BaseException | None]]:
    got: list[dict[str, Any]] = []
    lost: list[BaseException | None] = []
    return ipc.FrameProtocol(got.append, lost.append), got, lost


def test_frames_are_delivered_however_the_bytes_arrive() -> None:
    msgs = [{"type": "events", "events": [["r1", "chunk", {"text": "é" * i}]]} for i in range(6)]
    frames = [ipc.encode(m) for m in msgs]
    proto, got, lost = channel()
    for frame in frames:  # a frame per read: the common case, parsed in place
        proto.data_received(frame)
    assert got == msgs
    data = b"".join(frames)
    for size in (1, 3, 7, 1000):  # split anywhere, the header too, or several in one read
        proto, got, lost = channel()
        for i in range(0, len(data), size):
            proto.data_received(data[i:i + size])
        assert got == msgs and not lost
    proto, got, lost = channel()
    proto.data_received(frames[0][:2])  # a partial header, then the rest with a whole frame
    proto.data_received(frames[0][2:] + frames[1])
    assert got == msgs[:2]


def test_a_frame_over_the_limit_ends_the_channel_without_reading_it() -> None:
    proto, got, lost = channel()

    class Transport:
        aborted = False

        def abort(self) -> None:
            self.aborted = True

    proto.transport = Transport()  # type: ignore[assignment]
    proto.data_received(ipc.HEADER.pack(ipc.MAX_FRAME + 1) + b"{}")
    assert got == [] and isinstance(lost[0], ipc.ChannelClosed)
    assert proto.transport.aborted  # type: ignore[attr-defined]
    proto.connection_lost(None)  # the transport's own report after the abort: once only
    assert len(lost) == 1
    with pytest.raises(ipc.ChannelClosed):
        proto.write(b"x")


def test_writers_wait_while_the_runner_reads_slower_and_a_lost_channel_frees_them() -> None:
    async def run() -> None:
        proto, _, _ = channel()
        proto.pause_writing()
        waiting = [asyncio.create_task(proto.drain()) for _ in range(3)]
        await asyncio.sleep(0)
        waiting[0].cancel()  # one writer gives up: the others still wait, then go on
        await asyncio.sleep(0)
        assert not any(t.done() for t in waiting[1:])
        proto.resume_writing()
        await asyncio.gather(*waiting[1:])
        proto.pause_writing()
        stuck = asyncio.create_task(proto.drain())
        await asyncio.sleep(0)
        proto.connection_lost(ConnectionResetError())
        with pytest.raises(ipc.ChannelClosed):
            await stuck

    asyncio.run(run())


def _switches(tid: int) -> int:
    """How many times the thread `tid` has been given a core (the kernel's count)."""
    return int(Path(f"/proc/{tid}/task/{tid}/schedstat").read_text().split()[2])


@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="reads Linux's /proc")
def test_a_stream_leaves_the_runners_reading_thread_asleep(daemon: Daemon,
                                                           api: httpx.Client) -> None:
    """The runner's main thread reads the daemon's messages. It used to sleep in recv() on
    the socket its engine thread writes to, and the kernel woke it each time the daemon
    read a step's frame: a context switch per token on a core the decode threads need."""
    api.post("/api/generate", json={"model": "smollm2", "prompt": "hi", "stream": False,
                                    "options": {"num_predict": 1}}).raise_for_status()
    assert daemon.proc is not None
    runners = runner_pids(daemon.proc.pid)  # (idle ones too: they should not wake either)
    assert runners
    before = {pid: _switches(pid) for pid in runners}
    r = api.post("/api/generate", json={
        "model": "smollm2", "prompt": "Count from 1 to 200, one number per line.",
        "stream": True, "options": {"num_predict": 120, "temperature": 0}})
    r.raise_for_status()
    done = [json.loads(line) for line in r.text.splitlines() if line.strip()][-1]
    assert done["eval_count"] >= 60
    woken = sum(_switches(pid) - before[pid] for pid in runners)
    assert woken < 20, f"the reading thread woke {woken} times for {done['eval_count']} tokens"


# -- the protocol on both ends ---------------------------------------------------------------


def test_a_malformed_frame_from_the_runner_stops_it() -> None:
    """What a runner sends is checked before it is read: a frame that is no message of the
    protocol fails the requests in flight and stops the runner (raised, it also ends the
    channel), rather than reaching a request's stream."""
    async def run() -> None:
        handle = RunnerProcess(RunnerSpec((Path("m.gguf"),), 512, 1, 1), Path("runner.log"))
        handle._ready = asyncio.get_running_loop().create_future()
        handle._ready.set_result(protocol.Fatal(error="(started)"))
        q = handle._track("r1")
        handle._on_message({"type": "events", "events": [["r1", "chunk", {"text": "a"}]]})
        assert q.get_nowait() == ("chunk", {"text": "a"})
        with pytest.raises(protocol.ProtocolError, match="unknown event kind 'boom'"):
            handle._on_message({"type": "events", "events": [["r1", "boom", {}]]})
        kind, payload = q.get_nowait()
        assert kind == "error" and payload["code"] == "runner_failed"
        assert "malformed" in payload["message"] and not handle.alive
        assert handle._lost_task is not None
        await handle._lost_task

    asyncio.run(run())


def test_an_event_for_a_request_the_runner_was_never_given_stops_it() -> None:
    """A runner may only name the requests it was given. Late events of one that ended here
    (it reads a cancel between steps) are dropped; an id it never had, or one another
    runner was given, means the runner lies: the requests in flight fail and it is stopped."""
    async def run() -> None:
        handle = RunnerProcess(RunnerSpec((Path("m.gguf"),), 512, 1, 1), Path("runner.log"))
        handle._ready = asyncio.get_running_loop().create_future()
        handle._ready.set_result(protocol.Fatal(error="(started)"))
        handle._track("r1")
        handle._end("r1")  # cancelled: its last events may still come
        handle._on_message({"type": "events", "events": [["r1", "chunk", {"text": "late"}],
                                                         ["", "engine", {"steps": 3}]]})
        assert handle.engine_stats == {"steps": 3}
        q = handle._track("r2")
        with pytest.raises(protocol.ProtocolError, match="never given"):
            handle._on_message({"type": "events", "events": [["r999", "chunk", {"text": "x"}]]})
        kind, payload = q.get_nowait()
        assert kind == "error" and payload["code"] == "runner_failed"
        assert "never given" in payload["message"]
        assert handle._lost_task is not None
        await handle._lost_task

    asyncio.run(run())


def test_a_runner_whose_first_message_is_not_load_refuses_it() -> None:
    """Load is the first frame: a runner told anything else says why (Fatal) and exits."""
    parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with parent:
        proc = subprocess.Popen([sys.executable, "-m", "llmrun.engine.runner",
                                 "--fd", str(child.fileno())], pass_fds=(child.fileno(),),
                                stderr=subprocess.PIPE)
        child.close()
        chan = ipc.SyncChannel(parent)
        chan.send(protocol.Generate(id="r1", request=ChatRequest(model="m", messages=[])))
        reply = protocol.parse_reply(chan.recv())
        assert proc.wait(60) == 1
    assert isinstance(reply, protocol.Fatal) and "must load a model" in reply.error


def test_the_load_message_carries_the_spec_and_the_placement() -> None:
    spec = RunnerSpec((Path("/m/a.gguf"), Path("/m/b.gguf")), 4096, 4, 2, n_batch=256,
                      lora_paths=(Path("/l.gguf"),), projector_path=Path("/p.gguf"),
                      draft_paths=(Path("/d.gguf"),), adaptive_threads=True, kv_type="q8_0",
                      flash_attention="on", step_budget="64", debug=True)
    handle = RunnerProcess(spec, Path("runner.log"))
    handle.placement = Placement(n_gpu_layers=20, devices=("CUDA0", "CUDA1"),
                                 tensor_split=(2 / 3, 1 / 3), main_gpu=-1)
    load = handle._load()
    assert protocol.parse_command(jsonio.loads(ipc.encode(load)[ipc.HEADER.size:])) == load
    assert (load.model, load.ctx, load.slots, load.threads, load.batch) == (
        ["/m/a.gguf", "/m/b.gguf"], 4096, 4, 2, 256)
    assert load.lora == [protocol.Lora(path="/l.gguf", scale=1.0)]
    assert (load.mmproj, load.draft_model) == ("/p.gguf", ["/d.gguf"])
    assert (load.adaptive_threads, load.kv_type, load.flash_attn, load.step_budget,
            load.debug) == (True, "q8_0", "on", "64", True)
    assert (load.gpu_layers, load.device, load.main_gpu) == (20, ["CUDA0", "CUDA1"], -1)
    assert load.tensor_split == [0.666667, 0.333333]
    assert load.prompt_cache is None and load.max_frame == ipc.MAX_FRAME
    workers = RunnerProcess(RunnerSpec((Path("/m.gguf"),), 512, 1, 1, rpc_workers=("h:1",),
                                       rpc_split="3,1", gpu_layers=9), Path("runner.log"))
    workers.placement = handle.placement  # (RPC workers take the layers: no devices here)
    load = workers._load()
    assert (load.rpc, load.rpc_split, load.gpu_layers, load.device) == (["h:1"], [3.0, 1.0],
                                                                         9, [])


def test_use_mmap_false_reads_the_weights_into_memory(tmp_path: Path,
                                                      smollm2_path: Path) -> None:
    """The runner maps its GGUF file by default; a Modelfile's `use_mmap false` has llama.cpp
    read it into memory instead: the file is then in none of the runner's mappings."""
    from tests.conftest import make_home

    home = make_home(tmp_path, smollm2_path)
    d = Daemon(home).start()
    try:
        r = httpx.post(f"{d.url}/api/create", timeout=60, json={
            "model": "unmapped", "from": "smollm2", "parameters": {"use_mmap": False},
            "stream": False})
        assert r.status_code == 200, r.text
        blobs = {p.name for p in (home / "blobs").iterdir()}

        def mapped(model: str) -> set[str]:
            r = httpx.post(f"{d.url}/api/chat", timeout=120, json={
                "model": model, "stream": False, "options": {"num_predict": 2},
                "messages": [{"role": "user", "content": "Hi"}]})
            assert r.status_code == 200, r.text
            [pid] = runner_pids(d.proc.pid)
            maps = Path(f"/proc/{pid}/maps").read_text()
            httpx.post(f"{d.url}/api/generate", json={"model": model, "keep_alive": 0})
            return {name for name in blobs if name in maps}

        assert mapped("smollm2")  # the weights' blob, mapped
        assert mapped("unmapped") == set()
    finally:
        d.stop()
