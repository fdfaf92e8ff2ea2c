"""Which quantization of a model decodes fastest on this CPU: the model made in each type
(from an F16 copy of the file given, once, kept in --work), then rounds of the raw decode loop
(llmrun/bench/baselines.raw_batched: greedy, one llama_decode per step) that go through the
types in turn, so a busy neighbour slows every type alike. Prints a markdown table: median
decode tok/s, the file's size, and each type's rate over the fastest's.

    python scripts/quant_speed.py MODEL.gguf [--types Q4_0,Q4_1,Q5_0,Q8_0,Q4_K_M]
        [--rounds 5] [--tokens 128] [--threads 2] [--seqs 1] [--work DIR]

LLAMA_CPP_LIB_PATH points llama-cpp-python at another build of llama.cpp's libraries (a CPU
backend built for AVX2 only, say, to measure that class of CPU on this one). The table feeds
llmrun/store/quantspeed.py, which `llmrun show` reads.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def requantize(src: Path, dst: Path, ftype: int) -> None:
    """`src` into `dst` in llama.cpp's type `ftype`, dequantizing what `src` holds first
    (allow_requantize: a measurement of speed, not of quality)."""
    import llama_cpp.llama_cpp as C

    params = C.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = 0
    if C.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)):
        raise SystemExit(f"llama.cpp could not make {dst}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--types", default="Q4_0,Q4_1,Q5_0,Q8_0,Q4_K_M")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--work", type=Path, default=Path.home() / ".cache/llmrun/quant-speed")
    args = ap.parse_args()

    import llama_cpp.llama_cpp as C

    from llmrun.bench.baselines import raw_batched
    from llmrun.engine.llama.lib import init_backend
    from llmrun.engine.llama.quantization import QUANT_FTYPES

    init_backend()
    args.work.mkdir(parents=True, exist_ok=True)
    f16 = args.work / f"{args.gguf.stem}.F16.gguf"
    if not f16.exists():
        requantize(args.gguf, f16, C.LLAMA_FTYPE_MOSTLY_F16)
    files = {}
    for name in args.types.split(","):
        path = args.work / f"{args.gguf.stem}.{name}.gguf"
        if not path.exists():
            requantize(f16, path, QUANT_FTYPES[name])
        files[name] = path
    rates: dict[str, list[float]] = {name: [] for name in files}
    names = list(files)
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]  # who goes first rotates
        for name in order:
            rates[name].append(raw_batched(files[name], args.seqs, args.tokens,
                                           args.threads)[1])
        print(f"round {r + 1}: " + ", ".join(f"{n} {rates[n][-1]:.1f}" for n in names),
              file=sys.stderr)
    medians = {n: statistics.median(v) for n, v in rates.items()}
    best = max(medians.values())
    print(f"{args.gguf.name} in each type, {args.seqs} sequence(s), {args.threads} threads, "
          f"{args.rounds} rounds of {args.tokens} tokens; "
          f"{C.llama_print_system_info().decode().strip()}")
    print("| type | file MB | decode tok/s (median) | / fastest |")
    print("|---|---|---|---|")
    for n in sorted(medians, key=lambda k: -medians[k]):
        print(f"| {n} | {files[n].stat().st_size / 1e6:.0f} | {medians[n]:.1f} | "
              f"{medians[n] / best:.2f} |")


if __name__ == "__main__":
    main()
