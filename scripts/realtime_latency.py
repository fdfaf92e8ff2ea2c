"""The realtime transcription session's latency: from an utterance's last chunk (its commit)
to its first partial text, alone and beside a streaming chat client, and that client's gaps
between tokens meanwhile.

Serves SmolLM2 with tests/fakes/audio.py's random Qwen3-ASR-style projector from a scratch
LLMRUN_HOME (the pipeline's cost, not a real speech model's), then for each of TURNS
utterances of 2.5 s, sent in 10 chunks of varying size as 24 kHz PCM16 over
`/v1/realtime?intent=transcription`, times commit -> first `.delta` and -> `.completed`.
A second round does the same while a client streams a story (ignore_eos) on the same model.

    python scripts/realtime_latency.py [TURNS] [--burst]

Chunks are sent at the pace they are heard (a microphone's), so each second has been read
into the model before the commit; --burst sends them all at once, then the commit, which
then waits for the reads queued before it.
"""

from __future__ import annotations

import base64
import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conftest import Daemon, model_file
from tests.fakes.audio import noise, pcm16, write_projector

RATE = 24_000
SIZES = [1, 480, 24000, 7, 9600, 333, 12000, 12, 8000]  # samples; the 10th takes the rest
PACED = "--burst" not in sys.argv  # --burst: every chunk at once, then the commit


def utterances(ws: object, turns: int) -> list[tuple[float, float]]:
    """(commit -> first delta, commit -> completed) for each utterance, in seconds."""
    out = []
    for turn in range(turns):
        pcm = pcm16(noise(2.5, seed=turn, rate=RATE))
        at, pieces = 0, []
        for n in SIZES:
            pieces.append(pcm[at:at + 2 * n])
            at += 2 * n
        pieces.append(pcm[at:])
        for piece in pieces:
            ws.send(json.dumps({"type": "input_audio_buffer.append",  # type: ignore[attr-defined]
                                "audio": base64.b64encode(piece).decode()}))
            if PACED:  # as a microphone sends it: each chunk once it has been heard
                time.sleep(len(piece) / 2 / RATE)
        t0 = time.perf_counter()
        ws.send(json.dumps({"type": "input_audio_buffer.commit"}))  # type: ignore[attr-defined]
        first = None
        while True:
            event = json.loads(ws.recv(timeout=600))  # type: ignore[attr-defined]
            if event["type"].endswith(".delta") and first is None:
                first = time.perf_counter() - t0
            if event["type"].endswith(".completed"):
                out.append((first if first is not None else 0.0, time.perf_counter() - t0))
                break
            if event["type"] == "error":
                raise RuntimeError(event)
    return out


def stream_story(url: str, stamps: list[float], stop: threading.Event) -> None:
    body = {"model": "ears", "stream": True, "max_tokens": 4000, "ignore_eos": True,
            "temperature": 0, "messages": [{"role": "user", "content": "Tell me a story."}]}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
            if stop.is_set():
                break


def pct(values: list[float], q: float) -> float:
    return sorted(values)[min(len(values) - 1, int(q * len(values)))]


def report(name: str, rows: list[tuple[float, float]]) -> None:
    firsts, dones = [r[0] for r in rows], [r[1] for r in rows]
    print(f"| {name} | {len(rows)} | {statistics.median(firsts) * 1000:.0f} | "
          f"{pct(firsts, 0.95) * 1000:.0f} | {statistics.median(dones) * 1000:.0f} | "
          f"{pct(dones, 0.95) * 1000:.0f} |")


def main() -> None:
    from websockets.sync.client import connect

    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    turns = int(args[0]) if args else 10
    home = Path(tempfile.mkdtemp(prefix="llmrun-rt-"))
    from llmrun.store import Store

    mmproj = write_projector(home / "mmproj-audio.gguf")
    Store(home).create("ears", f"FROM {model_file('smollm2')}\nFROM {mmproj}\n")
    daemon = Daemon(home).start()  # tests' helper: serve from a scratch home, until it answers
    url = daemon.url
    try:
        ws_url = url.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
        with connect(ws_url, max_size=None) as ws:
            ws.recv(timeout=30)
            ws.send(json.dumps({"type": "transcription_session.update", "session": {
                "input_audio_transcription": {"model": "ears"}, "turn_detection": None}}))
            ws.recv(timeout=30)
            utterances(ws, 1)  # loads the model, warms the encoder
            alone = utterances(ws, turns)
            stamps: list[float] = []
            stop = threading.Event()
            story = threading.Thread(target=stream_story, args=(url, stamps, stop),
                                     daemon=True)
            story.start()
            while len(stamps) < 5:
                time.sleep(0.05)
            t0 = time.perf_counter()
            beside = utterances(ws, turns)
            t1 = time.perf_counter()
            stop.set()
        gaps = [b - a for a, b in itertools.pairwise(stamps) if t0 <= b <= t1]
        print("| utterances | n | first text p50 ms | p95 | completed p50 ms | p95 |")
        print("|---|---|---|---|---|---|")
        report("alone", alone)
        report("beside a chat stream", beside)
        if gaps:
            print(f"\nchat stream meanwhile: {len(gaps)} gaps, p50 "
                  f"{statistics.median(gaps) * 1000:.0f} ms, p95 {pct(gaps, 0.95) * 1000:.0f} "
                  f"ms, max {max(gaps) * 1000:.0f} ms")
    finally:
        daemon.stop()


if __name__ == "__main__":
    main()
