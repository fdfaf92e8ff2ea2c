"""A big model loading beside a model that is serving, and what the big one takes in memory.

A client streams from a small model (SmolLM2) and, once it flows, a load of the big model is
asked for (`/api/generate` with no prompt, as `ollama run` preloads). Reported per turn: the
load's time, the stream's gaps between tokens while the big model is read and repacked (p50,
max), and then, with the big model loaded and after one decode (its compute buffers
allocated), its runner's resident memory (anonymous and file-backed, /proc/PID/status)
against the estimate the daemon made for it (`/api/ps` size). The big model is unloaded
between turns (keep_alive 0) and the page cache is left as it is: the first turn reads the
file from disk if it is not cached, the later ones from memory.

    python scripts/load_beside.py BIG.gguf [TURNS] [NUM_CTX]
"""

from __future__ import annotations

import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conftest import free_port, model_file

PORT = free_port()
URL = f"http://127.0.0.1:{PORT}"


def stream_story(stamps: list[float], started: threading.Event, stop: threading.Event) -> None:
    while not stop.is_set():
        body = {"model": "small", "stream": True, "max_tokens": 2000, "temperature": 0,
                "ignore_eos": True, "messages": [{"role": "user", "content": "Tell a story."}]}
        with httpx.stream("POST", URL + "/v1/chat/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    stamps.append(time.perf_counter())
                    if len(stamps) == 30:
                        started.set()
                if stop.is_set():
                    return


def gaps_ms(stamps: list[float], t0: float, t1: float) -> list[float]:
    first = max((i for i, t in enumerate(stamps) if t < t0), default=0)
    inside = [t for t in stamps[first:] if t <= t1]
    return [(b - a) * 1000 for a, b in itertools.pairwise(inside)]


def children(pid: int) -> list[int]:
    """Every process descended from `pid`."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def rss(pid: int) -> dict[str, int]:
    fields = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def main() -> None:
    big = Path(sys.argv[1])
    turns = int(sys.argv[2]) if len(sys.argv) > 2 else 2
    num_ctx = int(sys.argv[3]) if len(sys.argv) > 3 else 4096
    home = Path(tempfile.mkdtemp(prefix="llmrun-loadbeside-"))
    env = {**os.environ, "LLMRUN_HOME": str(home), "LLMRUN_HOST": f"127.0.0.1:{PORT}",
           "LLMRUN_NUM_PARALLEL": "1", "LLMRUN_CONTEXT_LENGTH": str(num_ctx)}
    for name, path in (("small", model_file("smollm2")), ("big", big)):
        (home / f"Modelfile.{name}").write_text(f"FROM {path}\n")
        subprocess.run([sys.executable, "-m", "llmrun", "create", name, "-f",
                        str(home / f"Modelfile.{name}")], env=env, check=True,
                       stdout=subprocess.DEVNULL)
    daemon = subprocess.Popen([sys.executable, "-m", "llmrun", "serve"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                httpx.get(URL + "/api/version", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        httpx.post(URL + "/api/generate", json={"model": "small"}, timeout=600)
        small_pids = set(children(daemon.pid))
        for t in range(turns):
            stamps: list[float] = []
            started, stop = threading.Event(), threading.Event()
            story = threading.Thread(target=stream_story, args=(stamps, started, stop))
            story.start()
            started.wait(120)
            before = gaps_ms(stamps, 0, time.perf_counter())
            t0 = time.perf_counter()
            r = httpx.post(URL + "/api/generate", json={"model": "big"}, timeout=1800)
            r.raise_for_status()
            load_s = time.perf_counter() - t0
            gaps = gaps_ms(stamps, t0, time.perf_counter())
            stop.set()
            story.join()
            print(f"turn {t + 1}: the big model loaded in {load_s:.1f} s beside a stream; the "
                  f"stream's gaps before p50 {statistics.median(before):.1f} ms, during the "
                  f"load p50 {statistics.median(gaps):.1f} / max {max(gaps):.0f} ms over "
                  f"{len(gaps)} tokens")
            httpx.post(URL + "/api/generate", timeout=1800, json={
                "model": "big", "prompt": "Hello", "stream": False,
                "options": {"num_predict": 4}}).raise_for_status()
            ps = {m["name"]: m for m in httpx.get(URL + "/api/ps", timeout=30).json()["models"]}
            estimate = int(ps["big:latest"]["size"])
            runners = [p for p in children(daemon.pid) if p not in small_pids]
            mem = max((rss(p) for p in runners), key=lambda m: m.get("VmRSS", 0))
            print(f"  resident: {mem['VmRSS'] / 2**30:.2f} GiB (anonymous "
                  f"{mem['RssAnon'] / 2**30:.2f}, file {mem['RssFile'] / 2**30:.2f}, peak "
                  f"{mem['VmHWM'] / 2**30:.2f}); the daemon's estimate "
                  f"{estimate / 2**30:.2f} GiB, {estimate / mem['VmRSS']:.3f} of resident")
            httpx.post(URL + "/api/generate", json={"model": "big", "keep_alive": 0},
                       timeout=600)
            time.sleep(2)
    finally:
        daemon.terminate()
        daemon.wait(30)


if __name__ == "__main__":
    main()
