"""The default context (server/context.py): Ollama's GPU tiers at their edges, the CPU rule
by free memory, the cap at the model's trained context."""

from __future__ import annotations

from llmrun.server import context
from llmrun.server.fit import Device

GIB = 1 << 30


def gpu(total_gib: float, kind: str = "gpu") -> Device:
    return Device(name="CUDA0", type=kind, total=int(total_gib * GIB), free=int(total_gib * GIB))


def test_gpu_tiers_at_their_edges() -> None:
    assert context.for_gpus([]) is None
    assert context.for_gpus([Device("CPU", "cpu", 64 * GIB, 64 * GIB)]) is None
    assert context.for_gpus([gpu(8)]) == 4096
    assert context.for_gpus([gpu(24)]) == 32768  # 24 GiB is the second tier's first
    assert context.for_gpus([gpu(23.99)]) == 4096
    assert context.for_gpus([gpu(47.99)]) == 32768
    assert context.for_gpus([gpu(48)]) == 262144
    assert context.for_gpus([gpu(16), gpu(16)]) == 32768  # the GPUs' memory together
    assert context.for_gpus([gpu(80, "igpu")]) == 262144


def test_cpu_by_free_memory() -> None:
    per_token = 128 * 1024  # an 8B model's f16 KV cache: 32 layers x 8 heads x 256 x 2 B
    weights = 5 * GIB
    # 20 GiB free: (20 - 5) / 2 = 7.5 GiB for 4 slots -> 8k each (16k would be 8 GiB)
    assert context.for_cpu(20 * GIB, weights, per_token, 4) == 8192
    assert context.for_cpu(20 * GIB, weights, per_token, 1) == 32768
    assert context.for_cpu(200 * GIB, weights, per_token, 1) == 262144  # the last step
    assert context.for_cpu(4 * GIB, weights, per_token, 1) == 4096  # none fits: the least
    assert context.for_cpu(0, 0, per_token, 0) == 4096  # no slots counted as one


def test_capped_at_the_trained_context() -> None:
    assert context.default([], 200 * GIB, GIB, 1024, 1, trained=8192) == 8192
    assert context.default([gpu(80)], 0, GIB, 1024, 1, trained=32768) == 32768
    assert context.default([gpu(8)], 0, GIB, 1024, 1, trained=None) == 4096
    assert context.default([], 200 * GIB, GIB, 1024, 1, trained=2048) == 2048
