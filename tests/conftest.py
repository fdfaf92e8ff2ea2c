"""Shared fixtures. Every test gets a throwaway LLMRUN_HOME; integration tests share one real
daemon (a subprocess on a free port) serving the real SmolLM2 model."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from fetch_test_models import models, test_models_dir  # noqa: E402


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path_factory: pytest.TempPathFactory,
                   monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("LLMRUN_HOME", str(home))
    monkeypatch.setenv("LLMRUN_HOST", f"127.0.0.1:{free_port()}")
    return home


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def model_file(name: str) -> Path:
    path = test_models_dir() / models()[name].file
    if not path.is_file():
        pytest.fail(f"test model missing: run `python scripts/fetch_test_models.py` ({path})")
    return path


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return model_file("smollm2")


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    return model_file("gemma3")


def make_home(root: Path, model_path: Path, name: str = "smollm2") -> Path:
    """A store holding the test model under `name` (imported, as `llmrun create` does)."""
    from llmrun.store import Store

    Store(root).create(name, f"FROM {model_path}\n")
    return root


class Daemon:
    def __init__(self, home: Path, env: dict[str, str] | None = None) -> None:
        self.home = home
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**os.environ, "LLMRUN_HOME": str(home),
                    "LLMRUN_HOST": f"127.0.0.1:{self.port}", "LLMRUN_NUM_PARALLEL": "2",
                    "LLMRUN_CONTEXT_LENGTH": "2048", **(env or {})}
        self.log = home / "daemon-test.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "llmrun", "serve", *args]

    def start(self, *args: str) -> Daemon:
        """`llmrun serve [args]` (or `command`), once it answers."""
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.command(*args), env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited: {self.log.read_text()[-3000:]}")
            try:
                httpx.get(self.url + "/api/version", timeout=1)
                return self
            except httpx.TransportError:
                time.sleep(0.1)
        raise RuntimeError("daemon did not start")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture(scope="session")
def daemon(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Daemon]:
    home = make_home(tmp_path_factory.mktemp("daemon-home"), smollm2_path)
    d = Daemon(home).start()
    yield d
    d.stop()


@pytest.fixture
def api(daemon: Daemon) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=daemon.url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def oa(daemon: Daemon) -> Iterator[Any]:
    """The official `openai` client on the shared daemon."""
    import openai

    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0,
                       timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def an(daemon: Daemon) -> Iterator[Any]:
    """The official `anthropic` client on the shared daemon."""
    import anthropic

    with anthropic.Anthropic(base_url=daemon.url, api_key="x", max_retries=0,
                             timeout=120) as c:
        yield c
