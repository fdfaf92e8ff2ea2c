"""Paired A/B of llama.cpp's repacked weights (its CPU "extra" buffer types, such as
scripts/llama-patches/0006's Q4_1 8x8 layout) against the ordinary kernels, in one process:
the same GGUF loaded twice, once with `use_extra_bufts` true and once false (llama-server's
--no-repack), then rounds of a greedy decode that alternate between the two (which goes first
alternates too), so a busy neighbour on the CPU slows both sides alike.

    python scripts/repack_ab.py MODEL.gguf [--rounds 10] [--tokens 128] [--threads 2] [--seqs 1]

Prints each round's decode tokens/s of both (all sequences) and the median ratio. `--seqs`
sequences decode together, one token each per llama_decode (one KV stream each, as llmrun's
engine); flash attention as llama.cpp chooses (on, on the CPU), as the raw loop of
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path

import llama_cpp as C
import numpy as np

# llama.cpp's log, silenced; a module-level reference so ctypes keeps the callback alive
_QUIET = C.llama_log_callback(lambda *_: None)
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def load(path: Path, repack: bool, seqs: int) -> tuple[int, int]:
    """(model, context) pointers, the model's weights repacked at load or not."""
    mp = C.llama_model_default_params()
    mp.use_extra_bufts = repack
    model = C.llama_model_load_from_file(str(path).encode(), mp)
    if not model:
        raise SystemExit(f"llama.cpp could not load {path}")
    cp = C.llama_context_default_params()
    cp.n_ctx = 1024 * seqs
    cp.n_seq_max = seqs
    cp.kv_unified = False
    cp.n_batch = cp.n_ubatch = 512
    cp.no_perf = True
    return model, C.llama_init_from_model(model, cp)


def tokens_of(model: int, text: str) -> list[int]:
    vocab = C.llama_model_get_vocab(model)
    buf = (C.llama_token * 512)()
    n = C.llama_tokenize(vocab, text.encode(), len(text.encode()), buf, 512, True, True)
    return list(buf[:n])


def decode_rate(model: int, ctx: int, prompt: list[int], tokens: int, threads: int,
                seqs: int) -> float:
    """Decode tokens/s (all sequences) of a greedy run of `tokens` steps after the prompt,
    the same prompt in each sequence (prefill excluded)."""
    C.llama_set_n_threads(ctx, threads, threads)
    C.llama_memory_clear(C.llama_get_memory(ctx), True)
    n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(model))
    batch = C.llama_batch_init(512, 0, 1)
    try:
        def step(items: list[tuple[int, int, int, bool]]) -> list[int]:
            """Decode (token, position, sequence, wants logits); the argmax of each row
            that wants logits."""
            batch.n_tokens = len(items)
            for i, (t, pos, seq, out) in enumerate(items):
                batch.token[i] = t
                batch.pos[i] = pos
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = out
            if C.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed")
            # numpy's argmax: a Python loop over the vocabulary would cost more than a step
            return [int(np.ctypeslib.as_array(C.llama_get_logits_ith(ctx, i),
                                              shape=(n_vocab,)).argmax())
                    for i, it in enumerate(items) if it[3]]

        nxt = [step([(t, i, s, i == len(prompt) - 1) for i, t in enumerate(prompt)])[0]
               for s in range(seqs)]
        t0 = time.perf_counter()
        for k in range(tokens):
            nxt = step([(nxt[s], len(prompt) + k, s, True) for s in range(seqs)])
        return seqs * tokens / (time.perf_counter() - t0)
    finally:
        C.llama_batch_free(batch)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=1)
    args = ap.parse_args()
    C.llama_backend_init()
    C.llama_log_set(_QUIET, ctypes.c_void_p(0))
    sides = {"repacked": load(args.model, True, args.seqs),
             "ordinary": load(args.model, False, args.seqs)}
    prompt = tokens_of(sides["repacked"][0], PROMPT)
    for m, c in sides.values():  # warm both (page cache, first-call costs) before timing
        decode_rate(m, c, prompt, 16, args.threads, args.seqs)
    rates: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(args.rounds):
        order = list(sides) if r % 2 == 0 else list(reversed(sides))
        for k in order:
            rates[k].append(decode_rate(*sides[k], prompt, args.tokens, args.threads,
                                        args.seqs))
        print(f"round {r + 1}: repacked {rates['repacked'][-1]:.1f} tok/s, "
              f"ordinary {rates['ordinary'][-1]:.1f} tok/s", flush=True)
    ratios = [a / b for a, b in zip(rates["repacked"], rates["ordinary"], strict=True)]
    print(f"{args.model.name}: {args.seqs} sequence(s), {args.rounds} rounds x {args.tokens} "
          f"tokens, {args.threads} threads; "
          f"median repacked {statistics.median(rates['repacked']):.1f} tok/s, ordinary "
          f"{statistics.median(rates['ordinary']):.1f} tok/s; paired ratio median "
          f"{statistics.median(ratios):.3f} (min {min(ratios):.3f}, max {max(ratios):.3f})")


if __name__ == "__main__":
    main()
