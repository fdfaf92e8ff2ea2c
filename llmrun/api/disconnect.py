"""Cancelling work whose client went away.

Streaming responses are cancelled by Starlette when the client disconnects; a non-streaming
handler is not, so a client that gives up would keep a slot decoding for nobody. This races
the handler's work against the connection and cancels the work (which cancels its sequence
in the runner) when the client is gone.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response

T = TypeVar("T")
POLL = 0.25


async def unless_disconnected(request: Request | None, work: Awaitable[T]) -> T | Response:
    task = asyncio.ensure_future(work)
    if request is None:
        return await task
    while True:
        done, _ = await asyncio.wait({task}, timeout=POLL)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
            return Response(status_code=499)  # nginx's "client closed request"; nobody reads it
