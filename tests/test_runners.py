"""The daemon's handle on a runner, without a process: how it turns event frames into a
request's stream."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from llmrun.request import ChatRequest, Chunk, Done, Message, Started, error_event
from llmrun.server.runners import RunnerProcess, RunnerSpec


def handle_with(events: list[tuple[str, Any]]) -> RunnerProcess:
    """A handle whose next request finds `events` already waiting, as when the client reads
    slower than the runner writes."""
    handle = RunnerProcess(RunnerSpec((Path("m.gguf"),), 512, 1, 1), Path("runner.log"))
    track = handle._track

    def prefilled(req_id: str) -> asyncio.Queue[tuple[str, Any]]:
        q = track(req_id)
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
