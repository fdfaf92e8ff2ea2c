"""The raw baselines on the same model file and thread count, with the servers idle:
llama-cpp-python's high-level `Llama` streaming one completion (raw-1), and a plain low-level
loop decoding N sequences in one llama_decode per step (raw-N with its prefill, raw decode
without: the reference of the ratios). raw-1 calls llama-cpp-python directly: it is the thing
being compared against, not a use of llama.cpp by llmrun (that goes through engine/llama/)."""

from __future__ import annotations

import itertools
import time
from pathlib import Path
from typing import TYPE_CHECKING

from llmrun.bench.load import PROMPTS

if TYPE_CHECKING:
    from llmrun.engine.llama import Model


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


# The side work's sequences per decode (engine/sidework.py's n_seq; llama-server's 4 slots
# in scripts/bench_retrieval.sh): the raw loops batch as many, so they measure the same shape.
RAW_SEQ = 4


def _side_loop(model: Model, sequences: list[list[int]], threads: int,
               embeddings: bool) -> tuple[float, float]:
    """The plain loop of the side work: the sequences RAW_SEQ to a llama_decode, in order,
    whatever their lengths; each one's pooled vector (or rank score) read (`embeddings`), or
    the logits of its last token. Returns (sequences/s, tokens/s)."""
    from llmrun.engine.llama import Batch, Context

    n_ctx_seq = max(len(t) for t in sequences)
    ctx = Context(model, n_ctx_seq=n_ctx_seq, n_seq=RAW_SEQ, n_batch=n_ctx_seq * RAW_SEQ,
                  n_threads=threads, embeddings=embeddings)
    batch = Batch(n_ctx_seq * RAW_SEQ)
    t0 = time.perf_counter()
    for start in range(0, len(sequences), RAW_SEQ):
        chunk = sequences[start:start + RAW_SEQ]
        batch.clear()
        rows = []
        for seq, tokens in enumerate(chunk):
            ctx.seq_rm(seq, -1, -1)
            for pos, tok in enumerate(tokens):
                row = batch.add(tok, pos, seq, embeddings or pos == len(tokens) - 1)
            rows.append(row)
        ctx.decode(batch)
        for seq, row in enumerate(rows):
            if embeddings:
                ctx.embedding(seq)
            else:
                ctx.logits(row)
    wall = time.perf_counter() - t0
    batch.close()
    ctx.close()
    return len(sequences) / wall, sum(map(len, sequences)) / wall


def raw_embed(gguf: Path, inputs: list[str], threads: int) -> tuple[float, float]:
    """Embedding `inputs` in a plain pooled-context loop: (inputs/s, tokens/s), tokenizing
    outside the time."""
    from llmrun.engine.llama import Model

    model = Model(gguf)
    try:
        return _side_loop(model, [model.tokenize(t, add_special=True, parse_special=False)
                                  for t in inputs], threads, embeddings=True)
    finally:
        model.close()


def raw_rerank(gguf: Path, query: str, documents: list[str],
               threads: int) -> tuple[float, float]:
    """Reranking in a plain loop: (documents/s, tokens/s), preparing the prompts outside the
    time. A cross-encoder (a GGUF that declares rank pooling) reads each pair as BERT's
    `[CLS] query [SEP] document [SEP]` in a rank-pooled context, as llama-server does, and
    its score is read. An LLM reranker (engine/rerank.py) reads each
    document's prompt, the chat template over its Qwen3-Reranker turns, and the logits of
    its last token."""
    from llmrun.chat import templates
    from llmrun.engine.llama import Model
    from llmrun.engine.rerank import DEFAULT_INSTRUCTION, DEFAULT_SYSTEM, DEFAULT_USER, fill

    model = Model(gguf)
    try:
        if model.meta(f"{model.meta('general.architecture')}.pooling_type") == "4":  # rank
            first = model.tokenize(query, add_special=True, parse_special=False)
            return _side_loop(model, [
                first + model.tokenize(doc, add_special=True, parse_special=False)[1:]
                for doc in documents], threads, embeddings=True)
        tpl = model.chat_template() or templates.FALLBACK_TEMPLATE
        return _side_loop(model, [model.tokenize(templates.render(tpl, [
            {"role": "system", "content": DEFAULT_SYSTEM},
            {"role": "user", "content": fill(DEFAULT_USER, {
                "query": query, "document": doc, "instruction": DEFAULT_INSTRUCTION})}]),
            add_special=False) for doc in documents], threads, embeddings=False)
    finally:
        model.close()
