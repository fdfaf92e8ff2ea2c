"""Who may talk to the daemon: Host checks (DNS rebinding), browser Origins, API keys.

- DNS rebinding: a web page on evil.example can make its own hostname resolve to 127.0.0.1
  and then read the local API from the victim's browser. The browser still sends
  `Host: evil.example`, so a daemon that answers only for the names it is reached by
  (loopback names, the bound address, LLMRUN_ORIGINS hosts) defeats it.
- Origins: a browser request that carries an Origin other than a loopback http(s) one (or
  one listed in LLMRUN_ORIGINS) is refused, and CORS preflights are answered only for allowed
  origins. `null` (what a sandboxed iframe or a `data:` page sends) and other non-http(s)
  origins (file://, app://, chrome-extension://, ...) are refused unless listed exactly:
  any web page can make its requests carry `null`, and a body read as JSON whatever its
  Content-Type makes a "simple" POST (no preflight) enough to drive the API. A request the
  browser marks `Sec-Fetch-Site: cross-site` is refused unless its origin is allowed, which
  also covers requests that carry no Origin at all (navigations, `<img>`, `<form>` GETs).
- API keys: when LLMRUN_API_KEYS is set, every route but `/`, `/health` and the web page's
  static files (`/ui/...`: the page asks for the key, so it must load without one; its API
  calls need the key as any client's do) needs `Authorization: Bearer <key>` or
  `x-api-key: <key>`; refusals come in the caller's dialect.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmrun import config
from llmrun.daemon.dialects import error_body

LOCAL_NAMES = {"localhost", "127.0.0.1", "::1", "0.0.0.0", "::"}
OPEN_PATHS = {"/", "/health", "/ui"}
OPEN_PREFIX = "/ui/"  # the web page's files (daemon/web.py); never an API route


def _hostname(value: str) -> str:
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].split("]")[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value




async def send_error(send: Send, path: str, status: int, message: str, code: str | None = None,
                     headers: Iterable[tuple[bytes, bytes]] = ()) -> None:
    """Answer a whole HTTP response from ASGI middleware, in the caller's dialect."""
    body = json.dumps(error_body(path, status, message, code)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *headers]})
    await send({"type": "http.response.body", "body": body})


def supplied_key(headers: Mapping[str, str]) -> str:
    """The key a request presents (`x-api-key`, else `Authorization: Bearer`); "" if none."""
    auth = headers.get("authorization", "")
    bearer = auth[7:].strip() if auth.lower().startswith("bearer ") else ""
    return headers.get("x-api-key", "") or bearer


def key_valid(supplied: str, keys: Iterable[str]) -> bool:
    # compare with every key in constant time: the time taken says nothing about a key
    return any(hmac.compare_digest(supplied.encode(), k.encode()) for k in keys)


def authorized(headers: Mapping[str, str]) -> bool:
    """True when no keys are configured, or the request carries one of them."""
    keys = config.api_keys()
    return not keys or key_valid(supplied_key(headers), keys)


class Security:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.keys = config.api_keys()
        self.origins = {o.strip().rstrip("/").lower()
                        for o in config.raw("LLMRUN_ORIGINS").split(",") if o.strip()}
        bound, _ = config.host()
        self.hosts = {bound.lower()} | {urlsplit(o).hostname or "" for o in self.origins}
        # bound to all interfaces: the daemon is meant to be reached by other names
        self.any_host = bound in ("0.0.0.0", "::")

    def host_allowed(self, host: str) -> bool:
        name = _hostname(host)
        return (self.any_host or config.is_loopback(name) or name in self.hosts
                or name in LOCAL_NAMES)

    def origin_allowed(self, origin: str) -> bool:
        origin = origin.strip().rstrip("/").lower()
        if origin in self.origins:  # listed exactly: the only way in for null, file://, app://
            return True
        parts = urlsplit(origin)
        # `null` and non-web schemes cannot be told apart from any page that wants to pose as
        # them (a sandboxed iframe sends `null`), so neither `*` nor "looks local" admits them
        if parts.scheme not in ("http", "https") or not parts.hostname:
            return False
        return "*" in self.origins or config.is_loopback(parts.hostname)

    def cross_site_refused(self, headers: dict[str, str]) -> bool:
        """A request the browser says comes from another site, from an origin not allowed
        (or from no Origin at all: navigations and `<img>` loads carry none)."""
        if headers.get("sec-fetch-site", "").strip().lower() != "cross-site":
            return False
        origin = headers.get("origin")
        return not origin or not self.origin_allowed(origin)

    def key_ok(self, headers: dict[str, str]) -> bool:
        return key_valid(supplied_key(headers), self.keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "websocket":
            await self._websocket(scope, receive, send)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope["headers"]}
        path = scope["path"]
        origin = headers.get("origin") or None  # an empty header is no browser's
        if not self.host_allowed(headers.get("host", "")):
            await self._refuse(send, path, 403, "host not allowed (DNS rebinding protection); "
                               "add it to LLMRUN_ORIGINS or bind LLMRUN_HOST to it")
            return
        if origin is not None and not self.origin_allowed(origin):
            await self._refuse(send, path, 403, f"origin {origin[:200]} not allowed; add it to "
                               "LLMRUN_ORIGINS")
            return
        if self.cross_site_refused(headers):
            await self._refuse(send, path, 403, "cross-site request refused (Sec-Fetch-Site); "
                               "add the page's origin to LLMRUN_ORIGINS")
            return
        if scope["method"] == "OPTIONS" and origin:
            await self._preflight(send, origin, headers)
            return
        if self.keys and path not in OPEN_PATHS and not path.startswith(OPEN_PREFIX) \
                and not self.key_ok(headers):
            await self._refuse(send, path, 401, "missing or invalid API key")
            return
        if origin is None:
            await self.app(scope, receive, send)
            return

        async def with_cors(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []),
                                      (b"access-control-allow-origin", origin.encode()),
                                      (b"vary", b"Origin")]
            await send(message)

        await self.app(scope, receive, with_cors)

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The same checks for a WebSocket handshake (the realtime transcription session):
        a browser opens one to any address with any Origin and no preflight, so a page on
        another site could otherwise stream a microphone's worth of requests to the daemon.
        A refused handshake is closed before it is accepted (an HTTP 403 to the client)."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope["headers"]}
        origin = headers.get("origin") or None
        refused = (not self.host_allowed(headers.get("host", ""))
                   or (origin is not None and not self.origin_allowed(origin))
                   or self.cross_site_refused(headers)
                   or (bool(self.keys) and not self.key_ok(headers)))
        if refused:
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": 1008})
            return
        await self.app(scope, receive, send)

    async def _preflight(self, send: Send, origin: str, headers: dict[str, str]) -> None:
        allow = headers.get("access-control-request-headers", "*") or "*"
        await send({"type": "http.response.start", "status": 204, "headers": [
            (b"access-control-allow-origin", origin.encode()),
            (b"access-control-allow-methods", b"GET, POST, PUT, DELETE, HEAD, OPTIONS"),
            (b"access-control-allow-headers", allow.encode()),
            (b"access-control-max-age", b"600"), (b"vary", b"Origin")]})
        await send({"type": "http.response.body", "body": b""})

    async def _refuse(self, send: Send, path: str, status: int, message: str) -> None:
        await send_error(send, path, status, message,
                         "invalid_api_key" if status == 401 else "forbidden")
