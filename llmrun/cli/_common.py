"""Shared bits of the command modules: consoles and a uniform way to fail."""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console

from llmrun.client import Client, ClientError, DaemonStartError

console = Console(highlight=False)
err = Console(stderr=True, highlight=False)


def fail(message: str, code: int = 1) -> NoReturn:
    err.print(f"[bold red]Error:[/] {message}", markup=True)
    raise typer.Exit(code)


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
