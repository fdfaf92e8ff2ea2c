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

`--embedding` and `--rerank` measure embedding inputs/s and rerank documents/s instead, for
llmrun and the `--against` servers (llama-server started with `--embedding` or `--rerank`)
under the same fixed workload, with a raw pooled-context loop on the same file: retrieval.py.

The modules: servers.py (the HTTP client and the servers), load.py (one level's load and its
rates), scenarios.py (prefix reuse, prompt cache, stalls, drafting), baselines.py (the raw
loops), report.py (the result and its table), measure.py (a run, and the script's command
line). Callers import from here.
"""

from __future__ import annotations

from llmrun.bench.baselines import raw_batched, raw_embed, raw_high_level, raw_rerank
from llmrun.bench.load import PROMPTS, SCHEMA, decode_rate, level, union_length
from llmrun.bench.measure import main, run, store_path
from llmrun.bench.report import BenchResult, RetrievalResult, summary
from llmrun.bench.retrieval import Kind, Workload
from llmrun.bench.retrieval import run as run_retrieval
from llmrun.bench.servers import Api, Server, against_servers, one_request, post_lines

__all__ = ["PROMPTS", "SCHEMA", "Api", "BenchResult", "Kind", "RetrievalResult", "Server",
           "Workload", "against_servers", "decode_rate", "level", "main", "one_request",
           "post_lines", "raw_batched", "raw_embed", "raw_high_level", "raw_rerank", "run",
           "run_retrieval", "store_path", "summary", "union_length"]
