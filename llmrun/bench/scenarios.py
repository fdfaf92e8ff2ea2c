"""The scenarios beside the load: prefix reuse (a second chat turn while other streams are
busy), the prompt cache (a long system prompt in a new session on a new runner), a stream
beside a fresh long prompt (stall-free batching), and prompt-lookup drafting on and off."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import statistics
import time
from typing import Any

from llmrun.bench.load import PROMPTS
from llmrun.bench.servers import one_request, post_lines


async def prefix_reuse(url: str, model: str, busy: int) -> tuple[float, float]:
    """TTFT of turn 1 (~2,000 tokens of history) and of turn 2, with `busy` others decoding."""
    history = " ".join(f"Fact {i}: the number {i} is written {i * 7} in another base."
                       for i in range(150))
    turn1 = [{"role": "user", "content": history + "\nSummarise the facts briefly."}]
    others = [asyncio.create_task(one_request(url, model, PROMPTS[i], 256))
              for i in range(busy)]
    first = await one_request(url, model, "", 32, turn1)
    turn2 = [*turn1, {"role": "assistant", "content": str(first["text"])},
             {"role": "user", "content": "Now list the first three."}]
    second = await one_request(url, model, "", 32, turn2)
    await asyncio.gather(*others)
    return first["ttft"], second["ttft"]


async def _post(url: str, path: str, body: dict[str, Any]) -> None:
    async with contextlib.aclosing(post_lines(url, path, body)) as lines:
        async for _ in lines:
            pass


async def prompt_cache(url: str, model: str, n_tokens: int) -> tuple[float, float, int]:
    """TTFT of a chat whose system prompt is ~`n_tokens` long, read cold, and of a new
    session with the same system prompt after the model was unloaded (keep_alive 0), so its
    runner is a new one: the prompt cache's disk tier. Each is measured with the model
    loaded first by a short request. Returns (cold, restored, the prompt's tokens)."""
    tag = os.urandom(6).hex()  # no state of an earlier run can match
    line = "Tool {i}: reads the file at `path` and returns lines `start` to `end` ({tag}). "
    system = "".join(line.format(i=i, tag=tag) for i in range(n_tokens // 36 + 1))
    options = {"num_ctx": n_tokens * 2 + 1024}
    quick = {"model": model, "prompt": "hi", "stream": False,
             "options": {**options, "num_predict": 1}}

    async def session(question: str) -> dict[str, Any]:
        await _post(url, "/api/generate", {"model": model, "keep_alive": 0})  # unload
        await _post(url, "/api/generate", quick)  # and load again, on a new runner
        return await one_request(url, model, "", 1, [
            {"role": "system", "content": system}, {"role": "user", "content": question}],
            options=options)

    # one token: the time to the answer's end is the time to its first token
    cold = await session("Say hi.")
    restored = await session("What can you do?")
    return cold["elapsed"], restored["elapsed"], int(cold["prompt_tokens"])


# An "edit this code" task, whose answer repeats most of its prompt (prompt lookup's case),
# and free text, whose answer does not: speculative decoding's two sides.
EDIT_SOURCE = """def load(path):
    with open(path) as f:
        rows = [line.rstrip("\\n").split(",") for line in f]
    header, body = rows[0], rows[1:]
    return [dict(zip(header, row)) for row in body]


def total(records, field):
    result = 0.0
    for record in records:
        value = record.get(field, "")
        if value:
            result += float(value)
    return result


def report(path, field):
    records = load(path)
    print(f"{len(records)} records, {field} total {total(records, field):.2f}")
"""
DRAFT_TASKS = {
    "edit": f"Here is a Python file:\n```python\n{EDIT_SOURCE}```\n\nThe same file with "
            f"`result` renamed to `amount`:\n```python\n",
    "free": "The history of the lighthouse on the northern cape begins in a winter when",
}


def _gaps(stamps: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(stamps)]


async def stall(url: str, model: str, n_tokens: int) -> dict[str, float]:
    """A client streams a story alone, then beside a fresh prompt of ~`n_tokens` (the
    neighbour's inter-token gaps while the prompt is read: p50, the largest, and the time
    it stood still in gaps over 100 ms); and the long prompt's time to its first token,
    alone and beside the stream. Over the OpenAI API, the story made long by ignore_eos;
    the default context (4096) must hold each."""
    tag = os.urandom(6).hex()

    def long_prompt(i: int) -> list[dict[str, str]]:
        facts = " ".join(f"Fact {j} ({tag}-{i}): the number {j} is written {j * 7} in another "
                         "base." for j in range(n_tokens // 34 + 1))
        return [{"role": "user", "content": facts + "\nWhich fact is the last one?"}]

    alone = await one_request(url, model, f"({tag}a) {PROMPTS[0]}", 300, api="openai")
    first = await one_request(url, model, "", 1, long_prompt(0), api="openai")
    neighbour = asyncio.create_task(one_request(url, model, f"({tag}b) {PROMPTS[0]}", 3000,
                                                api="openai"))
    await asyncio.sleep(3)  # its prompt is read and it streams
    t0 = time.perf_counter()
    beside = await one_request(url, model, "", 1, long_prompt(1), api="openai")
    t1 = time.perf_counter()
    near = await neighbour
    during = [g for a, g in zip(near["stamps"], _gaps(near["stamps"]), strict=False)
              if t0 <= a <= t1]
    solo = _gaps(alone["stamps"])
    return {"alone_p50": statistics.median(solo), "alone_max": max(solo),
            "beside_p50": statistics.median(during) if during else float("nan"),
            "beside_max": max(during) if during else float("nan"),
            "stalled": sum(g for g in during if g > 0.1),
            "prompt_alone": first["elapsed"], "prompt_beside": beside["elapsed"]}


def _draft_counts(url: str) -> tuple[float, float]:
    """The daemon's counts of drafted and accepted tokens so far (/metrics)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    with httpx.Client(base_url=url, timeout=30) as c:
        text = c.get("/metrics").text
    counts = {"llmrun_draft_tokens": 0.0, "llmrun_draft_accepted_tokens": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name in counts:
            counts[family.name] = sum(x.value for x in family.samples
                                      if x.name.endswith("_total"))
    return counts["llmrun_draft_tokens"], counts["llmrun_draft_accepted_tokens"]


def drafting(url: str, model: str, tokens: int, rounds: int) -> dict[str, dict[str, float]]:
    """Each of DRAFT_TASKS, greedy, `tokens` long, at concurrency 1, with prompt lookup off
    (num_draft 0) and on (num_draft 16), alternating for `rounds` turns: the decode rates'
    medians and the median of each turn's ratio, whether every answer was the same text,
    and the share of drafted tokens that came true."""

    import httpx

    def generate(prompt: str, options: dict[str, Any]) -> tuple[float, str]:
        body = {"model": model, "prompt": prompt, "raw": True, "stream": False,
                "options": {"temperature": 0, "num_predict": tokens, "repeat_penalty": 1.0,
                            **options}}
        with httpx.Client(base_url=url, timeout=None) as c:
            r = c.post("/api/generate", json=body)
        r.raise_for_status()
        out = r.json()
        return out["eval_count"] / (out["eval_duration"] / 1e9), out["response"]

    results: dict[str, dict[str, float]] = {}
    for task, prompt in DRAFT_TASKS.items():
        generate(prompt, {"num_draft": 0})  # the prompt's cells for both sides alike
        plain: list[float] = []
        drafted: list[float] = []
        texts: set[str] = set()
        d0, a0 = _draft_counts(url)
        for turn in range(rounds):
            for n in ((0, 16) if turn % 2 == 0 else (16, 0)):
                rate, text = generate(prompt, {"num_draft": n})
                (drafted if n else plain).append(rate)
                texts.add(text)
        d1, a1 = _draft_counts(url)
        results[task] = {
            "plain": statistics.median(plain), "draft": statistics.median(drafted),
            "ratio": statistics.median(d / p for d, p in zip(drafted, plain, strict=True)),
            "same": float(len(texts) == 1),
            "accepted": (a1 - a0) / (d1 - d0) if d1 > d0 else float("nan"),
            "drafted_per_token": (d1 - d0) / (tokens * rounds)}
    return results
