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
        levels: str = typer.Option(None, help="Concurrency levels, comma-separated (default: "
                                              "1,2,4,8; with --embedding or --rerank 1,4)"),
        tokens: int = typer.Option(128, help="Tokens generated per request"),
        threads: int = typer.Option(os.cpu_count() or 1,
                                    help="Threads for the raw baselines (match the daemon's)"),
        gguf: Path = typer.Option(None, help="Model file for the baselines (default: the "
                                             "store's file for MODEL)"),
        baselines: bool = typer.Option(True, "--baselines/--no-baselines",
                                       help="Also measure raw llama-cpp-python, for ratios"),
        prefix: bool = typer.Option(True, "--prefix/--no-prefix",
                                    help="Also measure second-turn TTFT (prefix reuse)"),
        prompt_cache: int = typer.Option(0, metavar="TOKENS",
                                         help="Also measure a new session's TTFT, on a new "
                                              "runner, for a system prompt of about TOKENS "
                                              "against reading it cold (the prompt cache; "
                                              "the model needs twice that context)"),
        stall: int = typer.Option(0, "--stall", metavar="TOKENS",
                                  help="Also measure a stream's gaps between tokens beside a "
                                       "fresh prompt of about TOKENS (stall-free batching)"),
        draft: bool = typer.Option(False, "--draft", help="Also measure prompt-lookup "
                                                          "drafting on an edit task and on "
                                                          "free text, on and off (greedy)"),
        constrained: str = typer.Option("1,4", help="Levels that also run with a JSON schema "
                                                    "in `format`, as a ratio to the same load "
                                                    "without (empty: none)"),
        against: list[str] = typer.Option(None, "--against", metavar="URL",
                                          help="Another OpenAI-compatible server (llama-server, "
                                               "Ollama) to put under the same load, over "
                                               "/v1/chat/completions (repeatable, or a comma "
                                               "list)"),
        against_model: str = typer.Option(None, help="The model name sent to the --against "
                                                     "servers (default: MODEL)"),
        rounds: int = typer.Option(3, min=1, help="Turns at each level compared with another "
                                                  "server or with a schema (median kept)"),
        api: str = typer.Option(None, help="How llmrun is asked: chat (/api/chat) or openai "
                                           "(/v1/chat/completions; the default with --against, "
                                           "so both are measured the same way)"),
        embedding: bool = typer.Option(False, "--embedding",
                                       help="Measure embedding inputs/s over /v1/embeddings "
                                            "instead of generation (the --against servers too: "
                                            "llama-server started with --embedding)"),
        rerank: bool = typer.Option(False, "--rerank",
                                    help="Measure rerank documents/s over /v1/rerank instead "
                                         "of generation (MODEL must be a reranker; "
                                         "llama-server started with --rerank)"),
        inputs: int = typer.Option(64, min=1, help="--embedding: inputs (~60 tokens each) "
                                                   "per level"),
        batch: int = typer.Option(16, min=1, help="--embedding: inputs per request"),
        docs: int = typer.Option(32, min=1, help="--rerank: documents (~60 tokens each) per "
                                                 "request, one query, one request per client"),
    ) -> None:
        """Measure tokens/s, decode rate, time to first token and inter-token latency at each
        concurrency level, with ratios against raw llama-cpp-python on the same file, its
        decode-only loop the reference (docs/benchmarks.md). With --embedding or --rerank:
        embedding inputs/s or rerank documents/s instead, against a raw pooled-context loop
        (scripts/bench_retrieval.sh runs them against llama-server)."""
        from llmrun import bench as b
        from llmrun.store import StoreError

        levels = levels or ("1,4" if embedding or rerank else "1,2,4,8")
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
            others = b.against_servers(against or [], against_model or model)
        except ValueError as exc:
            fail(str(exc))
        if api not in (None, "chat", "openai"):
            fail(f"--api: chat or openai, not {api!r}")
        how: b.Api = "openai" if api == "openai" or (api is None and others) else "chat"
        try:
            path = gguf or b.store_path(model)
        except StoreError as exc:
            fail(str(exc))
        client = connect()
        kinds: list[b.Kind] = []
        if embedding:
            kinds.append("embedding")
        if rerank:
            kinds.append("rerank")
        err.print(f"[dim]measuring {' and '.join(kinds) or 'generation'} with {model} at "
                  + ", ".join([client.base_url, *(o.url for o in others)])
                  + " (the servers should be otherwise idle)...[/]")
        if kinds:
            servers = [b.Server("llmrun /v1", client.base_url, model, "openai"), *others]
            for i, kind in enumerate(kinds):
                work = b.Workload(kind, inputs=inputs, batch=batch, docs=docs)
                try:
                    table = b.run_retrieval(work, path, threads, counts, rounds, servers,
                                            baselines=baselines).table()
                except RuntimeError as exc:
                    fail(f"the benchmark stopped: {exc}")
                typer.echo(("\n" if i else "") + table)  # (markdown: a blank line between)
            return
        try:
            result = b.run(client.base_url, model, path, counts, tokens, threads,
                           baselines=baselines, prefix=prefix, constrained=with_schema,
                           rounds=rounds, api=how, against=others,
                           cache_tokens=prompt_cache, draft=draft, stall_tokens=stall)
        except RuntimeError as exc:
            fail(f"the benchmark stopped: {exc}")
        typer.echo(result.table())  # plain: a table to paste, never wrapped
