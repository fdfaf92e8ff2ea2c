"""What every dialect does with the service's event stream: `Started`, `Chunk`s, `Done`.

`Started` (the prompt's size, once the request has a slot) matters to a dialect that reports
usage before the answer (Anthropic's message_start); the others report it from `Done`'s
statistics and only need the first event after it. `first_event` is how each dialect waits
for it. Nothing here runs per token.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar, cast

from fastapi.responses import Response

from llmrun.request import Chunk, Done, Progress, Started

# Service.chat's stream: Started, Progress (only to a request that asked), Chunks, a Done
EventStream = AsyncGenerator[Started | Progress | Chunk | Done, None]
# what is left of one once first_output has read its first output: Chunks and a Done
OutputStream = AsyncGenerator[Chunk | Done, None]


async def first_output(events: AsyncIterator[Started | Progress | Chunk | Done]) -> Chunk | Done:
    """The first event after `Started`; an error before it raises EngineError, as reading
    the stream would. The rest of `events` holds only Chunks and a Done (`OutputStream`).
    For a request that asked for no Progress (`ChatRequest.progress`)."""
    event = await anext(events)
    while isinstance(event, Started):  # (it comes once, first)
        event = await anext(events)
    return cast("Chunk | Done", event)  # (no Progress: the request asked for none)


T = TypeVar("T")


async def first_event(reading: Awaitable[T], close: Callable[[], Awaitable[object]],
                      errors: tuple[type[Exception], ...],
                      # (Any: given one of `errors`, which mypy cannot pair with a union)
                      on_error: Callable[[Any], Response],
                      wait: Callable[[asyncio.Future[T]], Awaitable[object]] | None = None,
                      ) -> asyncio.Future[T] | Response:
    """Every dialect's way into an answer: wait for the first event (`reading`, which reads
    it) for as long as `wait` says (by default until it comes); an error among `errors`
    before then is the dialect's HTTP error (`on_error`), the stream closed. Otherwise the
    future, done or (when `wait` gave up first) still pending, for the answer to go on from.
    If this is cancelled meanwhile (the client left: `disconnect.unless_disconnected`), the
    read is cancelled and the stream closed, which cancels the request in the runner."""
    first = asyncio.ensure_future(reading)
    try:
        await (wait(first) if wait is not None else asyncio.wait({first}))
        if first.done():
            first.result()
    except errors as exc:
        await close()
        return on_error(exc)
    except BaseException:
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await first
        await close()
        raise
    return first
