"""The rate limit (daemon/intake.RateLimit) holds for WebSocket handshakes: a client that
reconnects in a loop spends its bucket as one that polls over HTTP, and is refused with the
same 429. And it names the client in the scope, for the realtime session's cap per client,
whether or not a rate is set."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient, WebSocketDenialResponse
from starlette.websockets import WebSocket

from llmrun.api.openai.realtime import CLIENT_SCOPE_KEY
from llmrun.daemon.intake import RateLimit


async def who(ws: WebSocket) -> None:
    await ws.accept()
    await ws.send_text(str(ws.scope.get(CLIENT_SCOPE_KEY)))
    await ws.close()


async def ping(request: Request) -> PlainTextResponse:
    return PlainTextResponse("pong")


def client(monkeypatch: pytest.MonkeyPatch, rate: int, keys: str = "") -> TestClient:
    monkeypatch.setenv("LLMRUN_API_KEYS", keys)
    app = RateLimit(Starlette(routes=[WebSocketRoute("/v1/realtime", who),
                                      Route("/v1/models", ping)]), per_minute=rate)
    return TestClient(app, client=("10.0.0.7", 5000))


def test_handshakes_spend_the_same_bucket_as_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    c = client(monkeypatch, rate=3)
    assert c.get("/v1/models").status_code == 200
    for _ in range(2):
        with c.websocket_connect("/v1/realtime") as ws:
            assert ws.receive_text() == "addr:10.0.0.7"
    with pytest.raises(WebSocketDenialResponse) as refused, \
            c.websocket_connect("/v1/realtime"):
        pass
    assert refused.value.status_code == 429
    assert int(refused.value.headers["retry-after"]) >= 1
    assert "LLMRUN_RATE_LIMIT" in refused.value.json()["error"]["message"]
    assert c.get("/v1/models").status_code == 429


def test_the_client_is_named_with_the_limit_off(monkeypatch: pytest.MonkeyPatch) -> None:
    c = client(monkeypatch, rate=0, keys="k1,k2")
    for _ in range(5):
        with c.websocket_connect("/v1/realtime", headers={"x-api-key": "k2"}) as ws:
            assert ws.receive_text() == "key:k2"
