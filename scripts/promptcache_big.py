"""The prompt cache at the size of the models people run: an 8B-class model's state of a
16k-token prompt (scripts/make_big_model.sh makes the model; Qwen2.5-7B's shape keeps
56 KiB of KV cache a token, so about 0.9 GB).

    python scripts/promptcache_big.py BIG.gguf [WORDS] [BUDGET]

One daemon (1 slot of 32768 tokens, 2 threads, the cache's disk budget BUDGET, default
1.5GiB), with its own store; the steps, each reported with its times:
1. a WORDS-word prompt (default 15500: ~16k tokens) read cold: the time to its answer;
2. the moment the answer arrives, SIGTERM to the daemon's process group (a terminal's
   Ctrl+C) while the state is being written: the runner finishes the write, and the state's
   file is whole (its size), with no temporary file left;
3. a new daemon, the same prefix and another question: the time to the answer, restored
   from the file;
4. a second, different prompt of half the words: the cache's files stay within BUDGET
   (the first state is evicted when both do not fit).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmrun.config import parse_size
from tests.conftest import free_port

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while",
         "seven", "wizards", "quietly", "judge", "boxing", "matches", "near", "a", "frozen",
         "river"]
PORT = free_port()
URL = f"http://127.0.0.1:{PORT}"


def system_prompt(n_words: int) -> str:
    return f"[{uuid.uuid4()}] " + " ".join(WORDS[i % len(WORDS)] for i in range(n_words))


def ask(system: str, question: str) -> tuple[float, int, int]:
    """(seconds to the answer, prompt tokens, tokens from the cache) of one request."""
    t0 = time.perf_counter()
    r = httpx.post(URL + "/v1/chat/completions", timeout=3600, json={
        "model": "big", "max_tokens": 1, "temperature": 0, "messages": [
            {"role": "system", "content": system}, {"role": "user", "content": question}]})
    r.raise_for_status()
    usage = r.json()["usage"]
    return (time.perf_counter() - t0, usage["prompt_tokens"],
            usage["prompt_tokens_details"]["cached_tokens"])


def serve(env: dict[str, str]) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "llmrun", "serve"], env=env,
                            start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            httpx.get(URL + "/api/version", timeout=1)
            return proc
        except httpx.TransportError:
            time.sleep(0.1)
    raise SystemExit("the daemon did not answer")


def files(home: Path) -> list[Path]:
    return sorted(p for p in (home / "prompt-cache").glob("*/*") if p.is_file())


def main() -> None:
    big = Path(sys.argv[1])
    n_words = int(sys.argv[2]) if len(sys.argv) > 2 else 15500
    budget = sys.argv[3] if len(sys.argv) > 3 else "1.5GiB"
    home = Path(tempfile.mkdtemp(prefix="llmrun-bigcache-"))
    env = {**os.environ, "LLMRUN_HOME": str(home), "LLMRUN_HOST": f"127.0.0.1:{PORT}",
           "LLMRUN_NUM_PARALLEL": "1", "LLMRUN_CONTEXT_LENGTH": "32768",
           "LLMRUN_NUM_THREADS": "2", "LLMRUN_PROMPT_CACHE_SIZE": budget}
    (home / "Modelfile").write_text(f"FROM {big}\n")
    subprocess.run([sys.executable, "-m", "llmrun", "create", "big", "-f",
                    str(home / "Modelfile")], env=env, check=True, stdout=subprocess.DEVNULL)
    proc = serve(env)
    try:
        httpx.post(URL + "/api/generate", json={"model": "big"}, timeout=1800)  # loaded
        system = system_prompt(n_words)
        seconds, n, cached = ask(system, "Why is the sky blue?")
        answered = time.perf_counter()
        print(f"1. cold: {n} prompt tokens ({cached} cached) in {seconds:.1f} s, "
              f"{n / seconds:.1f} tok/s", flush=True)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(600)
        stopped = time.perf_counter() - answered
        kept = files(home)
        print(f"2. group stop at the answer: the daemon and its runner exited {stopped:.1f} s "
              f"later; files {[(p.suffix, p.stat().st_size) for p in kept]}", flush=True)
        proc = serve(env)
        seconds, n2, cached2 = ask(system, "Name three prime numbers.")
        print(f"3. a new daemon, the same prefix: {n2} prompt tokens, {cached2} from the cache, "
              f"answered in {seconds:.2f} s (the load included)", flush=True)
        seconds, n3, _ = ask(system_prompt(n_words // 2), "Why is the sky blue?")
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and len(files(home)) < 2 and sum(
                p.stat().st_size for p in files(home)) < parse_size(budget) // 2:
            time.sleep(1)
        time.sleep(5)
        total = sum(p.stat().st_size for p in files(home))
        print(f"4. a second prompt ({n3} tokens, {seconds:.1f} s): the cache holds "
              f"{len(files(home))} file(s), {total / 2**30:.2f} GiB, budget {budget}",
              flush=True)
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)


if __name__ == "__main__":
    main()
