"""The runner's confinement: what a confined process can no longer do, and that the daemon's
runners really run confined (and still compute)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx

from tests.conftest import Daemon

PROBE = """
import os, socket, subprocess, threading
from llmrun.engine import sandbox
print("applied:", ", ".join(sandbox.confine()))
t = threading.Thread(target=lambda: print("thread: ok")); t.start(); t.join()
socket.socketpair()  # how a runner talks to the daemon: still allowed
for what, fn in [("socket", socket.socket), ("fork", os.fork),
                 ("exec", lambda: subprocess.run(["/bin/true"]))]:
    try:
        if fn() == 0:
            os._exit(0)
        print(what + ": allowed")
    except OSError as e:
        print(what + ": " + os.strerror(e.errno))
"""


def test_a_confined_process_cannot_run_programs_fork_or_connect() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "applied: no core dumps, no new privileges, seccomp filter"
    assert lines[1:] == ["thread: ok", "socket: Operation not permitted",
                         "fork: Operation not permitted", "exec: Operation not permitted"]


def _runner_pids(daemon_pid: int) -> list[int]:
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


def test_the_daemons_runner_is_confined(daemon: Daemon, api: httpx.Client) -> None:
    r = api.post("/api/generate", json={"model": "smollm2", "prompt": "Hi", "stream": False,
                                        "options": {"num_predict": 4}})
    assert r.status_code == 200 and r.json()["eval_count"] == 4  # it still computes
    assert daemon.proc is not None
    pids = _runner_pids(daemon.proc.pid)
    assert pids
    for pid in pids:
        status = dict(line.split(":", 1) for line in
                      Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
        assert status["NoNewPrivs"].strip() == "1"
        assert status["Seccomp"].strip() == "2"  # filter mode
