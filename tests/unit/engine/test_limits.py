"""A runner's resource limits, from the daemon's estimate (engine/sandbox/limits.py); that
they hold inside a real runner is tests/integration/test_redteam.py."""

from __future__ import annotations

import os
import resource
import subprocess
import sys

import pytest

from llmrun.engine.sandbox.limits import (
    ADDRESS_SPACE,
    ADDRESS_SPACE_HEADROOM,
    THREADS,
    Limits,
)


def test_a_cpu_runner_may_map_twice_its_estimate_and_some() -> None:
    limits = Limits.for_runner(500 << 20, threads=4, on_gpu=False, own_user_namespace=True)
    assert limits.address_space == 2 * (500 << 20) + ADDRESS_SPACE_HEADROOM
    assert limits.open_files == 128


def test_no_address_space_limit_with_gpu_layers_or_without_an_estimate() -> None:
    on_gpu = Limits.for_runner(500 << 20, threads=4, on_gpu=True, own_user_namespace=True)
    assert on_gpu.address_space is None and ADDRESS_SPACE in on_gpu.unbounded
    unknown = Limits.for_runner(0, threads=4, on_gpu=False, own_user_namespace=True)
    assert unknown.address_space is None and ADDRESS_SPACE not in unknown.unbounded


def test_threads_are_bounded_only_where_the_kernel_counts_the_runners_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "getuid", lambda: 1000)
    inside = Limits.for_runner(1 << 30, threads=8, on_gpu=False, own_user_namespace=True)
    assert inside.threads == 2 * 8 + 32
    outside = Limits.for_runner(1 << 30, threads=8, on_gpu=False, own_user_namespace=False)
    assert outside.threads is None and "user namespace" in outside.unbounded[THREADS]
    monkeypatch.setattr(os, "getuid", lambda: 0)
    root = Limits.for_runner(1 << 30, threads=8, on_gpu=False, own_user_namespace=True)
    assert root.threads is None and "root" in root.unbounded[THREADS]


def test_limits_are_hard_and_never_raise_what_the_system_set_lower() -> None:
    """In a child process: applied soft and hard, so the process cannot raise them again;
    a hard limit already lower than ours stays."""
    code = """
import resource
from llmrun.engine.sandbox.limits import Limits, apply
resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
applied, unavailable = apply(Limits(address_space=8 << 30, open_files=128, threads=None))
print(resource.getrlimit(resource.RLIMIT_NOFILE), resource.getrlimit(resource.RLIMIT_AS),
      resource.getrlimit(resource.RLIMIT_CORE))
try:
    resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30))
    print("raised")
except ValueError:
    print("refused")
"""
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 64:
        pytest.skip("this system's open-files limit is below 64")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout.splitlines()
    assert out[0] == f"(64, 64) ({8 << 30}, {8 << 30}) (0, 0)"
    assert out[1] in ("refused", "raised") and (out[1] == "refused" or os.getuid() == 0)
