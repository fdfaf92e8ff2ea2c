"""The GPU path on a machine without a GPU: llama.cpp's Vulkan backend on Mesa's CPU Vulkan
driver (lavapipe, a real Vulkan device with a 2 GiB heap), through the real daemon.

The daemon under test runs from the environment `make test` builds with the Vulkan backend
(scripts/vulkan-env.sh: `.venv-vulkan`), so the suite's own environment keeps the CPU build.
ggml leaves CPU-type Vulkan devices out unless they are named: GGML_VK_VISIBLE_DEVICES=0.

What is checked: the device is listed; a model is fitted onto it whole when nothing says
otherwise, or in part (`num_gpu`), and `ps` says so as Ollama does; its greedy answer is the
CPU's within a stated bound (MAX_LOGPROB_GAP); the strict sandbox holds with the device
opened before confinement.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmrun.server.devices import parse
from llmrun.store import Store
from tests.ci_groups import needs
from tests.conftest import Daemon, make_home, runner_pids

ROOT = Path(__file__).resolve().parents[2]
VENV = ROOT / ".venv-vulkan"
PYTHON = VENV / "bin" / "python"
WHY = Path(f"{VENV}.why")
VISIBLE = {"GGML_VK_VISIBLE_DEVICES": "0"}


def _unavailable() -> str:
    """Why there is no Vulkan environment here ("": there is one). The tests then fail,
    unless LLMRUN_TEST_SKIP=vulkan (tests/ci_groups.py)."""
    if WHY.exists():  # written by the last scripts/vulkan-env.sh that failed, removed by one
        return f"{WHY.read_text().strip()} (recorded in {WHY.name} by scripts/vulkan-env.sh)"
    if not PYTHON.exists():
        return (f"no {VENV.name} (make test builds it: scripts/vulkan-env.sh .venv/bin/python "
                f"{VENV.name})")
    return ""


pytestmark = needs("vulkan", _unavailable)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at",
           "Once upon a time, in a small village,"]


class VulkanDaemon(Daemon):
    """The daemon run by the Vulkan environment's Python (its runners then are too)."""

    def command(self, *args: str) -> list[str]:
        return [str(PYTHON), "-m", "llmrun", "serve", *args]


@pytest.fixture(scope="module")
def vk(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Daemon]:
    home = make_home(tmp_path_factory.mktemp("vulkan-home"), smollm2_path)
    d = VulkanDaemon(home, env={**VISIBLE, "LLMRUN_SANDBOX": "strict",
                                "LLMRUN_NUM_PARALLEL": "1"}).start()
    yield d
    d.stop()


def _generate(d: Daemon, prompt: str, logprobs: bool = False, top_logprobs: int = 0,
              model: str = "smollm2", **options: Any) -> dict[str, Any]:
    r = httpx.post(d.url + "/api/generate", timeout=600, json={
        "model": model, "prompt": prompt, "raw": True, "stream": False,
        "logprobs": logprobs, "top_logprobs": top_logprobs,
        # plain greedy: a repeat penalty scales logits, not log-probabilities, so it would
        # magnify the backends' differences past what the bound below is about
        "options": {"temperature": 0, "repeat_penalty": 1.0, "num_predict": 24, "seed": 0,
                    **options}})
    assert r.status_code == 200, r.text
    return r.json()


def _ps(d: Daemon) -> dict[str, Any]:
    (model,) = httpx.get(d.url + "/api/ps", timeout=30).json()["models"]
    return model


def test_the_device_is_listed() -> None:
    out = subprocess.run([str(PYTHON), "-m", "llmrun.engine.runner", "--list-devices"],
                         env={**os.environ, **VISIBLE}, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    listing = json.loads(out)
    devices = listing["devices"]
    gpus = [d for d in devices if d["type"] != "cpu"]
    assert gpus, devices
    assert gpus[0]["name"] == "Vulkan0" and "llvmpipe" in gpus[0]["description"], devices
    assert 0 < gpus[0]["free"] <= gpus[0]["total"], devices
    assert listing["backends"]["Vulkan"] == 1 and listing["backends"]["CPU"] == 1
    # without the variable ggml leaves the CPU-type device out: the CPU alone, and the
    # daemon says the Vulkan backend found no device
    hidden = subprocess.run([str(PYTHON), "-m", "llmrun.engine.runner", "--list-devices"],
                            env={k: v for k, v in os.environ.items()
                                 if k != "GGML_VK_VISIBLE_DEVICES"},
                            capture_output=True, text=True, timeout=120, check=True).stdout
    listed, idle = parse(hidden)
    assert [d.type for d in listed] == ["cpu"] and idle == ["Vulkan"]


# How far the device's numbers may stray from the CPU's (measured with scripts/kv_types.py
# on SmolLM2, 512 tokens of prose: log-probabilities 0.10 apart on average, 1.04 at most;
# ggml-vulkan multiplies in half precision where the device has it, the CPU in f32).
MAX_LOGPROB_GAP = 1.5


def test_full_offload_answers_as_the_cpu_does(vk: Daemon) -> None:
    """Fitted whole onto the device (no num_gpu: the fit decides), then on the CPU alone
    (num_gpu 0) in the same build. Greedy answers agree token by token until, at most, a
    near-tie: where they part, the CPU's two best tokens were within MAX_LOGPROB_GAP of each
    other, and every shared token's log-probability is that close on both."""
    gpu = [_generate(vk, p, logprobs=True, top_logprobs=2) for p in PROMPTS]
    model = _ps(vk)
    # every layer on the device: `ps` says "100% GPU" (size == size_vram), as Ollama's does,
    # and the host's part (input embeddings, prompt states) is in `devices`
    assert model["size_vram"] > 0 and model["size_vram"] == model["size"], model
    assert model["devices"]["CPU"] > 0 and model["devices"]["Vulkan0"] == model["size"], model
    cpu = [_generate(vk, p, num_gpu=0, logprobs=True, top_logprobs=2) for p in PROMPTS]
    assert _ps(vk)["size_vram"] == 0
    agreed = 0
    for g, c in zip(gpu, cpu, strict=True):
        assert len(g["logprobs"]) == len(c["logprobs"]) == 24, (g, c)
        for a, b in zip(g["logprobs"], c["logprobs"], strict=True):
            if a["token"] != b["token"]:
                best, second = (t["logprob"] for t in b["top_logprobs"][:2])
                assert best - second < MAX_LOGPROB_GAP, (g["response"], c["response"], a, b)
                break
            assert abs(a["logprob"] - b["logprob"]) < MAX_LOGPROB_GAP, (a, b)
            agreed += 1
    assert agreed >= 2 * len(PROMPTS), (agreed, [g["response"] for g in gpu],
                                        [c["response"] for c in cpu])


def test_partial_offload_shows_the_split(vk: Daemon) -> None:
    answer = _generate(vk, PROMPTS[0], num_gpu=12)  # 12 of SmolLM2's 30 layers
    assert answer["response"].strip()
    model = _ps(vk)
    assert 0 < model["size_vram"] < model["size"], model
    out = subprocess.run([str(PYTHON), "-m", "llmrun", "ps"], capture_output=True, text=True,
                         timeout=60, check=True, env=vk.env).stdout
    assert re.search(r"\b\d+%/\d+% CPU/GPU\b", out), out


def test_the_strict_sandbox_holds_on_the_device(vk: Daemon) -> None:
    _generate(vk, PROMPTS[1], num_gpu=99)
    model = _ps(vk)
    assert model["size_vram"] > 0 and model["confined"] is True, model


@pytest.mark.timeout(900)
def test_an_idle_model_makes_room_on_the_device(tmp_path: Path, smollm2_path: Path,
                                                 gemma3_path: Path) -> None:
    """Two models of about 1.07 GiB each on the device (8k context x 4 slots) do not both fit
    its 2 GiB: the second load unloads the idle first and takes the device whole. lavapipe
    reports its whole heap free whatever is allocated, so the daemon counts what the loaded
    models hold itself (before it did, both were placed whole: 2.1 GiB on a 2 GiB heap)."""
    home = make_home(tmp_path / "home", smollm2_path)
    Store(home).create("gemma3", f"FROM {gemma3_path}\n")
    d = VulkanDaemon(home, env={**VISIBLE, "LLMRUN_NUM_PARALLEL": "4",
                                "LLMRUN_CONTEXT_LENGTH": "8192"}).start()
    try:
        _generate(d, "Hi", num_predict=2)
        first = _ps(d)
        assert first["size_vram"] > 1 << 30, first
        _generate(d, "Hi", model="gemma3", num_predict=2)
        (second,) = httpx.get(d.url + "/api/ps", timeout=30).json()["models"]
        assert second["name"].startswith("gemma3") and second["size_vram"] > 1 << 30, second
        assert "unloading smollm2:latest to make room" in d.log.read_text()
    finally:
        d.stop()



def test_a_runner_that_loses_its_device_fails_its_request_and_the_next_load_fits_again(
        vk: Daemon) -> None:
    """A GPU that stops answering (reset, unplugged, a driver fault) aborts ggml inside the
    runner: SIGABRT mid-answer here. The stream ends with an error saying the runner stopped,
    the daemon lives, and the next request loads the model afresh, fitted on the device."""
    _generate(vk, PROMPTS[0], num_predict=2)  # loaded, on the device
    with httpx.stream("POST", vk.url + "/api/generate", timeout=600, json={
            "model": "smollm2", "prompt": PROMPTS[3], "raw": True,
            "options": {"temperature": 0, "num_predict": 2000}}) as r:
        lines = r.iter_lines()
        assert "response" in json.loads(next(lines))  # the answer has started
        (runner,) = runner_pids(vk.proc.pid)
        os.kill(runner, signal.SIGABRT)
        last = json.loads(list(lines)[-1])
    assert "error" in last and "runner" in last["error"], last
    answer = _generate(vk, PROMPTS[2])
    assert answer["response"].strip()
    model = _ps(vk)
    assert model["size_vram"] > 0 and model["confined"] is True, model
