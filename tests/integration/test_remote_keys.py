"""A remote model may send only a key the daemon's owner named, and connect only where the
owner allows: real daemons, and a listener on loopback playing the remote server that
records every byte it receives and must never see a secret of the daemon's environment.

No model is loaded: every model here is a remote one."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from llmrun.store import Store
from llmrun.store.manifests import Details, Manifest, Remote
from llmrun.store.names import parse as parse_name
from tests.conftest import Daemon

SECRET = "sk-daemon-secret-5b1e0c"  # in the daemon's environment: must never leave it
HF = "hf_daemon_token_93ad71"
ALLOWED = "sk-owner-allowed-2f6a"  # the one key the owner lets remote models send
SSE = (b'data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
       b'data: {"choices": [{"delta": {}, "finish_reason": "stop"}], '
       b'"usage": {"prompt_tokens": 3, "completion_tokens": 1}}\n\ndata: [DONE]\n\n')
QUESTION = [{"role": "user", "content": "hello"}]


class Listener:
    """A raw TCP server: keeps every byte any connection sends, answers each request with
    a short OpenAI stream."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.received = bytearray()
        self.connections = 0
        self.lock = threading.Lock()
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            data = b""
            try:
                while b"\r\n\r\n" not in data:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    data += chunk
                head, _, body = data.partition(b"\r\n\r\n")
                length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                while len(body) < length:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    body += chunk
                with self.lock:
                    self.connections += 1
                    self.received += head + b"\r\n\r\n" + body
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                             b"Content-Length: " + str(len(SSE)).encode() +
                             b"\r\nConnection: close\r\n\r\n" + SSE)
            except OSError:
                pass

    def saw(self, text: str) -> bool:
        with self.lock:
            return text.encode() in self.received

    def close(self) -> None:
        self.sock.close()


ENV = {"LLMRUN_TEST_SECRET": SECRET, "HF_TOKEN": HF, "LLMRUN_API_KEYS": "",
       "OWNER_KEY": ALLOWED, "LLMRUN_REMOTE_KEYS": "owner=OWNER_KEY"}


@pytest.fixture(scope="module")
def listener() -> Iterator[Listener]:
    server = Listener()
    yield server
    server.close()


@pytest.fixture(scope="module")
def plain(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon with the default settings: no remote model over HTTP."""
    d = Daemon(tmp_path_factory.mktemp("plain"), env=ENV).start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def open_(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """A daemon whose owner lets HTTP callers create remote models."""
    d = Daemon(tmp_path_factory.mktemp("open"), env={**ENV, "LLMRUN_REMOTE_CREATE": "1"}).start()
    yield d
    d.stop()


def create(d: Daemon, name: str, modelfile: str) -> httpx.Response:
    return httpx.post(d.url + "/api/create", timeout=60, json={
        "model": name, "modelfile": modelfile, "stream": False})


def ask(d: Daemon, name: str) -> httpx.Response:
    return httpx.post(d.url + "/api/chat", timeout=60, json={
        "model": name, "messages": QUESTION, "stream": False})


def test_over_http_a_remote_model_is_refused_by_default(plain: Daemon,
                                                        listener: Listener) -> None:
    for body in (f"FROM {listener.url}\nPARAMETER remote_key_env LLMRUN_TEST_SECRET\n",
                 f"FROM {listener.url}\nPARAMETER remote_key owner\n",
                 f"FROM {listener.url}\n"):
        r = create(plain, "leak", body)
        assert r.status_code == 400, r.text
        assert "LLMRUN_REMOTE_CREATE" in r.json()["error"]
    r = httpx.post(plain.url + "/api/create", timeout=60, json={
        "model": "leak", "from": listener.url, "stream": False})
    assert r.status_code == 400 and "LLMRUN_REMOTE_CREATE" in r.json()["error"]
    assert ask(plain, "leak").status_code == 404
    assert not listener.saw(SECRET) and not listener.saw(HF)


def test_the_cli_on_this_machine_still_creates_remote_models(plain: Daemon,
                                                             listener: Listener) -> None:
    modelfile = plain.home / "Modelfile"
    modelfile.write_text(f"FROM {listener.url}\nPARAMETER remote_key owner\n")
    done = subprocess.run([sys.executable, "-m", "llmrun", "create", "mine", "-f",
                           str(modelfile)], env=plain.env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    r = ask(plain, "mine")
    assert r.status_code == 200, r.text
    assert r.json()["message"]["content"] == "hi"
    assert listener.saw(f"Bearer {ALLOWED}")  # the owner's key, the one it named
    modelfile.write_text(f"FROM {listener.url}\nPARAMETER remote_key_env HF_TOKEN\n")
    done = subprocess.run([sys.executable, "-m", "llmrun", "create", "theirs", "-f",
                           str(modelfile)], env=plain.env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode != 0
    assert "may not name an environment variable" in " ".join(done.stderr.split())
    assert not listener.saw(SECRET) and not listener.saw(HF)


def test_a_modelfile_cannot_pick_a_daemon_variable(open_: Daemon, listener: Listener) -> None:
    for variable in ("LLMRUN_TEST_SECRET", "HF_TOKEN", "LLMRUN_API_KEYS", "PATH"):
        r = create(open_, "leak", f"FROM {listener.url}\nPARAMETER remote_key_env {variable}\n")
        assert r.status_code == 400, r.text
        assert "may not name an environment variable" in r.json()["error"]
    r = create(open_, "leak", f"FROM {listener.url}\nPARAMETER remote_key nosuch\n")
    assert r.status_code == 400 and "no such key" in r.json()["error"]
    assert ask(open_, "leak").status_code == 404
    # the owner's key, by its name, goes where the model says
    assert create(open_, "ok", f"FROM {listener.url}\nPARAMETER remote_key owner\n"
                  ).status_code == 200
    r = ask(open_, "ok")
    assert r.status_code == 200 and r.json()["message"]["content"] == "hi"
    assert listener.saw(f"Bearer {ALLOWED}")
    assert not listener.saw(SECRET) and not listener.saw(HF)


def test_a_manifest_naming_a_raw_variable_sends_nothing(open_: Daemon,
                                                        listener: Listener) -> None:
    """A manifest an older version wrote (or written by hand) names the variable itself."""
    before = listener.connections
    store = Store(open_.home)
    for name, variable in (("old", "LLMRUN_TEST_SECRET"), ("old-hf", "HF_TOKEN")):
        store.put(parse_name(name), Manifest(
            name="", remote=Remote(urls=[listener.url], model="m", key_env=variable),
            details=Details(format="remote", family="remote"), source=listener.url))
        r = ask(open_, name)
        assert r.status_code == 502, r.text
        assert "LLMRUN_REMOTE_KEYS" in r.json()["error"]
    assert listener.connections == before  # refused before connecting
    assert not listener.saw(SECRET) and not listener.saw(HF)


def test_metadata_and_link_local_addresses_are_not_reached(open_: Daemon,
                                                           tmp_path: Path) -> None:
    for url in ("http://169.254.169.254/latest/meta-data", "http://[fe80::1]:8000/v1",
                "http://2852039166/v1", "http://[::ffff:169.254.169.254]/v1",
                "http://metadata.google.internal/computeMetadata/v1"):
        r = create(open_, "meta", f"FROM {url}\n")
        assert r.status_code == 400, r.text
        assert "LLMRUN_REMOTE_LINK_LOCAL" in r.json()["error"]
    # a manifest from before the check: refused at connect time, at once
    Store(open_.home).put(parse_name("meta-old"), Manifest(
        name="", remote=Remote(urls=["http://0xa9fea9fe/latest"], model="m"),
        details=Details(format="remote", family="remote"), source="http://0xa9fea9fe/latest"))
    r = ask(open_, "meta-old")
    assert r.status_code == 502, r.text
    assert "metadata" in r.json()["error"] and "LLMRUN_REMOTE_LINK_LOCAL" in r.json()["error"]
