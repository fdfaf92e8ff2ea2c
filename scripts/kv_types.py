"""KV cache types and backends against the CPU with an f16 KV cache: the memory each KV type
takes and how far each moves the model's numbers, measured on the real test models.

    python scripts/kv_types.py [--tokens 1500] [--text FILE]
    GGML_VK_VISIBLE_DEVICES=0 .venv-vulkan/bin/python scripts/kv_types.py   # + Vulkan rows

For each test model and KV type (f16, q8_0, q4_0; flash attention on, which quantized V
needs), and for each GPU device llama.cpp lists (every layer on it, f16 KV), it reads the
same text and reports the KV bytes per token (the size of the sequence's saved state over
its tokens, which is what the cache holds), the perplexity of the text, and the change in
the log-probability the model gives each next token against the reference: mean and
largest absolute difference, and how often the most likely next token changes. The text is
the Apache License 2.0 (Debian's copy), prose no model repeats from its context; without
it, a short paragraph repeated. Paste the table into docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fetch_test_models import models, test_models_dir

from llmrun.engine.llama import KV_TYPES, Batch, Context, Model, list_devices

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


LICENSE_TEXT = Path("/usr/share/common-licenses/Apache-2.0")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=1500)
    ap.add_argument("--text", type=Path, default=LICENSE_TEXT if LICENSE_TEXT.exists() else None)
    ap.add_argument("--models", default="smollm2,gemma3", help="test models, comma-separated")
    args = ap.parse_args()
    gpus = [d["name"] for d in list_devices() if d["type"] in ("gpu", "igpu")]
    print("| model | backend | KV type | KV bytes / token | of f16 | perplexity | "
          "mean abs Δ logprob | max abs Δ | top-1 changed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        path = test_models_dir() / models()[name].file
        model = Model(path)
        text = args.text.read_text() if args.text else TEXT * (1 + args.tokens * 4 // len(TEXT))
        tokens = model.tokenize(text, add_special=True)[:args.tokens]
        runs: list[tuple[str, Model, str]] = [("CPU", model, kv) for kv in KV_TYPES]
        runs += [(gpu, Model(path, n_gpu_layers=10_000, devices=[gpu]), "f16") for gpu in gpus]
        try:
            base_lp, base_top, base_size = score(model, "f16", tokens)
            for backend, m, kv_type in runs:
                lp, top, size = (base_lp, base_top, base_size) \
                    if (backend, kv_type) == ("CPU", "f16") else score(m, kv_type, tokens)
                diff = np.abs(lp - base_lp)
                print(f"| {name} | {backend} | {kv_type} | {size / len(tokens):,.0f} | "
                      f"{size / base_size:.2f} | {np.exp(-lp.mean()):.3f} | "
                      f"{diff.mean():.4f} | {diff.max():.3f} | "
                      f"{100 * np.mean(top != base_top):.1f}% |", flush=True)
        finally:
            for m in {id(m): m for _, m, _ in runs}.values():
                m.close()


if __name__ == "__main__":
    main()
