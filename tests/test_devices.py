"""The daemon's device list: the runner's --list-devices on the real build, and what the
daemon makes of a list (LLMRUN_GPUS, the log line)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

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
    listed = devices.parse(done.stdout)
    cpu = [d for d in listed if d.type == "cpu"]
    assert len(cpu) == 1 and cpu[0].name == "CPU"
    assert 64 << 20 < cpu[0].total < 1 << 50 and 0 < cpu[0].free <= cpu[0].total


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
