"""A model of the size people run, llmrun against llama-server, one server in memory at a time.

    python scripts/bench_big.py BIG.gguf LLAMA_SERVER [--levels 1,4] [--tokens 24]
        [--rounds 2] [--threads 2]

Why not scripts/bench_vs_llama_server.sh: it keeps both servers loaded and loads the raw
loop's copy beside them. An 8B-class model takes ~4.3 GB of repacked weights in each process
plus the file's 4.7 GB of page cache; three of them on a 24 GB machine left the page cache
too small for the file, and every decode step read weights from disk again (0.4 tok/s where
the loop alone makes 2.4). Here each round starts one server, measures every level on it
(`llmrun bench`'s load: streaming /v1/chat/completions, greedy, a fresh prompt per request,
decode tok/s over the window where all N decode), stops it, then the other, then the raw
decode loop on the same file; the order flips each round. Reported: each one's median, the
median over rounds of llmrun / llama-server and of each against the raw loop, and the
memory floor (scripts/memory_floor.py: the bytes a step reads over this machine's read
bandwidth with the same threads).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import memory_floor

from llmrun.bench.baselines import raw_batched
from llmrun.bench.load import level
from llmrun.bench.measure import _run_async
from tests.conftest import free_port


def wait(url: str, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(3000):
        if proc.poll() is not None:
            raise SystemExit(f"the server at {url} exited")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not answer")


def start(which: str, gguf: Path, server: str, threads: int, slots: int, ctx: int,
          home: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    port = free_port()
    if which == "llama-server":
        proc = subprocess.Popen([server, "-m", str(gguf), "-t", str(threads), "-tb",
                                 str(threads), "-np", str(slots), "-c", str(slots * ctx),
                                 "-b", "512", "-fa", "on", "--host", "127.0.0.1", "--port",
                                 str(port), "--no-webui"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        url, model = f"http://127.0.0.1:{port}", "big"
        wait(url + "/health", proc)
    else:
        env = {**os.environ, "LLMRUN_HOME": str(home), "LLMRUN_HOST": f"127.0.0.1:{port}",
               "LLMRUN_NUM_THREADS": str(threads), "LLMRUN_NUM_PARALLEL": str(slots),
               "LLMRUN_CONTEXT_LENGTH": str(ctx)}
        proc = subprocess.Popen([sys.executable, "-m", "llmrun", "serve"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url, model = f"http://127.0.0.1:{port}", "big"
        wait(url + "/api/version", proc)
    _run_async(level(url, model, 1, 4, api="openai"))  # loaded and warm
    return proc, url, model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", type=Path)
    ap.add_argument("server")
    ap.add_argument("--levels", default="1,4")
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--ctx", type=int, default=4096)
    args = ap.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    slots = max(levels)
    home = Path(tempfile.mkdtemp(prefix="llmrun-benchbig-"))
    env = {**os.environ, "LLMRUN_HOME": str(home)}
    (home / "Modelfile").write_text(f"FROM {args.gguf}\n")
    subprocess.run([sys.executable, "-m", "llmrun", "create", "big", "-f",
                    str(home / "Modelfile")], env=env, check=True, stdout=subprocess.DEVNULL)
    rates: dict[str, dict[int, list[float]]] = {
        w: {n: [] for n in levels} for w in ("llmrun", "llama-server", "raw")}
    ttft: dict[str, dict[int, list[float]]] = {w: {n: [] for n in levels}
                                               for w in ("llmrun", "llama-server")}
    for r in range(args.rounds):
        order = ["llmrun", "llama-server"] if r % 2 == 0 else ["llama-server", "llmrun"]
        for which in order:
            proc, url, model = start(which, args.gguf, args.server, args.threads, slots,
                                     args.ctx, home)
            try:
                for n in levels:
                    res = _run_async(level(url, model, n, args.tokens, api="openai"))
                    rates[which][n].append(res["decode_tok_s"])
                    ttft[which][n].append(res["ttft_p50"])
                    print(f"round {r + 1} {which} x{n}: decode {res['decode_tok_s']:.2f} tok/s, "
                          f"TTFT p50 {res['ttft_p50']:.1f} s", flush=True)
            finally:
                proc.terminate()
                proc.wait(60)
        for n in levels:
            rates["raw"][n].append(raw_batched(args.gguf, n, args.tokens, args.threads)[1])
            print(f"round {r + 1} raw x{n}: decode {rates['raw'][n][-1]:.2f} tok/s", flush=True)
    step, _ = memory_floor.step_bytes(args.gguf)
    gbs = memory_floor.bandwidth(args.threads, 4.0)
    floor = gbs * 1e9 / step
    print(f"\n{args.gguf.name}, {args.tokens} tokens a request, {args.threads} threads, "
          f"{args.rounds} rounds; memory floor {floor:.2f} tok/s a sequence ({step / 1e9:.2f} "
          f"GB a step at {gbs:.1f} GB/s)")
    print("| streams | llmrun decode tok/s | llama-server | raw decode loop | llmrun / "
          "llama-server | llmrun / raw | llama-server / raw | raw / memory floor | "
          "TTFT p50 llmrun, llama-server (s) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n in levels:
        a, b, c = (rates[w][n] for w in ("llmrun", "llama-server", "raw"))
        med = statistics.median
        print(f"| {n} | {med(a):.2f} | {med(b):.2f} | {med(c):.2f} | "
              f"{med(x / y for x, y in zip(a, b, strict=True)):.2f} | "
              f"{med(x / y for x, y in zip(a, c, strict=True)):.2f} | "
              f"{med(x / y for x, y in zip(b, c, strict=True)):.2f} | "
              f"{med(c) / (floor * n):.2f} | "
              f"{med(ttft['llmrun'][n]):.1f}, {med(ttft['llama-server'][n]):.1f} |")


if __name__ == "__main__":
    main()
