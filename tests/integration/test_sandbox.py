"""The confinement of the processes that parse model files (runners, the quantizer child):
what a confined process can no longer do, that it still loads and decodes a real model,
that the daemon's runners really run confined with a scrubbed environment, and that
LLMRUN_SANDBOX=strict refuses a runner it cannot confine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmrun import childenv
from llmrun.engine import sandbox
from llmrun.store import quantize
from tests.conftest import Daemon, make_home, runner_pids
from tests.fakes.tinymodel import write_tiny_llama
from tests.integration.test_service import gen, loaded, tiny_home


def landlock_available() -> bool:
    try:
        return sandbox.landlock_abi() >= 1
    except OSError:
        return False


# Set on a machine whose kernel has no Landlock: the tests that need it skip, saying so, and
# those of the confinement that stands in for it still run. Without it, a missing Landlock
# fails them: its assertions must not pass unseen.
ALLOW_NO_LANDLOCK = "LLMRUN_TEST_ALLOW_NO_LANDLOCK"
# The test-only switch that makes a child act as on a kernel without Landlock.
NO_LANDLOCK_ENV = {sandbox.landlock.TEST_NO_LANDLOCK: "1"}
# Each confinement test runs both ways: with Landlock, and as on a kernel without it.
LANDLOCK_MODES = pytest.mark.parametrize("landlock", [True, False],
                                         ids=["landlock", "no-landlock"])


def require_landlock() -> None:
    """For a test of what Landlock stops: fail where the kernel lacks it, unless the
    machine is declared to lack it (ALLOW_NO_LANDLOCK), then skip."""
    if landlock_available():
        return
    if os.environ.get(ALLOW_NO_LANDLOCK) == "1":
        pytest.skip(f"no Landlock in this kernel ({ALLOW_NO_LANDLOCK}=1)")
    pytest.fail(f"this kernel has no Landlock, which these assertions need; set "
                f"{ALLOW_NO_LANDLOCK}=1 on such a machine (the no-landlock variants still run)")


def landlock_env(landlock: bool) -> dict[str, str]:
    """The environment of a child for a test's Landlock mode (require_landlock() first)."""
    if landlock:
        require_landlock()
        return {k: v for k, v in os.environ.items() if k != sandbox.landlock.TEST_NO_LANDLOCK}
    return {**os.environ, **NO_LANDLOCK_ENV}


def namespaces_available() -> list[str]:
    """The namespaces a fresh process may enter here (a runner enters them as it starts)."""
    out = subprocess.run([sys.executable, "-c", "from llmrun.engine import sandbox; "
                          "print(' '.join(sandbox.isolate()[0]))"],
                         capture_output=True, text=True, check=True, timeout=60)
    return out.stdout.split()


# The probes' common part: tried(), each attempt's outcome (tests/fakes/attempts.py).
TRIED = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
from tests.fakes.attempts import tried
"""

RUNNER_PROBE = TRIED + """
import ctypes, errno, json, os, signal, socket, subprocess, sys, threading
from pathlib import Path
from llmrun.engine import sandbox
isolated = sandbox.isolate()  # first, with one thread, as a runner does
from llmrun.engine.llama import Batch, Context, Model, Sampler  # before confining, as in runner

model_path, victim, elsewhere, other_pid, cache = sys.argv[1:6]
confinement = sandbox.confine(read=[Path(model_path)], read_write=[Path(cache)] if cache else [],
                              isolated=isolated)

model = Model(Path(model_path))  # parsed inside the confinement
ctx = Context(model, n_ctx_seq=256, n_seq=1, n_batch=64, n_threads=2)
sampler = Sampler(model, temperature=0.0, top_k=40, top_p=1.0, min_p=0.0, typical_p=1.0,
                  repeat_last_n=64, repeat_penalty=1.0, presence_penalty=0.0,
                  frequency_penalty=0.0, seed=1)
batch = Batch(64)
prompt = model.tokenize("The capital of France is", add_special=True)
for i, tok in enumerate(prompt):
    batch.add(tok, i, 0, i == len(prompt) - 1)
generated = []
for pos in range(len(prompt), len(prompt) + 4):
    assert ctx.decode(batch) == 0
    tok = ctx.sample(sampler, batch.n - 1)
    generated.append(tok)
    batch.clear()
    batch.add(tok, pos, 0, True)

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def io_uring_setup():
    params = ctypes.create_string_buffer(120)  # struct io_uring_params
    if libc.syscall(ctypes.c_long(425), ctypes.c_uint(4), params) < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))

attempts = {
    "write_new": lambda: open(os.path.join(elsewhere, "new.txt"), "w"),
    "append_existing": lambda: open(victim, "a"),
    "truncate_existing": lambda: os.truncate(victim, 0),
    "unlink": lambda: os.unlink(victim),
    "rename": lambda: os.rename(victim, os.path.join(elsewhere, "moved")),
    "read_elsewhere": lambda: open(victim).read(),
    "socket": socket.socket,
    "io_uring_setup": io_uring_setup,
    "kill_other": lambda: os.kill(int(other_pid), signal.SIGKILL),
    "kill_self": lambda: os.kill(os.getpid(), 0),
    "fork": lambda: os.fork() == 0 and os._exit(0),
    "exec": lambda: subprocess.run(["/bin/true"]),
    "thread": lambda: threading.Thread(target=lambda: None).start(),
    "socketpair": socket.socketpair,  # how a runner talks to the daemon: still allowed
    "renice_other": lambda: os.setpriority(os.PRIO_PROCESS, int(other_pid), 19),
    "renice_user": lambda: os.setpriority(os.PRIO_USER, 0, 19),
    "renice_own_thread": lambda: os.setpriority(os.PRIO_PROCESS, 0, 19),
    "write_dev_node": lambda: open("/dev/vda" if os.path.exists("/dev/vda") else "/dev/tty", "w"),
}
if cache:  # the prompt cache's directory: its files are written, renamed and removed
    def cache_cycle():
        tmp = os.path.join(cache, ".kv-tmp")
        with open(tmp, "wb") as fh:
            fh.write(b"state")
        os.replace(tmp, os.path.join(cache, "a.kv"))
        os.utime(os.path.join(cache, "a.kv"))
        assert open(os.path.join(cache, "a.kv"), "rb").read() == b"state"
        os.unlink(os.path.join(cache, "a.kv"))
    attempts["cache_cycle"] = cache_cycle
    attempts["rename_into_cache"] = lambda: os.rename(victim, os.path.join(cache, "stolen"))
results = tried(attempts)
print(json.dumps({"applied": confinement.applied, "missing": confinement.missing,
                  "generated": [model.piece(t).decode("utf-8", "replace") for t in generated],
                  "results": results}))
"""

DENIED = ("EPERM", "EACCES")  # seccomp answers EPERM, Landlock EACCES
# without Landlock, a process that may write meets read-only mounts (EROFS), and a rename
# from elsewhere into its output crosses mounts (EXDEV)
DENIED_WITHOUT_LANDLOCK = (*DENIED, "EROFS", "EXDEV")


@LANDLOCK_MODES
@pytest.mark.parametrize("with_cache", [False, True], ids=["no-writes", "prompt-cache"])
def test_a_runner_confined_before_loading_still_decodes_and_can_do_nothing_else(
        smollm2_path: Path, tmp_path: Path, with_cache: bool, landlock: bool) -> None:
    """Without a prompt cache a runner writes nothing; with one, only inside its directory:
    seccomp must then allow write-opens, and Landlock keeps them there or, on a kernel
    without it, the read-only mounts of the runner's mount namespace."""
    env = landlock_env(landlock)
    cache = tmp_path / "prompt-cache"
    if with_cache:
        cache.mkdir()
    victim = tmp_path / "bashrc"
    victim.write_text("keep me\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        out = subprocess.run([sys.executable, "-c", RUNNER_PROBE, str(smollm2_path),
                              str(victim), str(elsewhere), str(bystander.pid),
                              str(cache) if with_cache else ""],
                             capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        report = json.loads(out.stdout.splitlines()[-1])
        assert bystander.poll() is None  # the SIGKILL never reached it
    finally:
        bystander.kill()
        bystander.wait()
    namespaces = [n for n in report["applied"] if n.endswith("-namespace")]
    expected_layers = [*namespaces, "no-core-dumps", "open-files-limit", "no-new-privs",
                       "seccomp"]
    if landlock:
        expected_layers.insert(-1, "landlock")
    elif with_cache:  # the mounts stand in for Landlock where the runner may write
        assert "mount-namespace" in namespaces
        expected_layers.insert(-1, "read-only-mounts")
    assert report["applied"] == expected_layers and report["missing"] == []
    assert len(report["generated"]) == 4 and "".join(report["generated"]).strip()
    results = report["results"]
    denied = DENIED if landlock else DENIED_WITHOUT_LANDLOCK
    for name in ("write_new", "append_existing", "truncate_existing", "unlink", "rename",
                 "write_dev_node"):
        assert results[name] in denied, (name, results[name])
    assert victim.read_text() == "keep me\n" and list(elsewhere.iterdir()) == []
    for name in ("socket", "io_uring_setup", "kill_other", "fork", "exec", "renice_other",
                 "renice_user"):
        assert results[name] == "EPERM", (name, results[name])
    assert results["kill_self"] == results["thread"] == results["socketpair"] == "ok"
    assert results["renice_own_thread"] == "ok"  # what the prompt cache's writer does
    if landlock:  # files outside the model and the Python installation
        assert results["read_elsewhere"] == "EACCES"
    if with_cache:
        assert results["cache_cycle"] == "ok" and list(cache.iterdir()) == []
        assert results["rename_into_cache"] in denied


QUANTIZER_PROBE = TRIED + """
import errno, json, os, socket, sys
from pathlib import Path
from llmrun.engine.quantizer import _confine

src, dst, sibling = sys.argv[1:4]
refusal = _confine(Path(src), Path(dst))
def grow_dst():
    with open(dst, "r+b") as fh:  # past what the source could make of it (its limit)
        fh.seek(os.path.getsize(src) + (32 << 20))
        fh.write(b"x")

results = tried({
    "read_src": lambda: open(src, "rb").read(4),
    "write_dst": lambda: open(dst, "wb").write(b"GGUF"),
    "create_sibling": lambda: open(sibling, "w"),
    "write_tmp": lambda: open(os.path.join(os.path.dirname(os.path.dirname(sibling)),
                                           "planted"), "w"),
    "socket": socket.socket,
    "grow_dst_past_bound": grow_dst,
})
print(json.dumps({"refusal": refusal, "results": results}))
"""


@LANDLOCK_MODES
def test_the_quantizer_child_writes_only_its_output(tmp_path: Path, landlock: bool) -> None:
    """Landlock keeps its writes to its output; without Landlock, the read-only mounts of
    its mount namespace (then it may still read elsewhere: that only Landlock stops)."""
    env = {**landlock_env(landlock), "LLMRUN_SANDBOX": "strict"}
    src = write_tiny_llama(tmp_path / "src.gguf")
    out_dir = tmp_path / "blobs"
    out_dir.mkdir()
    dst = out_dir / ".quantize-x.gguf.partial"
    dst.touch()  # quantize() creates it (mkstemp) before the child starts
    sibling = out_dir / "sha256-evil"
    out = subprocess.run([sys.executable, "-c", QUANTIZER_PROBE, str(src), str(dst),
                          str(sibling)], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.splitlines()[-1])
    assert report == {"refusal": "", "results": {
        "read_src": "ok", "write_dst": "ok", "create_sibling": "EACCES" if landlock else "EROFS",
        "write_tmp": "EACCES" if landlock else "EROFS", "socket": "EPERM",
        "grow_dst_past_bound": "EFBIG"}}
    assert not sibling.exists() and not (tmp_path / "planted").exists()


# Runs a program with unshare() refused (EPERM), as where neither unprivileged user
# namespaces nor, for root, mount namespaces are allowed: with no Landlock either, nothing
# could keep a writer's writes in place.
NO_NAMESPACES = """
import errno, os, sys
from llmrun.engine import sandbox
from llmrun.engine.sandbox import seccomp as s

lib = s.libseccomp()
ctx = lib.seccomp_init(s.SCMP_ACT_ALLOW)
s._Filter(lib, ctx).rule(s._errno_action(errno.EPERM), "unshare")
sandbox._no_new_privs()
assert lib.seccomp_load(ctx) == 0
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""


def test_without_landlock_or_namespaces_the_quantizer_refuses_to_write(tmp_path: Path) -> None:
    """Where nothing can keep its writes to its output, the quantizer child writes nothing
    and says why, whatever LLMRUN_SANDBOX=1 would otherwise let run unconfined."""
    src = write_tiny_llama(tmp_path / "src.gguf")
    dst = tmp_path / "out.partial"
    dst.touch()
    sibling = tmp_path / "sibling"
    out = subprocess.run([sys.executable, "-c", NO_NAMESPACES, "-c", QUANTIZER_PROBE,
                          str(src), str(dst), str(sibling)], capture_output=True, text=True,
                         timeout=60, env={**os.environ, **NO_LANDLOCK_ENV,
                                          "LLMRUN_SANDBOX": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.splitlines()[-1])
    assert "cannot keep the quantizer's writes to its output" in report["refusal"]
    assert report["results"]["write_dst"] == "EPERM"  # no write-open at all
    assert report["results"]["create_sibling"] == "EPERM"
    assert not sibling.exists() and dst.stat().st_size == 0
    # and the store's quantize() reports it as the child's error
    proc = subprocess.run([sys.executable, "-c", NO_NAMESPACES, "-m", "llmrun.engine.quantizer",
                           str(src), str(dst), "Q8_0"], capture_output=True, text=True,
                          timeout=60, env={**os.environ, **NO_LANDLOCK_ENV, "LLMRUN_SANDBOX": "1"})
    assert proc.returncode == 1 and "cannot keep the quantizer's writes" in proc.stderr
    assert dst.stat().st_size == 0


@pytest.mark.parametrize("landlock", [True, False], ids=["landlock", "no-landlock"])
def test_the_quantizer_quantizes_in_strict_mode_either_way(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, landlock: bool) -> None:
    """Through the store's quantize() (what `create -q` and /api/create's `quantize` run):
    strict mode, which refuses any missing layer, still quantizes without Landlock, as the
    read-only mounts stand in for it; the test switch reaches the child."""
    if landlock:
        require_landlock()
        monkeypatch.delenv(sandbox.landlock.TEST_NO_LANDLOCK, raising=False)
    else:
        monkeypatch.setenv(sandbox.landlock.TEST_NO_LANDLOCK, "1")
    monkeypatch.setenv("LLMRUN_SANDBOX", "strict")
    src = write_tiny_llama(tmp_path / "src.gguf")
    result = quantize.quantize(src, "Q8_0", tmp_path / "out")
    assert 0 < result.stat().st_size < src.stat().st_size
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [result.name]


def test_the_quantizer_child_gets_a_scrubbed_environment_and_still_quantizes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "hf_secret")
    monkeypatch.setenv("LLMRUN_API_KEYS", "k1")
    monkeypatch.setenv("LLMRUN_SANDBOX", "strict")  # any missing layer would fail it
    seen: list[dict[str, str]] = []
    real_popen = subprocess.Popen

    def spy(*args: Any, **kwargs: Any) -> subprocess.Popen[Any]:
        seen.append(dict(kwargs["env"]))
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(quantize.subprocess, "Popen", spy)
    src = write_tiny_llama(tmp_path / "src.gguf")
    result = quantize.quantize(src, "Q8_0", tmp_path / "out")
    assert result.stat().st_size > 0
    (env,) = seen
    assert "HF_TOKEN" not in env and "LLMRUN_API_KEYS" not in env
    assert env["LLMRUN_SANDBOX"] == "strict"


def test_the_child_environment_is_an_allowlist() -> None:
    env = childenv.scrubbed({"LLMRUN_SANDBOX": "on"}, environ={
        "PATH": "/usr/bin", "HOME": "/home/u", "LANG": "C.UTF-8", "LC_ALL": "C",
        "PYTHONPATH": "/src", "OMP_NUM_THREADS": "2", "GGML_SCHED_PRIO": "1",
        "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1", "HF_TOKEN": "hf_x", "LLMRUN_API_KEYS": "k",
        "LLMRUN_ORIGINS": "x",
        "AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "s", "GITHUB_TOKEN": "g",
        "OPENAI_API_KEY": "o", "LLAMA_API_KEY": "l", "SSH_AUTH_SOCK": "/tmp/agent",
        "DATABASE_URL": "postgres://u:p@h/db", "PYTHON_KEYRING_PASSWORD": "p"})
    assert env == {"PATH": "/usr/bin", "HOME": "/home/u", "LANG": "C.UTF-8", "LC_ALL": "C",
                   "PYTHONPATH": "/src", "OMP_NUM_THREADS": "2", "GGML_SCHED_PRIO": "1",
                   "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1", "LLMRUN_SANDBOX": "on"}


# -- the daemon's runners -----------------------------------------------------------------

KEY = {"x-api-key": "sandbox-test-key"}


@pytest.fixture(scope="module")
def secret_daemon(tmp_path_factory: pytest.TempPathFactory,
                  smollm2_path: Path) -> Iterator[Daemon]:
    """A daemon whose environment holds credentials a runner must not inherit."""
    home = make_home(tmp_path_factory.mktemp("sandbox-home"), smollm2_path)
    d = Daemon(home, {"HF_TOKEN": "hf_do_not_leak", "LLMRUN_API_KEYS": "sandbox-test-key",
                      "AWS_SECRET_ACCESS_KEY": "aws_do_not_leak", "OMP_WAIT_POLICY": "PASSIVE",
                      "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1", "LLMRUN_SANDBOX": "1"}).start()
    r = httpx.post(f"{d.url}/api/generate", headers=KEY, timeout=120, json={
        "model": "smollm2", "prompt": "Hi", "stream": False, "options": {"num_predict": 4}})
    assert r.status_code == 200 and r.json()["eval_count"] == 4  # it still computes
    yield d
    d.stop()


def _one_runner(daemon: Daemon) -> int:
    assert daemon.proc is not None
    (pid,) = runner_pids(daemon.proc.pid)
    return pid


def test_the_daemons_runner_is_confined(secret_daemon: Daemon) -> None:
    pid = _one_runner(secret_daemon)
    status = dict(line.split(":", 1) for line in
                  Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    assert status["NoNewPrivs"].strip() == "1"
    assert status["Seccomp"].strip() == "2"  # filter mode


def test_the_runner_environment_holds_no_credentials(secret_daemon: Daemon) -> None:
    environ = Path(f"/proc/{_one_runner(secret_daemon)}/environ").read_bytes()
    names = {entry.split(b"=", 1)[0].decode() for entry in environ.split(b"\0") if entry}
    assert not names & {"HF_TOKEN", "LLMRUN_API_KEYS", "AWS_SECRET_ACCESS_KEY"}
    assert {"PATH", "OMP_WAIT_POLICY", "GLIBC_TUNABLES", "LLMRUN_SANDBOX"} <= names
    assert b"do_not_leak" not in environ and b"sandbox-test-key" not in environ


def test_ps_shows_that_the_runner_is_confined(secret_daemon: Daemon) -> None:
    (model,) = httpx.get(f"{secret_daemon.url}/api/ps", headers=KEY).json()["models"]
    assert model["confined"] is True
    layers = {"no-core-dumps", "memory-limit", "open-files-limit", "file-size-limit",
              "no-new-privs", "seccomp"}
    # (fails where Landlock is missing, unless the machine is declared so)
    if landlock_available() or os.environ.get(ALLOW_NO_LANDLOCK) != "1":
        layers |= {"landlock"}
    layers |= set(namespaces_available())
    assert layers <= set(model["sandbox"]), model["sandbox"]
    out = subprocess.run([sys.executable, "-m", "llmrun", "ps"], env=secret_daemon.env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    header, row = out.stdout.splitlines()[:2]
    assert "SANDBOX" in header.split() and "confined" in row.split()


# -- where a layer cannot be applied ------------------------------------------------------

# Starts the daemon in a process where seccomp filters cannot be installed: seccomp() answers
# ENOSYS and prctl(PR_SET_SECCOMP) EINVAL, as on a kernel built without seccomp filters or in
# a container that withholds them. Runners inherit this (a filter survives fork and exec).
NO_SECCOMP = """
import errno, os, sys
from llmrun.engine import sandbox
from llmrun.engine.sandbox import seccomp as s

lib = s.libseccomp()
ctx = lib.seccomp_init(s.SCMP_ACT_ALLOW)
f = s._Filter(lib, ctx)
f.rule(s._errno_action(errno.ENOSYS), "seccomp")
f.rule(s._errno_action(errno.EINVAL), "prctl", s._ArgCmp(0, s.SCMP_CMP_EQ, 22, 0))
sandbox._no_new_privs()
assert lib.seccomp_load(ctx) == 0
os.execv(sys.executable, [sys.executable, "-m", "llmrun", "serve"])
"""


class NoSeccompDaemon(Daemon):
    def command(self, *args: str) -> list[str]:
        return [sys.executable, "-c", NO_SECCOMP]


def test_strict_mode_refuses_a_runner_it_cannot_confine(tmp_path: Path) -> None:
    d = NoSeccompDaemon(tiny_home(tmp_path, ["a"]), {"LLMRUN_SANDBOX": "strict"}).start()
    try:
        r = gen(d.url, "a")
        assert r.status_code == 500
        error = r.json()["error"]
        assert "LLMRUN_SANDBOX=strict refuses to run a model unconfined" in error
        assert "seccomp" in error
        assert loaded(d.url) == []
        assert d.proc is not None and runner_pids(d.proc.pid) == []
    finally:
        d.stop()


def test_default_mode_runs_what_it_can_warns_once_and_ps_says_so(tmp_path: Path) -> None:
    d = NoSeccompDaemon(tiny_home(tmp_path, ["a", "b"]), {"LLMRUN_SANDBOX": "1"}).start()
    try:
        assert gen(d.url, "a").status_code == 200
        assert gen(d.url, "b").status_code == 200
        models = httpx.get(f"{d.url}/api/ps").json()["models"]
        assert len(models) == 2
        for model in models:
            assert model["confined"] is False and "seccomp" not in model["sandbox"]
            assert "no-new-privs" in model["sandbox"]
    finally:
        d.stop()
    warnings = [line for line in d.log.read_text().splitlines()
                if "sandbox: model runners run without: seccomp" in line]
    assert len(warnings) == 1, warnings



DEVICE_PROBE = TRIED + """
import errno, json, os, sys
from pathlib import Path
from llmrun.engine import sandbox

node, other, victim = sys.argv[1:4]
isolated = sandbox.isolate()
held = os.open(node, os.O_RDONLY)  # as a GPU backend holds its device open
nodes = sandbox.gpu_nodes(prefixes=(node,))
result = sandbox.confine(devices=nodes, isolated=isolated)
results = tried({
    "open_node_rw": lambda: os.close(os.open(node, os.O_RDWR)),
    "open_other_node_rw": lambda: os.close(os.open(other, os.O_RDWR)),
    "write_file": lambda: open(victim, "w"),
    "unlink": lambda: os.unlink(victim),
})
print(json.dumps({"nodes": [str(n) for n in nodes], "applied": result.applied,
                  "missing": result.missing, "results": results}))
"""


@LANDLOCK_MODES
def test_a_gpu_runner_keeps_its_device_nodes_and_nothing_else_writable(
        tmp_path: Path, landlock: bool) -> None:
    """A runner on a GPU may open the device nodes its backend held open read-write (its
    driver reopens them); still no other node, no file, no deleting. Without Landlock its
    mount namespace keeps that: everything read-only, and a /dev of its own nodes and the
    harmless ones. (/dev/zero stands in for a GPU's node, /dev/vda, or /dev/tty where there
    is none, for another device.)"""
    env = landlock_env(landlock)
    victim = tmp_path / "bashrc"
    victim.write_text("keep me\n")
    other = "/dev/vda" if os.path.exists("/dev/vda") else "/dev/tty"
    out = subprocess.run([sys.executable, "-c", DEVICE_PROBE, "/dev/zero", other,
                          str(victim)], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.splitlines()[-1])
    assert report["nodes"] == ["/dev/zero"] and report["missing"] == []
    assert ("landlock" if landlock else "read-only-mounts") in report["applied"]
    assert "seccomp" in report["applied"]
    results = report["results"]
    assert results["open_node_rw"] == "ok"
    # Landlock: not this runner's device; without it, not in the runner's /dev at all
    assert results["open_other_node_rw"] == ("EACCES" if landlock else "ENOENT")
    assert results["write_file"] == ("EACCES" if landlock else "EROFS")
    assert results["unlink"] == "EPERM"
    assert victim.read_text() == "keep me\n"


def test_a_gpu_runner_is_refused_where_its_writes_cannot_be_confined(tmp_path: Path) -> None:
    """No Landlock and no namespaces: a GPU runner's driver would open files for writing
    wherever its user can, so the runner refuses to start, saying what to do."""
    from llmrun.engine import boot

    probe = TRIED + """
import json, socket
from llmrun import ipc, protocol
from llmrun.engine import runner
from llmrun.ipc import SyncChannel
mine, theirs = socket.socketpair()
load = protocol.Load(model=[sys.argv[1]], ctx=256, slots=1, threads=2, device=["Vulkan0"],
                     max_frame=ipc.MAX_FRAME)
host = runner.start(SyncChannel(theirs), load)
print(json.dumps({"host": host is not None, "reply": SyncChannel(mine).recv()}))
"""
    model = write_tiny_llama(tmp_path / "model.gguf")
    out = subprocess.run([sys.executable, "-c", NO_NAMESPACES, "-c", probe, str(model)],
                         capture_output=True, text=True, timeout=60,
                         env={**os.environ, **NO_LANDLOCK_ENV, "LLMRUN_SANDBOX": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.splitlines()[-1])
    assert report["host"] is False
    assert report["reply"] == {"type": "fatal", "error": boot.GPU_UNCONFINABLE}


# -- the allowlist ------------------------------------------------------------------------

# Confines itself as a runner does, decodes, then makes calls the allowlist does not name
# (each with harmless arguments: what they answer unconfined is taken first), then decodes
# again: a refused call is an error for the caller, not the end of the process.
OUTSIDE_PROBE = TRIED + """
import ctypes, json, os, sys
from pathlib import Path
from llmrun.engine import sandbox
from llmrun.engine.llama import Batch, Context, Model, Sampler

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long

def call(nr, *args):
    def attempt():
        if libc.syscall(ctypes.c_long(nr), *[ctypes.c_long(a) for a in args]) < 0:
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
    return attempt

attempts = {
    "personality": call(135, 0xFFFFFFFF),  # only asks for the current persona
    "uselib": call(134, 0),
    "syslog": call(103, 10, 0, 0),  # SYSLOG_ACTION_SIZE_BUFFER
    "acct": call(163, 0),
    "raw_1000": call(1000),
    "memfd_create": call(319, ctypes.addressof(ctypes.create_string_buffer(b"x")), 0),
    "clone3": call(435, 0, 0),
    "openat2": call(437, -100, 0, 0, 0),
    "ioctl_tiocsti": call(16, 1, 0x5412, ctypes.addressof(ctypes.create_string_buffer(b"x"))),
    "ioctl_tiocsti_high_bits": call(16, 1, 0x100005412, 0),
    "ioctl_tcgets": call(16, 1, 0x5401, ctypes.addressof(ctypes.create_string_buffer(64))),
}
before = tried(attempts)
model_path = sys.argv[1]
confinement = sandbox.confine(read=[Path(model_path)])
model = Model(Path(model_path))
ctx = Context(model, n_ctx_seq=256, n_seq=1, n_batch=64, n_threads=2)
sampler = Sampler(model, temperature=0.0, top_k=40, top_p=1.0, min_p=0.0, typical_p=1.0,
                  repeat_last_n=64, repeat_penalty=1.0, presence_penalty=0.0,
                  frequency_penalty=0.0, seed=1)
batch = Batch(64)

prompt = model.tokenize("The capital of France is", add_special=True)
for i, tok in enumerate(prompt):
    batch.add(tok, i, 0, i == len(prompt) - 1)
pos = len(prompt)

def decode(n):
    global pos
    out = []
    for _ in range(n):
        assert ctx.decode(batch) == 0
        tok = ctx.sample(sampler, batch.n - 1)
        out.append(tok)
        batch.clear()
        batch.add(tok, pos, 0, True)
        pos += 1
    return out

first = decode(4)
after = tried(attempts)
second = decode(4)  # still decodes after the refusals
print(json.dumps({"applied": confinement.applied, "before": before, "after": after,
                  "decoded": len(first) + len(second)}))
"""


def test_calls_outside_the_allowlist_answer_eperm_and_the_model_still_decodes(
        smollm2_path: Path) -> None:
    out = subprocess.run([sys.executable, "-c", OUTSIDE_PROBE, str(smollm2_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.splitlines()[-1])
    assert "seccomp" in report["applied"] and report["decoded"] == 8
    before, after = report["before"], report["after"]
    # unconfined they did something else: the EPERM below is the filter's
    assert before["personality"] == "ok" and before["raw_1000"] == "ENOSYS"
    for name in ("personality", "uselib", "syslog", "acct", "raw_1000", "memfd_create",
                 "ioctl_tiocsti", "ioctl_tiocsti_high_bits"):
        assert after[name] == "EPERM", (name, after[name])
    # the two whose arguments a filter cannot read: ENOSYS, so the C library falls back
    assert after["clone3"] == after["openat2"] == "ENOSYS"
    # Python's own terminal query still reaches the kernel (stdout is a pipe here)
    assert after["ioctl_tcgets"] == "ENOTTY"
