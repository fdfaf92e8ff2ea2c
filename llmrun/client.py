"""The CLI's client for the daemon (httpx), and starting the daemon in the background.

Exceptions::

    ClientError
     ├── NotLlmrun          the port answers, but not as llmrun
     ├── DaemonStartError   `llmrun serve` exited or never became healthy (carries the log tail)
     └── APIError           the daemon answered with an error (carries status and message)
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import httpx
from filelock import FileLock

from llmrun import config

START_TIMEOUT = 60.0
IDENTITY_HEADER = "x-llmrun-version"


class ClientError(Exception):
    pass


class NotLlmrun(ClientError):
    pass


class DaemonStartError(ClientError):
    def __init__(self, message: str, log_tail: str = "") -> None:
        super().__init__(message)
        self.log_tail = log_tail


class APIError(ClientError):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def log_path() -> Path:
    return config.home() / "logs" / "server.log"


def pid_path() -> Path:
    return config.home() / "daemon.pid"


def tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Client:
    def __init__(self, base_url: str | None = None) -> None:
        self.base_url = base_url or config.base_url()
        keys = config.api_keys()
        headers = {"Authorization": f"Bearer {keys[0]}"} if keys else None
        self.http = httpx.Client(base_url=self.base_url, headers=headers,
                                 timeout=httpx.Timeout(10.0, read=None))

    def probe(self) -> Literal["llmrun", "other", "down"]:
        try:
            r = self.http.get("/api/version", timeout=2.0)
        except httpx.TransportError:
            return "down"
        return "llmrun" if IDENTITY_HEADER in r.headers else "other"

    def ensure_running(self) -> bool:
        """Make sure a daemon answers on LLMRUN_HOST; returns True if this call started it."""
        state = self.probe()
        if state == "llmrun":
            return False
        if state == "other":
            raise NotLlmrun(f"{self.base_url} is answered by a server that is not llmrun; "
                            "stop it or point LLMRUN_HOST at another port")
        home = config.make_private(config.home())
        # The lock makes concurrent CLIs agree on one daemon: the first starts it, the
        # others wait here and then find it running.
        with FileLock(home / "daemon.lock", timeout=START_TIMEOUT + 10):
            state = self.probe()
            if state == "llmrun":
                return False
            if state == "other":
                raise NotLlmrun(f"{self.base_url} is answered by a server that is not llmrun")
            self._spawn()
            return True

    def _spawn(self) -> None:
        log = log_path()
        log.parent.mkdir(parents=True, exist_ok=True)
        offset = log.stat().st_size if log.exists() else 0
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "llmrun", "serve"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise DaemonStartError(
                    f"llmrun serve exited with status {proc.returncode} (log: {log})",
                    _new_log_text(log, offset),
                )
            state = self.probe()
            if state == "llmrun":
                return
            if state == "other":
                raise NotLlmrun(f"{self.base_url} is answered by a server that is not llmrun")
            time.sleep(0.1)
        proc.kill()
        raise DaemonStartError(f"llmrun serve did not become healthy in {START_TIMEOUT:.0f}s",
                               _new_log_text(log, offset))

    def _raise_for(self, r: httpx.Response) -> None:
        if r.status_code < 400:
            return
        r.read()
        try:
            message = r.json().get("error", r.text)
        except ValueError:
            message = r.text
        raise APIError(r.status_code, str(message))

    def ps(self) -> list[dict[str, Any]]:
        r = self.http.get("/api/ps")
        self._raise_for(r)
        return list(r.json().get("models", []))

    def stop_model(self, model: str) -> None:
        r = self.http.post("/api/generate", json={"model": model, "keep_alive": 0}, timeout=None)
        self._raise_for(r)

    def load(self, model: str) -> None:
        """Load a model without generating (an empty chat, as Ollama's clients do)."""
        r = self.http.post("/api/chat", json={"model": model, "messages": []}, timeout=None)
        self._raise_for(r)

    def show(self, model: str) -> dict[str, Any]:
        r = self.http.post("/api/show", json={"model": model})
        self._raise_for(r)
        return dict(r.json())

    def upload_blob(self, path: Path) -> str:
        """Put a local file in the daemon's store as a blob (unless it is there already);
        returns its `sha256:<hex>`. The daemon hashes it again as it arrives."""
        h = hashlib.sha256()
        with open(path, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        digest = f"sha256:{h.hexdigest()}"
        if self.http.head(f"/api/blobs/{digest}").status_code == 200:
            return digest

        def chunks() -> Iterator[bytes]:
            with open(path, "rb") as fh:
                yield from iter(lambda: fh.read(1 << 20), b"")

        r = self.http.post(f"/api/blobs/{digest}", content=chunks(),
                           headers={"Content-Length": str(path.stat().st_size)}, timeout=None)
        self._raise_for(r)
        return digest

    def create(self, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Stream /api/create progress objects; raises APIError on an error line."""
        yield from self._ndjson("/api/create", {**body, "stream": True})

    def pull(self, model: str) -> Iterator[dict[str, Any]]:
        """Stream /api/pull progress objects; raises APIError on an error line."""
        yield from self._ndjson("/api/pull", {"model": model, "stream": True})

    def _ndjson(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        with self.http.stream("POST", path, json=body) as r:
            self._raise_for(r)
            for line in r.iter_lines():
                if not line.strip():
                    continue
                obj = json.loads(line)
                if "error" in obj:
                    raise APIError(500, obj["error"])
                yield obj

    def chat(self, model: str, messages: list[dict[str, Any]],
             options: dict[str, Any] | None = None,
             keep_alive: str | None = None,
             think: bool | None = None) -> Iterator[dict[str, Any]]:
        """Stream /api/chat; yields each NDJSON object; raises APIError on an error line."""
        body: dict[str, Any] = {"model": model, "messages": messages, "stream": True}
        if options:
            body["options"] = options
        if think is not None:
            body["think"] = think
        if keep_alive is not None:
            body["keep_alive"] = keep_alive
        yield from self._ndjson("/api/chat", body)


def _new_log_text(log: Path, offset: int) -> str:
    try:
        with open(log, "rb") as fh:
            fh.seek(offset)
            text = fh.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-20:])
