"""The red team: code running inside a confined runner, as a crafted model file that turned a
llama.cpp bug into code execution would run it, tries to reach the user's secrets, the
daemon, the network and the kernel's larger attack surfaces. Every attempt must fail, and
the daemon beside it must not notice.

The payload runs in tests/fakes/confined_payload.py, which confines itself through
engine/runner.start, the function every runner starts with, then loads a model inside the
confinement and makes its attempts. (What a hostile runner can do to the daemon through
its channel is tests/integration/test_hostile_runner.py.)
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Daemon, make_home
from tests.fakes.tinymodel import write_tiny_llama
from tests.integration.test_sandbox import (
    DENIED_WITHOUT_LANDLOCK,
    LANDLOCK_MODES,
    landlock_env,
    namespaces_available,
)

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64",
                                reason="the payload's raw system calls are x86_64's")

PAYLOAD = Path(__file__).resolve().parents[1] / "fakes" / "confined_payload.py"
MEMORY_ESTIMATE = 64 << 20  # what the daemon would estimate for the tiny model, about
REFUSED = {"EPERM", "EACCES"}  # seccomp's answer, Landlock's


def run_payload(spec: dict[str, Any], env: dict[str, str] | None = None,
                user: list[str] | None = None, landlock: bool = True) -> dict[str, Any]:
    out = subprocess.run([*(user or []), sys.executable, str(PAYLOAD), json.dumps(spec)],
                         capture_output=True, text=True, timeout=180,
                         env={**landlock_env(landlock), "LLMRUN_SANDBOX": "1", **(env or {})})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    report: dict[str, Any] = json.loads(out.stdout.splitlines()[-1])
    return report


@pytest.fixture(scope="module")
def victim(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Any:
    """A daemon serving SmolLM2, with keys in its config.yaml, and a user's home with an SSH
    key: what the payload must not reach."""
    root = tmp_path_factory.mktemp("redteam")
    home = root / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "id_rsa").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nsecret\n")
    store = make_home(root / "store", smollm2_path)
    (store / "config.yaml").write_text("api_keys: [redteam-secret-key]\n")
    d = Daemon(store).start()
    answer = httpx.post(f"{d.url}/api/generate", timeout=120, json={
        "model": "smollm2", "prompt": "Name a colour.", "stream": False,
        "options": {"temperature": 0, "num_predict": 12}}).json()["response"]
    own = root / "own-model"
    own.mkdir()
    model = write_tiny_llama(own / "model.gguf")
    cache = root / "prompt-cache"
    cache.mkdir()
    other_blob = max((store / "blobs").iterdir(), key=lambda p: p.stat().st_size)
    spec = {"model": str(model), "prompt_cache": str(cache), "memory": MEMORY_ESTIMATE,
            "memory_bomb": 2 * MEMORY_ESTIMATE + (6 << 30), "daemon_pid": d.proc.pid,
            "daemon_port": d.port, "home": str(home), "store": str(store),
            "other_model": str(other_blob)}
    yield d, spec, answer, root
    d.stop()


@LANDLOCK_MODES
def test_a_compromised_runner_reaches_nothing(victim: Any, landlock: bool) -> None:
    """With Landlock, and as on a kernel without it (the runner has a prompt-cache
    directory, so it may open files for writing: read-only mounts must then keep it there;
    what it can read is then not confined, which only Landlock does)."""
    d, spec, answer, root = victim
    before = sorted(p for p in root.rglob("*") if "prompt-cache" not in p.parts)
    daemon_nice = os.getpriority(os.PRIO_PROCESS, d.proc.pid)
    report = run_payload(spec, env={"HOME": spec["home"]}, landlock=landlock)
    layers = report["confinement"]["sandbox"]
    assert {"no-core-dumps", "no-new-privs", "seccomp", "memory-limit", "open-files-limit",
            "file-size-limit", "landlock" if landlock else "read-only-mounts"} <= set(layers)
    results = report["results"]
    print(json.dumps(results, indent=1))  # the record, in the test's output

    if landlock:
        for name in ("read_ssh_key", "read_config_keys", "read_other_model",
                     "read_daemon_environ", "read_daemon_mem", "list_processes"):
            assert results[name] == "EACCES", (name, results[name])
    for name in ("connect_daemon", "connect_anywhere", "exec_sh", "fork", "ptrace_daemon",
                 "signal_daemon", "new_namespace", "io_uring_setup", "memfd_exec",
                 "userfaultfd", "bpf", "perf_event_open", "syslog", "unassigned_syscall",
                 "raise_memory_limit", "renice_daemon", "renice_user", "renice_group"):
        assert results[name] == "EPERM", (name, results[name])
    assert results["renice_own_thread"] == "ok"
    for name in ("write_home", "write_store", "write_tmp", "write_beside_model"):
        assert results[name] in (REFUSED if landlock else DENIED_WITHOUT_LANDLOCK), (
            name, results[name])
    assert results["memory_bomb"] == "MemoryError"
    assert results["fd_bomb"] == "EMFILE"
    # a file in its own directory grows no larger than a state it could keep
    assert results["fill_cache_file"] == "EFBIG"
    assert os.getpriority(os.PRIO_PROCESS, d.proc.pid) == daemon_nice

    # nothing was written, and the daemon neither died nor changed its answer
    after = sorted(p for p in root.rglob("*") if "prompt-cache" not in p.parts)
    assert after == before
    assert not list(Path("/tmp").glob("llmrun-redteam-*"))
    assert d.proc.poll() is None
    again = httpx.post(f"{d.url}/api/generate", timeout=120, json={
        "model": "smollm2", "prompt": "Name a colour.", "stream": False,
        "options": {"temperature": 0, "num_predict": 12}}).json()["response"]
    assert again == answer


def test_the_runner_is_alone_on_an_empty_network(victim: Any) -> None:
    _, spec, _, _ = victim
    if "network-namespace" not in namespaces_available():
        pytest.skip("this kernel lets no process make a network namespace")
    report = run_payload({**spec, "only": ["connect_daemon"]})
    assert "network-namespace" in report["confinement"]["sandbox"]
    assert report["results"]["connect_daemon"] == "EPERM"


@pytest.mark.skipif(not shutil.which("setpriv"), reason="needs setpriv (util-linux)")
def test_an_unprivileged_runner_cannot_start_threads_without_end() -> None:
    """RLIMIT_NPROC binds only a user other than root, inside the runner's own user namespace
    (engine/sandbox/limits.py): run the payload as such a user."""
    if "user-namespace" not in namespaces_available():
        pytest.skip("this kernel gives unprivileged processes no user namespace")
    user: list[str] = []
    if os.getuid() == 0:
        user = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    # (pytest's temporary directories are the user's alone)
    shared = Path(tempfile.mkdtemp(prefix="llmrun-redteam-shared-"))
    shared.chmod(0o755)
    model = write_tiny_llama(shared / "model.gguf")
    model.chmod(0o644)
    spec = {"model": str(model), "prompt_cache": None, "memory": MEMORY_ESTIMATE,
            "daemon_pid": os.getpid(), "daemon_port": 1, "home": str(shared),
            "store": str(shared), "other_model": str(model), "only": ["thread_bomb"]}
    try:
        report = run_payload(spec, user=user, env={"HOME": str(shared)})
    finally:
        shutil.rmtree(shared)
    assert "threads-limit" in report["confinement"]["sandbox"]
    assert report["results"]["thread_bomb"] == "RuntimeError"  # "can't start new thread"
