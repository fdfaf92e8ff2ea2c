"""Shared bits of the command modules: consoles and a uniform way to fail.

Nothing heavy is imported at module level, here or in the command modules: `llmrun --help`,
`list` and `ps` should each start in under 0.25 s on an idle 2-core machine (commands typed
to look something up should answer at once; scripts/startup_time.py measures them), and
rich's console, httpx and the store's modules each cost a good part of that, so they load
inside the commands that use them (tests/unit/cli/test_startup.py checks it)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NoReturn, cast

import typer

from llmrun.client import Client, ClientError, DaemonStartError

if TYPE_CHECKING:
    from rich.console import Console


class _LazyConsole:
    """A rich Console built on first use: importing rich.console costs tens of ms, which commands
    that print nothing through it (or exit early) should not pay."""

    def __init__(self, stderr: bool) -> None:
        self._stderr = stderr
        self._console: Console | None = None

    def get(self) -> Console:
        if self._console is None:
            from rich.console import Console

            self._console = Console(stderr=self._stderr, highlight=False)
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self.get(), name)


console = cast("Console", _LazyConsole(stderr=False))
err = cast("Console", _LazyConsole(stderr=True))


def rich_console(c: Console) -> Console:
    """The Console itself behind `console` or `err`, for rich objects that take one."""
    return c.get() if isinstance(c, _LazyConsole) else c


def fail(message: str, code: int = 1) -> NoReturn:
    err.print(f"[bold red]Error:[/] {message}", markup=True)
    raise typer.Exit(code)


def print_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> None:
    """Columns padded to their widest cell, as Ollama's `list` and `ps` print them: plain
    text, because rich's table would double these commands' start-up time."""
    cells = [header, *rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    for row in cells:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


def human_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def connect() -> Client:
    """A client for the daemon, started in the background if none answers."""
    client = Client()
    try:
        if client.ensure_running():
            err.print(f"[dim]started llmrun daemon on {client.base_url}[/]")
    except DaemonStartError as exc:
        err.print(f"[bold red]Error:[/] {exc}")
        if exc.log_tail:
            err.print("[dim]last lines of the log:[/]")
            err.print(exc.log_tail, markup=False)
        raise typer.Exit(1) from None
    except ClientError as exc:
        fail(str(exc))
    return client
