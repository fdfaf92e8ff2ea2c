"""The fit with fake device lists: where a model's layers go, in milliseconds. No llama.cpp:
the shapes are made up, or read from a tiny synthetic GGUF."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmrun.cli.daemon import _processor
from llmrun.server.fit import (
    CPU,
    Device,
    GiB,
    MiB,
    ModelShape,
    Needs,
    _assign,
    fit,
    shape_of,
)
from llmrun.store import gguf as gguf_reader
from tests.fakes.tinymodel import write_tiny_llama

# a 7B-like model: 32 layers of 200 MiB, a 250 MiB output layer, 250 MiB of embeddings
SEVEN_B = ModelShape(layer_bytes=(200 * MiB,) * 32, output_bytes=250 * MiB,
                     input_bytes=250 * MiB, kv_width=8 * 256)
NEEDS = Needs(n_ctx=4096, n_slots=4)  # 4 x 4096 tokens x 2048 x 2 bytes: 64 MiB per layer


def gpu(name: str, free_gib: float, total_gib: float | None = None,
        kind: str = "gpu") -> Device:
    total = total_gib if total_gib is not None else max(free_gib, 1.0)
    return Device(name, kind, int(total * GiB), int(free_gib * GiB))


CPU_DEV = Device("CPU", "cpu", 64 * GiB, 32 * GiB)


def test_cpu_only_list_keeps_everything_on_the_cpu() -> None:
    p = fit(SEVEN_B, NEEDS, [CPU_DEV])
    assert p.n_gpu_layers == 0 and p.devices == () and p.vram == 0
    assert list(p.memory) == [CPU] and p.layers == 33
    # every byte counted once: weights, KV for each layer, a compute buffer
    weights = 32 * 200 * MiB + 250 * MiB + 250 * MiB
    assert p.memory[CPU] == weights + 32 * NEEDS.kv_per_layer(SEVEN_B) + NEEDS.compute


def test_a_model_that_fits_goes_whole_on_the_gpu_with_most_room() -> None:
    p = fit(SEVEN_B, NEEDS, [CPU_DEV, gpu("CUDA0", 12, 16), gpu("CUDA1", 20, 24)])
    assert p.n_gpu_layers == 33 and p.devices == ("CUDA1",) and p.tensor_split == ()
    assert p.main_gpu == 0
    assert p.memory[CPU] == 250 * MiB + NEEDS.compute  # the input embeddings stay here
    assert "CUDA0" not in p.memory


def test_main_gpu_is_preferred_when_the_model_fits_there() -> None:
    p = fit(SEVEN_B, NEEDS, [gpu("CUDA0", 12, 16), gpu("CUDA1", 20, 24)], main_gpu=0)
    assert p.devices == ("CUDA0",)


def test_too_large_for_one_gpu_spreads_over_them_by_room() -> None:
    p = fit(SEVEN_B, NEEDS, [gpu("CUDA0", 6, 8), gpu("CUDA1", 6, 8), gpu("CUDA2", 3, 4)])
    assert p.n_gpu_layers == 33 and p.devices == ("CUDA0", "CUDA1", "CUDA2")
    assert p.tensor_split[0] == p.tensor_split[1] > p.tensor_split[2]
    assert p.main_gpu == -1 and p.memory[CPU] == 250 * MiB + NEEDS.compute
    for name in p.devices:  # each within its room
        assert p.memory[name] <= 6 * GiB - 1 * GiB


def test_too_large_for_all_gpus_puts_the_last_layers_on_them() -> None:
    p = fit(SEVEN_B, NEEDS, [CPU_DEV, gpu("Vulkan0", 4, 8)])
    assert 0 < p.n_gpu_layers < 33 and p.devices == ("Vulkan0",)
    assert p.memory["Vulkan0"] <= 3 * GiB
    # one more layer would not have fitted
    more = fit(SEVEN_B, NEEDS, [gpu("Vulkan0", 4, 8)], num_gpu=p.n_gpu_layers + 1)
    assert more.memory["Vulkan0"] > 3 * GiB
    # every byte is somewhere
    assert p.size == fit(SEVEN_B, NEEDS, [CPU_DEV]).size + NEEDS.compute


def test_num_gpu_zero_is_cpu_only_and_a_number_is_obeyed() -> None:
    devices = [gpu("CUDA0", 20, 24)]
    assert fit(SEVEN_B, NEEDS, devices, num_gpu=0).n_gpu_layers == 0
    p = fit(SEVEN_B, NEEDS, devices, num_gpu=10)
    assert p.n_gpu_layers == 10 and p.devices == ("CUDA0",)
    # the last 10: the output layer and 9 blocks
    assert p.memory["CUDA0"] == 250 * MiB + 9 * (200 * MiB + NEEDS.kv_per_layer(SEVEN_B)) \
        + NEEDS.compute
    assert fit(SEVEN_B, NEEDS, devices, num_gpu=1000).n_gpu_layers == 33
    assert fit(SEVEN_B, NEEDS, devices, num_gpu=-1).n_gpu_layers == 33  # -1: auto
    # asked for more than fits: given anyway (the load's retry takes fewer if it fails)
    small = fit(SEVEN_B, NEEDS, [gpu("CUDA0", 2, 4)], num_gpu=33)
    assert small.n_gpu_layers == 33


@pytest.mark.parametrize("devices", [
    [gpu("CUDA0", 0, 24)],  # no free memory
    [gpu("CUDA0", 0.5, 0.5)],  # smaller than one layer and its buffers
    [],
])
def test_no_room_means_the_cpu(devices: list[Device]) -> None:
    p = fit(SEVEN_B, NEEDS, [CPU_DEV, *devices])
    assert p.n_gpu_layers == 0 and p.vram == 0 and p.reason


def test_overhead_larger_than_memory_means_the_cpu() -> None:
    p = fit(SEVEN_B, NEEDS, [gpu("CUDA0", 20, 24)], overhead=64 * GiB)
    assert p.n_gpu_layers == 0
    some = fit(SEVEN_B, NEEDS, [gpu("CUDA0", 20, 24)], overhead=16 * GiB)
    assert 0 < some.n_gpu_layers < 33


def test_a_huge_model_and_many_gpus() -> None:
    huge = ModelShape(layer_bytes=(2 * GiB,) * 126, output_bytes=4 * GiB, input_bytes=4 * GiB,
                      kv_width=16 * 256)
    gpus = [gpu(f"CUDA{i}", 80, 80) for i in range(16)]
    p = fit(huge, NEEDS, gpus)
    assert p.n_gpu_layers == 127 and len(p.devices) == 16
    assert sum(p.tensor_split) == pytest.approx(1.0, abs=1e-3)
    assert all(p.memory[g.name] <= 79 * GiB for g in gpus)
    few = fit(huge, NEEDS, gpus[:2])
    assert 0 < few.n_gpu_layers < 127 and set(few.devices) == {"CUDA0", "CUDA1"}
    assert all(few.memory[g] <= 79 * GiB for g in few.devices)


def test_cpu_and_accelerator_devices_take_no_layers_igpus_do() -> None:
    devices = [CPU_DEV, Device("BLAS", "accel", 0, 0), gpu("Vulkan0", 20, 24, kind="igpu")]
    p = fit(SEVEN_B, NEEDS, devices)
    assert p.devices == ("Vulkan0",) and p.n_gpu_layers == 33


def test_assign_repeats_llama_cpps_layer_rule() -> None:
    # 5 layers, the last 4 on two devices split 1:1: two each
    assert _assign(5, 4, [1.0, 1.0]) == [-1, 0, 0, 1, 1]
    assert _assign(5, 0, [1.0]) == [-1] * 5
    assert _assign(5, 9, [3.0, 1.0]) == [0, 0, 0, 0, 1]
    assert _assign(3, 3, [0.0, 1.0]) == [1, 1, 1]  # a device with no share takes none


def test_shape_of_a_gguf(tmp_path: Path) -> None:
    info = gguf_reader.read(write_tiny_llama(tmp_path / "m.gguf"))
    shape = shape_of([info])
    n_layer = int(info.arch_value("block_count"))
    assert shape.n_layer == n_layer and all(b > 0 for b in shape.layer_bytes)
    total = sum(t.nbytes for t in info.tensors)
    tied = not any(t.name == "output.weight" for t in info.tensors)
    embd = next(t.nbytes for t in info.tensors if t.name == "token_embd.weight")
    # every tensor counted once (a tied output layer is a second copy of the embeddings)
    assert sum(shape.layer_bytes) + shape.output_bytes + shape.input_bytes \
        == total + (embd if tied else 0)
    assert shape.kv_width > 0


@pytest.mark.parametrize(("size", "vram", "shown"), [
    (1000, 0, "100% CPU"),
    (1000, 1000, "100% GPU"),
    (1000, 590, "41%/59% CPU/GPU"),
    (1000, 1, "100%/0% CPU/GPU"),
    (0, 10, "Unknown"),
])
def test_processor_reads_as_ollamas(size: int, vram: int, shown: str) -> None:
    assert _processor({"size": size, "size_vram": vram}) == shown
