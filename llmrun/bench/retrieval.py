"""Embedding and reranking throughput (`llmrun bench --embedding`, `--rerank`): llmrun and the
`--against` servers (llama-server started with `--embedding` or `--rerank` on the same GGUF)
under the same fixed workload, taking turns, with the raw pooled-context loop on the same
file in each turn (baselines.raw_embed, raw_rerank).

The workloads are fixed so that runs compare: `texts(n)` gives n inputs of about 60 tokens
(SmolLM2's tokenizer), of a few different lengths, as a real batch of passages is; an
embedding level sends them in requests of `batch` inputs over /v1/embeddings; a rerank level
sends one query with `docs` documents over /v1/rerank (llama-server's and Jina's shape, which
llmrun serves too). At concurrency c, c clients drain the level's requests (an embedding
level: inputs / batch requests; a rerank level: c of them, one per client), so every level
embeds as many inputs and each rerank client ranks as many documents, alike but for the tag
each level (and rerank request) opens its texts with. The rate is items (inputs, documents)
over the level's wall time."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from llmrun import jsonio
from llmrun.bench.baselines import raw_embed, raw_rerank
from llmrun.bench.load import pct
from llmrun.bench.measure import _run_async
from llmrun.bench.report import RetrievalResult, median_run
from llmrun.bench.servers import Server, post_lines, turn_order

Kind = Literal["embedding", "rerank"]

# Sentences a passage is made of: plain prose of common words, so each input's token count
# follows its word count in any tokenizer, the WordPiece one of the synthetic BERT models in
# tests/fakes/encodermodel.py (a few hundred common words) as SmolLM2's; twelve of them,
# combined by index, make every input different.
_SENTENCES = [
    "The cat sat on the mat in the sun and the dog sat by the tree.",
    "Paris is the capital of France and Berlin is the capital of Germany.",
    "A quick brown fox jumps over the lazy dog in the city at night.",
    "Machine learning models search each document for the text of a query.",
    "The sea is blue and the sky is blue when the sun is on the water.",
    "Many people read books in their house when the day is old.",
    "Rome is in Italy, Madrid is in Spain and London is in England.",
    "The bird and the fish have a house by the red tree near the road.",
    "An embedding is a vector that a language model makes from a text.",
    "Some children have a car, some have a book and all have a good day.",
    "The first year of the new city had more people than the last one.",
    "Two dogs and three cats were in the green house with the woman.",
]
_runs = itertools.count(1)
QUERY = "Which city is the capital of France?"


def texts(n: int, tag: str = "") -> list[str]:
    """`n` inputs, three or four sentences each (about 50 to 75 tokens, ~60 on average), every
    one different (its number and its choice of sentences), each opening with `tag`."""
    out = []
    for i in range(n):
        count = 3 + i % 2
        picked = [_SENTENCES[(i * 5 + k * 7) % len(_SENTENCES)] for k in range(count)]
        out.append(f"{tag}Text {i}. " + " ".join(picked))
    return out


@dataclass(frozen=True)
class Workload:
    """What one level sends: the inputs and their requests' size (embedding), or the query
    and documents of each request (rerank)."""
    kind: Kind
    inputs: int = 256  # embedding: inputs per level
    batch: int = 32  # embedding: inputs per request
    docs: int = 200  # rerank: documents per request

    def bodies(self, model: str, concurrency: int) -> list[tuple[str, dict[str, Any], int]]:
        """(path, JSON body, items in it) for each request of a level at `concurrency`; the
        texts of each level, and of each rerank request, open with a tag of their own, so
        that no server answers from a prompt cache what an earlier request read."""
        if self.kind == "embedding":
            inputs = texts(self.inputs, f"Day {next(_runs)}. ")
            return [("/v1/embeddings", {"model": model, "input": inputs[i:i + self.batch]},
                     len(inputs[i:i + self.batch]))
                    for i in range(0, len(inputs), self.batch)]
        out = []
        for _ in range(concurrency):
            tag = f"Day {next(_runs)}. "
            out.append(("/v1/rerank", {"model": model, "query": tag + QUERY,
                                       "documents": texts(self.docs, tag)}, self.docs))
        return out

    def items(self) -> str:
        return "inputs" if self.kind == "embedding" else "documents"

    def describe(self) -> str:
        if self.kind == "embedding":
            return (f"{self.inputs} inputs of ~60 tokens in requests of {self.batch} "
                    "(/v1/embeddings)")
        return (f"1 query x {self.docs} documents of ~60 tokens per request, one request "
                "per client (/v1/rerank)")


async def post_json(url: str, path: str, body: dict[str, Any]) -> Any:
    """POST `body` and parse the whole answer (on the load's own client, servers.post_lines)."""
    async with contextlib.aclosing(post_lines(url, path, body)) as lines:
        return jsonio.loads(b"\n".join([line async for line in lines]))


def _count(kind: Kind, answer: Any, sent: int) -> int:
    """The prompt tokens a server says it read, after checking that it answered for every
    item sent (a server that dropped some would look fast)."""
    got = len(answer.get("data" if kind == "embedding" else "results") or [])
    if got != sent:
        raise RuntimeError(f"{sent} {kind} items sent, {got} answered")
    return int((answer.get("usage") or {}).get("prompt_tokens") or 0)


async def level(server: Server, work: Workload, concurrency: int) -> dict[str, float]:
    """One level: `concurrency` clients drain the level's requests; items/s and prompt
    tokens/s over the wall time, and the requests' latencies (p50, p95)."""
    todo = list(work.bodies(server.model, concurrency))
    latencies: list[float] = []
    items = tokens = 0

    async def client() -> None:
        nonlocal items, tokens
        while todo:
            path, body, n = todo.pop(0)
            t = time.perf_counter()
            answer = await post_json(server.url, path, body)
            latencies.append(time.perf_counter() - t)
            tokens += _count(work.kind, answer, n)
            items += n

    t0 = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    return {"items_s": items / wall, "tokens_s": tokens / wall,
            "p50": pct(latencies, 0.5), "p95": pct(latencies, 0.95)}


async def probe(server: Server, work: Workload) -> str | None:
    """Why `server` cannot do this work (its error, shortened), or None when it can: a small
    request first, so a server that refuses the model (llama-server asked to rerank with a
    model that has no rank head; llmrun asked to rerank with a model whose Modelfile does not
    make it a reranker) gets a line in the table instead of stopping the run. It also loads
    the model."""
    path, body, n = work.bodies(server.model, 1)[0]
    small = dict(body, **({"input": body["input"][:2]} if work.kind == "embedding"
                          else {"documents": body["documents"][:2]}))
    try:
        _count(work.kind, await post_json(server.url, path, small), min(n, 2))
    except RuntimeError as exc:
        return str(exc)[:300]
    return None


def run(work: Workload, gguf: Path, threads: int, levels: list[int], rounds: int,
        servers: list[Server], baselines: bool = True) -> RetrievalResult:
    """`rounds` turns; in each, every level in order, the servers taking turns at each in
    alternating order, then the raw loop once on `gguf` with the servers idle (its rate
    does not depend on the level; a pass of it costs as much as a server's). The first
    server is llmrun, whose rate is compared with each other's turn by turn."""
    result = RetrievalResult(work.kind, work.describe(), work.items(), gguf, threads,
                             [s.label for s in servers])
    live = []
    for server in servers:
        reason = _run_async(probe(server, work))
        if reason is None:
            live.append(server)
        else:
            result.refused[server.label] = reason
    runs: dict[tuple[str, int], list[dict[str, float]]] = {
        (s.label, n): [] for s in live for n in levels}
    raws: list[tuple[float, float]] = []  # items/s, tokens/s
    for turn in range(max(1, rounds)):
        this_turn = []
        for n in levels:
            for server in turn_order(turn + levels.index(n), live):
                runs[server.label, n].append(_run_async(level(server, work, n)))
                this_turn.append(runs[server.label, n][-1])
        if baselines:  # in the same turn: the machine's speed drifts between minutes
            rate = (raw_embed(gguf, texts(work.inputs), threads) if work.kind == "embedding"
                    else raw_rerank(gguf, QUERY, texts(work.docs), threads))
            raws.append(rate)
            for r in this_turn:
                r["raw_ratio"] = r["items_s"] / rate[0]
    first = servers[0].label
    for (label, n), by_turn in runs.items():
        # the rates are each the median over the turns (with an even count, the mean of the
        # middle two: both rates then come from the same turns); latencies, the median run's
        s = result.served.setdefault(label, {})[n] = median_run(by_turn, "items_s")
        for key in ("items_s", "tokens_s"):
            s[key] = statistics.median(r[key] for r in by_turn)
        if raws:
            result.raw[n] = (statistics.median(r[0] for r in raws),
                             statistics.median(r[1] for r in raws))
            s["raw_ratio"] = statistics.median(r["raw_ratio"] for r in by_turn)
        if label != first and (first, n) in runs:
            # the direct comparison: turn by turn, the two servers a minute apart at most
            s["first_over"] = statistics.median(
                a["items_s"] / b["items_s"]
                for a, b in zip(runs[first, n], by_turn, strict=True))
    return result
