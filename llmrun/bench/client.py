"""Throughput and latency of a running llmrun daemon, against raw llama-cpp-python, in one run.

    llmrun bench smollm2 [--gguf PATH] [--levels 1,2,4,8] [--tokens 128]
                         [--against http://127.0.0.1:8080 ...] [--api chat|openai]
    python scripts/bench.py --model smollm2 ...        (the same, against --url)

For each concurrency level it sends that many streaming requests at once (fixed prompts,
greedy, fixed length) and reports aggregate generated tokens/s, the decode rate, time to first
token (p50/p95) and inter-token latency. llmrun is asked over /api/chat (`--api chat`, the
default) or its OpenAI endpoint (`--api openai`, the default with `--against`). `--against URL`
(repeatable, or a comma list) sends the same load to another OpenAI-compatible server
(llama-server, Ollama) over /v1/chat/completions, streaming, with `max_tokens`, `temperature:
0`, `repeat_penalty: 1` and llama-server's `ignore_eos`, so every request decodes the full
length there too; at each level the servers take turns (in alternating order), `--rounds`
runs each (3 by default), each turn ending with the raw decode loop. In
the same run, on the same model file and thread count, it measures baselines with the daemon
idle:

  raw-1       llama-cpp-python's high-level `Llama` streaming one completion (what its own
              server does per request; it serves one request at a time)
  raw decode  a plain low-level loop decoding N sequences in one llama_decode per step, timed
              over the decode steps only (prefill excluded): the ceiling for batching on this
              machine, with no HTTP, IPC or scheduling, and the reference of the ratios
  raw-N       the same loop timed with its prefill (the prompts one after another), as before

Two rates per server and level: `tok/s` is all generated tokens over the wall time of the level
(prefill included, comparable to raw-N); `decode tok/s` is the output that arrived while every
request was decoding (between the last first token and the first last token) over that
window, comparable to raw decode, which decodes all N sequences together. At concurrency 1
that is (tokens - 1) / (last token - first token). Where the requests never decoded together
(more requests than slots: waves) it is each request's tokens after its first over the union
of their decoding intervals. `decode / raw decode` is the median over the turns of each
turn's ratio (the machine's speed drifts between minutes; within a turn it mostly cancels).

The load comes from a small HTTP client of its own (`post_lines`, on httptools): it runs on
the machine it measures, and httpx's streaming costs several times its CPU per token.

The constrained run (`--constrained 1,4`) sends the same requests with a JSON schema in
`format` (SCHEMA: records with bounded integers, a pattern and a format, longer than the token
budget, so every request decodes its full length under the constraint), alternating with the
unconstrained ones at the same level (median of 3 each; the --against servers take the same
turns without a schema), and reports their ratio. It also measures prefix reuse: TTFT of a
second chat turn after a ~2,000-token first turn, while the other slots are busy. Numbers are
noisy on small machines: compare ratios, not absolute values. Paste the printed table into
docs/benchmarks.md.

The raw-1 baseline calls llama-cpp-python's high-level `Llama` directly: it is the thing being
compared against, not a use of llama.cpp by llmrun (that goes through engine/llama.py).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import os
import platform
import statistics
import time
from collections.abc import AsyncGenerator, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import httptools

from llmrun import config, jsonio

T = TypeVar("T")
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


Api = Literal["chat", "openai"]


@dataclass(frozen=True)
class Server:
    """A server under the load: llmrun over /api/chat or /v1, or another OpenAI-compatible
    server (`--against`)."""
    label: str
    url: str
    model: str
    api: Api = "chat"


def openai_base(url: str) -> str:
    """`http://host:port` from a server's address as users write it (with or without /v1)."""
    url = url.strip().rstrip("/")
    return url[:-3].rstrip("/") if url.endswith("/v1") else url


class _Response:
    """httptools' callbacks for one response: its status, and its body as it arrives (with
    the chunked transfer encoding already taken off)."""

    def __init__(self) -> None:
        self.parser: httptools.HttpResponseParser | None = None
        self.status = 0
        self.body = bytearray()
        self.complete = False

    def on_headers_complete(self) -> None:
        assert self.parser is not None
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete = True


async def post_lines(url: str, path: str, body: dict[str, Any]) -> AsyncGenerator[bytes, None]:
    """POST `body` as JSON and yield the streamed answer line by line as it arrives.

    The load generator runs on the machine it measures, so its own CPU per token is taken
    from the servers' decode threads: httpx's streaming layers cost ~0.4 ms of CPU per
    token on a 2-core machine, several percent of the decode rate at concurrency 4. This is
    one socket read and httptools' C parser (a dependency already, uvicorn's) per arrival,
    the same client for every server. A status of 400 or more raises with the body."""
    parts = urlsplit(url)
    tls = parts.scheme == "https"
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
            f"Connection: close\r\n\r\n").encode()
    try:
        reader, writer = await asyncio.open_connection(
            parts.hostname, parts.port or (443 if tls else 80), ssl=tls or None)
    except OSError as exc:
        raise RuntimeError(f"{url}: cannot connect ({exc})") from exc
    response = _Response()
    parser = response.parser = httptools.HttpResponseParser(response)
    try:
        writer.write(head + payload)
        pending = b""
        while not response.complete:
            data = await reader.read(1 << 16)
            if not data:
                break
            parser.feed_data(data)
            if response.status >= 400:
                continue  # the whole error body, then raise
            if response.body:
                *lines, pending = (pending + bytes(response.body)).split(b"\n")
                response.body.clear()
                for line in lines:
                    yield line.rstrip(b"\r")
        if response.status >= 400 or not response.status:
            text = bytes(response.body).decode(errors="replace")[:200]
            raise RuntimeError(f"{url}{path}: {response.status or 'no answer'} {text}")
        if not response.complete:
            raise RuntimeError(f"{url}{path}: the answer ended before its end")
        if pending:
            yield pending
    except (OSError, httptools.HttpParserError) as exc:
        raise RuntimeError(f"{url}{path}: {exc}") from exc
    finally:
        writer.close()


async def one_request(url: str, model: str, prompt: str,
                      tokens: int, messages: list[dict[str, str]] | None = None,
                      fmt: dict[str, Any] | None = None,
                      api: Api = "chat", options: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed request; its TTFT, tokens, mean inter-token latency, the times of its
    first and last token (perf_counter), and its text."""
    messages = messages or [{"role": "user", "content": prompt}]
    if api == "openai":
        body: dict[str, Any] = {
            "model": model, "stream": True, "messages": messages, "max_tokens": tokens,
            "temperature": 0, "repeat_penalty": 1.0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
        path = "/v1/chat/completions"
    else:
        body = {"model": model, "stream": True, "messages": messages,
                "options": {"temperature": 0, "num_predict": tokens, "repeat_penalty": 1.0,
                            **(options or {})}}
        path = "/api/chat"
    if fmt is not None:
        body["format"] = fmt
    t0 = time.perf_counter()
    stamps: list[float] = []
    count: float | None = None  # the server's own count of generated tokens
    prompt_tokens = 0  # and of the prompt's (/api/chat)
    text = []
    async with contextlib.aclosing(post_lines(url, path, body)) as lines:
        async for line in lines:
            now = time.perf_counter()
            if api == "openai":
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = jsonio.loads(data)
                if "error" in obj:
                    raise RuntimeError(str(obj["error"]))
                if obj.get("usage"):
                    count = float(obj["usage"].get("completion_tokens", 0))
                choices = obj.get("choices") or [{}]
                piece = (choices[0].get("delta") or {}).get("content") or ""
            else:
                if not line:
                    continue
                obj = jsonio.loads(line)
                if "error" in obj:
                    raise RuntimeError(obj["error"])
                if obj.get("done"):
                    count = float(obj.get("eval_count", 0))
                    prompt_tokens = int(obj.get("prompt_eval_count", 0))
                    break
                piece = obj["message"]["content"]
            if piece:
                text.append(piece)
                stamps.append(now)
    itl = [b - a for a, b in itertools.pairwise(stamps)]
    return {"ttft": stamps[0] - t0 if stamps else float("nan"),
            # a server that gives no count: one token per chunk, as llama-server streams them
            "tokens": count if count is not None else float(len(stamps)),
            "itl": statistics.mean(itl) if itl else float("nan"),
            "first": stamps[0] if stamps else t0, "last": stamps[-1] if stamps else t0,
            "stamps": stamps,
            "elapsed": time.perf_counter() - t0, "text": "".join(text),
            "prompt_tokens": prompt_tokens}


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
        # (llama-cpp-python types the result as a response or a stream, whatever `stream`)
        n += 1 if chunk["choices"][0]["text"] else 0  # type: ignore[index]
    wall = time.perf_counter() - t0
    llm.close()
    return n / wall


def raw_batched(gguf: Path, n_seq: int, tokens: int, threads: int) -> tuple[float, float]:
    """A plain loop: prefill N prompts, then N tokens per llama_decode, greedy, until each
    sequence has `tokens`. Returns (tokens/s with the prefill in the wall time, tokens/s of
    the decode steps alone: the tokens after each sequence's first over their time)."""
    from llmrun.chat import templates
    from llmrun.engine.llama import Batch, Context, Model, Sampler

    model = Model(gguf)
    ctx = Context(model, n_ctx_seq=1024, n_seq=n_seq, n_batch=512, n_threads=threads)
    tpl = model.chat_template() or templates.FALLBACK_TEMPLATE
    prompts = [model.tokenize(templates.render(tpl, [{"role": "user", "content": p}]),
                              add_special=False)
               for p in itertools.islice(itertools.cycle(PROMPTS), n_seq)]
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
        nxt.append(ctx.sample(samplers[s], idx))  # each sequence's first token
        pos.append(len(p))
    t_decode = time.perf_counter()
    for _ in range(max(0, tokens - 1)):
        batch.clear()
        rows = [batch.add(nxt[s], pos[s], s, True) for s in range(n_seq)]
        ctx.decode(batch)
        for s in range(n_seq):
            nxt[s] = ctx.sample(samplers[s], rows[s])
            pos[s] += 1
    t_end = time.perf_counter()
    for sm in samplers:
        sm.close()
    batch.close()
    ctx.close()
    model.close()
    decode = n_seq * max(0, tokens - 1) / (t_end - t_decode) if tokens > 1 else float("nan")
    return n_seq * tokens / (t_end - t0), decode


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
                 f"{self.threads} threads, {platform.processor() or platform.machine()}, "
                 f"{os.cpu_count()} cores",
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


def _summary(runs: list[dict[str, float]]) -> dict[str, float]:
    """The run with the median throughput (its latencies come with it), with the median
    decode rate and the median of the decode rate's ratios to the raw loop of the same turn
    (a ratio within a turn cancels the machine's drift between turns)."""
    out = dict(sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2])
    out["decode_tok_s"] = statistics.median(r["decode_tok_s"] for r in runs)
    if all("decode_ratio" in r for r in runs):
        out["decode_ratio"] = statistics.median(r["decode_ratio"] for r in runs)
    return out


def _num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def _ratio(a: float | None, b: float | None) -> str:
    return _num(a / b if a is not None and b else None, 2)


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
    turns, the servers in alternating order, and each keeps its median (`_summary`)."""
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
            # the servers take turns in alternating order, so neither always follows the
            # raw loop (or the other) when the machine's speed drifts
            order = [None, *against] if turn % 2 == 0 else [*against, None]
            this_turn = []
            for other in order:
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
        result.served[n] = _summary(plain)
        if schema:
            result.constrained[n] = _summary(schema)
        for label, runs in others.items():
            result.against[label][n] = _summary(runs)
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


def against_servers(urls: list[str], model: str) -> list[Server]:
    """Servers from `--against` values (each repeatable or a comma list), asked for `model`
    over their OpenAI API; labelled by address."""
    out: list[Server] = []
    for value in urls:
        for url in (u.strip() for u in value.split(",")):
            if not url:
                continue
            if "://" not in url:
                url = f"http://{url}"
            base = openai_base(url)
            out.append(Server(label=f"{base.split('://', 1)[1]} /v1", url=base, model=model,
                              api="openai"))
    labels = [s.label for s in out]
    if len(set(labels)) != len(labels):
        raise ValueError("--against: the same server twice")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
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


if __name__ == "__main__":
    main()
