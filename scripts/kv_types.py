"""KV cache types against f16 (issue 15): the memory each takes and how far it moves the
model's numbers, measured on the real test models.

    python scripts/kv_types.py [--tokens 1500]

For each test model and KV type (f16, q8_0, q4_0; flash attention on, which quantized V
needs), it reads the same text and reports the KV bytes per token (the size of the
sequence's saved state over its tokens, which is what the cache holds) and the change in
the log-probability the model gives each next token of the text against f16: mean and
largest absolute difference, and how often the most likely next token changes. Paste the
table into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fetch_test_models import models, test_models_dir

from llmrun.engine.llama import KV_TYPES, Batch, Context, Model

TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the "
    "steps as his father had taught him. Below, the sea argued with the rocks; above, the "
    "great lamp waited. He trimmed the wick, polished the brass, and wrote the weather in "
    "the log: wind from the south-west, a long swell, rain before midnight. "
)


def score(model: Model, kv_type: str, tokens: list[int]) -> tuple[np.ndarray, np.ndarray, int]:
    """Log-probabilities of each next token, the most likely token at each position, and
    the state's bytes."""
    ctx = Context(model, n_ctx_seq=len(tokens) + 8, n_seq=1, n_batch=512, n_threads=2,
                  flash_attn=True, kv_type=kv_type)
    batch = Batch(512)
    logprobs, argmax = [], []
    try:
        for start in range(0, len(tokens), 512):
            chunk = tokens[start:start + 512]
            batch.clear()
            rows = [batch.add(t, start + i, 0, True) for i, t in enumerate(chunk)]
            if ctx.decode(batch) != 0:
                raise RuntimeError("decode failed")
            for i, row in enumerate(rows):
                pos = start + i
                if pos + 1 >= len(tokens):
                    break
                logits = ctx.logits(row).astype(np.float64)
                top = logits.max()
                lse = top + np.log(np.exp(logits - top).sum())
                logprobs.append(logits[tokens[pos + 1]] - lse)
                argmax.append(int(logits.argmax()))
        size = len(ctx.state_seq_get(0))
    finally:
        batch.close()
        ctx.close()
    return np.array(logprobs), np.array(argmax), size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1500)
    args = ap.parse_args()
    print("| model | KV type | KV bytes / token | of f16 | mean abs Δ logprob | max abs Δ | "
          "top-1 changed |")
    print("|---|---|---|---|---|---|---|")
    for name in ("smollm2", "gemma3"):
        model = Model(test_models_dir() / models()[name].file)
        try:
            text = TEXT * (1 + args.tokens * 4 // len(TEXT))
            tokens = model.tokenize(text, add_special=True)[:args.tokens]
            base_lp, base_top, base_size = score(model, "f16", tokens)
            for kv_type in KV_TYPES:
                lp, top, size = (base_lp, base_top, base_size) if kv_type == "f16" \
                    else score(model, kv_type, tokens)
                diff = np.abs(lp - base_lp)
                print(f"| {name} | {kv_type} | {size / len(tokens):,.0f} | "
                      f"{size / base_size:.2f} | {diff.mean():.4f} | {diff.max():.3f} | "
                      f"{100 * np.mean(top != base_top):.1f}% |", flush=True)
        finally:
            model.close()


if __name__ == "__main__":
    main()
