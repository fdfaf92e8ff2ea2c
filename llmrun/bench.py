"""Throughput and latency of a running llmrun daemon, against raw llama-cpp-python, in one run.

    llmrun bench smollm2 [--gguf PATH] [--levels 1,2,4,8] [--tokens 128]
    python scripts/bench.py --model smollm2 ...        (the same, against --url)

For each concurrency level it sends that many streaming /api/chat requests at once (fixed
prompts, greedy, fixed length) and reports aggregate generated tokens/s, time to first token
(p50/p95) and inter-token latency. In the same run, on the same model file and thread count,
it measures two baselines with the daemon idle:

  raw-1    llama-cpp-python's high-level `Llama` streaming one completion (what its own server
           does per request; it serves one request at a time)
  raw-N    a plain low-level loop decoding N sequences in one llama_decode per step (the
           ceiling for batching on this machine, with no HTTP, IPC or scheduling)

and prints ratios. The constrained run (`--constrained 1,4`) sends the same requests with a JSON
schema in `format` (SCHEMA: records with bounded integers, a pattern and a format, longer than
the token budget, so every request decodes its full length under the constraint), alternating
with the unconstrained ones at the same level (median of 3 each), and reports their ratio. It
also measures prefix reuse: TTFT of a second chat turn after a ~2,000-token first turn, while
the other slots are busy. Numbers are noisy on small machines: compare ratios, not absolute
values. Paste the printed table into docs/benchmarks.md.

The raw-1 baseline calls llama-cpp-python's high-level `Llama` directly: it is the thing being
compared against, not a use of llama.cpp by llmrun (that goes through engine/llama.py).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

PROMPTS = [
    "Write a long story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in detail how a steam engine works, step by step.",
    "Describe the history of the printing press and its effects on Europe.",
    "Write a detailed guide to growing tomatoes in a small garden.",
    "Tell a long fairy tale about a fox, a crow and a clever rabbit.",
    "Explain how airplanes fly, covering lift, thrust, drag and weight.",
    "Describe a journey through the Amazon rainforest in vivid detail.",
    "Write an essay about the importance of sleep for memory and health.",
]

# The constrained run's `format`: an array of records that cannot close before 100 of them,
# so every request decodes its whole budget inside the grammar, through keys, numbers with
# bounds, a pattern, a format and enum strings (the mix of lexemes real schemas have).
SCHEMA: dict[str, Any] = {
    "type": "array", "minItems": 100, "items": {
        "type": "object", "additionalProperties": False,
        "required": ["name", "age", "email", "role", "score", "code"],
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "format": "email", "maxLength": 40},
            "role": {"enum": ["admin", "editor", "viewer"]},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{4}$"}}}}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


async def one_request(client: httpx.AsyncClient, model: str, prompt: str,
                      tokens: int, messages: list[dict[str, str]] | None = None,
                      fmt: dict[str, Any] | None = None) -> dict[str, float]:
    body: dict[str, Any] = {
        "model": model, "stream": True,
        "messages": messages or [{"role": "user", "content": prompt}],
        "options": {"temperature": 0, "num_predict": tokens, "repeat_penalty": 1.0}}
    if fmt is not None:
        body["format"] = fmt
    t0 = time.perf_counter()
    first = None
    stamps: list[float] = []
    final: dict[str, object] = {}
    text = []
    async with client.stream("POST", "/api/chat", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line:
                continue
            obj = json.loads(line)
            if "error" in obj:
                raise RuntimeError(obj["error"])
            now = time.perf_counter()
            if obj.get("done"):
                final = obj
                break
            if obj["message"]["content"]:
                text.append(obj["message"]["content"])
                if first is None:
                    first = now - t0
                stamps.append(now)
    itl = [b - a for a, b in itertools.pairwise(stamps)]
    return {"ttft": first or float("nan"), "tokens": float(final.get("eval_count", 0)),
            "itl": statistics.mean(itl) if itl else float("nan"),
            "elapsed": time.perf_counter() - t0, "text": "".join(text)}  # type: ignore[dict-item]


_runs = iter(range(1, 1 << 30))


async def level(url: str, model: str, n: int, tokens: int,
                fmt: dict[str, Any] | None = None) -> dict[str, float]:
    # a fresh tag per request, so no prompt is served from the prefix cache of an earlier run
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(
            one_request(client, model, f"(request {next(_runs)}) {PROMPTS[i % len(PROMPTS)]}",
                        tokens, fmt=fmt) for i in range(n)))
        wall = time.perf_counter() - t0
    if fmt is not None:
        for r in results:  # a server that ignored `format` would make the ratio meaningless
            if not str(r["text"]).startswith("["):
                raise RuntimeError(f"the constrained run's answer is not the schema's JSON: "
                                   f"{str(r['text'])[:80]!r}")
    total = sum(r["tokens"] for r in results)
    return {"tok_s": total / wall, "ttft_p50": pct([r["ttft"] for r in results], 0.5),
            "ttft_p95": pct([r["ttft"] for r in results], 0.95),
            "itl_ms": 1000 * statistics.mean(r["itl"] for r in results)}


async def prefix_reuse(url: str, model: str, busy: int) -> tuple[float, float]:
    """TTFT of turn 1 (~2,000 tokens of history) and of turn 2, with `busy` others decoding."""
    history = " ".join(f"Fact {i}: the number {i} is written {i * 7} in another base."
                       for i in range(150))
    turn1 = [{"role": "user", "content": history + "\nSummarise the facts briefly."}]
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        others = [asyncio.create_task(one_request(client, model, PROMPTS[i], 256))
                  for i in range(busy)]
        first = await one_request(client, model, "", 32, turn1)
        turn2 = [*turn1, {"role": "assistant", "content": str(first["text"])},
                 {"role": "user", "content": "Now list the first three."}]
        second = await one_request(client, model, "", 32, turn2)
        await asyncio.gather(*others)
    return first["ttft"], second["ttft"]


def raw_high_level(gguf: Path, tokens: int, threads: int) -> float:
    from llama_cpp import Llama

    from llmrun.chat import templates

    llm = Llama(model_path=str(gguf), n_ctx=2048, n_threads=threads, flash_attn=True,
                verbose=False)
    # the same rendered prompt the engine sees (some GGUFs carry no chat template)
    tpl = llm.metadata.get("tokenizer.chat_template") or templates.FALLBACK_TEMPLATE
    prompt = templates.render(tpl, [{"role": "user", "content": PROMPTS[0]}])
    t0 = time.perf_counter()
    n = 0
    for chunk in llm.create_completion(prompt, max_tokens=tokens, temperature=0.0,
                                       repeat_penalty=1.0, stream=True):
        n += 1 if chunk["choices"][0]["text"] else 0
    wall = time.perf_counter() - t0
    llm.close()
    return n / wall


def raw_batched(gguf: Path, n_seq: int, tokens: int, threads: int) -> float:
    """A plain loop: prefill N prompts, then N tokens per llama_decode, greedy."""
    from llmrun.chat import templates
    from llmrun.engine.llama import Batch, Context, Model, Sampler

    model = Model(gguf)
    ctx = Context(model, n_ctx_seq=1024, n_seq=n_seq, n_batch=512, n_threads=threads)
    tpl = model.chat_template() or templates.FALLBACK_TEMPLATE
    prompts = [model.tokenize(templates.render(tpl, [{"role": "user", "content": p}]),
                              add_special=False) for p in PROMPTS[:n_seq]]
    samplers = [Sampler(model, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0,
                        repeat_last_n=0, repeat_penalty=1.0, presence_penalty=0.0,
                        frequency_penalty=0.0, seed=0) for _ in range(n_seq)]
    batch = Batch(512)
    t0 = time.perf_counter()
    nxt, pos = [], []
    for s, p in enumerate(prompts):
        batch.clear()
        for i, t in enumerate(p):
            idx = batch.add(t, i, s, i == len(p) - 1)
        ctx.decode(batch)
        nxt.append(ctx.sample(samplers[s], idx))
        pos.append(len(p))
    generated = 0
    for _ in range(tokens):
        batch.clear()
        rows = [batch.add(nxt[s], pos[s], s, True) for s in range(n_seq)]
        ctx.decode(batch)
        for s in range(n_seq):
            nxt[s] = ctx.sample(samplers[s], rows[s])
            pos[s] += 1
        generated += n_seq
    wall = time.perf_counter() - t0
    for sm in samplers:
        sm.close()
    batch.close()
    ctx.close()
    model.close()
    return generated / wall


@dataclass
class BenchResult:
    model: str
    gguf: Path
    tokens: int
    threads: int
    served: dict[int, dict[str, float]]
    raw1: float | None = None  # None: baselines not measured
    rawn: dict[int, float] = field(default_factory=dict)
    prefix: tuple[float, float] | None = None  # TTFT of turn 1 and turn 2
    constrained: dict[int, dict[str, float]] = field(default_factory=dict)  # with SCHEMA

    def table(self) -> str:
        """The markdown table (and lines) that docs/benchmarks.md keeps."""
        lines = [f"model {self.model} ({self.gguf.name}), {self.tokens} tokens per request, "
                 f"{self.threads} threads, {platform.processor() or platform.machine()}, "
                 f"{os.cpu_count()} cores",
                 "| concurrency | llmrun tok/s | TTFT p50 s | TTFT p95 s | ITL ms | raw-N tok/s "
                 "| llmrun / raw-N | llmrun / raw-1 | with schema tok/s | schema / plain |",
                 "|---|---|---|---|---|---|---|---|---|---|"]
        for n, s in self.served.items():
            raw_n = self.rawn.get(n)
            c = self.constrained.get(n)
            lines.append(
                f"| {n} | {s['tok_s']:.1f} | {s['ttft_p50']:.3f} | {s['ttft_p95']:.3f} | "
                f"{s['itl_ms']:.1f} | {_num(raw_n)} | "
                f"{_num(s['tok_s'] / raw_n if raw_n else None, 2)} | "
                f"{_num(s['tok_s'] / self.raw1 if self.raw1 else None, 2)} | "
                f"{_num(c['tok_s'] if c else None)} | "
                f"{_num(c['tok_s'] / s['tok_s'] if c else None, 2)} |")
        if self.raw1 is not None:
            lines.append(f"\nraw-1 (llama-cpp-python high-level Llama, one stream): "
                         f"{self.raw1:.1f} tok/s")
        if self.prefix is not None:
            t1, t2 = self.prefix
            lines.append(f"prefix reuse with 3 other streams busy: turn-1 TTFT {t1:.2f} s, "
                         f"turn-2 TTFT {t2:.2f} s ({100 * t2 / t1:.1f}% of turn 1)")
        return "\n".join(lines)


def _median_run(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run with the median throughput (its latencies come with it)."""
    return sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def run(url: str, model: str, gguf: Path, levels: list[int], tokens: int, threads: int,
        baselines: bool = True, prefix: bool = True,
        constrained: tuple[int, ...] | list[int] = (1, 4), rounds: int = 3) -> BenchResult:
    """Measure the daemon at `url` serving `model`, then (with the daemon idle) the raw
    baselines on `gguf`. At each level also in `constrained`, the load runs `rounds` times
    without and with SCHEMA, alternating, and each side keeps its median run: a ratio of
    two single runs on a shared machine would measure its neighbours."""
    asyncio.run(level(url, model, 1, 8))  # load the model, warm caches
    if any(n in constrained for n in levels):
        asyncio.run(level(url, model, 1, 8, fmt=SCHEMA))  # the tokenizer's view, once
    result = BenchResult(model, gguf, tokens, threads, {})
    for n in levels:
        if n not in constrained:
            result.served[n] = asyncio.run(level(url, model, n, tokens))
            continue
        plain, schema = [], []
        for _ in range(max(1, rounds)):
            plain.append(asyncio.run(level(url, model, n, tokens)))
            schema.append(asyncio.run(level(url, model, n, tokens, fmt=SCHEMA)))
        result.served[n], result.constrained[n] = _median_run(plain), _median_run(schema)
    if prefix:
        result.prefix = asyncio.run(prefix_reuse(url, model, busy=3))
    if baselines:
        result.raw1 = raw_high_level(gguf, tokens, threads)
        result.rawn = {n: raw_batched(gguf, n, tokens, threads) for n in levels}
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default=os.environ.get("LLMRUN_URL", "http://127.0.0.1:11434"))
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--gguf", type=Path, help="model file for the raw baselines "
                    "(default: the store's blob for --model)")
    ap.add_argument("--levels", default="1,2,4,8")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--constrained", default="1,4",
                    help="levels that also run with a JSON schema (empty: none)")
    args = ap.parse_args()
    gguf = args.gguf or store_path(args.model)
    levels = [int(x) for x in args.levels.split(",")]
    constrained = [int(x) for x in args.constrained.split(",") if x.strip()]
    print(run(args.url, args.model, gguf, levels, args.tokens, args.threads,
              constrained=constrained).table())


def store_path(model: str) -> Path:
    from llmrun.store import Store

    store = Store()
    return store.model_path(store.get(model)[1])


if __name__ == "__main__":
    main()
