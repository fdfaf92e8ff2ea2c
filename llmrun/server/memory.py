"""What a load needs before its runner starts: its files checked (digests, GGUF headers) and
the memory it will take, estimated for the fit (server/fit.py) and for making room."""

from __future__ import annotations

import dataclasses

from llmrun.request import EngineError
from llmrun.server import fit
from llmrun.server.fit import KV_BYTES
from llmrun.server.loadspec import RunnerSpec
from llmrun.store import Manifest, Store, StoreError
from llmrun.store import gguf as gguf_reader


def available() -> int:
    """Bytes the kernel says can be allocated without swapping (MemAvailable)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: do not refuse on a guess


def estimate(info: gguf_reader.GGUFInfo, weights: int, spec: RunnerSpec) -> int:
    """Weights + the KV cache (of its element type) for every slot's full context + the
    prompt states it may keep in memory + a compute-buffer allowance."""
    n_layer = int(info.arch_value("block_count", 0) or 0)
    kv = n_layer * fit.kv_width(info) * spec.n_ctx * spec.n_slots
    kv = int(kv * KV_BYTES[spec.kv_type])
    # (a vision projector's weights are in `weights`; its encoder needs buffers of its own)
    vision = (128 << 20) if spec.projector_path else 0
    return weights + kv + spec.prompt_cache_ram + fit.COMPUTE_BYTES + vision


def needs_of(shape: fit.ModelShape, spec: RunnerSpec, need: int) -> fit.Needs:
    """The fit's view of a load: its KV cache, and in host memory whatever the runner keeps
    there (prompt states, the projector, the draft model, adapters), as the part of the
    estimate `need` the model's own layers do not explain."""
    needs = fit.Needs(n_ctx=spec.n_ctx, n_slots=spec.n_slots, kv_type=spec.kv_type)
    own = fit.fit(shape, needs, []).size
    return dataclasses.replace(needs, host=max(0, need - own))


def check_files(store: Store, verified: set[tuple[str, int, int]], name: str,
                manifest: Manifest, spec: RunnerSpec) -> tuple[int, fit.ModelShape]:
    """Before llama.cpp reads a file: it must still hash to its digest (checked once per
    file version: size and mtime) and its GGUF header must pass the validator.
    Returns the memory the loaded model will need, in bytes (an estimate), and the
    model's shape (for the fit). `verified` holds the file versions already checked."""
    files = (*spec.model_paths, *spec.lora_paths,
             *([spec.projector_path] if spec.projector_path else []), *spec.draft_paths)
    draft = None
    try:
        if spec.draft_model:
            _, draft = store.get(spec.draft_model)
        versions = {(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files}
        if not versions <= verified:
            store.verify(manifest)  # hashes every file of the model once
            if draft is not None:
                store.verify(draft)
            for p in files[1:]:
                gguf_reader.read(p)
        info = gguf_reader.read(files[0])
        parts = [info, *(gguf_reader.read(p) for p in spec.model_paths[1:])]
        verified |= versions
        need = estimate(info, manifest.size, spec)
        if draft is not None:  # its weights, its own KV cache and compute buffers
            need += estimate(gguf_reader.read(spec.draft_paths[0]), draft.size,
                                    dataclasses.replace(spec, prompt_cache_ram=0,
                                                        projector_path=None))
    except (OSError, StoreError, gguf_reader.GGUFError) as exc:
        raise EngineError(f"model '{name}' cannot be loaded: {exc}") from None
    return need, fit.shape_of(parts)
