"""The interactive chat: its slash commands on their own, then a real session in a terminal
(a pty) against the real daemon."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

from llmrun.cli.repl import HELP, Session


def test_messages_and_commands() -> None:
    s = Session("smollm2")
    assert s.handle("Hello there") == ("send", "Hello there")
    assert s.handle("   ") == ("continue", "")
    assert s.handle("/?") == ("say", HELP) == s.handle("/help")
    assert s.handle("/bye") == ("bye", "") == s.handle("/exit")
    assert s.handle("/nope")[1].startswith("Unknown command '/nope'")
    assert s.handle("/show info") == ("show", "info")
    assert s.handle("/show everything")[1].startswith("Usage: /show")
    assert s.handle("/load qwen3") == ("load", "qwen3")
    assert s.handle("/load")[1] == "Usage: /load MODEL"


def test_set_changes_the_session() -> None:
    s = Session("smollm2")
    s.handle("/set parameter temperature 0.2")
    s.handle("/set parameter num_ctx 4096")
    s.handle("/set parameter stop <|im_end|>")
    s.handle("/set parameter stop END")
    assert s.options == {"temperature": 0.2, "num_ctx": 4096, "stop": ["<|im_end|>", "END"]}
    assert s.handle("/set parameter seed")[1].startswith("Usage")
    s.handle("/set system You are terse.")
    s.history = [{"role": "user", "content": "Hi"}]
    assert s.messages()[0] == {"role": "system", "content": "You are terse."}
    s.handle("/set think")
    s.handle("/set verbose")
    assert s.think is True and s.verbose is True
    s.handle("/set nothink")
    assert s.think is False
    assert s.handle("/clear")[0] == "say" and s.history == []
    s.handle("/set system")
    assert s.system is None and s.messages() == []


def test_multiline_messages() -> None:
    s = Session("smollm2")
    assert s.handle('"""First line') == ("continue", "")
    assert s.writing
    assert s.handle("/bye is just text here") == ("continue", "")
    assert s.handle('last line"""') == ("send", "First line\n/bye is just text here\nlast line")
    assert not s.writing
    assert s.handle('"""one line"""') == ("send", "one line")
    assert s.handle('"""') == ("continue", "")
    assert s.handle('"""') == ("continue", "")  # an empty message is not sent


def _read_until(fd: int, needle: bytes, timeout: float = 120) -> bytes:
    out = b""
    deadline = time.monotonic() + timeout
    while needle not in out:
        left = deadline - time.monotonic()
        assert left > 0, f"no {needle!r} in {out[-500:]!r}"
        ready, _, _ = select.select([fd], [], [], left)
        if ready:
            try:
                chunk = os.read(fd, 4096)
            except OSError:
                break
            if not chunk:
                break
            out += chunk
    return out


def test_a_session_in_a_terminal(_isolated_home: Path, smollm2_path: Path) -> None:
    from tests.conftest import make_home
    from tests.test_cli import stop_daemon

    make_home(_isolated_home, smollm2_path)
    controller, terminal = pty.openpty()
    env = {**os.environ, "LLMRUN_CONTEXT_LENGTH": "1024", "COLUMNS": "200", "TERM": "dumb"}
    proc = subprocess.Popen([sys.executable, "-m", "llmrun", "run", "smollm2"],
                            stdin=terminal, stdout=terminal, stderr=terminal, env=env)
    os.close(terminal)
    try:
        _read_until(controller, b">>> ")
        os.write(controller, b"/set parameter num_predict 5\n")
        _read_until(controller, b"Set parameter 'num_predict' to '5'")
        os.write(controller, b"/show info\n")
        assert b"capabilities" in _read_until(controller, b"capabilities")
        os.write(controller, b'"""Say hi\n')
        _read_until(controller, b"... ")
        os.write(controller, b'in two words"""\n')
        answer = _read_until(controller, b">>> ")
        assert len(answer.strip()) > len(b">>> ")
        os.write(controller, b"/bye\n")
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(controller)
        stop_daemon(_isolated_home)
