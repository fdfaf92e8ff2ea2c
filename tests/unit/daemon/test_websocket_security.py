"""The daemon's Host, Origin and key checks (daemon/security.py) hold for WebSocket handshakes
too: a browser opens a WebSocket to any address with any Origin and no CORS preflight, so the
realtime transcription session would otherwise be open to every page the user visits."""

from __future__ import annotations

import pytest
from starlette.applications import Starlette
from starlette.routing import WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocket, WebSocketDisconnect

from llmrun.daemon.security import Security


async def echo(ws: WebSocket) -> None:
    await ws.accept()
    await ws.send_text("hello")
    await ws.close()


def client(monkeypatch: pytest.MonkeyPatch, keys: str = "") -> TestClient:
    monkeypatch.setenv("LLMRUN_API_KEYS", keys)
    monkeypatch.setenv("LLMRUN_HOST", "127.0.0.1:11434")
    app = Security(Starlette(routes=[WebSocketRoute("/v1/realtime", echo)]))
    return TestClient(app, base_url="http://127.0.0.1:11434")


def opens(c: TestClient, **headers: str) -> bool:
    headers = {"host": "127.0.0.1:11434", **headers}
    try:
        with c.websocket_connect("/v1/realtime", headers=headers) as ws:
            return ws.receive_text() == "hello"
    except WebSocketDisconnect as exc:
        assert exc.code == 1008
        return False


def test_origins_and_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    c = client(monkeypatch)
    assert opens(c)
    assert opens(c, origin="http://localhost:3000")
    assert not opens(c, origin="https://evil.example")
    assert not opens(c, origin="null")
    assert not opens(c, host="evil.example")  # DNS rebinding
    assert not opens(c, **{"sec-fetch-site": "cross-site"})


def test_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    c = client(monkeypatch, keys="sekrit")
    assert not opens(c)
    assert not opens(c, authorization="Bearer wrong")
    assert opens(c, authorization="Bearer sekrit")
    assert opens(c, **{"x-api-key": "sekrit"})
