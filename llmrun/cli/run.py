"""`llmrun run` / `llmrun chat`: talk to a model, starting the daemon if none answers."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from llmrun.cli._common import connect, err, fail
from llmrun.client import APIError, Client, ClientError

if TYPE_CHECKING:
    from llmrun.cli.repl import Session


def _stream(client: Client, session: Session, messages: list[dict[str, Any]],
            hide_thinking: bool = False) -> str:
    """Print the answer as it streams (a thinking model's thought first, dimmed, as Ollama
    shows it), wrapped at word boundaries on a terminal; return the answer's text."""
    from llmrun.cli.wrap import WordWrap

    parts: list[str] = []
    final: dict[str, Any] = {}
    thinking = False
    start = 0  # the wrapper's line count where the answer began
    tty = sys.stdout.isatty()
    dim, plain = ("\x1b[2m", "\x1b[0m") if tty else ("", "")
    out = sys.stdout
    wrap = WordWrap(out.write, shutil.get_terminal_size().columns) \
        if tty and session.wordwrap else None
    write = wrap.feed if wrap is not None else out.write
    bar = _PromptBar() if sys.stderr.isatty() else None
    try:
        for obj in client.chat(session.model, messages, session.options, think=session.think,
                               progress=bar is not None, keep_alive=session.keep_alive,
                               format=session.format):
            if "prompt_progress" in obj:
                if bar is not None:
                    bar.update(obj["prompt_progress"])
                continue
            if bar is not None:
                bar.close()
            message = obj.get("message", {})
            thought = message.get("thinking")
            if thought and not hide_thinking:
                if not thinking:
                    out.write(dim)
                    write("Thinking...\n")
                    thinking = True
                write(thought)
            text = message.get("content", "")
            if text:
                if thinking:
                    write("\n...done thinking.")
                    if wrap is not None:
                        wrap.close()
                    out.write(f"{plain}\n\n")
                    if wrap is not None:
                        wrap.col = 0
                    thinking = False
                if not parts and wrap is not None:
                    start = wrap.lines
                parts.append(text)
                write(text)
            out.flush()
            if obj.get("done"):
                final = obj
    finally:
        if bar is not None:
            bar.close()
        if wrap is not None:
            wrap.close()
    out.write(f"{plain}\n" if thinking else "\n")
    out.flush()
    if wrap is not None and session.markdown and final and parts:
        _as_markdown("".join(parts), wrap.lines - start + 1)
    if session.verbose and final:
        _print_stats(final)
    return "".join(parts)


MARKDOWN = ("```", "**", "__", "# ", "\n- ", "\n* ", "\n1. ", "|---", "`")


def _as_markdown(text: str, lines: int) -> None:
    """Redraw a whole answer that uses Markdown as rich renders it (headings, lists, code),
    over the `lines` lines it was streamed on; an answer taller than the screen stays as it
    streamed (the lines above the screen cannot be rewritten)."""
    if not any(mark in f"\n{text}" for mark in MARKDOWN):
        return
    if lines >= shutil.get_terminal_size().lines - 1:
        return
    from rich.markdown import Markdown

    from llmrun.cli._common import console

    sys.stdout.write(f"\x1b[{lines}F\x1b[J")  # to the answer's first line; clear below
    sys.stdout.flush()
    console.print(Markdown(text))


class _PromptBar:
    """A bar on stderr while a long prompt is read (the daemon reports each step that read
    part of it); gone once the answer starts."""

    def __init__(self) -> None:
        self._progress: Any = None
        self._task: Any = None

    def update(self, p: dict[str, int]) -> None:
        if self._progress is None:
            from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn

            self._progress = Progress(TextColumn("[dim]reading the prompt"), BarColumn(),
                                      TaskProgressColumn(), TextColumn("[dim]{task.fields[n]}"),
                                      console=err, transient=True)
            self._progress.start()
            self._task = self._progress.add_task("prompt", total=p["total"], n="")
        self._progress.update(self._task, completed=p["processed"],
                              n=f"{p['processed']}/{p['total']} tokens")

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


def _print_stats(final: dict[str, Any]) -> None:
    def rate(count: int, ns: int) -> str:
        return f"{count / (ns / 1e9):.1f} tokens/s" if ns else "-"

    err.print(f"[dim]total duration:       {final.get('total_duration', 0) / 1e9:.3f}s")
    err.print(f"[dim]load duration:        {final.get('load_duration', 0) / 1e9:.3f}s")
    err.print(f"[dim]prompt eval count:    {final.get('prompt_eval_count', 0)} token(s)")
    err.print(f"[dim]prompt eval rate:     "
              f"{rate(final.get('prompt_eval_count', 0), final.get('prompt_eval_duration', 0))}")
    err.print(f"[dim]eval count:           {final.get('eval_count', 0)} token(s)")
    err.print(f"[dim]eval rate:            "
              f"{rate(final.get('eval_count', 0), final.get('eval_duration', 0))}")


def _not_found_hint(model: str) -> str:
    from llmrun.store import catalog, names

    try:
        in_catalog = catalog.lookup(names.parse(model)) is not None
    except ValueError:
        in_catalog = False
    if in_catalog:
        return f"model '{model}' is not in the store; get it with: llmrun pull {model}"
    return (f"model '{model}' not found; pull it (llmrun pull NAME) or import a GGUF file "
            f"(llmrun create {model} -f Modelfile)")


def _options(pairs: list[str]) -> dict[str, Any]:
    """`--option k=v` values, read as JSON where they are (numbers, true/false)."""
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            fail(f"--option: expected NAME=VALUE, got {pair!r}")
        try:
            parsed = json.loads(value)
        except ValueError:
            parsed = value
        if key.strip() == "stop":
            out.setdefault("stop", []).append(str(parsed))
        else:
            out[key.strip()] = parsed
    return out


def _format(value: str | None) -> Any:
    """`--format`: json, or a file holding a JSON schema."""
    if value is None or value == "json":
        return value
    try:
        return json.loads(Path(value).read_text())
    except (OSError, ValueError) as exc:
        fail(f"--format: 'json' or a file holding a JSON schema ({value}: {exc})")


def _pull_if_missing(client: Client, model: str) -> None:
    """Pull `model` first when the store lacks it and the catalog or the Hub may have it (as
    `ollama run` does); a name nothing can provide is left to the chat's clear error."""
    try:
        client.show(model)
        return
    except APIError as exc:
        if exc.status != 404:
            return
    from llmrun.store import catalog, names

    try:
        parsed = names.parse(model)
    except ValueError:
        return
    if catalog.lookup(parsed) is None and not model.startswith("hf.co/"):
        return
    err.print(f"[dim]pulling {model}...[/]")
    last = ""
    for event in client.pull(model):
        status = str(event.get("status", ""))
        if status != last and sys.stderr.isatty():
            err.print(f"[dim]{status}[/]")
        last = status


def register(app: typer.Typer) -> None:
    @app.command(name="run")
    def run(
        model: str = typer.Argument(..., help="Model name, e.g. smollm2"),
        prompt: list[str] = typer.Argument(None, help="Prompt (omit for an interactive chat)"),
        verbose: bool = typer.Option(False, "--verbose", help="Print timings after answers"),
        temperature: float = typer.Option(None, help="Sampling temperature"),
        seed: int = typer.Option(None, help="Random seed, for reproducible output"),
        num_ctx: int = typer.Option(None, "--num-ctx", help="Context tokens"),
        option: list[str] = typer.Option(None, "--option", "-o", metavar="NAME=VALUE",
                                         help="A model option (repeatable), e.g. top_k=20"),
        system: str = typer.Option(None, "--system", help="The system message"),
        format: str = typer.Option(None, "--format",
                                   help="Answer format: json, or a file with a JSON schema"),
        keepalive: str = typer.Option(None, "--keepalive",
                                      help="How long the model stays loaded (e.g. 5m, 0)"),
        nowordwrap: bool = typer.Option(False, "--nowordwrap",
                                        help="Do not wrap answers at word boundaries"),
        plain: bool = typer.Option(False, "--plain",
                                   help="Leave answers as streamed (no Markdown rendering)"),
        think: bool = typer.Option(None, "--think/--no-think",
                                   help="Let a thinking model think first (default: the "
                                        "model's own behaviour)"),
        hide_thinking: bool = typer.Option(False, "--hidethinking",
                                           help="Do not print a thinking model's thought"),
    ) -> None:
        """Run a model: answer PROMPT, or chat interactively (also reads piped stdin)."""
        from llmrun.cli.attach import user_turn
        from llmrun.cli.repl import Session, run_session

        options = {k: v for k, v in (("temperature", temperature), ("seed", seed),
                                     ("num_ctx", num_ctx)) if v is not None}
        options.update(_options(option or []))
        text = " ".join(prompt or [])
        if not sys.stdin.isatty():
            piped = sys.stdin.read()
            text = f"{text}\n\n{piped}".strip() if text else piped.strip()
        client = connect()
        session = Session(model, options, verbose, think, system=system,
                          format=_format(format), keep_alive=keepalive,
                          wordwrap=not nowordwrap, markdown=not plain)
        try:
            _pull_if_missing(client, model)
            if text:
                _stream(client, session, [*session.messages(),
                                          user_turn(client, session.model, text)],
                        hide_thinking)
            elif sys.stdin.isatty():
                run_session(client, session,
                            lambda s, msgs: _stream(client, s, msgs, hide_thinking))
            else:
                fail("no prompt: give one as an argument or on standard input")
        except APIError as exc:
            if exc.status == 404:
                fail(_not_found_hint(session.model))
            fail(str(exc))
        except ClientError as exc:
            fail(str(exc))
        except (ValueError, OSError) as exc:  # an image file named in the prompt
            fail(str(exc))
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            raise typer.Exit(130) from None

    app.command(name="chat", help="Alias of run.")(run)
