"""Host (DNS rebinding), Origin and API-key checks, answered in each dialect's error shape."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from tests.conftest import Daemon
from tests.test_service import tiny_home


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory):
    home = tiny_home(tmp_path_factory.mktemp("sec"), ["a"])
    d = Daemon(home, env={"LLMRUN_API_KEYS": "k1,k2",
                          "LLMRUN_ORIGINS": "https://app.example.com"}).start()
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
