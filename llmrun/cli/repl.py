"""The interactive chat of `llmrun run MODEL`, with Ollama's slash commands.

    >>> Hello                      a message
    >>> \"\"\"                        a message over several lines, until a line ending in \"\"\"
    >>> /set parameter temperature 0.2      /set system You are terse.
    >>> /set think | nothink | verbose | quiet | format json | noformat
    >>> /set history | nohistory | wordwrap | nowordwrap
    >>> /show info | parameters | system | template | modelfile | license
    >>> /save NAME   /load MODEL   /clear   /? (help)   /bye

`Session.handle` decides what a line means and changes the session's state; the loop in
`run_session` only reads lines (`LineReader`: readline's editing and a history file),
prints, and streams answers, so the commands are tested without a terminal.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from llmrun.cli._common import console
from llmrun.client import APIError, Client

BYE = ("/bye", "/exit", "/quit")
FENCE = '"""'

HELP = """Available commands:
  /set parameter NAME VALUE   set an option (temperature, num_ctx, seed, top_k, stop, ...)
  /set system TEXT            set the system message
  /set think | nothink        let a thinking model think, or not
  /set verbose | quiet        print timings after each answer, or not
  /set format json | noformat answer in JSON, or freely
  /set history | nohistory    keep what you type in the history file, or not
  /set wordwrap | nowordwrap  wrap answers at word boundaries, or not
  /set markdown | plain       render a finished answer's Markdown, or leave it as streamed
  /show info | parameters | system | template | modelfile | license
  /save NAME                  save this session as a new model
  /load MODEL                 chat with another model
  /clear                      forget the conversation
  /bye                        exit
  /?, /help                   this help
Start a message with \"\"\" to write it over several lines (end it with \"\"\").
Up and Down recall earlier lines; Ctrl+C stops an answer; Ctrl+D or /bye leaves."""

SHOW = ("info", "parameters", "system", "template", "modelfile", "license")


@dataclass
class Session:
    model: str
    options: dict[str, Any] = field(default_factory=dict)
    verbose: bool = False
    think: bool | None = None
    system: str | None = None
    history: list[dict[str, Any]] = field(default_factory=list)
    format: Any = None  # "json" or a JSON schema, as Ollama's `format`
    keep_alive: str | None = None
    wordwrap: bool = True
    markdown: bool = True  # a finished answer with Markdown is redrawn rendered (a terminal)
    save_history: bool = True  # what is typed goes to the history file
    _draft: list[str] | None = None  # lines of a \"\"\" message being written

    @property
    def writing(self) -> bool:
        return self._draft is not None

    def messages(self) -> list[dict[str, Any]]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return [*head, *self.history]

    def handle(self, line: str) -> tuple[str, str]:
        """What to do with one input line: ("send", text), ("say", text to print),
        ("show", what), ("load", model), ("continue", ""), ("bye", "")."""
        if self._draft is not None:
            if line.rstrip().endswith(FENCE):
                self._draft.append(line.rstrip()[: -len(FENCE)])
                text, self._draft = "\n".join(self._draft).strip(), None
                return ("send", text) if text else ("continue", "")
            self._draft.append(line)
            return "continue", ""
        cmd = line.strip()
        if cmd.startswith(FENCE):
            rest = cmd[len(FENCE):]
            if rest.endswith(FENCE) and rest:  # """one line"""
                return "send", rest[: -len(FENCE)].strip()
            self._draft = [rest] if rest else []
            return "continue", ""
        if not cmd:
            return "continue", ""
        if not cmd.startswith("/"):
            return "send", line
        word, _, arg = cmd.partition(" ")
        arg = arg.strip()
        if word in BYE:
            return "bye", ""
        if word in ("/?", "/help"):
            return "say", HELP
        if word == "/clear":
            self.history.clear()
            return "say", "Cleared the conversation."
        if word == "/set":
            return "say", self._set(arg)
        if word == "/show":
            if arg not in SHOW:
                return "say", f"Usage: /show {' | '.join(SHOW)}"
            return "show", arg
        if word == "/load":
            if not arg:
                return "say", "Usage: /load MODEL"
            return "load", arg
        if word == "/save":
            if not arg or " " in arg:
                return "say", "Usage: /save NAME"
            return "save", arg
        return "say", f"Unknown command {word!r}. Type /? for help."

    def _set(self, arg: str) -> str:
        what, _, rest = arg.partition(" ")
        rest = rest.strip()
        if what == "parameter":
            name, _, value = rest.partition(" ")
            if not name or not value.strip():
                return "Usage: /set parameter NAME VALUE"
            parsed = _value(value.strip())
            if name == "stop":  # several stop strings, as in a Modelfile
                self.options.setdefault("stop", []).append(str(parsed))
            else:
                self.options[name] = parsed
            return f"Set parameter '{name}' to '{value.strip()}'"
        if what == "system":
            self.system = rest or None
            return "Set system message." if rest else "Cleared the system message."
        if what == "format":
            if rest != "json":
                return "Usage: /set format json"
            self.format = "json"
            return "Set format to 'json' mode."
        flags = {"think": ("think", True), "nothink": ("think", False),
                 "verbose": ("verbose", True), "quiet": ("verbose", False),
                 "noformat": ("format", None), "history": ("save_history", True),
                 "nohistory": ("save_history", False), "wordwrap": ("wordwrap", True),
                 "nowordwrap": ("wordwrap", False), "markdown": ("markdown", True),
                 "plain": ("markdown", False)}
        if what in flags:
            attr, setting = flags[what]
            setattr(self, attr, setting)
            return f"Set '{what}' mode."
        return ("Usage: /set parameter NAME VALUE | system TEXT | think | nothink | verbose | "
                "quiet | format json | noformat | history | nohistory | wordwrap | nowordwrap | "
                "markdown | plain")

    def saved(self, name: str) -> dict[str, Any]:
        """The /api/create body of a model that is this session: its model, system prompt,
        parameters and messages (as Ollama's /save)."""
        body: dict[str, Any] = {"model": name, "from": self.model}
        if self.system:
            body["system"] = self.system
        if self.options:
            body["parameters"] = self.options
        if self.history:
            body["messages"] = self.history
        return body


def _value(text: str) -> Any:
    """A parameter value as JSON would read it (numbers, true/false), else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def show(client: Client, model: str, what: str) -> str:
    info = client.show(model)
    if what == "info":
        d = info.get("details", {})
        mi = info.get("model_info", {})
        arch = mi.get("general.architecture", d.get("family", ""))
        rows = [("architecture", arch), ("parameters", d.get("parameter_size", "")),
                ("context length", mi.get(f"{arch}.context_length", "")),
                ("quantization", d.get("quantization_level", "")),
                ("capabilities", ", ".join(info.get("capabilities", [])))]
        return "\n".join(f"  {k:<16}{v}" for k, v in rows)
    return str(info.get(what, "") or f"(no {what})")


class LineReader:
    """Lines from the terminal with readline's editing (arrows, Ctrl+A/E, ...) and a history
    that outlives the session, in `path` (None: this session only, as LLMRUN_NOHISTORY
    asks). `save` off (/set nohistory) keeps new lines out of the file."""

    LENGTH = 1000  # lines the history file keeps

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.save = True
        rl: ModuleType | None
        try:
            import readline as rl  # importing it gives input() line editing
        except ImportError:  # (a Python built without it: plain lines)
            rl = None
        self._rl: Any = rl
        if rl is None:
            return
        rl.clear_history()
        rl.set_history_length(self.LENGTH)
        if path is not None and path.exists():
            with contextlib.suppress(OSError):
                rl.read_history_file(str(path))

    def read(self, prompt: str) -> str:
        line = input(prompt)
        if self._rl is not None and self.path is not None and self.save and line.strip():
            with contextlib.suppress(OSError):  # a history that cannot be kept: not fatal
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self._rl.write_history_file(str(self.path))
                os.chmod(self.path, 0o600)  # what the user typed
        return line


class _PromptInterrupts:
    """Makes a Ctrl+C typed the moment a prompt appears take effect at once.

    CPython's readline draws the prompt, then waits for a key in select() and looks at
    signals only when a signal interrupts that select(). A SIGINT landing between the two
    only sets Python's flag, and select() then waits for the next key: the Ctrl+C seems
    ignored, and is raised later, on the next line typed. A busy machine widens the gap:
    measured during a compile on 2 cores, 1 of 258 Ctrl+Cs sent as the prompt appeared.

    Here the SIGINT handler counts the interrupts Python raised, the C-level handler writes
    each signal's number to a wakeup pipe, and a thread reading it interrupts the main
    thread with SIGUSR1 (whose handler does nothing) every 50 ms until the SIGINT has been
    raised: the first kick that lands inside select() makes readline raise it. (Two SIGINTs
    before Python runs its handler are raised once, so the kicks also stop after MAX_KICKS.)
    """

    KICK_SECONDS = 0.05
    MAX_KICKS = 100

    def __init__(self) -> None:
        self.raised = 0  # KeyboardInterrupts raised by the handler
        self._main = threading.main_thread().ident or 0
        self._done = threading.Event()

    def _on_sigint(self, _sig: int, _frame: object) -> None:
        self.raised += 1
        raise KeyboardInterrupt

    def _watch(self, read_end: int) -> None:
        while not self._done.is_set():
            before = self.raised  # (a SIGINT read next arrived after this)
            try:
                got = os.read(read_end, 64)
            except OSError:
                return
            if not got:  # the write end closed: the session is over
                return
            if bytes([signal.SIGINT]) not in got:
                continue
            for _ in range(self.MAX_KICKS):
                if self.raised != before or self._done.is_set():
                    break
                signal.pthread_kill(self._main, signal.SIGUSR1)
                self._done.wait(self.KICK_SECONDS)

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # (signal handlers belong to the main thread: a test's session)
            return
        read_end, write_end = os.pipe()
        os.set_blocking(write_end, False)
        old_int = signal.signal(signal.SIGINT, self._on_sigint)
        old_usr1 = signal.signal(signal.SIGUSR1, lambda _sig, _frame: None)
        old_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
        watcher = threading.Thread(target=self._watch, args=(read_end,), daemon=True,
                                   name="llmrun-ctrl-c")
        watcher.start()
        try:
            yield
        finally:
            self._done.set()
            signal.set_wakeup_fd(old_fd)
            os.close(write_end)
            watcher.join()  # (before SIGUSR1's default, which ends the process, is back)
            os.close(read_end)
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGUSR1, old_usr1)


def history_path() -> Path | None:
    from llmrun import config

    if config.no_history():
        return None
    return config.home() / "history"


def run_session(client: Client, session: Session,
                stream: Callable[[Session, list[dict[str, Any]]], str],
                reader: LineReader | None = None) -> None:
    """Read lines until /bye or end of input; `stream` prints an answer and returns it.
    Ctrl+C never ends the chat: on the prompt it says how to leave, during an answer it
    stops the answer (its request is cancelled), anywhere else it drops what was going on."""
    console.print(f"[dim]Chatting with {session.model}. Type /? for help, /bye to quit.[/]")
    client.load(session.model)  # before the first prompt, so the first answer starts promptly
    reader = reader or LineReader(history_path())
    with _PromptInterrupts().installed():
        _chat(client, session, stream, reader)


def _chat(client: Client, session: Session,
          stream: Callable[[Session, list[dict[str, Any]]], str], reader: LineReader) -> None:
    while True:
        asked = len(session.history)
        try:
            if not _turn(client, session, stream, reader):
                return
        except KeyboardInterrupt:
            del session.history[asked:]  # a question without its whole answer is dropped
            console.print()
        except EOFError:
            console.print()
            return


def _turn(client: Client, session: Session,
          stream: Callable[[Session, list[dict[str, Any]]], str], reader: LineReader) -> bool:
    """Read one line and do what it says; False when the chat is over."""
    reader.save = session.save_history
    try:
        line = reader.read("... " if session.writing else ">>> ")
    except KeyboardInterrupt:  # Ctrl+C on the prompt: the line is dropped, not the chat
        console.print("\nUse Ctrl + d or /bye to exit.", markup=False)
        return True
    action, arg = session.handle(line)
    if action == "bye":
        return False
    if action == "say":
        console.print(arg, markup=False)
    elif action == "show":
        try:
            console.print(show(client, session.model, arg), markup=False)
        except APIError as exc:
            console.print(f"[red]{exc}[/]")
    elif action == "save":
        try:
            for _ in client.create(session.saved(arg)):
                pass
        except APIError as exc:
            console.print(f"[red]{exc}[/]")
            return True
        console.print(f"Created new model '{arg}'", markup=False)
    elif action == "load":
        try:
            client.load(arg)
        except APIError as exc:
            console.print(f"[red]{exc}[/]")
            return True
        session.model = arg
        session.history.clear()
        console.print(f"[dim]Loaded {arg}.[/]")
    elif action == "send":
        from llmrun.cli.attach import user_turn

        try:
            session.history.append(user_turn(client, session.model, arg))
        except (ValueError, OSError) as exc:  # an image file too large, or unreadable
            console.print(str(exc), style="red", markup=False)
            return True
        try:
            answer = stream(session, session.messages())
        except APIError as exc:
            console.print(f"[red]{exc}[/]")
            session.history.pop()
            return True
        session.history.append({"role": "assistant", "content": answer})
    return True
