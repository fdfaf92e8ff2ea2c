"""What a remote model's connections may do, tried against the real transport (no mock):
the key sent is one the owner configured, looked up per request; the addresses connected
to are checked after resolving, so no spelling, DNS answer or redirect reaches a link-local
address or a metadata service."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import anyio
import httpcore
import httpx
import pytest

from llmrun.api.dialect import http_status
from llmrun.request import ChatRequest, EngineError, Message
from llmrun.server import upstream as upstream_module
from llmrun.server.upstream import Upstream
from llmrun.store import CreateError, Store
from llmrun.store.manifests import Remote

SSE = ('data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
       'data: {"choices": [{"delta": {}, "finish_reason": "stop"}], '
       '"usage": {"prompt_tokens": 3, "completion_tokens": 1}}\n\ndata: [DONE]\n\n')
HELLO = ChatRequest(model="big", messages=[Message(role="user", content="hello")])


class _Listener(ThreadingHTTPServer):
    """A remote server on loopback that keeps what each request carried; `redirect` makes
    it answer 302 to that URL instead."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.seen: list[dict[str, str]] = []
        self.redirect: str | None = None


class _Handler(BaseHTTPRequestHandler):
    server: _Listener

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        self.server.seen.append({"path": self.path, **{k.lower(): v for k, v in
                                                      self.headers.items()}})
        if self.server.redirect:
            self.send_response(302)
            self.send_header("Location", self.server.redirect)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = SSE.encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def listener() -> Iterator[_Listener]:
    server = _Listener()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.fixture(autouse=True)
def _secrets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LLMRUN_HOME", str(tmp_path))
    monkeypatch.setenv("LLMRUN_REMOTE_KEYS", "vllm=VLLM_KEY")
    monkeypatch.setenv("VLLM_KEY", "sk-allowed-1")
    monkeypatch.setenv("HF_TOKEN", "hf-secret-2")
    monkeypatch.delenv("LLMRUN_REMOTE_LINK_LOCAL", raising=False)


def chat(remote: Remote) -> str:
    async def run() -> str:
        up = Upstream("big", remote)
        try:
            events = [e async for e in up.chat(HELLO)]
        finally:
            await up.close()
        return "".join(getattr(e, "text", "") for e in events)

    return asyncio.run(run())


def refused(remote: Remote) -> EngineError:
    with pytest.raises(EngineError) as err:
        chat(remote)
    return err.value


def test_the_configured_key_is_sent(listener: _Listener) -> None:
    url = f"http://127.0.0.1:{listener.server_port}/v1"
    assert chat(Remote(urls=[url], model="m", key="vllm")) == "hi"
    assert listener.seen[-1]["authorization"] == "Bearer sk-allowed-1"
    # an older manifest's variable, read by a configured key, is still sent
    assert chat(Remote(urls=[url], model="m", key_env="VLLM_KEY")) == "hi"
    assert listener.seen[-1]["authorization"] == "Bearer sk-allowed-1"
    assert chat(Remote(urls=[url], model="m")) == "hi"
    assert "authorization" not in listener.seen[-1]


def test_a_variable_no_configured_key_reads_is_never_sent(listener: _Listener,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    url = f"http://127.0.0.1:{listener.server_port}/v1"
    for remote in (Remote(urls=[url], model="m", key_env="HF_TOKEN"),  # an old manifest
                   Remote(urls=[url], model="m", key="hf")):  # a key no longer configured
        err = refused(remote)
        assert http_status(err) == 502 and "LLMRUN_REMOTE_KEYS" in err.message
        assert "hf-secret-2" not in err.message
    monkeypatch.setenv("LLMRUN_REMOTE_KEYS", "other=OTHER")  # the owner dropped `vllm`
    assert "not configured" in refused(Remote(urls=[url], model="m", key="vllm")).message
    assert listener.seen == []  # refused before any connection


def test_create_refuses_a_raw_variable_and_keeps_the_name(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    with pytest.raises(CreateError, match="may not name an environment variable"):
        store.create("x", "FROM http://127.0.0.1:9/v1\nPARAMETER remote_key_env HF_TOKEN\n")
    m = store.create("y", "FROM http://127.0.0.1:9/v1\nPARAMETER remote_key_env VLLM_KEY\n")
    assert m.remote is not None and (m.remote.key, m.remote.key_env) == ("vllm", None)
    assert "PARAMETER remote_key vllm" in store.modelfile_of(m).render()


@pytest.mark.parametrize("host", [
    "169.254.169.254", "2852039166", "0xa9fea9fe", "169.254.43518",
    "[::ffff:169.254.169.254]", "[fe80::1]",
])
def test_literal_spellings_are_refused_before_connecting(host: str) -> None:
    """A manifest from before these checks (or written by hand) still connects nowhere."""
    err = refused(Remote(urls=[f"http://{host}:80/v1"], model="m", key="vllm"))
    assert http_status(err) == 502 and "refused" in err.message
    assert "LLMRUN_REMOTE_LINK_LOCAL" in err.message


def test_a_name_is_checked_at_each_address_it_resolves_to(
        listener: _Listener, monkeypatch: pytest.MonkeyPatch) -> None:
    answers = {"rebind.test": ["10.0.0.7", "169.254.169.254"], "loop.test": ["127.0.0.1"]}
    real = anyio.getaddrinfo

    async def resolve(host: Any, port: Any, **kwargs: Any) -> Any:
        if host in answers:
            return [(2, 1, 6, "", (ip, port)) for ip in answers[host]]
        return await real(host, port, **kwargs)

    monkeypatch.setattr(upstream_module.anyio, "getaddrinfo", resolve)
    port = listener.server_port
    err = refused(Remote(urls=[f"http://rebind.test:{port}/v1"], model="m"))
    assert "rebind.test" in err.message and "metadata" in err.message
    # connected by the checked address, with the name as the Host
    assert chat(Remote(urls=[f"http://loop.test:{port}/v1"], model="m")) == "hi"
    assert listener.seen[-1]["host"] == f"loop.test:{port}"


def test_one_refused_replica_fails_over_to_the_next(listener: _Listener) -> None:
    url = f"http://127.0.0.1:{listener.server_port}/v1"
    assert chat(Remote(urls=["http://169.254.169.254/v1", url], model="m")) == "hi"


def test_redirects_are_not_followed(listener: _Listener, monkeypatch: pytest.MonkeyPatch) -> None:
    hosts: list[str] = []
    real = upstream_module._CheckedBackend.resolve

    async def spy(self: Any, host: str, port: int, timeout: float | None) -> Any:
        hosts.append(host)
        return await real(self, host, port, timeout)

    monkeypatch.setattr(upstream_module._CheckedBackend, "resolve", spy)
    listener.redirect = "http://127.0.0.2:1/v1/chat/completions"
    err = refused(Remote(urls=[f"http://127.0.0.1:{listener.server_port}/v1"], model="m",
                         key="vllm"))
    assert "302" in err.message
    assert hosts == ["127.0.0.1"] and len(listener.seen) == 1


def test_the_owner_may_allow_link_local(monkeypatch: pytest.MonkeyPatch,
                                        tmp_path: Path) -> None:
    monkeypatch.setenv("LLMRUN_REMOTE_LINK_LOCAL", "1")
    m = Store(tmp_path / "store").create("meta", "FROM http://169.254.169.254/v1\n")
    assert m.remote is not None
    tried: list[str] = []

    async def connect(self: Any, host: str, *args: Any) -> Any:
        tried.append(host)  # (nothing is really connected: this may run on a cloud machine)
        raise httpcore.ConnectError("not here")

    monkeypatch.setattr(httpcore.AnyIOBackend, "connect_tcp", connect)
    err = refused(m.remote)
    assert tried == ["169.254.169.254"] and "cannot connect" in err.message


def test_the_guard_is_the_default_transport() -> None:
    up = Upstream("big", Remote(urls=["http://a/v1"], model="m"))
    transport = up.client._transport
    assert isinstance(transport, upstream_module.GuardedTransport)
    assert isinstance(transport._pool._network_backend,  # type: ignore[union-attr]
                      upstream_module._CheckedBackend)
    assert not up.client.follow_redirects
    asyncio.run(up.close())
    assert httpx.__version__  # (the transport's pool is httpx's private field: checked here)
