"""A runner's log, written by the daemon: the runner's stdout and stderr are a pipe, and a
thread here copies what comes through it to `runner-<model>.log`, rotated past a size.

A runner parses files from strangers; one that a crafted file took over must not be able to
fill the disk. Were its log a file it holds open (as it once was, appended to), it could
write without end; through a pipe it can only write to the daemon, which keeps each log file
under `MAX_BYTES` and one older part (`.log.1`) beside it: at most twice that per model,
however much a runner writes. The pipe is always drained, to the end, so a runner writing a
flood never blocks on it (it only costs the daemon this thread's copying).
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

MAX_BYTES = 64 << 20  # per log file; LLMRUN_DEBUG's step lines take ~100 bytes a step
CHUNK = 1 << 16


class _Sink:
    """One log file, shared by the runners that write it (a reload overlaps the runner it
    replaces): appends under a lock, and past `limit` the file becomes `<name>.1`."""

    def __init__(self, path: Path, limit: int) -> None:
        self.path, self.limit = path, limit
        self.lock = threading.Lock()
        self.users = 0
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "ab")  # noqa: SIM115 (closed when its last runner is gone)
        self.size = self.file.tell()

    def write(self, data: bytes) -> None:
        with self.lock:
            if self.size and self.size + len(data) > self.limit:
                self._rotate()
            data = data[:self.limit]  # (a single chunk is far smaller; a limit of a few bytes)
            self.file.write(data)
            self.file.flush()
            self.size += len(data)

    def _rotate(self) -> None:
        self.file.close()
        with contextlib.suppress(OSError):
            os.replace(self.path, self.path.with_name(self.path.name + ".1"))
        self.file = open(self.path, "ab")  # noqa: SIM115
        self.size = self.file.tell()


_sinks: dict[Path, _Sink] = {}
_sinks_lock = threading.Lock()


def _acquire(path: Path, limit: int) -> _Sink:
    with _sinks_lock:
        sink = _sinks.get(path)
        if sink is None:
            sink = _sinks[path] = _Sink(path, limit)
        sink.users += 1
        return sink


def _release(sink: _Sink) -> None:
    with _sinks_lock:
        sink.users -= 1
        if sink.users == 0:
            del _sinks[sink.path]
            with sink.lock:
                sink.file.close()


def start(path: Path, limit: int | None = None) -> tuple[int, threading.Thread]:
    """A pipe whose write end (returned: give it to the runner as stdout and stderr, then
    close it here) lands in the log `path`; the thread copying it ends at the pipe's end
    (when the runner and every copy of the write end are gone)."""
    sink = _acquire(path, MAX_BYTES if limit is None else limit)
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC)

    def pump() -> None:
        try:
            while chunk := os.read(read_fd, CHUNK):
                # a full disk, say: keep draining, or the runner would block on its writes
                with contextlib.suppress(OSError):
                    sink.write(chunk)
        finally:
            os.close(read_fd)
            _release(sink)

    thread = threading.Thread(target=pump, name=f"log {path.name}", daemon=True)
    thread.start()
    return write_fd, thread
