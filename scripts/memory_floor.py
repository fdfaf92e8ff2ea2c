"""The memory floor of decoding a model here: the bytes one decode step must read (every
weight but the token embedding, of which a step reads one row per token) over this machine's
read bandwidth, measured with the decode's thread count.

    python scripts/memory_floor.py MODEL.gguf [--threads N] [--gib 4]

Why a C reader: the bandwidth a decode meets is that of N threads streaming through memory
that is not in the caches; numpy reduces on one thread and a Python loop is far slower than
memory. The reader (compiled once with the system's cc, OpenMP, -O3 -march=native less AMX)
sums 64-bit words over a buffer several times the L3's size, each thread its own part, and
reports the best of a few passes, as a decode's weights are read once per step.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf

READER = r"""
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
int main(int argc, char **argv) {
    size_t bytes = (size_t) atof(argv[1]) * (1ull << 30);
    int passes = atoi(argv[2]);
    size_t n = bytes / sizeof(uint64_t);
    uint64_t *buf = aligned_alloc(64, n * sizeof(uint64_t));
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) buf[i] = i;  /* touched by the thread that reads it */
    double best = 0;
    uint64_t sink = 0;
    for (int p = 0; p < passes; p++) {
        double t0 = omp_get_wtime();
        uint64_t s = 0;
        #pragma omp parallel for schedule(static) reduction(+:s)
        for (size_t i = 0; i < n; i++) s += buf[i];
        double dt = omp_get_wtime() - t0;
        sink += s;
        if (bytes / dt > best) best = bytes / dt;
    }
    printf("%.3f %llu\n", best / 1e9, (unsigned long long) (sink & 1));
    return 0;
}
"""


def bandwidth(threads: int, gib: float, passes: int = 5) -> float:
    """GB/s (10^9 bytes) that `threads` threads read, the best of `passes`."""
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = Path(tmp, "read.c"), Path(tmp, "read")
        src.write_text(READER)
        subprocess.run(["cc", "-O3", "-march=native", "-mno-amx-tile", "-mno-amx-int8",
                        "-mno-amx-bf16", "-fopenmp", str(src), "-o", str(exe)], check=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OMP_PROC_BIND": "spread"}
        out = subprocess.run([str(exe), str(gib), str(passes)], env=env, check=True,
                             capture_output=True, text=True).stdout
    return float(out.split()[0])


def step_bytes(model: Path) -> tuple[int, int]:
    """(bytes a decode step reads, bytes of the file's tensors)."""
    reader = gguf.GGUFReader(model)
    total = sum(int(t.n_bytes) for t in reader.tensors)
    embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    # a tied embedding is the output matrix too: read whole
    skipped = 0 if embd is None or tied else int(embd.n_bytes)
    return total - skipped, total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--gib", type=float, default=4.0, help="buffer read (GiB)")
    args = ap.parse_args(argv)
    read, total = step_bytes(args.model)
    gbs = bandwidth(args.threads, args.gib)
    print(f"{args.model.name}: {total / 1e9:.2f} GB of tensors, {read / 1e9:.2f} GB read per "
          f"decode step")
    print(f"read bandwidth, {args.threads} threads: {gbs:.1f} GB/s")
    print(f"memory floor: {read / gbs / 1e6:.1f} ms a step, {gbs * 1e9 / read:.2f} tok/s at "
          f"one sequence")
    return 0


if __name__ == "__main__":
    sys.exit(main())
