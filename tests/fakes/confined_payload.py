"""A test-only entry point: confine this process exactly as a runner is confined, load a model
inside the confinement, then run a payload that tries what a compromised engine would.

    python tests/fakes/confined_payload.py SPEC_JSON

It lives in tests/, so it is in no installed command line. SPEC_JSON names the model the
"runner" loads, its prompt-cache directory, its memory estimate, and the targets (a daemon's
pid and port, files that must stay out of reach). It prints one JSON object: the confinement
the runner reported and, for each attempt, "ok" or how it failed (an errno name, or an
exception's type).

The payload runs code inside the runner, as an attacker who turned a parser bug into code
execution would: Python's own calls, and raw system calls through ctypes where Python has
no wrapper. The numbers are x86_64's.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's llmrun

from llmrun import ipc, protocol
from llmrun.engine import runner
from llmrun.ipc import SyncChannel
from tests.fakes.attempts import tried

SYS = {"ptrace": 101, "syslog": 103, "unshare": 272, "perf_event_open": 298, "memfd_create": 319,
       "bpf": 321, "execveat": 322, "userfaultfd": 323, "io_uring_setup": 425, "prlimit64": 302,
       "unassigned": 1000}
PTRACE_ATTACH = 16
AT_EMPTY_PATH = 0x1000
CLONE_NEWUSER = 0x10000000
RLIMIT_AS = 9

libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long


def raw(name: str, *args: Any) -> int:
    rc = int(libc.syscall(ctypes.c_long(SYS[name]), *args))
    if rc < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return rc


def memfd_exec() -> None:
    """Write a program into memory and run it (the way around a read-only file system)."""
    fd = raw("memfd_create", b"x", ctypes.c_uint(0))
    with open("/bin/true", "rb") as src:
        os.write(fd, src.read())
    argv = (ctypes.c_char_p * 2)(b"true", None)
    raw("execveat", ctypes.c_int(fd), b"", argv, argv, ctypes.c_int(AT_EMPTY_PATH))


def raise_memory_limit() -> None:
    """Lift its own address-space limit (root may raise a hard limit)."""
    unlimited = (ctypes.c_ulong * 2)(ctypes.c_ulong(-1).value, ctypes.c_ulong(-1).value)
    raw("prlimit64", ctypes.c_int(0), ctypes.c_int(RLIMIT_AS), unlimited, None)


def many_files(n: int) -> None:
    held = [os.open("/dev/null", os.O_RDONLY) for _ in range(n)]
    for fd in held:
        os.close(fd)


def many_threads(n: int) -> None:
    stop = threading.Event()
    started = []
    try:
        for _ in range(n):
            t = threading.Thread(target=stop.wait, daemon=True)
            t.start()
            started.append(t)
    finally:
        stop.set()
        for t in started:
            t.join()


def fill_cache_file(directory: str) -> None:
    """Grow one file in its prompt-cache directory past any state it could keep (64 MiB;
    the payload's budget is 1 MiB)."""
    path = os.path.join(directory, "fill.kv")
    try:
        with open(path, "wb") as fh:
            piece = bytes(1 << 20)
            for _ in range(64):
                fh.write(piece)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)


def attempts(spec: dict[str, Any]) -> dict[str, Callable[[], object]]:
    daemon, port = int(spec["daemon_pid"]), int(spec["daemon_port"])
    home, store = Path(spec["home"]), Path(spec["store"])
    return {
        # what it may read: the model it loaded and nothing of the user's
        "read_ssh_key": lambda: (home / ".ssh" / "id_rsa").read_bytes(),
        "read_config_keys": lambda: (store / "config.yaml").read_bytes(),
        "read_other_model": lambda: open(spec["other_model"], "rb").read(16),
        "read_daemon_environ": lambda: open(f"/proc/{daemon}/environ", "rb").read(),
        "read_daemon_mem": lambda: open(f"/proc/{daemon}/mem", "rb").read(1),
        "list_processes": lambda: os.listdir("/proc"),
        # where it may connect: nowhere
        "connect_daemon": lambda: socket.create_connection(("127.0.0.1", port), timeout=2),
        "connect_anywhere": lambda: socket.create_connection(("192.0.2.1", 443), timeout=2),
        # where it may write: nowhere but its prompt-cache directory
        "write_home": lambda: open(home / "planted", "w"),
        "write_store": lambda: open(store / "planted", "w"),
        "write_tmp": lambda: open(f"/tmp/llmrun-redteam-{os.getpid()}", "w"),
        "write_beside_model": lambda: open(Path(spec["model"]).parent / "planted", "w"),
        # how large a file it may grow: in its own directory, a state it could keep
        "fill_cache_file": lambda: fill_cache_file(spec["prompt_cache"]),
        # other programs, other processes
        "exec_sh": lambda: os.execv("/bin/sh", ["sh", "-c", "true"]),
        "fork": lambda: os.fork() == 0 and os._exit(0),
        "ptrace_daemon": lambda: raw("ptrace", ctypes.c_long(PTRACE_ATTACH),
                                     ctypes.c_long(daemon), None, None),
        "signal_daemon": lambda: os.kill(daemon, signal.SIGTERM),
        # the daemon's priority, or every process of the user (PRIO_USER, who 0: its own)
        "renice_daemon": lambda: os.setpriority(os.PRIO_PROCESS, daemon, 19),
        "renice_user": lambda: os.setpriority(os.PRIO_USER, 0, 19),
        "renice_group": lambda: os.setpriority(os.PRIO_PGRP, 0, 19),
        "renice_own_thread": lambda: os.setpriority(os.PRIO_PROCESS, 0, 19),
        "new_namespace": lambda: raw("unshare", ctypes.c_int(CLONE_NEWUSER)),
        # the kernel's larger attack surfaces
        "io_uring_setup": lambda: raw("io_uring_setup", ctypes.c_uint(4),
                                      ctypes.create_string_buffer(120)),
        "memfd_exec": memfd_exec,
        "userfaultfd": lambda: raw("userfaultfd", ctypes.c_int(0)),
        "bpf": lambda: raw("bpf", ctypes.c_int(0), ctypes.create_string_buffer(128),
                           ctypes.c_uint(128)),
        "perf_event_open": lambda: raw("perf_event_open", ctypes.create_string_buffer(128),
                                       ctypes.c_int(0), ctypes.c_int(-1), ctypes.c_int(-1),
                                       ctypes.c_ulong(0)),
        # calls no runner needs: the allowlist does not name them
        "syslog": lambda: raw("syslog", ctypes.c_int(10), None, ctypes.c_int(0)),
        "unassigned_syscall": lambda: raw("unassigned"),
        # resources past the limits
        "raise_memory_limit": raise_memory_limit,
        "memory_bomb": lambda: bytearray(int(spec["memory_bomb"])),
        "fd_bomb": lambda: many_files(1000),
        "thread_bomb": lambda: many_threads(1000),
    }


def main() -> int:
    spec = json.loads(sys.argv[1])
    mine, theirs = socket.socketpair()
    load = protocol.Load(model=[spec["model"]], ctx=256, slots=1, threads=2,
                         memory=int(spec["memory"]), prompt_cache=spec["prompt_cache"],
                         prompt_cache_key="redteam", prompt_cache_size=1 << 20,
                         max_frame=ipc.MAX_FRAME)
    host = runner.start(SyncChannel(theirs), load)
    if host is None:
        print(json.dumps({"error": "the model did not load"}))
        return 1
    only = spec.get("only")
    chosen = {k: v for k, v in attempts(spec).items() if not only or k in only}
    report = {"confinement": host.sandbox_info, "results": tried(chosen)}
    print(json.dumps(report))
    mine.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
