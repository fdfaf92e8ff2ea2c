"""What one engine step costs: a generating row beside a prompt chunk.

Sequence 0 stands for a streaming neighbour: its context is filled to NEIGHBOUR cells once,
and every step decodes one more row of it. Sequence 1 stands for a long prompt: before each
measurement it holds DEPTH cells, and the step writes a chunk of N of its tokens beside the
neighbour's row. The time of that decode, median of --repeat, is printed per (depth, N),
with the step's time per prompt token (a column of docs/benchmarks-log.md's tables) and the
marginal cost of one, once the neighbour's row alone (N = 0 in --chunks) is taken off.

It drives `engine/llama/`'s Context, as the batcher does (separate KV streams, the same
batch and ubatch sizes), with no daemon or runner around it.

    python scripts/step_cost.py MODEL.gguf [--threads 2] [--flash-attn on|off|auto]
        [--depths 0,1500,2900] [--chunks 0,8,16,64,128] [--neighbour 1000] [--repeat 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from llmrun.engine.llama import Batch, Context, Model

FLASH = {"on": True, "off": False, "auto": None}


def fill(ctx: Context, batch: Batch, seq: int, start: int, n: int, token: int) -> None:
    """Write n cells of `seq` from position `start`, in ubatch-sized pieces."""
    pos = start
    while pos < start + n:
        batch.clear()
        for p in range(pos, min(start + n, pos + ctx.n_ubatch)):
            batch.add(token + p % 97, p, seq, False)
        if ctx.decode(batch) != 0:
            raise SystemExit("decode failed while filling the context")
        pos += batch.n


def step(ctx: Context, batch: Batch, neighbour_pos: int, depth: int, n: int) -> float:
    """Seconds for one decode of the neighbour's next row plus n prompt tokens at `depth`."""
    batch.clear()
    batch.add(500, neighbour_pos, 0, True)
    for i in range(n):
        batch.add(1000 + (depth + i) % 97, depth + i, 1, i == n - 1)
    t0 = time.perf_counter()
    if ctx.decode(batch) != 0:
        raise SystemExit("decode failed")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--flash-attn", choices=list(FLASH), default="auto")
    ap.add_argument("--depths", default="0,1500,2900")
    ap.add_argument("--chunks", default="0,8,16,64,128")
    ap.add_argument("--neighbour", type=int, default=1000, help="cells the neighbour holds")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    depths = [int(d) for d in args.depths.split(",")]
    chunks = [int(n) for n in args.chunks.split(",")]
    need = max(depths) + max(chunks) + 1
    n_ctx = max(args.neighbour + args.repeat * len(depths) * len(chunks) + 2, need)

    model = Model(args.model)
    ctx = Context(model, n_ctx_seq=-(-n_ctx // 256) * 256, n_seq=2, n_batch=512,
                  n_threads=args.threads, flash_attn=FLASH[args.flash_attn])
    batch = Batch(512)
    fill(ctx, batch, 0, 0, args.neighbour, 300)
    step(ctx, batch, args.neighbour, 0, 8)  # the first decode of a shape sets up its graph
    neighbour_pos = args.neighbour + 1
    print(f"{args.model.name}: {args.threads} threads, flash attention {args.flash_attn}, "
          f"neighbour at {args.neighbour} cells, median of {args.repeat}")
    print("| depth | N | step ms | step ms / N | (step - row alone) ms / N |")
    print("|---|---|---|---|---|")
    for depth in depths:
        ctx.seq_rm(1, 0)
        fill(ctx, batch, 1, 0, depth, 1000)
        alone: float | None = None
        for n in chunks:
            times = []
            for _ in range(args.repeat):
                ctx.seq_rm(1, depth)  # the chunk is written from the same depth each time
                times.append(step(ctx, batch, neighbour_pos, depth, n))
                neighbour_pos += 1
            ms = statistics.median(times) * 1000
            if n == 0:
                alone = ms
            per = f"{ms / n:.1f}" if n else "-"
            marginal = f"{(ms - alone) / n:.1f}" if n and alone is not None else "-"
            print(f"| {depth:,} | {n} | {ms:.0f} | {per} | {marginal} |", flush=True)
    batch.close()
    ctx.close()
    model.close()


if __name__ == "__main__":
    main()
