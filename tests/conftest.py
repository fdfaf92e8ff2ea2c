"""Shared fixtures. Every test gets a throwaway LLMRUN_HOME; integration tests share one real
daemon (a subprocess on a free port) serving the real SmolLM2 model.

Tests that need a test model file, a daemon or llama.cpp carry the `model` marker, so that
`pytest -m "not model"` runs the unit tests alone, quickly and without the models. It is given
here (`pytest_collection_modifyitems`) to a test that uses a fixture of MODEL_FIXTURES, or
whose code or fixtures' code names a `Daemon`, a `RunnerProcess` or anything of llama.cpp,
llguidance or the runner side (`llmrun.engine`); `@pytest.mark.model` covers what that misses.
A daemon started by a test without the marker fails that test (`Daemon.start`), so a helper
that hides one cannot slip a slow test into the quick run.
"""

from __future__ import annotations

import inspect
import os
import socket
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

from fetch_test_models import models, test_models_dir  # noqa: E402

T = TypeVar("T")

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

# Fixtures that give a test a model file or the shared daemon: a test using one, directly or
# through another fixture, is a `model` test.
MODEL_FIXTURES = frozenset({"smollm2_path", "gemma3_path", "daemon"})
# What loads llama.cpp (or its grammar engine) when used
MODEL_MODULES = ("llama_cpp", "llguidance", "llmrun.engine")

_running: pytest.Item | None = None  # the test being set up or run (for Daemon.start)
_needs_model: dict[object, bool] = {}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if MODEL_FIXTURES & set(getattr(item, "fixturenames", ())) or any(
                _uses_model(f) for f in _functions(item)):
            item.add_marker(pytest.mark.model)


def _functions(item: pytest.Item) -> Iterator[object]:
    """The test function and the functions of the fixtures it uses (their whole closure)."""
    yield getattr(item, "function", None)
    info = getattr(item, "_fixtureinfo", None)  # pytest's own record of the closure
    for defs in getattr(info, "name2fixturedefs", {}).values():
        for fixturedef in defs:
            yield fixturedef.func


def _uses_model(func: object) -> bool:
    """Whether `func`'s code (its nested functions too) names a Daemon, a RunnerProcess or
    anything of MODEL_MODULES: a global bound to one, or a module it imports itself."""
    func = inspect.unwrap(func) if callable(func) else func
    if func not in _needs_model:
        code = getattr(func, "__code__", None)
        scope = getattr(func, "__globals__", {})
        _needs_model[func] = code is not None and any(
            name.startswith(MODEL_MODULES) or _is_model_thing(scope.get(name))
            for name in _names(code))
    return _needs_model[func]


def _names(code: types.CodeType) -> Iterator[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _is_model_thing(obj: object) -> bool:
    if obj is None:
        return False
    if isinstance(obj, type) and issubclass(obj, Daemon):
        return True
    if isinstance(obj, types.ModuleType):
        return obj.__name__.startswith(MODEL_MODULES)
    module = getattr(obj, "__module__", None)
    if not isinstance(module, str):
        return False
    return module.startswith(MODEL_MODULES) or (
        module == "llmrun.server.runners" and getattr(obj, "__name__", "") == "RunnerProcess")


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
    """A local Hugging Face Hub (tests/hubserver.py), empty, that huggingface_hub talks to."""
    from tests.hubserver import HubServer, use_hub

    server = HubServer(chunk_size=64 * 1024)
    with server:
        use_hub(monkeypatch, server)
        yield server
