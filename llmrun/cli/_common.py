"""Shared bits of the command modules: consoles and a uniform way to fail."""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console

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
