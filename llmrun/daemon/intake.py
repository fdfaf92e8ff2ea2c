"""Request limits at the HTTP edge: body size (413) and a per-client rate limit (429).

Both are pure ASGI middleware: BaseHTTPMiddleware would buffer streamed answers, and the body
cap must count bytes as they arrive rather than after a whole body sits in memory. Refusals
come in the caller's dialect (`security.send_error`).
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmrun import config
from llmrun.api.openai.realtime import CLIENT_SCOPE_KEY
from llmrun.daemon.security import OPEN_PATHS, send_error, supplied_key
from llmrun.server.service import CLIENT_NUM_CTX
from llmrun.tokenbucket import TokenBucket

# Blob uploads are model files: they have their own cap (LLMRUN_MAX_BLOB_SIZE) and are
# streamed to disk by their route.
BODY_EXEMPT_PREFIX = "/api/blobs/"
# Clients remembered by the rate limiter; past it the least recently seen is forgotten (a
# client idle for a minute has a full bucket anyway, so forgetting it changes nothing).
MAX_RATE_CLIENTS = 65536


def _human(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size} {unit}"
    return f"{n} bytes"


def _content_length(scope: Scope) -> int | None:
    for key, value in scope["headers"]:
        if key == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server's HTTP parser refuses these before we see them
    return None


class BodyLimit:
    """413 for a body over `max_size`: at once when Content-Length says so, else as soon as
    the bytes received pass it (chunked bodies), without reading the rest. The server drains
    what the client still sends, so the client can read the 413."""

    def __init__(self, app: ASGIApp, max_size: int | None = None) -> None:
        self.app = app
        self.max_size = config.max_body_size() if max_size is None else max_size

    def _message(self) -> str:
        return (f"request body too large: the limit is {_human(self.max_size)} "
                "(LLMRUN_MAX_BODY_SIZE)")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(BODY_EXEMPT_PREFIX):
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        declared = _content_length(scope)
        if declared is not None and declared > self.max_size:
            await send_error(send, path, 413, self._message(), "request_too_large")
            return
        received = 0
        started = refused = False

        async def counting_receive() -> Message:
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_size:
                    refused = True
                    if not started:
                        await send_error(send, path, 413, self._message(), "request_too_large")
                    # the app sees a client that went away: it stops reading and gives up
                    return {"type": "http.disconnect"}
            return message

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if refused:
                return  # the 413 is the answer; whatever the app says after it is dropped
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        await self.app(scope, counting_receive, guarded_send)


class TokenBuckets:
    """One token bucket per client: `per_minute` tokens refill evenly over a minute, up to a
    burst of `per_minute`. Holds at most `max_clients` buckets (least recently seen first
    out), so a flood of addresses cannot grow memory without bound."""

    def __init__(self, per_minute: int, max_clients: int = MAX_RATE_CLIENTS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = float(per_minute)
        self.per_second = per_minute / 60.0
        self.max_clients = max_clients
        self.clock = clock
        self.buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def take(self, client: str) -> int:
        """0 when the request may go ahead (a token is spent), else whole seconds (>= 1)
        until the next token."""
        now = self.clock()
        bucket = self.buckets.pop(client, None) or \
            TokenBucket.full(self.per_second, self.capacity, now)
        wait = 0
        if not bucket.take(1.0, now):
            wait = max(1, math.ceil((1.0 - bucket.tokens) / self.per_second))
        self.buckets[client] = bucket  # re-inserted last: most recently seen
        while len(self.buckets) > self.max_clients:
            self.buckets.popitem(last=False)
        return wait


class RateLimit:
    """429 with Retry-After past LLMRUN_RATE_LIMIT requests a minute, counted per API key when
    keys are set (every request here has passed the key check) or per client address; off
    when the rate is 0. `/` and `/health` stay free, so liveness probes never use it up.
    WebSocket handshakes count as requests (a refused one gets the same 429). On or off, it
    names the client in the scope (CLIENT_SCOPE_KEY), for the realtime session's cap per
    client."""

    def __init__(self, app: ASGIApp, per_minute: int | None = None,
                 max_clients: int = MAX_RATE_CLIENTS) -> None:
        self.app = app
        rate = config.rate_limit() if per_minute is None else per_minute
        self.buckets = TokenBuckets(rate, max_clients) if rate > 0 else None
        self.by_key = bool(config.api_keys())

    def client(self, scope: Scope) -> str:
        if self.by_key:
            headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                       for k, v in scope["headers"]}
            return "key:" + supplied_key(headers)
        peer = scope.get("client")
        return "addr:" + (peer[0] if peer else "")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        # who the client is, for what else counts per client (the realtime session's cap)
        scope[CLIENT_SCOPE_KEY] = client = self.client(scope)
        if self.buckets is None or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        # a WebSocket handshake is a request like any other: a client that reconnects in a
        # loop spends its bucket as one that polls over HTTP
        wait = self.buckets.take(client)
        if wait:
            message = (f"rate limit exceeded (LLMRUN_RATE_LIMIT={self.buckets.capacity:g} "
                       f"requests a minute); retry in {wait} s")
            headers = [(b"retry-after", str(wait).encode())]
            if scope["type"] == "websocket":
                await _refuse_handshake(scope, receive, send, 429, message,
                                        "rate_limit_exceeded", headers)
            else:
                await send_error(send, scope["path"], 429, message, "rate_limit_exceeded",
                                 headers=headers)
            return
        await self.app(scope, receive, send)


async def _refuse_handshake(scope: Scope, receive: Receive, send: Send, status: int,
                            message: str, code: str,
                            headers: list[tuple[bytes, bytes]]) -> None:
    """Refuse a WebSocket handshake with an HTTP answer (status, headers and the dialect's
    error body) where the server offers ASGI's denial-response extension (uvicorn does);
    else close it unaccepted, which the server answers with a bare 403."""
    await receive()  # websocket.connect
    if "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": 1008})
        return

    async def as_denial(message: Message) -> None:
        await send({**message, "type": "websocket." + message["type"]})

    await send_error(as_denial, scope["path"], status, message, code, headers=headers)


NUM_CTX_HEADER = b"x-llmrun-num-ctx"
MAX_CLIENT_NUM_CTX = 1 << 24  # past any model's trained context (num_ctx is capped there)


class ClientContext:
    """`X-Llmrun-Num-Ctx: N`: the context this client's requests are loaded with where their
    body names none (server/service.CLIENT_NUM_CTX). A value that is no whole number from 1
    to 2**24 is a 400, in the path's dialect, before any route reads the body."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw = dict(scope.get("headers") or ()).get(NUM_CTX_HEADER) \
            if scope["type"] == "http" else None
        if raw is None:
            await self.app(scope, receive, send)
            return
        text = raw.decode("latin-1").strip()
        if not (text.isascii() and text.isdigit() and len(text) <= 9
                and 1 <= int(text) <= MAX_CLIENT_NUM_CTX):
            await send_error(send, scope["path"], 400,
                             f"X-Llmrun-Num-Ctx must be a whole number from 1 to "
                             f"{MAX_CLIENT_NUM_CTX}, not {text[:40]!r}", "invalid_request")
            return
        token = CLIENT_NUM_CTX.set(int(text))
        try:
            await self.app(scope, receive, send)
        finally:
            CLIENT_NUM_CTX.reset(token)
