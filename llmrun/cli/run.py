"""`llmrun run` / `llmrun chat`: talk to a model, starting the daemon if none answers."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import typer

from llmrun.cli._common import connect, err, fail
from llmrun.client import APIError, Client, ClientError

if TYPE_CHECKING:
    from llmrun.cli.repl import Session


def _stream(client: Client, session: Session, messages: list[dict[str, Any]],
            hide_thinking: bool = False) -> str:
    """Print the answer as it streams (a thinking model's thought first, dimmed, as Ollama
    shows it); return the answer's text."""
    parts: list[str] = []
    final: dict[str, Any] = {}
    thinking = False
    dim, plain = ("\x1b[2m", "\x1b[0m") if sys.stdout.isatty() else ("", "")
    out = sys.stdout
    bar = _PromptBar() if sys.stderr.isatty() else None
    try:
        for obj in client.chat(session.model, messages, session.options, think=session.think,
                               progress=bar is not None):
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
                    out.write(f"{dim}Thinking...\n")
                    thinking = True
                out.write(thought)
            text = message.get("content", "")
            if text:
                if thinking:
                    out.write(f"\n...done thinking.{plain}\n\n")
                    thinking = False
                parts.append(text)
                out.write(text)
            out.flush()
            if obj.get("done"):
                final = obj
    finally:
        if bar is not None:
            bar.close()
    out.write(f"{plain}\n" if thinking else "\n")
    out.flush()
    if session.verbose and final:
        _print_stats(final)
    return "".join(parts)


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


def register(app: typer.Typer) -> None:
    @app.command(name="run")
    def run(
        model: str = typer.Argument(..., help="Model name, e.g. smollm2"),
        prompt: list[str] = typer.Argument(None, help="Prompt (omit for an interactive chat)"),
        verbose: bool = typer.Option(False, "--verbose", help="Print timings after answers"),
        temperature: float = typer.Option(None, help="Sampling temperature"),
        seed: int = typer.Option(None, help="Random seed, for reproducible output"),
        num_ctx: int = typer.Option(None, "--num-ctx", help="Context tokens"),
        think: bool = typer.Option(None, "--think/--no-think",
                                   help="Let a thinking model think first (default: the "
                                        "model's own behaviour)"),
        hide_thinking: bool = typer.Option(False, "--hidethinking",
                                           help="Do not print a thinking model's thought"),
    ) -> None:
        """Run a model: answer PROMPT, or chat interactively (also reads piped stdin)."""
        from llmrun.cli.repl import Session, run_session

        options = {k: v for k, v in (("temperature", temperature), ("seed", seed),
                                     ("num_ctx", num_ctx)) if v is not None}
        text = " ".join(prompt or [])
        if not sys.stdin.isatty():
            piped = sys.stdin.read()
            text = f"{text}\n\n{piped}".strip() if text else piped.strip()
        client = connect()
        session = Session(model, options, verbose, think)
        try:
            if text:
                _stream(client, session, [{"role": "user", "content": text}], hide_thinking)
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
        except KeyboardInterrupt:
            sys.stdout.write("\n")
            raise typer.Exit(130) from None

    app.command(name="chat", help="Alias of run.")(run)
