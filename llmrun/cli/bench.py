"""`llmrun bench`: throughput and latency of the daemon against raw llama-cpp-python."""

from __future__ import annotations

import os
from pathlib import Path

import typer

from llmrun.cli._common import connect, err, fail


def register(app: typer.Typer) -> None:
    @app.command()
    def bench(
        model: str = typer.Argument("smollm2", help="Model to measure"),
        levels: str = typer.Option("1,2,4,8", help="Concurrency levels, comma-separated"),
        tokens: int = typer.Option(128, help="Tokens generated per request"),
        threads: int = typer.Option(os.cpu_count() or 1,
                                    help="Threads for the raw baselines (match the daemon's)"),
        gguf: Path = typer.Option(None, help="Model file for the baselines (default: the "
                                             "store's file for MODEL)"),
        baselines: bool = typer.Option(True, "--baselines/--no-baselines",
                                       help="Also measure raw llama-cpp-python, for ratios"),
        prefix: bool = typer.Option(True, "--prefix/--no-prefix",
                                    help="Also measure second-turn TTFT (prefix reuse)"),
        constrained: str = typer.Option("1,4", help="Levels that also run with a JSON schema "
                                                    "in `format`, as a ratio to the same load "
                                                    "without (empty: none)"),
    ) -> None:
        """Measure tokens/s, time to first token and inter-token latency at each concurrency
        level, with ratios against raw llama-cpp-python on the same file (docs/benchmarks.md)."""
        from llmrun import bench as b
        from llmrun.store import StoreError

        try:
            counts = [int(x) for x in levels.split(",") if x.strip()]
        except ValueError:
            fail(f"--levels: expected numbers like 1,2,4,8, got {levels!r}")
        if not counts or min(counts) < 1:
            fail("--levels: give at least one level of 1 or more")
        try:
            with_schema = [int(x) for x in constrained.split(",") if x.strip()]
        except ValueError:
            fail(f"--constrained: expected numbers like 1,4, got {constrained!r}")
        try:
            path = gguf or b.store_path(model)
        except StoreError as exc:
            fail(str(exc))
        client = connect()
        err.print(f"[dim]measuring {model} at {client.base_url} (the daemon should be "
                  "otherwise idle)...[/]")
        result = b.run(client.base_url, model, path, counts, tokens, threads,
                       baselines=baselines, prefix=prefix, constrained=with_schema)
        typer.echo(result.table())  # plain: a table to paste, never wrapped
