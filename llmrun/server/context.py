"""The context a model is loaded with when nothing names one: no request's `num_ctx`, no
Modelfile `PARAMETER num_ctx`, no LLMRUN_CONTEXT_LENGTH.

    on a GPU   Ollama's rule, by the GPUs' total memory: under 24 GiB 4k, under 48 GiB 32k,
               else 256k (Ollama's docs/context-length.mdx)
    on a CPU   the largest of 4k, 8k, ... 256k whose KV cache, for every slot, fits in half
               of the memory free when the model is first loaded after its weights

and never past the context the model was trained for. Agents need long contexts (Claude
Code's own prompt is about 20k tokens), and 4k everywhere made their first request fail.

The choice is made once per model and daemon (scheduler.Scheduler keeps it): free memory
moves with every other program, and a default that moved with it would make requests that
name no context reload their runner now and then.
"""

from __future__ import annotations

from llmrun.server.fit import Device

# the steps a CPU default is chosen among, smallest first (powers of two: what users and
# model cards name, and what prompt-cache keys and bench tables stay comparable at)
STEPS = tuple(4096 << i for i in range(7))  # 4k .. 256k
GIB = 1 << 30


def for_gpus(devices: list[Device]) -> int | None:
    """Ollama's default for the GPUs in `devices` (None: none offloads)."""
    vram = sum(d.total for d in devices if d.offloads)
    if vram <= 0:
        return None
    if vram < 24 * GIB:
        return 4096
    if vram < 48 * GIB:
        return 32768
    return 262144


def for_cpu(free: int, weights: int, kv_per_token: int, n_slots: int) -> int:
    """The largest step whose KV cache for `n_slots` slots fits in half of what `free` leaves
    after the weights (the other half: compute buffers, prompt states, other programs); the
    smallest step when none does, so a load that cannot fit fails on its own estimate."""
    room = (free - weights) // 2
    best = STEPS[0]
    for n_ctx in STEPS:
        if kv_per_token * n_ctx * max(1, n_slots) <= room:
            best = n_ctx
    return best


def default(devices: list[Device], free: int, weights: int, kv_per_token: int, n_slots: int,
            trained: int | None) -> int:
    """The default context (see the module's doc), capped at `trained` when it is known."""
    n_ctx = for_gpus(devices) or for_cpu(free, weights, kv_per_token, n_slots)
    return min(n_ctx, trained) if trained else n_ctx
