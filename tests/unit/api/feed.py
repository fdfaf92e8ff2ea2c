"""Hand-built event streams for the dialects' stream layers, and readers of what comes out.

A dialect's answer is built from the service's events (`Started`, `Chunk`s, a `Done`, or an
`EngineError` raised on the way). `FakeService.chat` hands each request a scripted stream of
them, so the translation into a whole body or into SSE / NDJSON frames runs with no model, no
runner and no HTTP server; `body` reads a response (a StreamingResponse's iterator is read
directly) and `sse` / `ndjson` split what it wrote.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from fastapi.responses import Response, StreamingResponse

from llmrun.request import ChatRequest, Chunk, Done, Progress, Started

Event = Started | Progress | Chunk | Done | Exception
T = TypeVar("T")


@dataclass
class Script:
    """One request's events, in order; an exception among them is raised where it stands.
    `closed` says whether the reader closed the stream (which cancels it in the runner)."""

    events: Sequence[Event]
    closed: bool = False
    read: int = 0  # events handed out

    async def stream(self) -> AsyncGenerator[Any, None]:
        try:
            for event in self.events:
                self.read += 1
                if isinstance(event, Exception):
                    raise event
                yield event
        finally:
            self.closed = True


@dataclass
class FakeService:
    """Stands in for `Service` where the stream layer calls `chat`: the i-th request gets the
    i-th script (the last one again when there are fewer), and sets `leased` at once (the
    request has its slot, as the scheduler signals it)."""

    scripts: list[Script]
    requests: list[ChatRequest] = field(default_factory=list)

    @classmethod
    def of(cls, *events: Event) -> FakeService:
        return cls([Script(events)])

    def chat(self, req: ChatRequest, leased: asyncio.Event | None = None
             ) -> AsyncGenerator[Any, None]:
        script = self.scripts[min(len(self.requests), len(self.scripts) - 1)]
        self.requests.append(req)
        if leased is not None:
            leased.set()
        return script.stream()

    @property
    def closed(self) -> bool:
        return all(s.closed for s in self.scripts)


def stream_of(*events: Event) -> tuple[Script, AsyncGenerator[Any, None]]:
    script = Script(events)
    return script, script.stream()


def run(work: Awaitable[T]) -> T:
    async def main() -> T:
        return await work

    return asyncio.run(main())


async def body(response: Response) -> bytes:
    """All a response writes: a stream's frames joined, else its body."""
    if isinstance(response, StreamingResponse):
        return b"".join([cast(bytes, part) async for part in response.body_iterator])
    return bytes(response.body)


async def collect(frames: Any) -> bytes:
    """An async iterator of bytes, read to its end."""
    return b"".join([part async for part in frames])


def as_json(response: Response, raw: bytes) -> Any:
    assert not isinstance(response, StreamingResponse), "a stream, not a whole body"
    return json.loads(raw)


def sse(raw: bytes) -> list[tuple[str | None, Any]]:
    """SSE frames as (event name or None, data parsed as JSON, or the text `[DONE]`);
    comments (`: ping`) as ("comment", their text). Every frame must end with a blank line."""
    text = raw.decode()
    assert text.endswith("\n\n"), text[-40:]
    out: list[tuple[str | None, Any]] = []
    for frame in text[:-2].split("\n\n"):
        name: str | None = None
        data: list[str] = []
        for line in frame.split("\n"):
            if line.startswith(":"):
                out.append(("comment", line[1:].strip()))
            elif line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                data.append(line[len("data: "):])
            else:
                raise AssertionError(f"not an SSE line: {line!r}")
        if data:
            joined = "\n".join(data)
            out.append((name, joined if joined == "[DONE]" else json.loads(joined)))
        else:
            assert name is None, frame
    return out


def ndjson(raw: bytes) -> list[dict[str, Any]]:
    """NDJSON lines, each one object ending with a newline."""
    text = raw.decode()
    assert text.endswith("\n"), text[-40:]
    return [json.loads(line) for line in text[:-1].split("\n")]
