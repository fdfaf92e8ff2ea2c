"""One request never takes the engine down, nor does an oversized IPC frame.

In-process: a real runner (engine/host.py's ModelHost on the real SmolLM2 model) whose channel
is a stand-in keeping every frame, so a test can break one sequence and watch the others.
Through a real daemon or a real runner process: the watchdog, the IPC frame limit, large
embedding batches.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from llmrun import ipc
from llmrun.chat.toolcalls import ToolCheck, ToolStream, parse_calls
from llmrun.engine import batcher
from llmrun.engine.host import ModelHost
from llmrun.engine.llama import Context, Model
from llmrun.request import DEFAULT_OPTIONS, ChatRequest, Done, EngineError, Options, Started, Tool
from llmrun.server import work
from llmrun.server.loadspec import RunnerSpec
from llmrun.server.runners import RunnerProcess as RunnerHandle
from tests.conftest import Daemon, make_home, wait_until
from tests.fakes.tinymodel import write_tiny_llama

GREEDY = {"temperature": 0.0, "seed": 1}


class Frames:
    """The runner's channel, kept in memory: every frame is checked against the limit as a
    real peer would (past it, the daemon drops the channel) and its events recorded."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.sizes: list[int] = []
        self.events: dict[str, list[tuple[str, Any]]] = {}
        # frames with no events, or only a prompt's progress (and the step counters): the
        # engine saying it is busy, not hung
        self.beats = 0

    def send(self, msg: dict[str, Any]) -> None:
        self.send_frame(ipc.encode(msg))

    def send_frame(self, frame: bytes) -> None:
        ipc.checked(frame)
        msg = json.loads(frame[ipc.HEADER.size:])
        with self.cond:
            self.sizes.append(ipc.body_size(frame))
            self.beats += all(kind in ("progress", "engine")  # (engine: step counters)
                              for _, kind, _ in msg.get("events", []))
            for rid, kind, payload in msg.get("events", []):
                self.events.setdefault(rid, []).append((kind, payload))
            self.cond.notify_all()

    def final(self, rid: str, timeout: float = 120) -> tuple[str, Any]:
        """The event that ended request `rid` (done, error, embedding, count)."""
        def ended() -> bool:
            return any(k in ("done", "error", "embedding", "count")
                       for k, _ in self.events.get(rid, []))
        with self.cond:
            assert self.cond.wait_for(ended, timeout), f"{rid} never finished"
            return next((k, p) for k, p in self.events[rid]
                        if k in ("done", "error", "embedding", "count"))

    def text(self, rid: str) -> str:
        with self.cond:
            return "".join(p["text"] for k, p in self.events.get(rid, []) if k == "chunk")


@pytest.fixture(scope="module")
def model(smollm2_path: Path) -> Iterator[Model]:
    m = Model(smollm2_path)
    yield m
    m.close()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Model]:
    """Random weights, a 350-token vocabulary: for output forced by grammar, where only its
    length matters (a thousand steps take a second)."""
    m = Model(write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf"))
    yield m
    m.close()


def start_runner(model: Model) -> tuple[ModelHost, Frames, Context]:
    # one thread: on a busy 2-core machine a second one mostly waits for the first
    frames = Frames()
    ctx = Context(model, n_ctx_seq=2048, n_seq=2, n_batch=512, n_threads=1)
    r = ModelHost(frames, model, ctx, 2048, 2, 1)  # type: ignore[arg-type]
    r.engine.start()
    return r, frames, ctx


def running(model: Model) -> Iterator[tuple[ModelHost, Frames]]:
    r, frames, ctx = start_runner(model)
    yield r, frames
    r.engine.stop()
    ctx.close()


@pytest.fixture
def runner(model: Model) -> Iterator[tuple[ModelHost, Frames]]:
    yield from running(model)


@pytest.fixture
def tiny_runner(tiny: Model) -> Iterator[tuple[ModelHost, Frames]]:
    yield from running(tiny)


def job(question: str = "What is the capital of France?", num_predict: int = 8,
        **fields: Any) -> ChatRequest:
    options = Options(num_predict=num_predict, **GREEDY).merged_over(DEFAULT_OPTIONS)
    return ChatRequest(model="test", messages=[{"role": "user", "content": question}],
                       options=options, **fields)


def assert_serving(r: ModelHost, frames: Frames, rid: str = "after") -> None:
    """The runner still answers a plain request, and every slot holds exactly the cells it
    believes it holds."""
    r.generate(rid, job())
    kind, stats = frames.final(rid)
    assert kind == "done" and stats["completion_tokens"] > 0, (kind, stats)
    for slot in r.engine.slots:
        assert r.engine.ctx.seq_pos_max(slot.seq_id) == len(slot.tokens) - 1


# -- (a) deeply nested JSON reaching the tool-call parser ------------------------------------

DEPTH = 1200  # Python's json raises RecursionError near 1000 levels


def test_tool_call_parser_survives_deeply_nested_json(
        tiny_runner: tuple[ModelHost, Frames]) -> None:
    r, frames = tiny_runner
    head = '<tool_call>{"name": "f", "arguments": '
    # the output is forced: a call whose arguments open DEPTH lists, parsed when it ends;
    # beside it, a sequence still generating then (its grammar keeps it from stopping early)
    grammar = f"root ::= {json.dumps(head)} {json.dumps('[' * DEPTH)}\n"
    r.generate("deep", job("hello", num_predict=DEPTH + 80, grammar=grammar,
                           tools=[Tool(name="f")], tool_choice="auto"))
    long = f"root ::= {json.dumps('a' * 2 * DEPTH)}\n"
    r.generate("beside", job("hello", num_predict=DEPTH + 200, grammar=long))
    kind, stats = frames.final("deep")
    # not a call (too deep to be one): the text comes back as the answer
    assert kind == "done" and stats["finish_reason"] == "stop", stats
    assert frames.text("deep") == head + "[" * DEPTH
    kind, stats = frames.final("beside")
    assert kind == "done" and stats["completion_tokens"] == DEPTH + 200
    assert_serving(r, frames)


def test_nesting_is_bounded_before_parsing() -> None:
    f = ToolCheck({"f": None})
    deep = '<tool_call>{"name": "f", "arguments": ' + "[" * 5000 + "]" * 5000 + "}</tool_call>"
    assert parse_calls(deep, "hermes", f) is None
    assert parse_calls("[" * 5000, "json", f, truncated=True) is None
    assert parse_calls('[f(a=' + "[" * 5000 + ")]", "llama3", f) is None
    nested_str = json.dumps("[" * 5000)  # arguments given as a JSON string
    assert parse_calls('{"name": "f", "arguments": ' + nested_str + "}", "json", f) is None
    # brackets inside strings are text, not nesting; a normal call still parses
    ok = '<tool_call>{"name": "f", "arguments": {"s": "' + "[" * 500 + '"}}</tool_call>'
    found = parse_calls(ok, "hermes", f)
    assert found is not None and found[0][0].arguments == {"s": "[" * 500}


def test_output_filter_failure_ends_that_request_only(runner: tuple[ModelHost, Frames],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    r, frames = runner
    push = ToolStream.push

    def fragile(self: ToolStream, text: str, logprobs: Any = None) -> Any:
        if self is r.outputs.tool_streams.get("bad"):
            raise RuntimeError("parser bug")
        return push(self, text, logprobs)

    monkeypatch.setattr(ToolStream, "push", fragile)
    offered = {"tools": [Tool(name="f")], "tool_choice": "auto"}
    r.generate("bad", job(num_predict=400, **offered))
    r.generate("good", job(num_predict=16, **offered))
    kind, err = frames.final("bad")
    assert kind == "error" and err["code"] == "internal" and "RuntimeError" in err["message"]
    assert frames.final("good")[0] == "done"
    # the failed sequence was cancelled in the engine (its slot is free for the next
    # request), and nothing more of it was sent after its error
    assert_serving(r, frames)
    assert [k for k, _ in frames.events["bad"]][-1] == "error"
    assert "bad" not in r.outputs.tool_streams


# -- (b) a sampler or grammar failure in one sequence ----------------------------------------

def test_sampler_failure_ends_that_sequence_only(runner: tuple[ModelHost, Frames],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    r, frames = runner
    engine = r.engine
    sample = engine.ctx.sample

    def fragile(sampler: Any, idx: int) -> int:
        if any(s.seq is not None and s.seq.id == "bad" and s.seq.sampler is sampler
               for s in engine.slots):
            raise RuntimeError("sampler exploded")
        return sample(sampler, idx)

    monkeypatch.setattr(engine.ctx, "sample", fragile)
    r.generate("good", job(num_predict=24))
    r.generate("bad", job("Tell me a story.", num_predict=24))
    kind, err = frames.final("bad")
    assert kind == "error" and err["code"] == "internal" and "sampler exploded" in err["message"]
    kind, stats = frames.final("good")
    assert kind == "done" and stats["completion_tokens"] == 24
    assert_serving(r, frames)


def test_grammar_that_does_not_build_is_a_400(runner: tuple[ModelHost, Frames]) -> None:
    r, frames = runner
    r.generate("bad", job(grammar="root ::= ( \"unclosed\"\n"))
    kind, err = frames.final("bad")
    assert kind == "error" and err["code"] == "invalid_request"
    assert_serving(r, frames)


def test_prompt_over_the_context_is_a_typed_error(runner: tuple[ModelHost, Frames]) -> None:
    """The numbers travel as fields (each dialect words them), before any Started."""
    r, frames = runner
    r.generate("long", job("blue sky " * 1500))
    kind, err = frames.final("long")
    assert kind == "error" and err["code"] == "prompt_too_long"
    assert err["n_ctx"] == 2048 and err["prompt_tokens"] > 2048
    assert [k for k, _ in frames.events["long"]] == ["error"]
    assert_serving(r, frames)


def test_template_crash_is_an_error_for_that_request(runner: tuple[ModelHost, Frames],
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    r, frames = runner

    def crash(*_: Any, **__: Any) -> str:
        raise TypeError("a template bug")

    monkeypatch.setattr("llmrun.chat.templates.render", crash)
    r.generate("gen", job())
    r.count("count", job())
    for rid in ("gen", "count"):
        kind, err = frames.final(rid)
        assert kind == "error" and err["code"] == "internal" and "TypeError" in err["message"]
    monkeypatch.undo()
    assert_serving(r, frames)


# -- (c) the engine thread or the message loop dying ends the process ------------------------

def test_engine_thread_death_exits_the_process(runner: tuple[ModelHost, Frames]) -> None:
    r, frames = runner
    exited: list[int] = []
    gone = threading.Event()

    def fake_exit(status: int) -> None:  # returning ends the engine thread
        exited.append(status)
        gone.set()

    def broken_step() -> None:
        raise RuntimeError("a bug in the step")

    r._exit = fake_exit  # type: ignore[method-assign]
    r._inflight.add("e-elsewhere")  # as an embedding in flight on the other thread
    r.engine._step = broken_step  # type: ignore[method-assign]
    r.generate("doomed", job())
    assert gone.wait(60), "the runner kept running with a dead engine thread"
    assert exited == [ipc.EXIT_ENGINE_FAILED]
    for rid in ("doomed", "e-elsewhere"):  # every request in flight was told first
        kind, err = frames.final(rid)
        assert kind == "error" and "restarted" in err["message"]
        assert err["code"] == "runner_failed"


def test_message_loop_failure_exits_the_process(model: Model) -> None:
    class Broken(Frames):
        def recv(self) -> dict[str, Any]:
            return {"type": "generate"}  # no id: not a message (ProtocolError)

    frames = Broken()
    ctx = Context(model, n_ctx_seq=256, n_seq=1, n_batch=64, n_threads=1)
    r = ModelHost(frames, model, ctx, 256, 1, 1)  # type: ignore[arg-type]
    exited: list[int] = []
    r._exit = exited.append  # type: ignore[assignment]
    try:
        r.serve()
    finally:
        ctx.close()
    assert exited == [ipc.EXIT_SERVE_FAILED]


# -- (d) the watchdog --------------------------------------------------------------------------

def _children(pid: int) -> set[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
    return {int(p) for p in out.stdout.split()}


def test_watchdog_restarts_a_runner_that_stops_responding(tmp_path: Path,
                                                          smollm2_path: Path) -> None:
    d = Daemon(make_home(tmp_path, smollm2_path),
               env={"LLMRUN_WATCHDOG": "8s", "LLMRUN_NUM_PARALLEL": "1"}).start()
    try:
        assert d.proc is not None
        body = {"model": "smollm2", "messages": [{"role": "user", "content": "Tell a story"}],
                "options": {"num_predict": 2000}}
        with httpx.stream("POST", f"{d.url}/api/chat", json=body, timeout=60) as r:
            lines = r.iter_lines()
            first = json.loads(next(lines))
            assert first.get("done") is False, first
            stopped = _children(d.proc.pid)
            assert stopped, "expected a runner under the daemon"
            for pid in stopped:
                os.kill(pid, signal.SIGSTOP)
            rest = [json.loads(line) for line in lines if line]
        error = rest[-1]["error"]
        assert "made no progress for 8 s and was restarted" in error
        assert "/" not in error  # no server paths in an error body
        again = httpx.post(f"{d.url}/api/chat", timeout=60, json={
            **body, "stream": False, "options": {"num_predict": 4, **GREEDY}})
        assert again.status_code == 200, again.text
        assert again.json()["eval_count"] == 4
        # a fresh runner; the stopped one is gone once the daemon has reaped it
        wait_until(lambda: not stopped & _children(d.proc.pid),
                   what="the stopped runner killed and reaped")
    finally:
        d.stop()


def test_engine_heartbeats_while_reading_a_long_prompt(tiny: Model,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # a prompt read in 64-token chunks makes steps that emit no text: each says how far the
    # reading is (and a step that emits nothing at all sends a heartbeat, normally at most
    # one a second), so the daemon's watchdog sees a runner at work
    monkeypatch.setattr(batcher, "HEARTBEAT_SECONDS", 0.0)
    frames = Frames()
    ctx = Context(tiny, n_ctx_seq=2048, n_seq=1, n_batch=64, n_threads=1)
    r = ModelHost(frames, tiny, ctx, 2048, 1, 1)  # type: ignore[arg-type]
    r.engine.start()
    try:
        r.generate("long", job("hello " * 600, num_predict=2))
        assert frames.final("long")[0] == "done"
    finally:
        r.engine.stop()
        ctx.close()
    assert frames.beats >= 5
    read = [p["processed"] for k, p in frames.events["long"] if k == "progress"]
    assert len(read) >= 5 and read == sorted(read)


# -- (e) IPC frames and large embedding batches ----------------------------------------------

def test_embed_batch_over_the_cap_is_413_and_the_runner_lives(daemon: Daemon) -> None:
    inputs = [f"w{i}" for i in range(3000)]  # over the inputs' cap, under the JSON values'
    with httpx.Client(base_url=daemon.url, timeout=120) as api:
        r = api.post("/api/embed", json={"model": "smollm2", "input": inputs})
        assert r.status_code == 413 and "2048" in r.json()["error"]
        r = api.post("/v1/embeddings", json={"model": "smollm2", "input": inputs})
        assert r.status_code == 413 and "2048" in r.json()["error"]["message"]
        # far more is refused before it is parsed, by the body's count of values
        many = [f"w{i}" for i in range(50_000)]
        r = api.post("/api/embed", json={"model": "smollm2", "input": many})
        assert r.status_code == 413 and "32768 values" in r.json()["error"]
        ok = api.post("/api/embed", json={"model": "smollm2", "input": ["a", "b"]})
        assert ok.status_code == 200 and len(ok.json()["embeddings"]) == 2


def test_large_batches_and_frames_with_a_small_frame_limit(tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # both sides at 256 KiB (the daemon passes its limit to the runner): a 2,000-input batch
    # goes in pieces and its replies (about 1.3 MB per piece) come back in several frames
    monkeypatch.setattr(ipc, "MAX_FRAME", 256 << 10)
    path = write_tiny_llama(tmp_path / "tiny.gguf")
    spec = RunnerSpec(model_paths=(path,), n_ctx=128, n_slots=1, n_threads=1)
    words = [f"hello {w}" for w in ("a", "b", "c", "he", "the", "hell", "o", "x")]
    inputs = [words[i % len(words)] for i in range(2000)]

    async def go() -> None:
        runner = RunnerHandle(spec, tmp_path / "runner.log")
        await runner.start()
        try:
            vectors, n_tokens = await runner.run(work.Embedding(inputs, truncate=False))
            assert len(vectors) == 2000 and n_tokens > 2000
            alone = {w: (await runner.run(work.Embedding([w], truncate=False)))[0][0]
                     for w in words}
            for text, v in zip(inputs, vectors, strict=True):
                assert np.allclose(v, alone[text], atol=1e-4)
            # a message over the limit fails its own request with 413, never the runner
            with pytest.raises(EngineError) as err:
                await runner.run(work.Embedding(["x" * (300 << 10)], truncate=True))
            assert err.value.code == "too_large" and str(256 << 10) in err.value.message
            huge = ChatRequest(model="tiny", messages=[], prompt="x" * (300 << 10),
                               options=DEFAULT_OPTIONS)
            with pytest.raises(EngineError) as err:
                async for _ in runner.generate(huge):
                    pass
            assert err.value.code == "too_large"
            assert runner.alive
            out = [c async for c in runner.generate(ChatRequest(
                model="tiny", messages=[], prompt="hello",
                options=Options(num_predict=3).merged_over(DEFAULT_OPTIONS)))]
            assert isinstance(out[0], Started) and isinstance(out[-1], Done)
            assert out[0].prompt_tokens == out[-1].stats.prompt_tokens and out[0].n_ctx == 128
        finally:
            await runner.stop()

    asyncio.run(go())


def test_runner_splits_events_too_large_for_a_frame(runner: tuple[ModelHost, Frames],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    r, frames = runner
    monkeypatch.setattr(ipc, "MAX_FRAME", 4096)
    vectors = [[0.125] * 100 for _ in range(40)]  # ~24 KB as one event
    r.emit([("e1", "embedding", {"embeddings": vectors, "prompt_tokens": 40}),
            ("g1", "chunk", {"text": "hello"})])
    assert max(frames.sizes) <= 4096
    got = [v for kind, p in frames.events["e1"] for v in p["embeddings"]]
    assert got == vectors and [k for k, _ in frames.events["e1"]][-1] == "embedding"
    assert frames.events["g1"] == [("chunk", {"text": "hello"})]
    # one event that cannot be split: an error for its request, the channel intact
    r.emit([("g2", "chunk", {"text": "y" * 10_000})])
    kind, err = frames.final("g2")
    assert kind == "error" and err["code"] == "too_large"
