"""One benchmark run: the load at each level and its turns (llmrun, the `--against` servers
and the raw decode loop, alternating), then the scenarios and the raw-1 baseline; and
`scripts/bench.py`'s command line."""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

from llmrun import config
from llmrun.bench.baselines import raw_batched, raw_high_level
from llmrun.bench.load import SCHEMA, level
from llmrun.bench.report import BenchResult, summary
from llmrun.bench.scenarios import drafting, prefix_reuse, prompt_cache, stall
from llmrun.bench.servers import Api, Server, against_servers, turn_order

T = TypeVar("T")
# the command line's description (the package's docstring's first line)
DESCRIPTION = ("Throughput and latency of a running llmrun daemon, against raw "
               "llama-cpp-python, in one run.")


def _run_async(coro: Coroutine[Any, Any, T]) -> T:
    """Run the load generator's coroutine on uvloop's event loop where there is one (a
    dependency, uvicorn's): the client runs on the machine it measures, and asyncio's own
    loop cost it ~30 us more CPU per streamed token (~170 against ~145 us), taken from the
    servers' decode threads as the rest of its work is."""
    try:
        import uvloop
    except ImportError:  # (Windows)
        return asyncio.run(coro)
    return uvloop.run(coro)


def run(url: str, model: str, gguf: Path, levels: list[int], tokens: int, threads: int,
        baselines: bool = True, prefix: bool = True,
        constrained: tuple[int, ...] | list[int] = (1, 4), rounds: int = 3,
        api: Api = "chat", against: list[Server] | tuple[Server, ...] = (),
        cache_tokens: int = 0, draft: bool = False, stall_tokens: int = 0) -> BenchResult:
    """Measure the daemon at `url` serving `model` (over `api`), and the `against` servers
    under the same load, and (with the servers idle, in each turn) the raw loops on `gguf`. At each
    level also in `constrained`, the load runs `rounds` times without and with SCHEMA,
    alternating, and each side keeps its median run: a ratio of two single runs on a shared
    machine would measure its neighbours. With `against` servers every level runs `rounds`
    turns, the servers in alternating order, and each keeps its median (`summary`)."""
    _run_async(level(url, model, 1, 8, api=api))  # load the model, warm caches
    for other in against:
        _run_async(level(other.url, other.model, 1, 8, api=other.api))
    if any(n in constrained for n in levels):
        _run_async(level(url, model, 1, 8, fmt=SCHEMA))  # the tokenizer's view, once
    result = BenchResult(model, gguf, tokens, threads, {},
                         label=f"llmrun {'/v1' if api == 'openai' else '/api/chat'}",
                         against={o.label: {} for o in against})
    for n in levels:
        # a ratio of two single runs on a shared machine would measure its neighbours
        turns = max(1, rounds) if n in constrained or against else 1
        plain: list[dict[str, float]] = []
        schema: list[dict[str, float]] = []
        others: dict[str, list[dict[str, float]]] = {o.label: [] for o in against}
        raws: list[tuple[float, float]] = []
        for turn in range(turns):
            this_turn = []
            for other in turn_order(turn, [None, *against]):
                if other is None:
                    plain.append(_run_async(level(url, model, n, tokens, api=api)))
                    this_turn.append(plain[-1])
                else:
                    others[other.label].append(
                        _run_async(level(other.url, other.model, n, tokens, api=other.api)))
                    this_turn.append(others[other.label][-1])
            if n in constrained:
                schema.append(_run_async(level(url, model, n, tokens, fmt=SCHEMA)))
            if baselines:  # in the same turn: the machine's speed drifts between minutes
                raws.append(raw_batched(gguf, n, tokens, threads))
                for r in this_turn:
                    r["decode_ratio"] = r["decode_tok_s"] / raws[-1][1]
        if raws:
            result.rawn[n] = statistics.median(r[0] for r in raws)
            result.raw_decode[n] = statistics.median(r[1] for r in raws)
        result.served[n] = summary(plain)
        if schema:
            result.constrained[n] = summary(schema)
        for label, runs in others.items():
            result.against[label][n] = summary(runs)
            # the direct comparison: turn by turn, the two servers a minute apart at most
            result.against[label][n]["llmrun_over"] = statistics.median(
                a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(plain, runs, strict=True))
    if prefix:
        result.prefix = _run_async(prefix_reuse(url, model, busy=3))
    if cache_tokens > 0:
        result.cache = _run_async(prompt_cache(url, model, cache_tokens))
    if draft:
        result.draft = drafting(url, model, max(tokens, 128), max(rounds, 3))
    if stall_tokens > 0:  # (each server in turn: the scenario needs the machine to itself)
        result.stall = _run_async(stall(url, model, stall_tokens))
        for other in against:
            result.stall_against[other.label] = _run_async(
                stall(other.url, other.model, stall_tokens))
    if baselines:
        result.raw1 = raw_high_level(gguf, tokens, threads)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=DESCRIPTION)
    ap.add_argument("--url", default=config.base_url(),
                    help="the daemon measured (default: LLMRUN_HOST's)")
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--gguf", type=Path, help="model file for the raw baselines "
                    "(default: the store's blob for --model)")
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--constrained", default="1,4",
                    help="levels that also run with a JSON schema (empty: none)")
    ap.add_argument("--against", action="append", default=[],
                    help="another OpenAI-compatible server under the same load (repeatable, "
                         "or a comma list)")
    ap.add_argument("--against-model", help="the model name sent to --against servers "
                    "(default: --model)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="turns at each level compared with another server or with a schema")
    ap.add_argument("--api", choices=["chat", "openai"],
                    help="how llmrun is asked (default: openai with --against, else chat)")
    args = ap.parse_args()
    gguf = args.gguf or store_path(args.model)
    levels = [int(x) for x in args.levels.split(",")]
    constrained = [int(x) for x in args.constrained.split(",") if x.strip()]
    against = against_servers(args.against, args.against_model or args.model)
    api: Api = args.api or ("openai" if against else "chat")
    print(run(args.url, args.model, gguf, levels, args.tokens, args.threads,
              constrained=constrained, rounds=args.rounds, api=api, against=against).table())


def store_path(model: str) -> Path:
    from llmrun.store import Store

    store = Store()
    return store.model_path(store.get(model)[1])
