"""The benchmark's result and its table (the markdown docs/benchmarks.md keeps): a row per
level and server, each against the same level's raw loops; a level's turns kept by their
median (`summary`)."""

from __future__ import annotations

import math
import os
import platform
import statistics
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class BenchResult:
    model: str
    gguf: Path
    tokens: int
    threads: int
    served: dict[int, dict[str, float]]  # llmrun's, by level
    raw1: float | None = None  # None: baselines not measured
    rawn: dict[int, float] = field(default_factory=dict)  # prefill in the wall time
    raw_decode: dict[int, float] = field(default_factory=dict)  # decode steps only
    prefix: tuple[float, float] | None = None  # TTFT of turn 1 and turn 2
    # prompt cache: cold TTFT, restored TTFT (a new runner), the prompt's tokens
    cache: tuple[float, float, int] | None = None
    constrained: dict[int, dict[str, float]] = field(default_factory=dict)  # with SCHEMA
    label: str = "llmrun"  # llmrun's row, with the API it was asked over
    draft: dict[str, dict[str, float]] = field(default_factory=dict)  # drafting(), by task
    stall: dict[str, float] = field(default_factory=dict)  # stall(): a stream beside a prompt
    stall_against: dict[str, dict[str, float]] = field(default_factory=dict)  # by label
    against: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)

    def table(self) -> str:
        """The markdown table (and lines) that docs/benchmarks.md keeps: a row per level and
        server, each against the same level's raw loops."""
        lines = [f"model {self.model} ({self.gguf.name}), {self.tokens} tokens per request, "
                 f"{self.threads} threads, {machine()}",
                 "| concurrency | server | tok/s | decode tok/s | TTFT p50 s | TTFT p95 s "
                 "| ITL ms | raw decode tok/s | decode / raw decode | raw-N tok/s "
                 "| tok/s / raw-N | tok/s / raw-1 | with schema tok/s | schema / plain |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        servers = [(self.label, self.served), *self.against.items()]
        for n in self.served:
            raw_n, raw_d = self.rawn.get(n), self.raw_decode.get(n)
            for label, by_level in servers:
                s = by_level.get(n)
                if s is None:
                    continue
                c = self.constrained.get(n) if by_level is self.served else None
                decode_ratio = (_num(s["decode_ratio"], 2) if "decode_ratio" in s
                                else _ratio(s.get("decode_tok_s"), raw_d))
                lines.append(
                    f"| {n} | {label} | {s['tok_s']:.1f} | {_num(s.get('decode_tok_s'))} | "
                    f"{s['ttft_p50']:.3f} | {s['ttft_p95']:.3f} | {s['itl_ms']:.1f} | "
                    f"{_num(raw_d)} | {decode_ratio} | "
                    f"{_num(raw_n)} | {_ratio(s['tok_s'], raw_n)} | "
                    f"{_ratio(s['tok_s'], self.raw1)} | "
                    f"{_num(c['tok_s'] if c else None)} | "
                    f"{_ratio(c['tok_s'] if c else None, s['tok_s'])} |")
        for label, by_level in self.against.items():
            paired = ", ".join(f"{n}: {_num(s.get('llmrun_over'), 2)}"
                               for n, s in by_level.items())
            lines.append(f"\n{self.label} decode tok/s / {label}'s, the median of each turn's "
                         f"ratio, by concurrency: {paired}")
        if self.raw1 is not None:
            lines.append(f"\nraw-1 (llama-cpp-python high-level Llama, one stream): "
                         f"{self.raw1:.1f} tok/s")
        if self.cache is not None:
            cold, restored, n = self.cache
            lines.append(f"prompt cache: a {n}-token system prompt, TTFT {cold:.2f} s cold, "
                         f"{restored:.2f} s in a new session after the model was unloaded "
                         f"({100 * restored / cold:.1f}% of cold)")
        stalls = {self.label: self.stall, **self.stall_against} if self.stall else {}
        for label, st in stalls.items():
            lines.append(f"{label}, a stream beside a fresh long prompt: gaps between tokens "
                         f"p50 / max {1000 * st['alone_p50']:.1f} / "
                         f"{1000 * st['alone_max']:.1f} ms alone, "
                         f"{1000 * st['beside_p50']:.1f} / {1000 * st['beside_max']:.1f} ms "
                         f"beside it, stood still {st['stalled']:.2f} s; the prompt read in "
                         f"{st['prompt_alone']:.2f} s alone, {st['prompt_beside']:.2f} s "
                         "beside the stream")
        for task, d in self.draft.items():
            lines.append(f"prompt lookup, {task} task: {d['plain']:.1f} tok/s plain, "
                         f"{d['draft']:.1f} drafting ({d['ratio']:.2f}x, median of turns), "
                         f"{'the same text' if d['same'] else 'DIFFERENT TEXT'}, "
                         f"{d['drafted_per_token']:.2f} drafted per token of which "
                         f"{100 * d['accepted']:.0f}% came true")
        if self.prefix is not None:
            t1, t2 = self.prefix
            lines.append(f"prefix reuse with 3 other streams busy: turn-1 TTFT {t1:.2f} s, "
                         f"turn-2 TTFT {t2:.2f} s ({100 * t2 / t1:.1f}% of turn 1)")
        return "\n".join(lines)


def summary(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run with the median throughput (its latencies come with it), with the median
    decode rate and the median of the decode rate's ratios to the raw loop of the same turn
    (a ratio within a turn cancels the machine's drift between turns)."""
    out = median_run(runs, "tok_s")
    out["decode_tok_s"] = statistics.median(r["decode_tok_s"] for r in runs)
    if all("decode_ratio" in r for r in runs):
        out["decode_ratio"] = statistics.median(r["decode_ratio"] for r in runs)
    return out


def median_run(runs: list[dict[str, float]], key: str) -> dict[str, float]:
    """A copy of the run with the median `key` (its other figures come with it)."""
    return dict(sorted(runs, key=lambda r: r[key])[len(runs) // 2])


def machine() -> str:
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores"


@dataclass
class RetrievalResult:
    """An embedding or rerank run (bench/retrieval.py): by server label and level, the
    median turn's figures; the raw loop's items/s by level; the servers that refused."""
    kind: str  # "embedding" or "rerank"
    workload: str  # what a level sends, in words
    items: str  # "inputs" or "documents"
    gguf: Path
    threads: int
    labels: list[str]  # llmrun's first
    served: dict[str, dict[int, dict[str, float]]] = field(default_factory=dict)
    raw: dict[int, tuple[float, float]] = field(default_factory=dict)  # items/s, tokens/s
    refused: dict[str, str] = field(default_factory=dict)

    def table(self) -> str:
        """The markdown table docs/benchmarks.md keeps: a row per level and server (items/s
        to two places: a large model on a small machine embeds a few inputs a second)."""
        first = self.labels[0]
        lines = [f"{self.kind}: {self.gguf.name}, {self.workload}, {self.threads} threads, "
                 f"{machine()}", "",
                 f"| concurrency | server | {self.items}/s | prompt tokens/s | request p50 s "
                 f"| request p95 s | raw {self.items}/s | raw tokens/s | / raw "
                 f"| {first} / this |",
                 "|---|---|---|---|---|---|---|---|---|---|"]
        levels = sorted({n for by_level in self.served.values() for n in by_level})
        for n in levels:
            for label in self.labels:
                s = self.served.get(label, {}).get(n)
                if s is None:
                    continue
                raw = self.raw.get(n)
                lines.append(
                    f"| {n} | {label} | {s['items_s']:.2f} | {s['tokens_s']:.0f} | "
                    f"{s['p50']:.2f} | {s['p95']:.2f} | {_num(raw[0] if raw else None, 2)} | "
                    f"{_num(raw[1] if raw else None, 0)} | "
                    f"{_num(s.get('raw_ratio'), 2)} | {_num(s.get('first_over'), 2)} |")
        for label, why in self.refused.items():
            lines.append(f"\n{label} refused this work: {why}")
        return "\n".join(lines)


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return _num(a / b if a is not None and b else None, 2)
