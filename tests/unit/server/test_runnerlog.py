"""A runner's log is a pipe the daemon copies to a file that never grows past its cap (one
older part kept beside it), however much the runner writes; the pipe is drained to the end."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from llmrun.server import runnerlog

FLOOD = """
import os, sys
line = b"x" * 99 + b"\\n"
for _ in range(int(sys.argv[1])):
    os.write(2, line * 100)
os.write(2, b"last words\\n")
"""


def test_a_runner_writing_without_end_fills_at_most_two_capped_files(tmp_path: Path) -> None:
    log = tmp_path / "runner-x.log"
    log.write_bytes(b"from an earlier runner\n")
    cap = 64 << 10
    write_fd, thread = runnerlog.start(log, limit=cap)
    try:
        proc = subprocess.run([sys.executable, "-c", FLOOD, "200"], stderr=write_fd,
                              timeout=60, check=True)
    finally:
        os.close(write_fd)
    thread.join(30)
    assert proc.returncode == 0 and not thread.is_alive()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["runner-x.log", "runner-x.log.1"]  # 2 MB written, 128 KiB kept
    assert all((tmp_path / f).stat().st_size <= cap for f in files)
    assert log.read_bytes().endswith(b"last words\n")


def test_two_runners_of_one_model_share_its_log(tmp_path: Path) -> None:
    log = tmp_path / "runner-y.log"
    ends = [runnerlog.start(log), runnerlog.start(log)]
    for i, (fd, _) in enumerate(ends):
        os.write(fd, f"runner {i}\n".encode())
        os.close(fd)
    for _, thread in ends:
        thread.join(30)
    assert sorted(log.read_text().splitlines()) == ["runner 0", "runner 1"]
    assert runnerlog._sinks == {}  # closed with its last writer
