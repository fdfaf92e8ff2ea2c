"""What every dialect does with the service's event stream: `Started`, `Chunk`s, `Done`.

`Started` (the prompt's size, once the request has a slot) matters to a dialect that reports
usage before the answer (Anthropic's message_start); the others report it from `Done`'s
statistics and only need the first event after it. Nothing here runs per token.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import cast

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
