"""Shared fixtures. Every test gets a throwaway LLMRUN_HOME; integration tests share one real
daemon (a subprocess on a free port) serving the real SmolLM2 model.

The folders are the tiers. tests/unit/<package>/ holds what runs in milliseconds without a
model, a daemon or llama.cpp (fakes from tests/fakes/ stand in: a fake engine backend, fake
runners): `pytest tests/unit` is the quick run. tests/integration/ holds what uses the real
models, daemons and runner processes, tests/e2e/ what drives an agent's own CLI (Claude Code,
Codex). Tests outside tests/unit carry the `model` marker (`-m "not model"` is the same quick
run). A unit test that asks for a model fixture stops the collection, and a daemon started
by one fails it (`Daemon.start`), so nothing slow slips into the quick run.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from fetch_test_models import models, test_models_dir  # noqa: E402

T = TypeVar("T")

# The groups CI must run (the web page's, Vulkan's, the repack patches'): their tests fail,
# not skip, where their environment is missing, unless LLMRUN_TEST_SKIP names the group.
pytest_plugins = ["tests.ci_groups"]

# Runners (daemons started here, and the CLI's autostarted ones, inherit this) decode with one
# thread: llama.cpp's threads meet at a spinning barrier several times per layer, so on a
# 2-core machine with another busy process two threads ran 6x slower than one (6.7 vs 39.6
# tok/s measured beside a CPU hog), and answers outlasted the tests' timeouts. One thread
# slows only by the share of the core it gets.
os.environ.setdefault("LLMRUN_NUM_THREADS", "1")
# The prompt cache is off unless a test turns it on: a state saved by one test's long prompt
# would make another's "cold" request a restored one (and its memory tier would count in
# every memory estimate).
os.environ.setdefault("LLMRUN_PROMPT_CACHE_SIZE", "0")

# Fixtures that give a test a model file or the shared daemon: no unit test may use one.
MODEL_FIXTURES = frozenset({"smollm2_path", "gemma3_path", "daemon"})
UNIT = Path(__file__).resolve().parent / "unit"

_running: pytest.Item | None = None  # the test being set up or run (for Daemon.start)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if not item.path.is_relative_to(UNIT):
            item.add_marker(pytest.mark.model)
            continue
        used = MODEL_FIXTURES & set(getattr(item, "fixturenames", ()))
        if used:
            raise pytest.UsageError(f"{item.nodeid} uses {', '.join(sorted(used))}: a test "
                                    "with a model belongs in tests/integration")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    global _running
    _running = item  # before its fixtures, module-scoped ones included, are set up


def wait_until(predicate: Callable[[], T], timeout: float = 60, what: str = "") -> T:
    """Polls `predicate` until it returns something true, and returns that. For what a
    background thread or process does after the action that asked for it (a counter, a log
    line, a file, a process ending): the deadline is generous because a loaded 2-core machine
    is slow, and the wait ends as soon as the event happened."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        result = predicate()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"not reached in {timeout:g} s: {what or predicate}")
        time.sleep(delay)  # polling, not ordering: the predicate decides
        delay = min(delay * 2, 0.2)


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


def runner_pids(daemon_pid: int) -> list[int]:
    """The runner processes of the daemon `daemon_pid`."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == daemon_pid and b"llmrun.engine.runner" in cmdline:
            pids.append(int(stat.parent.name))
    return pids


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
        if _running is not None and _running.get_closest_marker("model") is None:
            pytest.fail(f"{_running.nodeid} starts a daemon: mark it `model` (tests/conftest.py)")
        with open(self.log, "ab") as out:
            # a process group of its own, as `llmrun` starts it (client.py): a test can stop
            # it as a terminal or a service manager does (signal_group)
            self.proc = subprocess.Popen(self.command(*args), env=self.env, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True)
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

    def signal_group(self, sig: int, timeout: float = 60) -> None:
        """Send `sig` to the daemon's whole process group (as Ctrl+C in a terminal or `kill
        -TERM -PGID` do) and wait for the daemon to exit."""
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)
        self.proc.wait(timeout)

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


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A local Hugging Face Hub (tests/fakes/hubserver.py), empty, that huggingface_hub talks to."""
    from tests.fakes.hubserver import HubServer, use_hub

    server = HubServer(chunk_size=64 * 1024)
    with server:
        use_hub(monkeypatch, server)
        yield server
