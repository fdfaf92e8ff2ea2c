"""Who may talk to the daemon: Host checks (DNS rebinding), browser Origins, API keys.

- DNS rebinding: a web page on evil.example can make its own hostname resolve to 127.0.0.1
  and then read the local API from the victim's browser. The browser still sends
  `Host: evil.example`, so a daemon that answers only for the names it is reached by
  (loopback names, the bound address, LLMRUN_ORIGINS hosts) defeats it.
- Origins: a browser request that carries an Origin other than a local one (or one listed in
  LLMRUN_ORIGINS) is refused, and CORS preflights are answered only for allowed origins.
- API keys: when LLMRUN_API_KEYS is set, every route but `/` and `/health` needs
  `Authorization: Bearer <key>` or `x-api-key: <key>`; refusals come in the caller's dialect.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from llmrun import config

LOCAL_NAMES = {"localhost", "127.0.0.1", "::1", "0.0.0.0", "::"}
OPEN_PATHS = {"/", "/health"}


def _hostname(value: str) -> str:
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].split("]")[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


def _is_loopback(host: str) -> bool:
    if host in ("localhost",) or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _error(path: str, status: int, message: str) -> tuple[int, bytes]:
    if path.startswith("/v1/messages"):
        kind = "authentication_error" if status == 401 else "permission_error"
        body = {"type": "error", "error": {"type": kind, "message": message}}
    elif path.startswith("/v1/"):
        code = "invalid_api_key" if status == 401 else "forbidden"
        body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                          "code": code}}
    else:
        body = {"error": message}
    return status, json.dumps(body).encode()


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
        return self.any_host or _is_loopback(name) or name in self.hosts or name in LOCAL_NAMES

    def origin_allowed(self, origin: str) -> bool:
        origin = origin.rstrip("/").lower()
        if origin in self.origins or "*" in self.origins:
            return True
        parts = urlsplit(origin)
        # local pages and apps (file://, app://, tauri://, vscode-webview://) are the user's own
        return _is_loopback(parts.hostname or "") or parts.scheme not in ("http", "https")

    def key_ok(self, headers: dict[str, str]) -> bool:
        supplied = headers.get("x-api-key", "")
        auth = headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            supplied = supplied or auth[7:].strip()
        return any(hmac.compare_digest(supplied.encode(), k.encode()) for k in self.keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1")
                   for k, v in scope["headers"]}
        path = scope["path"]
        origin = headers.get("origin")
        if not self.host_allowed(headers.get("host", "")):
            await self._refuse(send, path, 403, "host not allowed (DNS rebinding protection); "
                               "add it to LLMRUN_ORIGINS or bind LLMRUN_HOST to it")
            return
        if origin and not self.origin_allowed(origin):
            await self._refuse(send, path, 403, f"origin {origin} not allowed; add it to "
                               "LLMRUN_ORIGINS")
            return
        if scope["method"] == "OPTIONS" and origin:
            await self._preflight(send, origin, headers)
            return
        if self.keys and path not in OPEN_PATHS and not self.key_ok(headers):
            await self._refuse(send, path, 401, "missing or invalid API key")
            return
        if origin is None:
            await self.app(scope, receive, send)
            return

        async def with_cors(message: dict) -> None:  # type: ignore[type-arg]
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []),
                                      (b"access-control-allow-origin", origin.encode()),
                                      (b"vary", b"Origin")]
            await send(message)

        await self.app(scope, receive, with_cors)

    async def _preflight(self, send: Send, origin: str, headers: dict[str, str]) -> None:
        allow = headers.get("access-control-request-headers", "*") or "*"
        await send({"type": "http.response.start", "status": 204, "headers": [
            (b"access-control-allow-origin", origin.encode()),
            (b"access-control-allow-methods", b"GET, POST, PUT, DELETE, HEAD, OPTIONS"),
            (b"access-control-allow-headers", allow.encode()),
            (b"access-control-max-age", b"600"), (b"vary", b"Origin")]})
        await send({"type": "http.response.body", "body": b""})

    async def _refuse(self, send: Send, path: str, status: int, message: str) -> None:
        status, body = _error(path, status, message)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})
