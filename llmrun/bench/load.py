"""The load at one concurrency level: N streamed requests at once (fixed prompts, greedy,
fixed length, each with a fresh tag so no prefix cache serves it), and what is measured of
them: tokens/s over the wall time, the decode rate while all were decoding, TTFT, ITL."""

from __future__ import annotations

import asyncio
import statistics
import time
from typing import Any

from llmrun.bench.servers import Api, one_request

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


def decode_rate(results: list[dict[str, Any]]) -> float:
    """Tokens per second while every request was decoding: the output that arrived between
    the last first token and the first last token, over that window (so no request's prompt
    being read, and no request that has finished, is in it), which is what the raw decode
    loop measures. Each streamed chunk counts as one token (llmrun sends several in one only
    when the reader falls behind, which can only lower this rate). Requests that never
    decoded together (more requests than slots: waves) fall back to their tokens after the
    first over the union of their decoding intervals."""
    start = max(r["first"] for r in results)
    end = min(r["last"] for r in results)
    if end > start:
        arrived = sum(1 for r in results for t in r["stamps"] if start < t <= end)
        return arrived / (end - start)
    span = union_length([(r["first"], r["last"]) for r in results])
    decoded = sum(max(0.0, r["tokens"] - 1) for r in results)
    return decoded / span if span > 0 else float("nan")


def union_length(intervals: list[tuple[float, float]]) -> float:
    """How long at least one of the intervals was open."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


_runs = iter(range(1, 1 << 30))


async def level(url: str, model: str, n: int, tokens: int,
                fmt: dict[str, Any] | None = None, api: Api = "chat") -> dict[str, float]:
    # a fresh tag per request, so no prompt is served from the prefix cache of an earlier run
    t0 = time.perf_counter()
    results = await asyncio.gather(*(
        one_request(url, model, f"(request {next(_runs)}) {PROMPTS[i % len(PROMPTS)]}",
                    tokens, fmt=fmt, api=api) for i in range(n)))
    wall = time.perf_counter() - t0
    if fmt is not None:
        for r in results:  # a server that ignored `format` would make the ratio meaningless
            if not str(r["text"]).startswith("["):
                raise RuntimeError(f"the constrained run's answer is not the schema's JSON: "
                                   f"{str(r['text'])[:80]!r}")
    total = sum(r["tokens"] for r in results)
    return {"tok_s": total / wall, "decode_tok_s": decode_rate(results),
            "ttft_p50": pct([r["ttft"] for r in results], 0.5),
            "ttft_p95": pct([r["ttft"] for r in results], 0.95),
            "itl_ms": 1000 * statistics.mean(r["itl"] for r in results)}
