"""Prompt reading alone, llmrun against other OpenAI-compatible servers (llama-server, stock
and patched) on the same GGUF and threads, in alternating turns: does llmrun, with stall-free
batching, still read a prompt alone at full speed?

Each turn sends a fresh prompt (a unique first line, so no cache helps) with max_tokens 1;
the time to the answer is the time to read the prompt and sample one token.

    python scripts/prefill_vs.py LLMRUN_URL MODEL OTHER_URL[,OTHER_URL...] WORDS TURNS

Each turn reads one prompt on every server, in the opposite order to the turn before; the
end prints each server's median and its rate over llmrun's, the median of the per-turn
ratios (a turn's servers run minutes apart at most, while the machine drifts more).
"""

from __future__ import annotations

import statistics
import sys
import time
import uuid

import httpx

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "the", "lazy", "dog", "while",
         "seven", "wizards", "quietly", "judge", "boxing", "matches", "near", "a", "frozen",
         "river"]


def prompt_of(n_words: int) -> str:
    body = " ".join(WORDS[i % len(WORDS)] for i in range(n_words))
    return f"[{uuid.uuid4()}] {body}\nSummarise."


def read(url: str, model: str, text: str) -> tuple[float, int]:
    """(seconds to the answer, prompt tokens) of one request."""
    t0 = time.perf_counter()
    r = httpx.post(url + "/v1/chat/completions", timeout=1800, json={
        "model": model, "messages": [{"role": "user", "content": text}], "max_tokens": 1,
        "temperature": 0})
    r.raise_for_status()
    return time.perf_counter() - t0, int(r.json()["usage"]["prompt_tokens"])


def main() -> None:
    llmrun_url, model, other_urls, n_words, turns = sys.argv[1:6]
    servers = [("llmrun", llmrun_url, model)]
    servers += [(url.split("://", 1)[-1], url, model) for url in other_urls.split(",") if url]
    for _, url, name in servers:
        read(url, name, "hi")  # loaded before the clock starts
    rates: dict[str, list[float]] = {label: [] for label, _, _ in servers}
    for turn in range(int(turns)):
        for label, url, name in servers if turn % 2 == 0 else servers[::-1]:
            seconds, tokens = read(url, name, prompt_of(int(n_words)))
            rates[label].append(tokens / seconds)
            print(f"{label}: {tokens} tokens in {seconds:.2f} s, {tokens / seconds:.0f} tok/s",
                  flush=True)
    for label, values in rates.items():
        over = statistics.median(a / b for a, b in zip(rates["llmrun"], values, strict=True))
        print(f"{label}: median {statistics.median(values):.0f} tok/s; llmrun / {label}, "
              f"the median of the turns' ratios: {over:.3f}")


if __name__ == "__main__":
    main()
