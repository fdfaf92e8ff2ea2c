"""The daemon's pid file: `LLMRUN_HOME/daemon.pid`, written at start, removed at exit.

A pid file left by a crash names a process that is gone (or a reused pid that is not an
llmrun daemon): it is detected as stale and replaced. A live llmrun daemon's pid file stops
a second daemon from starting on the same LLMRUN_HOME.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path


class AlreadyRunning(RuntimeError):
    pass


def is_llmrun_daemon(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, someone else's: look at its command line
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    args = [a.decode(errors="replace") for a in cmdline]
    return "serve" in args and any("llmrun" in a for a in args)


def read(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def claim(path: Path) -> None:
    """Write our pid, replacing a stale file; refuse if a live daemon holds it."""
    pid = read(path)
    if pid is not None and pid != os.getpid() and is_llmrun_daemon(pid):
        raise AlreadyRunning(f"an llmrun daemon (pid {pid}) already uses {path.parent}; stop "
                             "it first or set LLMRUN_HOME")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(f"{os.getpid()}\n")
    tmp.replace(path)
    atexit.register(release, path)


def release(path: Path) -> None:
    if read(path) == os.getpid():
        path.unlink(missing_ok=True)
