"""An image read beside a streaming client: does the stream stand still while the vision
encoder runs and the image's positions are read? The claim measured: image chunks are
evaluated within continuous batching without stalling other sequences.

Makes a vision model of SmolLM2 and a random projector the size of CLIP ViT-B/14 at 224 px
(12 layers, 768 wide, 256 image positions: tests/fakes/vision.py's generator, bigger), serves it
from a scratch LLMRUN_HOME, then:
1. an image request alone (a fresh image each turn): its time to the first token;
2. a client streams a story (ignore_eos) and, once it flows, an image request is sent: the
   stream's gaps between tokens until the image request's first token.

    python scripts/vision_stall.py [TURNS]
"""

from __future__ import annotations

import base64
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

from tests import vision
from tests.conftest import free_port, model_file

PORT = free_port()
URL = f"http://127.0.0.1:{PORT}"


def big_projector(path: Path) -> Path:
    """ViT-B/14 at 224 px: 16 x 16 patches, 256 image positions."""
    for name, value in (("IMAGE_SIZE", 224), ("PATCH_SIZE", 14), ("V_EMBD", 768),
                        ("V_FF", 3072), ("V_HEAD", 12), ("V_LAYER", 12)):
        setattr(vision, name, value)
    vision.N_IMAGE_TOKENS = (224 // 14) ** 2
    return vision.write_projector(path)


def image_request(seed: int) -> tuple[float, int]:
    """(seconds to the first token, prompt tokens) of a question about a fresh image."""
    png = base64.b64encode(vision.image(seed, (224, 224))).decode()
    t0 = time.perf_counter()
    r = httpx.post(URL + "/v1/chat/completions", timeout=600, json={
        "model": "vis", "max_tokens": 1, "temperature": 0, "messages": [{"role": "user",
        "content": [{"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}},
                    {"type": "text", "text": "What is this?"}]}]})
    r.raise_for_status()
    return time.perf_counter() - t0, int(r.json()["usage"]["prompt_tokens"])


def stream_story(stamps: list[float], started: threading.Event) -> None:
    body = {"model": "vis", "stream": True, "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "messages": [{"role": "user", "content": "Tell a story."}]}
    with httpx.stream("POST", URL + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                stamps.append(time.perf_counter())
                if len(stamps) == 30:
                    started.set()


def gaps_ms(stamps: list[float], t0: float, t1: float) -> list[float]:
    """Gaps between the stream's tokens from the last one before t0 to the last before t1."""
    first = max((i for i, t in enumerate(stamps) if t < t0), default=0)
    inside = [t for t in stamps[first:] if t <= t1]
    return [(b - a) * 1000 for a, b in itertools.pairwise(inside)]


def main() -> None:
    turns = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    home = Path(tempfile.mkdtemp(prefix="llmrun-vision-"))
    smollm2 = model_file("smollm2")
    mmproj = big_projector(home / "mmproj-vitb.gguf")
    env = {**os.environ, "LLMRUN_HOME": str(home), "LLMRUN_HOST": f"127.0.0.1:{PORT}",
           "LLMRUN_NUM_PARALLEL": "2", "LLMRUN_CONTEXT_LENGTH": "2048"}
    (home / "Modelfile").write_text(f"FROM {smollm2}\nFROM {mmproj}\n")
    subprocess.run([sys.executable, "-m", "llmrun", "create", "vis", "-f",
                    str(home / "Modelfile")], env=env, check=True)
    daemon = subprocess.Popen([sys.executable, "-m", "llmrun", "serve"], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                httpx.get(URL + "/api/version", timeout=1)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        image_request(0)  # loaded before the clock starts
        alone = [image_request(1000 + t) for t in range(turns)]
        for seconds, tokens in alone:
            print(f"image alone: {tokens} prompt tokens, first token after {seconds:.2f} s")
        for t in range(turns):
            stamps: list[float] = []
            started = threading.Event()
            story = threading.Thread(target=stream_story, args=(stamps, started))
            story.start()
            started.wait(120)
            before = gaps_ms(stamps, 0, time.perf_counter())
            t0 = time.perf_counter()
            seconds, _ = image_request(2000 + t)
            gaps = gaps_ms(stamps, t0, time.perf_counter())
            story.join()
            stalled = sum(g for g in gaps if g > 100) / 1000
            print(f"beside a stream: image first token after {seconds:.2f} s; the stream's "
                  f"gaps before p50 {statistics.median(before):.1f} ms, while the image was "
                  f"read p50 {statistics.median(gaps):.1f} / max {max(gaps):.0f} ms over "
                  f"{len(gaps)} tokens, stood still {stalled:.2f} s (gaps over 100 ms: "
                  f"{', '.join(f'{g:.0f}' for g in gaps if g > 100)})")
    finally:
        daemon.terminate()
        daemon.wait(30)


if __name__ == "__main__":
    main()
