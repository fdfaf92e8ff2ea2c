"""The interactive chat: its slash commands on their own, then a real session in a terminal
(a pty) against the real daemon."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

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
    from tests.integration.test_cli import stop_daemon

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


def test_new_commands() -> None:
    s = Session("smollm2")
    assert s.handle("/save") == ("say", "Usage: /save NAME")
    assert s.handle("/save my chat")[1] == "Usage: /save NAME"
    assert s.handle("/save mine") == ("save", "mine")
    assert s.handle("/show license") == ("show", "license")
    s.handle("/set format json")
    assert s.format == "json"
    s.handle("/set noformat")
    assert s.format is None
    assert s.handle("/set format yaml")[1] == "Usage: /set format json"
    s.handle("/set nohistory")
    assert not s.save_history
    s.handle("/set nowordwrap")
    assert not s.wordwrap
    s.handle("/set system Be terse.")
    s.handle("/set parameter temperature 0")
    s.history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    assert s.saved("mine") == {"model": "mine", "from": "smollm2", "system": "Be terse.",
                               "parameters": {"temperature": 0}, "messages": s.history}


def test_word_wrap_breaks_between_words_only() -> None:
    from llmrun.cli.wrap import WordWrap

    text = ("The lighthouse keeper counted the ships that passed in the night, "
            "implications unknown, and wrote supercalifragilisticexpialidocious "
            "words\nin his log. " * 3)
    for width in (12, 20, 41):
        out: list[str] = []
        w = WordWrap(out.append, width)
        for i in range(0, len(text), 3):  # streamed in small pieces
            w.feed(text[i:i + 3])
        w.close()
        shown = "".join(out)
        assert all(len(line) <= width - 1 for line in shown.split("\n"))
        assert "".join(shown.split()) == "".join(text.split())  # nothing lost or added
        # every word that fits a line is whole; only longer ones were cut
        fits = [word for word in text.split() if len(word) < width - 1]
        assert set(fits) <= set(shown.split())
        if width == 41:
            assert " ".join(shown.split()) == " ".join(text.split())


def test_a_finished_markdown_answer_is_redrawn_rendered(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    import io

    from rich.console import Console

    from llmrun.cli import _common, run

    screen = io.StringIO()
    monkeypatch.setattr(sys, "stdout", screen)
    monkeypatch.setattr(_common, "console", Console(file=screen, force_terminal=True,
                                                    width=40))
    run._as_markdown("Plain words only.", 1)
    assert screen.getvalue() == ""  # no Markdown in it: left as streamed
    run._as_markdown("Fruits:\n- apple\n- **pear**", 3)
    shown = screen.getvalue()
    assert shown.startswith("\x1b[3F\x1b[J")  # back over the 3 streamed lines, cleared
    assert "•" in shown and "pear" in shown and "**" not in shown
    screen.truncate(0)
    screen.seek(0)
    run._as_markdown("- tall\n" * 500, 501)  # taller than the screen: left alone
    assert screen.getvalue() == ""


# -- a real terminal: line editing, history, Ctrl+C, /save, wrapping, pipes ------------------


def _terminal(env: dict[str, str], *args: str) -> tuple[int, subprocess.Popen[bytes]]:
    """`llmrun ARGS` in a new session whose controlling terminal is a 40-column pty, so that
    Ctrl+C typed there is SIGINT to it, as in a real terminal."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 40, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "llmrun", *args], stdin=terminal,
                            stdout=terminal, stderr=terminal, env=env, start_new_session=True,
                            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))
    os.close(terminal)
    return controller, proc


UP, LEFT, RIGHT = b"\x1b[A", b"\x1b[D", b"\x1b[C"


def _command(controller: int, line: bytes) -> bytes:
    """Type `line` at the prompt and read to the next prompt (typing before a prompt is up
    would interleave the terminal's echo with it)."""
    os.write(controller, line + b"\n")
    out = _read_until(controller, line + b"\r\n")
    if b">>> " not in out.split(line + b"\r\n", 1)[1]:  # (it may have come in the same read)
        out += _read_until(controller, b">>> ")
    return out


def test_editing_history_interrupt_save_wrap_and_pipes(_isolated_home: Path,
                                                       smollm2_path: Path) -> None:
    from tests.conftest import make_home
    from tests.integration.test_cli import llmrun, stop_daemon

    make_home(_isolated_home, smollm2_path)
    env = {**os.environ, "LLMRUN_CONTEXT_LENGTH": "1024", "COLUMNS": "40", "TERM": "xterm"}
    try:
        controller, proc = _terminal(env, "run", "smollm2")
        try:
            _read_until(controller, b">>> ")
            assert b"Set parameter" in _command(controller, b"/set parameter num_predict 6")
            _command(controller, b"Say hi to Bob")
            # Left and Right move the cursor: "/b", "e", Left, "y", Right, "" is "/bye",
            # which ends the chat (the arrows as text would make an unknown message)
            os.write(controller, b"/be" + LEFT + b"y" + RIGHT + b"\n")
            assert proc.wait(60) == 0
        finally:
            os.close(controller)
        assert "Say hi to Bob" in (_isolated_home / "history").read_text()

        controller, proc = _terminal(env, "run", "smollm2")
        try:
            _read_until(controller, b">>> ")
            assert b"Set parameter" in _command(controller, b"/set parameter num_predict 6")
            # Up recalls the lines of the last session (then this one's): "/bye", then
            # the message before it... and this session's own /set line first
            os.write(controller, UP + UP + UP)
            _read_until(controller, b"Say hi to Bob")
            os.write(controller, b"\n")
            _read_until(controller, b">>> ")
            # Ctrl+C mid-answer stops it and keeps the chat; the next question is answered
            assert b"Set parameter" in _command(controller, b"/set parameter num_predict 3000")
            os.write(controller, b"Tell me a very long story about a dragon.\n")
            _read_until(controller, b"dragon.\r\n")
            _read_until(controller, b" ", timeout=60)  # the answer has started
            os.write(controller, b"\x03")
            _read_until(controller, b">>> ", timeout=60)
            # on the prompt: a hint, not an exit, however soon after the prompt it comes
            # (CPython's readline alone misses one landing as it draws the prompt)
            for _ in range(200):
                os.write(controller, b"\x03")
                _read_until(controller, b"/bye to exit.\r\n>>> ")
            assert b"Set parameter" in _command(controller, b"/set parameter num_predict 6")
            after = _command(controller, b"What is 2+2?")
            assert len(after.split(b"2+2?", 1)[-1].strip()) > len(b">>> ")
            assert b"Created new model 'bobchat'" in _command(controller, b"/save bobchat")
            os.write(controller, b"/bye\n")
            assert proc.wait(60) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
            os.close(controller)
        assert "bobchat" in llmrun("list").stdout
        modelfile = llmrun("show", "bobchat", "--modelfile").stdout
        assert "MESSAGE user" in modelfile and "What is 2+2?" in modelfile

        # wrapped on a 40-column terminal, only between words; piped, the text alone
        question = ["Describe the sea in a few sentences.", "-o", "num_predict=60",
                    "-o", "temperature=0", "--system", "You write long sentences.", "--plain"]
        piped = llmrun("run", "smollm2", *question)
        assert piped.returncode == 0 and "\x1b" not in piped.stdout and piped.stdout.strip()
        controller, proc = _terminal(env, "run", "smollm2", *question)
        try:
            shown = _read_until(controller, b"\n", timeout=120)
            assert proc.wait(120) == 0
            while True:  # the rest, to the end of the output
                ready, _, _ = select.select([controller], [], [], 1)
                if not ready:
                    break
                try:
                    chunk = os.read(controller, 4096)
                except OSError:
                    break
                if not chunk:
                    break
                shown += chunk
        finally:
            os.close(controller)
        text = shown.decode().replace("\r\n", "\n")
        assert all(len(line) <= 40 for line in text.split("\n")), text
        assert " ".join(text.split()) == " ".join(piped.stdout.split())
    finally:
        stop_daemon(_isolated_home)


def test_run_pulls_a_model_the_store_lacks(_isolated_home: Path, smollm2_path: Path) -> None:
    from tests.fakes.hubserver import HubServer
    from tests.integration.test_cli import llmrun, stop_daemon

    with HubServer() as server:
        server.add_file("test/SmolLM2-GGUF", "SmolLM2-135M-Instruct-Q4_K_M.gguf", smollm2_path)
        env = {"HF_ENDPOINT": server.url, "HF_HUB_OFFLINE": "0"}
        try:
            # piped, as `echo hi | llmrun run ...`: asks nothing, prints the answer alone
            r = llmrun("run", "hf.co/test/SmolLM2-GGUF", "-o", "num_predict=4", stdin="hi",
                       env=env)
            assert r.returncode == 0, r.stderr
            assert r.stdout.strip() and "\x1b" not in r.stdout
            assert "hf.co/test/SmolLM2-GGUF" in llmrun("list").stdout
            r = llmrun("run", "hf.co/test/missing-GGUF", "hi", env=env)
            assert r.returncode != 0 and "missing-GGUF" in r.stderr
        finally:
            stop_daemon(_isolated_home)


def test_history_and_cache_settings_come_from_the_settings_table(
        _isolated_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llmrun import config
    from llmrun.cli.repl import history_path

    assert history_path() == _isolated_home / "history"
    monkeypatch.setenv("LLMRUN_NOHISTORY", "yes")
    assert history_path() is None
    monkeypatch.delenv("LLMRUN_NOHISTORY")
    # like every setting, also from config.yaml
    (_isolated_home / "config.yaml").write_text(
        f"LLMRUN_NOHISTORY: 1\nLLMRUN_CACHE: {_isolated_home / 'cache'}\n")
    config._file_settings.cache_clear()  # (read once per process, as a daemon does)
    assert history_path() is None and config.cache_dir() == _isolated_home / "cache"
    names = {s.name for s in config.SETTINGS}
    assert {"LLMRUN_NOHISTORY", "LLMRUN_CACHE"} <= names
