"""Host (DNS rebinding), Origin and API-key checks, answered in each dialect's error shape."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmrun.daemon.security import Security
from tests.conftest import Daemon, free_port
from tests.integration.test_service import tiny_home


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    home = tiny_home(tmp_path_factory.mktemp("sec"), ["a"])
    d = Daemon(home, env={"LLMRUN_API_KEYS": "k1,k2",
                          "LLMRUN_ORIGINS": "https://app.example.com,app://listed"}).start()
    yield d
    d.stop()


def test_dns_rebinding_host_is_refused(daemon: Daemon) -> None:
    r = httpx.get(f"{daemon.url}/api/tags", headers={"Host": "evil.example:11434"})
    assert r.status_code == 403
    assert "DNS rebinding" in r.json()["error"]
    for host in ("localhost:1", "127.0.0.1", "[::1]:5"):
        assert httpx.get(f"{daemon.url}/api/tags", headers={"Host": host}).status_code == 200


def test_foreign_origin_is_refused_local_allowed(daemon: Daemon) -> None:
    r = httpx.get(f"{daemon.url}/api/tags", headers={"Origin": "https://evil.example"})
    assert r.status_code == 403
    ok = httpx.get(f"{daemon.url}/api/tags", headers={"Origin": "http://localhost:3000"})
    assert ok.status_code == 200
    assert ok.headers["access-control-allow-origin"] == "http://localhost:3000"
    pre = httpx.options(f"{daemon.url}/api/chat", headers={
        "Origin": "http://127.0.0.1:8080", "Access-Control-Request-Method": "POST"})
    assert pre.status_code == 204


def test_api_keys_in_each_dialect(secured: Daemon) -> None:
    url = secured.url
    assert httpx.get(f"{url}/").status_code == 200  # health stays open
    r = httpx.get(f"{url}/api/tags")
    assert r.status_code == 401 and r.json() == {"error": "missing or invalid API key"}
    r = httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{url}/v1/messages", json={})
    assert r.status_code == 401
    assert r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{url}/api/tags", headers={"Authorization": "Bearer k2"}).status_code \
        == 200
    assert httpx.get(f"{url}/api/tags", headers={"x-api-key": "k1"}).status_code == 200
    allowed = httpx.get(f"{url}/api/tags", headers={"x-api-key": "k1",
                                                    "Origin": "https://app.example.com"})
    assert allowed.status_code == 200


def test_cli_sends_the_key(secured: Daemon, monkeypatch: pytest.MonkeyPatch,
                           tmp_path: Path) -> None:
    import subprocess
    import sys

    env = {**secured.env}
    out = subprocess.run([sys.executable, "-m", "llmrun", "ps"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    env["LLMRUN_API_KEYS"] = "nope"
    out = subprocess.run([sys.executable, "-m", "llmrun", "ps"], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1 and "API key" in out.stderr


def test_null_and_non_web_origins_refused_unless_listed(secured: Daemon) -> None:
    key = {"x-api-key": "k1"}
    for origin in ("null", "file://", "chrome-extension://abcdef", "vscode-webview://x",
                   "app://other"):
        r = httpx.get(f"{secured.url}/api/tags", headers={**key, "Origin": origin})
        assert r.status_code == 403, origin
        assert "access-control-allow-origin" not in r.headers  # never echoed
        pre = httpx.options(f"{secured.url}/api/chat", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST"})
        assert pre.status_code == 403 and "access-control-allow-origin" not in pre.headers
    r = httpx.post(f"{secured.url}/v1/messages", json={}, headers={**key, "Origin": "null"})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    ok = httpx.get(f"{secured.url}/api/tags", headers={**key, "Origin": "app://listed"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "app://listed"


def test_star_admits_web_origins_but_not_null(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMRUN_ORIGINS", "*,file://")
    sec = Security(app=None)  # type: ignore[arg-type]
    assert sec.origin_allowed("https://anything.example")
    assert sec.origin_allowed("file://")  # listed exactly
    for origin in ("null", "NULL", "file:///home/x/page.html", "app://x", "data:", ""):
        assert not sec.origin_allowed(origin), origin
    monkeypatch.setenv("LLMRUN_ORIGINS", "")
    sec = Security(app=None)  # type: ignore[arg-type]
    assert sec.origin_allowed("http://localhost:3000") and sec.origin_allowed("https://[::1]")
    assert not sec.origin_allowed("null") and not sec.origin_allowed("file://")


def test_cross_site_fetch_refused_unless_origin_allowed(secured: Daemon) -> None:
    key = {"x-api-key": "k1"}
    url = f"{secured.url}/api/tags"
    # a cross-site navigation or <img> carries no Origin at all
    r = httpx.get(url, headers={**key, "Sec-Fetch-Site": "cross-site"})
    assert r.status_code == 403 and "Sec-Fetch-Site" in r.json()["error"]
    r = httpx.get(url, headers={**key, "Sec-Fetch-Site": "cross-site",
                                "Origin": "https://app.example.com"})
    assert r.status_code == 200  # listed
    r = httpx.get(url, headers={**key, "Sec-Fetch-Site": "cross-site",
                                "Origin": "http://localhost:5173"})
    assert r.status_code == 200  # a local dev server is another site, and allowed
    for site in ("same-origin", "same-site", "none"):
        assert httpx.get(url, headers={**key, "Sec-Fetch-Site": site}).status_code == 200


def test_health_without_a_key_says_only_up(secured: Daemon) -> None:
    assert httpx.get(f"{secured.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{secured.url}/health",
                     headers={"Authorization": "Bearer wrong"}).json() == {"status": "ok"}
    full = httpx.get(f"{secured.url}/health", headers={"Authorization": "Bearer k2"}).json()
    assert full["status"] == "ok" and "version" in full and full["loaded"] == []


def _serve_env(host: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "LLMRUN_API_KEYS"}
    return {**env, "LLMRUN_HOST": host}


def test_non_loopback_bind_without_keys_refused() -> None:
    port = free_port()
    # hold the port: had it tried to bind first, it would say "already in use"
    with socket.socket() as held:
        held.bind(("0.0.0.0", port))
        held.listen()
        for host in (f"0.0.0.0:{port}", f"192.0.2.7:{port}"):
            out = subprocess.run([sys.executable, "-m", "llmrun", "serve"],
                                 env=_serve_env(host), capture_output=True, text=True,
                                 timeout=60)
            assert out.returncode != 0, host
            assert "LLMRUN_API_KEYS" in out.stderr and "--insecure" in out.stderr, out.stderr
            assert "in use" not in out.stderr


def test_non_loopback_bind_with_insecure_or_keys(tmp_path: Path) -> None:
    (tmp_path / "open").mkdir()
    d = Daemon(tiny_home(tmp_path / "open", ["a"]))
    d.env["LLMRUN_HOST"] = f"0.0.0.0:{d.port}"
    d.env.pop("LLMRUN_API_KEYS", None)
    d.start("--insecure")
    try:
        assert httpx.get(f"{d.url}/api/tags").status_code == 200
        log = d.log.read_text()
        assert "--insecure" in log and "Host check is off" in log
    finally:
        d.stop()
    (tmp_path / "keyed").mkdir()
    d = Daemon(tiny_home(tmp_path / "keyed", ["a"]), env={"LLMRUN_API_KEYS": "k"})
    d.env["LLMRUN_HOST"] = f"0.0.0.0:{d.port}"
    d.start()  # keys guard it: no flag needed
    try:
        assert httpx.get(f"{d.url}/api/tags").status_code == 401
        assert httpx.get(f"{d.url}/api/tags", headers={"x-api-key": "k"}).status_code == 200
    finally:
        d.stop()
