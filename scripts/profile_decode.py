"""Where a decode step's time goes: perf's flat profile of the raw decode loop
(llmrun/bench/baselines.raw_batched: N sequences, one llama_decode per step, greedy), its
symbols grouped by what they do (the matrix products by weight type, the activations'
quantization, attention, norms, the threads' synchronisation), printed as a markdown table.

    python scripts/profile_decode.py MODEL.gguf [--seqs 1] [--tokens 512] [--threads 2]

Needs Linux `perf` (Debian's linux-perf) and symbols in llama.cpp's libraries (ggml's are
exported, so a release build names its kernels). The prompts' prefill is in the profile too,
a few percent of it at 512 tokens; the table says how many samples it holds.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

# (group, pattern over the symbol) in order: the first that matches names the group
GROUPS = [
    # (the 8x8 kernels of llama-patches 0006-0008 take repacked weights: gemv/gemm_q4_1_8x8)
    ("matmul Q4_1", r"vec_dot_q4_1_q8_1|q4_1_8x8"),
    ("matmul Q4_0", r"vec_dot_q4_0|gemv_q4_0|gemm_q4_0"),
    ("matmul Q8_0", r"vec_dot_q8_0_q8_0|gemv_q8_0|gemm_q8_0|q8_0_8x8"),
    ("matmul Q5_0", r"vec_dot_q5_0|q5_0_8x8"),
    ("matmul Q4_K", r"vec_dot_q4_K|gemv_q4_K|gemm_q4_K"),
    ("matmul Q5_K / Q6_K", r"vec_dot_q[56]_K"),
    ("matmul F16 / F32", r"vec_dot_f16|vec_dot_f32|sgemm|tinyBLAS"),
    ("quantize activations (to Q8)", r"quantize_row_q8|quantize_q8"),
    ("flash attention (its expf included)", r"flash_attn|expf"),
    ("softmax", r"soft_max"),
    ("norms", r"rms_norm|norm_f32|ggml_compute_forward_norm"),
    ("rope", r"rope"),
    ("elementwise (add, mul, silu, glu, cpy, get_rows)",
     r"forward_add|forward_mul|silu|swiglu|geglu|gelu|forward_cpy|get_rows|vec_mad|vec_scale|"
     r"forward_dup|forward_scale|forward_set_rows|fp16_to_fp32|fp32_to_fp16"),
    # (numpy's OpenBLAS threads, blas_thread_server, are idle workers of the same kind)
    ("threads: barrier and spin",
     r"barrier|sched_yield|omp|gomp|spin|futex|atomic|blas_thread_server"),
    ("graph build and scheduling", r"ggml_graph|ggml_backend_sched|ggml_gallocr|ggml_new|"
     r"llm_build|llama_.*graph|ggml_visit|ggml_hash"),
    ("sampling", r"sampler|llama_sampler|argmax"),
    ("Python", r"^_?Py|^py|pymalloc|_PyEval"),
    ("kernel", r"^\[k\]|entry_SYSCALL|do_syscall|page_fault|clear_page|native_"),
    # static functions perf cannot name in the wheel's stripped library: llamafile's
    # tinyBLAS kernels (sgemm.cpp, a product of several rows in supported types) and the
    # repacked weights' 8x8 kernels (repack.cpp); a build with symbols names them
    ("libggml-cpu, unnamed (repacked 8x8 kernels, tinyBLAS)", r"^0x\S+ in libggml-cpu"),
]
LINE = re.compile(r"^\s*([0-9.]+)%\s+(\S+)\s+\[(.)\]\s+(.+?)(?:\s+-\s+-)?\s*$")


def profile(gguf: Path, seqs: int, tokens: int,
            threads: int) -> tuple[list[tuple[float, str]], int, float]:
    """(percent, symbol) of the flat profile, the samples it holds, and the loop's decode
    tokens/s (all sequences), as measured under perf."""
    code = ("from pathlib import Path; from llmrun.bench.baselines import raw_batched; "
            f"print(raw_batched(Path({str(gguf)!r}), {seqs}, {tokens}, {threads}))")
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "perf.data"
        run = subprocess.run(["perf", "record", "-q", "-F", "1999", "-o", str(data), "--",
                              sys.executable, "-c", code], check=True, stdout=subprocess.PIPE,
                             text=True)
        rate = float(run.stdout.strip().strip("()").split(",")[1])
        report = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--no-children",
                                 "--sort", "dso,symbol", "--percent-limit", "0.05"],
                                check=True, capture_output=True, text=True).stdout
    rows, samples = [], 0
    for line in report.splitlines():
        if m := re.search(r"Samples: (\d+)([KM]?)", line):
            samples = int(float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6}[m.group(2)])
        if m := LINE.match(line):
            dso, kind, sym = m.group(2), m.group(3), m.group(4).strip()
            if sym.startswith("0x"):  # no symbol: the library says what it is
                sym = f"{sym} in {dso}"
            rows.append((float(m.group(1)), f"[k] {sym}" if kind == "k" else sym))
    return rows, samples, rate


def grouped(rows: list[tuple[float, str]]) -> dict[str, float]:
    out: dict[str, float] = defaultdict(float)
    for pct, sym in rows:
        name = next((g for g, pat in GROUPS if re.search(pat, sym)), "other")
        out[name] += pct
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("--seqs", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--top", type=int, default=12, help="symbols listed under the groups")
    a = ap.parse_args()
    rows, samples, rate = profile(a.gguf, a.seqs, a.tokens, a.threads)
    print(f"{a.gguf.name}, {a.seqs} sequence(s), {a.tokens} tokens each, {a.threads} threads, "
          f"{samples} samples; decode {rate:.1f} tok/s ({1000 * a.seqs / rate:.2f} ms a step) "
          "under perf\n")
    print("| group | % of samples |\n|---|---|")
    for name, pct in grouped(rows).items():
        print(f"| {name} | {pct:.1f} |")
    print("\n| symbol | % |\n|---|---|")
    for pct, sym in rows[:a.top]:
        print(f"| `{sym}` | {pct:.1f} |")


if __name__ == "__main__":
    main()
