"""Limits at the HTTP edge: body size (413), rate limit (429 + Retry-After), unknown routes,
each answered in the caller's dialect. Real daemons on tiny models; the middleware's counting
also driven directly through ASGI, where a test can see how much of a body was read."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from llmrun.daemon.intake import BodyLimit, RateLimit, TokenBuckets
from tests.conftest import Daemon
from tests.integration.test_service import gen, tiny_home

MiB = 1 << 20


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tiny_home(tmp_path_factory.mktemp("edge"), ["a"])).start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tiny_home(tmp_path_factory.mktemp("limited"), ["a"]),
               env={"LLMRUN_RATE_LIMIT": "3"}).start()
    yield d
    d.stop()


def chunks(total: int, size: int = MiB) -> Iterator[bytes]:
    """A body produced as it is sent, so the test never holds it whole."""
    block = b"x" * size
    for _ in range(total // size):
        yield block


def post_big(url: str, total: int = 64 * MiB, declare: bool = False) -> httpx.Response:
    # without Content-Length httpx sends it chunked: only counting can catch it
    headers = {"Content-Length": str(total)} if declare else {}
    return httpx.post(url, content=chunks(total), headers=headers, timeout=120)


def test_64mib_body_is_413_and_the_daemon_still_serves(edge: Daemon) -> None:
    r = post_big(f"{edge.url}/api/chat")  # chunked: counted as it arrives
    assert r.status_code == 413
    assert "LLMRUN_MAX_BODY_SIZE" in r.json()["error"]
    r = post_big(f"{edge.url}/api/no-such-route", declare=True)  # refused before routing
    assert r.status_code == 413 and "LLMRUN_MAX_BODY_SIZE" in r.json()["error"]
    r = gen(edge.url, "a")
    assert r.status_code == 200 and r.json()["done"]


def test_unknown_routes_answer_in_the_dialect(edge: Daemon) -> None:
    r = httpx.post(f"{edge.url}/api/nope", json={})
    assert r.status_code == 404 and set(r.json()) == {"error"}
    assert "/api/nope" in r.json()["error"]
    r = httpx.get(f"{edge.url}/v1/nope")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and set(err) == {"message", "type", "param",
                                                                   "code"}
    r = httpx.post(f"{edge.url}/v1/messages/nope", json={})
    assert r.status_code == 404 and r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(f"{edge.url}/api/chat")  # wrong method
    assert r.status_code == 405 and set(r.json()) == {"error"}


def until_limited(client: httpx.Client, method: str, path: str,
                  **kwargs: Any) -> httpx.Response:
    """Requests until one is refused: a token refills every 20 s at 3/min, so a stalled
    machine could let one more through, but never ten."""
    for _ in range(10):
        r = client.request(method, path, **kwargs)
        if r.status_code == 429:
            return r
    raise AssertionError("never rate limited")


def test_rate_limit_429_with_retry_after_in_each_dialect(limited: Daemon) -> None:
    with httpx.Client(base_url=limited.url, timeout=30) as client:
        # the burst is 3, one spent by Daemon.start's readiness probe (the exact count is
        # test_token_bucket_refills_and_its_table_is_bounded's)
        assert client.get("/api/tags").status_code == 200
        r = until_limited(client, "GET", "/api/tags")
        assert int(r.headers["retry-after"]) >= 1
        assert "rate limit" in r.json()["error"]
        r = until_limited(client, "GET", "/v1/models")
        assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert int(r.headers["retry-after"]) >= 1
        r = until_limited(client, "POST", "/v1/messages", json={})
        assert r.json()["error"]["type"] == "rate_limit_error"
        # liveness stays free
        assert client.get("/health").status_code == 200
        assert client.get("/").status_code == 200


# ---- the middleware alone, through ASGI ---------------------------------------------------


def _scope(path: str, headers: list[tuple[bytes, bytes]] | None = None,
           client: str = "10.0.0.1") -> dict[str, Any]:
    return {"type": "http", "method": "POST", "path": path, "headers": headers or [],
            "client": (client, 1234)}


async def _drain_app(scope: Any, receive: Any, send: Any) -> None:
    """Reads the whole body, then answers 200 (what a JSON route does)."""
    while (await receive()).get("more_body"):
        pass
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def _call(app: Any, scope: dict[str, Any], body_chunks: int = 0,
          chunk: int = MiB) -> tuple[list[dict[str, Any]], int]:
    """Runs one request; returns what was sent and how many body chunks were read."""
    sent: list[dict[str, Any]] = []
    read = 0

    async def receive() -> dict[str, Any]:
        nonlocal read
        read += 1
        return {"type": "http.request", "body": b"x" * chunk, "more_body": read < body_chunks}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    return sent, read


def test_chunked_body_stops_being_read_past_the_cap() -> None:
    sent, read = _call(BodyLimit(_drain_app, max_size=4 * MiB), _scope("/api/chat"),
                       body_chunks=1000)
    assert sent[0]["status"] == 413 and len(sent) == 2  # the app's own answer is dropped
    assert read == 5  # 5 MiB read of a 1000 MiB body: stopped at the first chunk past 4 MiB
    sent, read = _call(BodyLimit(_drain_app, max_size=4 * MiB), _scope("/api/blobs/sha256:0"),
                       body_chunks=8)
    assert sent[0]["status"] == 200 and read == 8  # blobs have their own cap
    sent, _ = _call(BodyLimit(_drain_app, max_size=4 * MiB), _scope("/api/chat"), body_chunks=4)
    assert sent[0]["status"] == 200  # at the cap is fine


def test_413_in_each_dialect() -> None:
    app = BodyLimit(_drain_app, max_size=MiB)
    sent, _ = _call(app, _scope("/v1/chat/completions"), body_chunks=2)
    err = json.loads(sent[1]["body"])["error"]
    assert sent[0]["status"] == 413 and err["code"] == "request_too_large"
    sent, _ = _call(app, _scope("/v1/messages"), body_chunks=2)
    body = json.loads(sent[1]["body"])
    assert body["type"] == "error" and body["error"]["type"] == "request_too_large"


def test_rate_limit_counts_per_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMRUN_API_KEYS", "k1,k2")
    app = RateLimit(_drain_app, per_minute=2)

    def status(key: str, client: str = "10.0.0.1") -> int:
        sent, _ = _call(app, _scope("/api/tags", [(b"x-api-key", key.encode())], client))
        return sent[0]["status"]

    assert [status("k1"), status("k1", "10.0.0.2"), status("k1")] == [200, 200, 429]
    assert status("k2") == 200  # another key, its own bucket


def test_token_bucket_refills_and_its_table_is_bounded() -> None:
    now = [0.0]
    buckets = TokenBuckets(3, max_clients=100, clock=lambda: now[0])
    assert [buckets.take("a") for _ in range(4)] == [0, 0, 0, 20]  # 3/min: a token per 20 s
    now[0] = 19.5
    assert buckets.take("a") == 1  # Retry-After rounds up, never 0
    now[0] = 20.0
    assert buckets.take("a") == 0
    for i in range(1000):
        buckets.take(f"10.1.{i // 256}.{i % 256}")
    assert len(buckets.buckets) == 100


def test_rate_limit_off_at_zero() -> None:
    app = RateLimit(_drain_app, per_minute=0)
    assert all(_call(app, _scope("/api/tags"))[0][0]["status"] == 200 for _ in range(50))


def test_body_limit_default_from_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMRUN_MAX_BODY_SIZE", "1KiB")
    scope = _scope("/api/chat", [(b"content-length", b"1025")])
    sent, read = _call(BodyLimit(_drain_app), scope, body_chunks=1, chunk=1025)
    assert sent[0]["status"] == 413 and read == 0  # refused on the declared length alone
