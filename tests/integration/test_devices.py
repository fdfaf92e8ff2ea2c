"""The daemon's device list: the runner's --list-devices on the real build, and what the
daemon makes of a list (LLMRUN_GPUS, the log line)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from llmrun import config
from llmrun.server import devices
from llmrun.server.fit import Device

LISTED = [Device("CPU", "cpu", 64 << 30, 32 << 30, "AMD EPYC"),
          Device("CUDA0", "gpu", 80 << 30, 70 << 30, "H100"),
          Device("Vulkan0", "igpu", 2 << 30, 2 << 30, "llvmpipe")]


@pytest.mark.model
def test_list_devices_on_this_build_names_the_cpu_with_sane_memory() -> None:
    done = subprocess.run([sys.executable, "-m", "llmrun.engine.runner", "--list-devices"],
                          capture_output=True, text=True, timeout=120, check=True)
    listed, idle = devices.parse(done.stdout)
    cpu = [d for d in listed if d.type == "cpu"]
    assert len(cpu) == 1 and cpu[0].name == "CPU"
    assert 64 << 20 < cpu[0].total < 1 << 50 and 0 < cpu[0].free <= cpu[0].total
    assert idle == []  # (the CPU build: no GPU backend to find nothing)


def test_a_gpu_backend_without_a_device_is_named_with_llama_cpps_reason(
        caplog: pytest.LogCaptureFixture) -> None:
    listing = ('{"devices": [{"name": "CPU", "type": "cpu", "total": 8, "free": 4}],'
               ' "backends": {"CUDA": 0, "CPU": 1, "RPC": 0, "Vulkan": 1}}')
    listed, idle = devices.parse(listing)
    assert [d.name for d in listed] == ["CPU"] and idle == ["CUDA"]
    stderr = ("ggml_cuda_init: failed to initialize CUDA: no CUDA-capable device is "
              "detected\nload_backend: loaded CPU backend\n")
    assert "no CUDA-capable device" in devices._why("CUDA", stderr)
    assert devices._why("Vulkan", stderr) == ""


@pytest.mark.model
def test_the_daemons_list_is_the_childs() -> None:
    listed = asyncio.run(devices.list_devices())
    assert [d.type for d in listed].count("cpu") == 1


@pytest.mark.parametrize(("value", "kept"), [
    ("", ["CPU", "CUDA0", "Vulkan0"]),
    ("CUDA0", ["CPU", "CUDA0"]),
    ("1", ["CPU", "Vulkan0"]),  # an index among the GPUs
    ("none", ["CPU"]),
    ("-1", ["CPU"]),
    ("CUDA7", ["CPU"]),  # no such GPU (a warning)
])
def test_llmrun_gpus_chooses_visible_gpus(monkeypatch: pytest.MonkeyPatch, value: str,
                                          kept: list[str]) -> None:
    monkeypatch.setenv("LLMRUN_GPUS", value)
    assert [d.name for d in devices.visible(LISTED, config.gpus())] == kept


def test_overhead_setting_reads_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMRUN_GPU_OVERHEAD", "512MiB")
    assert config.gpu_overhead() == 512 << 20
    monkeypatch.setenv("LLMRUN_GPU_OVERHEAD", "lots")
    assert config.gpu_overhead() == 0  # the default, with a warning


def test_describe_names_each_device() -> None:
    line = devices.describe(LISTED)
    assert line.startswith("CPU; CUDA0 (H100, 70.0 of 80.0 GiB free)") and "llvmpipe" in line


def test_a_failed_listing_means_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices.sys, "executable", "/nonexistent/python")
    assert asyncio.run(devices.list_devices()) == []


def test_cached_is_empty_until_listed_then_the_visible_devices(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    async def listing() -> list[Device]:
        calls.append(1)
        return LISTED

    monkeypatch.setattr(devices, "list_devices", listing)
    monkeypatch.setenv("LLMRUN_GPUS", "CUDA0")
    cache = devices.DeviceList()
    assert cache.cached() == []
    asyncio.run(cache.current())
    assert [d.name for d in cache.cached()] == ["CPU", "CUDA0"]
    assert len(calls) == 1  # reading the cache lists nothing again


def test_api_show_names_the_daemons_devices(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """/api/show adds llmrun's own `devices` key from the cached list: empty before the
    first listing, then the visible devices (a fake list; no runner child)."""
    from fastapi.testclient import TestClient

    from llmrun.daemon.app import create_app
    from llmrun.store import Store
    from tests.fakes.tinymodel import write_tiny_llama

    async def listing() -> list[Device]:
        return LISTED

    monkeypatch.setattr(devices, "list_devices", listing)
    monkeypatch.setenv("LLMRUN_GPUS", "CUDA0")
    store = Store(tmp_path / "store")
    store.create("tiny", f"FROM {write_tiny_llama(tmp_path / 'tiny.gguf')}\n")
    app = create_app(store)
    before = TestClient(app, base_url="http://127.0.0.1")  # no lifespan: nothing listed
    assert before.post("/api/show", json={"model": "tiny"}).json()["devices"] == []
    with TestClient(app, base_url="http://127.0.0.1") as client:  # start lists them
        deadline = time.monotonic() + 10
        while not (shown := client.post("/api/show", json={"model": "tiny"}).json())["devices"]:
            assert time.monotonic() < deadline, "the start's listing never ended"
            time.sleep(0.01)
    assert shown["details"]["family"] == "llama"  # the rest of show as before
    assert shown["devices"] == [
        {"name": "CPU", "description": "AMD EPYC", "type": "cpu", "total": 64 << 30,
         "free": 32 << 30},
        {"name": "CUDA0", "description": "H100", "type": "gpu", "total": 80 << 30,
         "free": 70 << 30}]
