"""CLI start-up time: `llmrun --help`, `llmrun list` and `llmrun ps`, each run N times.

    python scripts/startup_time.py [-n 20] [--no-daemon] [--instructions]

Each command runs as a fresh process (the installed `llmrun` script next to this Python, else
`python -m llmrun`), with a throwaway LLMRUN_HOME holding one model's manifest, so `list` reads
a store; `ps` asks a daemon started for the run on a free port (`llmrun serve`; it loads no
model), so it makes its real GETs. One untimed run of each warms the page cache first. It
prints a markdown table (median, min and max wall seconds) and the load average, which says how
far to trust it: beside other work the times are high. `--instructions` adds the instructions
each command executes (one run under valgrind's callgrind, when installed): a count that other
work on the machine does not change, for comparing two versions on a busy machine. The target:
each under 0.25 s on an idle 2-core machine, since these are the commands typed to look
something up, and each heavy import (httpx, pydantic, Jinja) costs 0.1-0.3 s of it.
hyperfine, where installed, measures the same commands:
`hyperfine -N --warmup 1 'llmrun --help' 'llmrun list' 'llmrun ps'`.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMANDS = [["--help"], ["list"], ["ps"]]


def llmrun_command() -> list[str]:
    script = Path(sys.executable).parent / "llmrun"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "llmrun"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_manifest(home: Path) -> None:
    """One model in the store, so `list` parses a manifest (its blob need not exist)."""
    env = {**os.environ, "LLMRUN_HOME": str(home)}
    code = ("from llmrun.store.manifests import Layer, Manifest, Manifests\n"
            "from llmrun import config\n"
            "from llmrun.store import names\n"
            "m = Manifest(name='smollm2:latest', model=Layer(digest='sha256:' + '0' * 64, "
            "size=100_000_000))\n"
            "Manifests(config.home() / 'manifests').put(names.parse('smollm2'), m)\n")
    subprocess.run([sys.executable, "-c", code], env=env, check=True)


def start_daemon(env: dict[str, str]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([*llmrun_command(), "serve"], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    host, port = env["LLMRUN_HOST"].rsplit(":", 1)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llmrun serve exited with status {proc.returncode}")
        try:
            socket.create_connection((host, int(port)), timeout=1).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit("llmrun serve did not start in 60 s")


def measure(argv: list[str], env: dict[str, str], runs: int) -> list[float]:
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # warm
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        times.append(time.perf_counter() - t0)
    return times


def instructions(argv: list[str], env: dict[str, str]) -> int | None:
    """Instructions one run executes (valgrind's callgrind), None without valgrind."""
    if shutil.which("valgrind") is None:
        return None
    r = subprocess.run(["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null",
                        *argv], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                       text=True)
    found = re.search(r"Collected\s*:\s*(\d+)", r.stderr)
    return int(found.group(1)) if found else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", "--runs", type=int, default=20, help="timed runs of each command")
    ap.add_argument("--no-daemon", action="store_true",
                    help="start no daemon: `ps` then only finds none answering")
    ap.add_argument("--instructions", action="store_true",
                    help="also count each command's instructions (valgrind)")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="llmrun-startup-"))
    env = {**os.environ, "LLMRUN_HOME": str(home), "LLMRUN_HOST": f"127.0.0.1:{free_port()}"}
    env.pop("LLMRUN_API_KEYS", None)
    daemon = None
    try:
        write_manifest(home)
        if not args.no_daemon:
            daemon = start_daemon(env)
        base = llmrun_command()
        rows = []
        for cmd in COMMANDS:
            argv = [*base, *cmd]
            rows.append((" ".join(["llmrun", *cmd]), measure(argv, env, args.runs),
                         instructions(argv, env) if args.instructions else None))
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(30)
        shutil.rmtree(home, ignore_errors=True)
    load = os.getloadavg()
    print(f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"{args.runs} runs each after one warm-up; load average "
          f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (1 / 5 / 15 min)"
          + ("" if daemon else "; no daemon (ps finds none)"))
    counted = args.instructions
    print("| command | median s | min s | max s |" + (" instructions |" if counted else ""))
    print("|---|---|---|---|" + ("---|" if counted else ""))
    for name, times, count in rows:
        print(f"| `{name}` | {statistics.median(times):.3f} | {min(times):.3f} | "
              f"{max(times):.3f} |" + (f" {_millions(count)} |" if counted else ""))


def _millions(count: int | None) -> str:
    return "-" if count is None else f"{count / 1e6:.0f} M"


if __name__ == "__main__":
    main()
