"""Where a model's layers go: a pure function of the model's shape, its load options and the
devices' free memory, decided by the daemon before a runner starts (the runner only applies
it). Tested with fake device lists in milliseconds (tests/unit/server/test_fit.py).

The order of preference is Ollama's: every layer on one GPU when the whole model fits there
within a margin; else every layer spread over the GPUs by their free memory; else as many of
the last layers as fit, the rest on the CPU. llama.cpp numbers the output layer n_layer and
places the last `n_gpu_layers` of the n_layer + 1 layers on the GPUs, each device taking the
run of layers its share of `tensor_split` gives it (llama-model.cpp, load_tensors):
`_assign` repeats that rule, so the bytes counted per device are those llama.cpp will ask
for. The input embeddings always stay on the CPU.
"""

from __future__ import annotations

import bisect
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from llmrun.store import gguf as gguf_reader

GiB = 1 << 30
MiB = 1 << 20
CPU = "CPU"  # the host's name in Placement.memory
# The device types that hold offloaded layers (ggml_backend_dev_type): llama.cpp skips the
# CPU and accelerator types (AMX, BLAS), which work beside the CPU backend on host memory.
OFFLOAD_TYPES = ("gpu", "igpu")
# bytes per KV cache element: q8_0 and q4_0 store 32 values in 34 and 18 bytes
KV_BYTES = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
# Compute buffers: what llama.cpp's scheduler reserves for one graph, per device computing
# (SmolLM2's CPU compute buffer at 512-token batches is under 100 MiB; larger models and
# contexts grow it, hence the allowance)
COMPUTE_BYTES = 256 * MiB
# Left free on each GPU besides LLMRUN_GPU_OVERHEAD: drivers and fragmentation take some,
# and llama.cpp's own --fit leaves 1 GiB per device by default (its --fit-target). A quarter
# of a small device at most, so that a 2 GiB one (lavapipe's heap) still takes layers.
MARGIN_BYTES = 1 * GiB

_BLOCK = re.compile(r"blk\.(\d+)\.")


@dataclass(frozen=True)
class Device:
    """A device as ggml lists it (the runner's --list-devices)."""

    name: str  # ggml's name: CPU, CUDA0, Vulkan0, RPC[host:port]
    type: str  # cpu, gpu, igpu, accel
    total: int  # bytes
    free: int  # bytes free when listed
    description: str = ""

    @property
    def offloads(self) -> bool:
        return self.type in OFFLOAD_TYPES


@dataclass(frozen=True)
class ModelShape:
    """What placing a model needs of its GGUF: each repeating layer's weights, the output
    layer's, the input embeddings' (which stay on the CPU) and the KV cache's geometry."""

    layer_bytes: tuple[int, ...]  # weights of blk.0 ... blk.{n-1}
    output_bytes: int  # output.weight (or its copy of tied embeddings) and output_norm
    input_bytes: int  # token embeddings and anything outside the layers
    kv_width: int  # KV elements per token per layer: n_head_kv x (key_length + value_length)

    @property
    def n_layer(self) -> int:
        return len(self.layer_bytes)


@dataclass(frozen=True)
class Needs:
    """What the load options add to the weights."""

    n_ctx: int  # tokens of KV cache per sequence (num_ctx)
    n_slots: int  # sequences (LLMRUN_NUM_PARALLEL)
    kv_type: str = "f16"  # KV_BYTES
    host: int = 0  # kept in host memory whatever the split: prompt states, projector, draft
    compute: int = COMPUTE_BYTES  # per device computing

    def kv_per_layer(self, shape: ModelShape) -> int:
        return int(shape.kv_width * self.n_ctx * self.n_slots * KV_BYTES[self.kv_type])


@dataclass(frozen=True)
class Placement:
    """The decided split, as the runner applies it (llama_model_params) and `ps` shows it."""

    n_gpu_layers: int = 0  # the last layers (output included) off the CPU
    devices: tuple[str, ...] = ()  # the devices holding them, in tensor_split's order
    tensor_split: tuple[float, ...] = ()  # their shares; empty: one device holds them all
    main_gpu: int = -1  # the index in `devices` of the one device holding all; -1: split
    memory: dict[str, int] = field(default_factory=dict)  # estimated bytes per device (CPU)
    layers: int = 0  # n_layer + 1: what n_gpu_layers counts out of
    reason: str = ""  # why this split, for the log

    @property
    def vram(self) -> int:
        return sum(v for k, v in self.memory.items() if k != CPU)

    @property
    def size(self) -> int:
        return sum(self.memory.values())


def shape_of(infos: Sequence[gguf_reader.GGUFInfo]) -> ModelShape:
    """The shape of the model whose GGUF parts (one file, or a split model's parts in order)
    are `infos`; metadata from the first."""
    info = infos[0]
    n_layer = int(info.arch_value("block_count", 0) or 0)
    layers = [0] * n_layer
    output = embed = other = 0
    has_output = False
    for part in infos:
        for t in part.tensors:
            m = _BLOCK.match(t.name)
            if m and int(m.group(1)) < n_layer:
                layers[int(m.group(1))] += t.nbytes
            elif t.name.startswith("output"):  # output.weight, output_norm.weight
                output += t.nbytes
                has_output |= t.name == "output.weight"
            elif t.name == "token_embd.weight":
                embed = t.nbytes
            else:
                other += t.nbytes
    if not has_output:  # tied embeddings: llama.cpp loads a copy on the output's device
        output += embed
    return ModelShape(tuple(layers), output, embed + other, kv_width(info))


def kv_width(info: gguf_reader.GGUFInfo) -> int:
    """KV cache elements per token per layer: the KV heads' key and value widths."""
    n_embd = int(info.arch_value("embedding_length", 0) or 0)
    n_head = int(info.arch_value("attention.head_count", 1) or 1)
    n_head_kv = info.arch_value("attention.head_count_kv", n_head)
    n_head_kv = int(n_head_kv if isinstance(n_head_kv, int) else n_head)
    k_len = int(info.arch_value("attention.key_length", n_embd // max(n_head, 1)) or 0)
    v_len = int(info.arch_value("attention.value_length", k_len) or 0)
    return n_head_kv * (k_len + v_len)


def usable(device: Device, overhead: int) -> int:
    """Bytes a model may take on `device`: its free memory less the overhead asked for and
    the margin."""
    margin = min(MARGIN_BYTES, device.total // 4)
    return device.free - overhead - margin


def _f32(x: float) -> float:
    """`x` as a C float: llama.cpp sums and compares the split points in single precision."""
    return float(struct.unpack("f", struct.pack("f", x))[0])


def _assign(layers: int, n_gpu: int, shares: Sequence[float]) -> list[int]:
    """The device index (into `shares`) of each of the `layers` layers (the output last), -1
    for the CPU: llama.cpp's rule (llama-model.cpp, get_layer_buft_list)."""
    total = sum(shares)
    points, run = [], 0.0
    for s in shares:
        run = _f32(run + s)
        points.append(_f32(run / total) if total > 0 else 1.0)
    start = max(layers - n_gpu, 0)
    active = min(n_gpu, layers)
    out = []
    for il in range(layers):
        if il < start or active == 0:
            out.append(-1)
        else:
            idx = bisect.bisect_right(points, _f32((il - start) / active))
            out.append(min(idx, len(shares) - 1))
    return out


def _memory(shape: ModelShape, needs: Needs, gpus: Sequence[Device], n_gpu: int,
            shares: Sequence[float]) -> dict[str, int]:
    """Bytes per device (and CPU) when the last `n_gpu` layers go to `gpus` by `shares`:
    each layer's weights and KV cache where the layer is, the output layer's weights,
    compute buffers on every device that holds a layer and on the CPU."""
    kv = needs.kv_per_layer(shape)
    cost = [w + kv for w in shape.layer_bytes] + [shape.output_bytes]
    memory = {CPU: shape.input_bytes + needs.host + needs.compute}
    for cost_i, where in zip(cost, _assign(len(cost), n_gpu, shares), strict=True):
        name = CPU if where < 0 else gpus[where].name
        if name not in memory:
            memory[name] = needs.compute
        memory[name] += cost_i
    return memory


def _fits(memory: dict[str, int], room: dict[str, int]) -> bool:
    return all(v <= room[k] for k, v in memory.items() if k != CPU)


def fit(shape: ModelShape, needs: Needs, devices: Sequence[Device], *,
        num_gpu: int | None = None, main_gpu: int | None = None,
        overhead: int = 0) -> Placement:
    """Where the model goes. `num_gpu` (Ollama's option): None or negative fits
    automatically, 0 keeps every layer on the CPU, N places the last N layers on the GPUs
    whether they fit or not (as asked). `main_gpu`: the index among the offloading devices
    of the one to prefer for a model that fits on one GPU. `overhead`: bytes to leave free
    on each GPU (LLMRUN_GPU_OVERHEAD)."""
    layers = shape.n_layer + 1
    gpus = [d for d in devices if d.offloads]
    room = {d.name: usable(d, overhead) for d in gpus}
    cpu_only = Placement(memory=_memory(shape, needs, [], 0, []), layers=layers)
    if not gpus or num_gpu == 0:
        return _with(cpu_only, reason="no GPU" if not gpus else "num_gpu 0")
    if main_gpu is not None and 0 <= main_gpu < len(gpus):
        order = [gpus[main_gpu]] + [g for i, g in enumerate(gpus) if i != main_gpu]
    else:  # the one with the most room first
        order = sorted(gpus, key=lambda g: room[g.name], reverse=True)
    want = layers if num_gpu is None or num_gpu < 0 else min(num_gpu, layers)
    # 1. one GPU, when all it is given fits there (or the first, when num_gpu insists)
    for gpu in order:
        memory = _memory(shape, needs, [gpu], want, [1.0])
        if _fits(memory, room):
            return Placement(want, (gpu.name,), (), 0, memory, layers,
                             f"{want}/{layers} layers on {gpu.name}")
    # 2. spread over the GPUs with room, by their room less their compute buffers
    spread = [g for g in gpus if room[g.name] > needs.compute]
    shares = [float(room[g.name] - needs.compute) for g in spread]
    if spread:
        memory = _memory(shape, needs, spread, want, shares)
        if _fits(memory, room) and len(spread) > 1:
            return _split(spread, shares, want, memory, layers)
    if num_gpu is not None and num_gpu > 0:  # as many as asked, over every GPU
        every = [float(max(room[g.name], 1)) for g in gpus]
        return _split(gpus, every, want, _memory(shape, needs, gpus, want, every), layers)
    # 3. as many of the last layers as fit; the rest on the CPU
    if not spread:
        return _with(cpu_only, reason="no GPU has room")
    best = _most_layers(shape, needs, [order[0]] if order[0] in spread else spread[:1],
                        [1.0], room, want)
    if len(spread) > 1:
        wide = _most_layers(shape, needs, spread, shares, room, want)
        if wide[0] > best[0]:
            return _split(spread, shares, *wide, layers)
    n, memory = best
    if n == 0:
        return _with(cpu_only, reason="no layer fits on a GPU")
    name = next(k for k in memory if k != CPU)
    return Placement(n, (name,), (), 0, memory, layers, f"{n}/{layers} layers on {name}")


def _most_layers(shape: ModelShape, needs: Needs, gpus: Sequence[Device],
                 shares: Sequence[float], room: dict[str, int],
                 most: int) -> tuple[int, dict[str, int]]:
    """The most layers (at most `most`) that fit on `gpus` split by `shares`, found by
    bisection (the bytes placed grow with the layers), with the memory they take."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if _fits(_memory(shape, needs, gpus, mid, shares), room):
            lo = mid
        else:
            hi = mid - 1
    return lo, _memory(shape, needs, gpus, lo, shares)


def _split(gpus: Sequence[Device], shares: Sequence[float], n: int, memory: dict[str, int],
           layers: int) -> Placement:
    total = sum(shares) or 1.0
    split = tuple(round(s / total, 4) for s in shares)
    names = tuple(g.name for g in gpus)
    return Placement(n, names, split, -1, memory, layers,
                     f"{n}/{layers} layers over " + ", ".join(names))


def _with(p: Placement, reason: str) -> Placement:
    return Placement(p.n_gpu_layers, p.devices, p.tensor_split, p.main_gpu, p.memory,
                     p.layers, reason)

