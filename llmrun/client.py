"""The CLI's client for the daemon (httpx), and starting the daemon in the background.

`probe` and `ps` are two small GETs made with the standard library's http.client, and httpx
is imported only when a command streams or uploads: importing it and building its client (an
SSL context) costs 0.1-0.3 s, more than the 0.25 s `llmrun ps` may take in all on an idle
2-core machine (the CLI's start-up target; scripts/startup_time.py measures it).

Exceptions::

    ClientError
     ├── NotLlmrun          the port answers, but not as llmrun
     ├── DaemonStartError   `llmrun serve` exited or never became healthy (carries the log tail)
     └── APIError           the daemon answered with an error (carries status and message)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from llmrun import config

if TYPE_CHECKING:
    import httpx

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
        self.headers = {"Authorization": f"Bearer {keys[0]}"} if keys else {}

    @cached_property
    def http(self) -> httpx.Client:
        """The httpx client, for streams, uploads and the POSTs; built on first use."""
        import httpx

        return httpx.Client(base_url=self.base_url, headers=self.headers or None,
                            timeout=httpx.Timeout(10.0, read=None))

    def _get(self, path: str, connect_timeout: float,
             read_timeout: float | None) -> tuple[int, str | None, bytes]:
        """GET `path` with the standard library: (status, the identity header, body). Raises
        OSError or http.client.HTTPException when no HTTP answer comes back."""
        import http.client
        from urllib.parse import urlsplit

        url = urlsplit(self.base_url)
        kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        conn = kind(url.hostname or "127.0.0.1", url.port, timeout=connect_timeout)
        try:
            conn.connect()
            if conn.sock is not None:
                conn.sock.settimeout(read_timeout)
            conn.request("GET", url.path.rstrip("/") + path, headers=self.headers)
            r = conn.getresponse()
            return r.status, r.getheader(IDENTITY_HEADER), r.read()
        finally:
            conn.close()

    def probe(self) -> Literal["llmrun", "other", "down"]:
        import http.client

        try:
            _, identity, _ = self._get("/api/version", 2.0, 2.0)
        except (OSError, http.client.HTTPException):
            return "down"
        return "llmrun" if identity is not None else "other"

    def ensure_running(self) -> bool:
        """Make sure a daemon answers on LLMRUN_HOST; returns True if this call started it."""
        state = self.probe()
        if state == "llmrun":
            return False
        if state == "other":
            raise NotLlmrun(f"{self.base_url} is answered by a server that is not llmrun; "
                            "stop it or point LLMRUN_HOST at another port")
        from filelock import FileLock

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
        raise APIError(r.status_code, _error_message(r.read()))

    def ps(self) -> list[dict[str, Any]]:
        import http.client

        try:
            status, _, body = self._get("/api/ps", 10.0, None)
        except (OSError, http.client.HTTPException) as exc:
            raise ClientError(f"cannot reach the daemon at {self.base_url}: {exc}") from None
        if status >= 400:
            raise APIError(status, _error_message(body))
        return list(json.loads(body).get("models", []))

    def stop_model(self, model: str) -> None:
        r = self.http.post("/api/generate", json={"model": model, "keep_alive": 0}, timeout=None)
        self._raise_for(r)

    def delete(self, model: str) -> None:
        """Remove `model` from the store through the daemon, which unloads it too."""
        r = self.http.request("DELETE", "/api/delete", json={"model": model}, timeout=None)
        self._raise_for(r)

    def load(self, model: str, num_ctx: int | None = None) -> None:
        """Load a model without generating (an empty chat, as Ollama's clients do); with
        `num_ctx`, as a client that sends X-Llmrun-Num-Ctx gets it (`llmrun launch`)."""
        headers = {"X-Llmrun-Num-Ctx": str(num_ctx)} if num_ctx else None
        r = self.http.post("/api/chat", json={"model": model, "messages": []}, timeout=None,
                           headers=headers)
        self._raise_for(r)

    def show(self, model: str) -> dict[str, Any]:
        r = self.http.post("/api/show", json={"model": model})
        self._raise_for(r)
        return dict(r.json())

    def upload_blob(self, path: Path) -> str:
        """Put a local file in the daemon's store as a blob (unless it is there already);
        returns its `sha256:<hex>`. The daemon hashes it again as it arrives."""
        import hashlib

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

    def rerank(self, model: str, query: str, documents: list[str],
               top_n: int | None = None) -> dict[str, Any]:
        """/v1/rerank: the results by relevance, highest first, with their documents."""
        body: dict[str, Any] = {"model": model, "query": query, "documents": documents,
                                "return_documents": True}
        if top_n is not None:
            body["top_n"] = top_n
        r = self.http.post("/v1/rerank", json=body, timeout=None)
        self._raise_for(r)
        return dict(r.json())

    def transcribe(self, model: str, filename: str, data: bytes, fmt: str = "text",
                   language: str | None = None, prompt: str | None = None,
                   translate: bool = False) -> str:
        """/v1/audio/transcriptions (or translations): the transcript in `fmt` (text, srt,
        vtt, json, verbose_json) as the daemon wrote it."""
        fields = {"model": model, "response_format": fmt,
                  **({"language": language} if language else {}),
                  **({"prompt": prompt} if prompt else {})}
        path = "/v1/audio/translations" if translate else "/v1/audio/transcriptions"
        r = self.http.post(path, data=fields, files={"file": (filename, data)}, timeout=None)
        self._raise_for(r)
        return r.text

    def embed(self, model: str, inputs: list[str],
              dimensions: int | None = None) -> list[list[float]]:
        """/api/embed: one vector per input, in order (normalised, as Ollama's)."""
        body: dict[str, Any] = {"model": model, "input": inputs}
        if dimensions is not None:
            body["dimensions"] = dimensions
        r = self.http.post("/api/embed", json=body, timeout=None)
        self._raise_for(r)
        return list(r.json()["embeddings"])

    def chat(self, model: str, messages: list[dict[str, Any]],
             options: dict[str, Any] | None = None,
             keep_alive: str | None = None,
             think: bool | None = None,
             progress: bool = False,
             format: Any = None) -> Iterator[dict[str, Any]]:
        """Stream /api/chat; yields each NDJSON object; raises APIError on an error line.
        `progress`: a long prompt's reading comes first, as `prompt_progress` objects."""
        body: dict[str, Any] = {"model": model, "messages": messages, "stream": True}
        if progress:
            body["return_progress"] = True
        if options:
            body["options"] = options
        if think is not None:
            body["think"] = think
        if keep_alive is not None:
            body["keep_alive"] = keep_alive
        if format is not None:
            body["format"] = format
        yield from self._ndjson("/api/chat", body)


def _error_message(body: bytes) -> str:
    """The daemon's `{"error": ...}` text (OpenAI's `{"error": {"message": ...}}` too), else
    the body itself."""
    text = body.decode(errors="replace")
    try:
        obj = json.loads(body)
    except ValueError:
        return text
    if not isinstance(obj, dict):
        return text
    error = obj.get("error", text)
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return str(error)


def _new_log_text(log: Path, offset: int) -> str:
    try:
        with open(log, "rb") as fh:
            fh.seek(offset)
            text = fh.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-20:])
