"""The runner spec of a load, and the Load message that starts its runner: from the merged
runner options (request over client header over Modelfile: service.merged) and the daemon's
settings, each value capped where more buys nothing. One function, so that every road to a
runner reads the same values the same way."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from llmrun import bounds, config, ipc, protocol
from llmrun.request import EngineError, RunnerOptions
from llmrun.server import context
from llmrun.server.fit import Placement
from llmrun.store import InvalidName, Manifest, ModelNotFound, Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerSpec:
    """Everything that decides how a runner is started; a change means a new runner."""

    model_paths: tuple[Path, ...]
    n_ctx: int
    n_slots: int
    n_threads: int
    n_batch: int = 512
    lora_paths: tuple[Path, ...] = ()  # LoRA adapter GGUFs, applied in order at scale 1
    projector_path: Path | None = None  # a vision projector (mmproj GGUF) for images
    sound_piece_seconds: float | None = None  # its sound read in such pieces (None: whole)
    draft_model: str = ""  # a model guessing tokens ahead (speculative decoding), by name
    draft_paths: tuple[Path, ...] = ()  # its file (or split parts)
    # n_threads is the most: fewer while other processes keep cores busy (engine/threads.py)
    adaptive_threads: bool = False
    kv_type: str = "f16"  # engine/llama/ KV_TYPES
    flash_attention: str = "auto"  # auto, on, off
    prompt_cache_size: int = 0  # bytes on disk for prompt states, all models; 0: none
    prompt_cache_ram: int = 0  # bytes of them this runner keeps in memory
    prompt_cache_min: int = 1024  # prompt tokens read before a state is kept
    # config.parse_step_budget: prompt reading per step beside others that generate
    step_budget: str = config.default("LLMRUN_STEP_BUDGET")
    rpc_workers: tuple[str, ...] = ()  # llama.cpp RPC workers (host:port) to place layers on
    rpc_split: str = ""  # their shares of the layers, "3,1" (empty: by free memory)
    gpu_layers: int = -1  # num_gpu: layers off the CPU (GPUs or workers); -1: fitted / all
    main_gpu: int = -1  # main_gpu: the GPU (index among them) preferred; -1: most room
    debug: bool = False  # LLMRUN_DEBUG: the runner logs every engine step
    use_mmap: bool = True  # use_mmap: the weights mapped from the file, else read into memory


def load_message(s: RunnerSpec, placement: Placement | None, memory: int,
                 cache_dir: str | None, cache_key: str) -> protocol.Load:
    """The Load message for a runner of spec `s`: the scheduler's `placement` and memory
    estimate, the prompt-cache directory prepared for it."""
    gpu_layers, main_gpu = -1, 0
    devices: list[str] = []
    tensor_split: list[float] | None = None
    if s.rpc_workers:
        gpu_layers = s.gpu_layers
    elif placement is not None and placement.n_gpu_layers > 0:
        p = placement
        gpu_layers, main_gpu, devices = p.n_gpu_layers, p.main_gpu, list(p.devices)
        # to 6 significant digits, as the runner's flags carried them: the same split
        tensor_split = [float(f"{x:g}") for x in p.tensor_split] or None
    return protocol.Load(
        model=[str(p) for p in s.model_paths], ctx=s.n_ctx, slots=s.n_slots,
        threads=s.n_threads, adaptive_threads=s.adaptive_threads, batch=s.n_batch,
        lora=[protocol.Lora(path=str(p)) for p in s.lora_paths],
        mmproj=str(s.projector_path) if s.projector_path is not None else None,
        sound_piece_seconds=s.sound_piece_seconds,
        draft_model=[str(p) for p in s.draft_paths],
        kv_type=cast(protocol.KvType, s.kv_type),
        flash_attn=cast(protocol.FlashAttn, s.flash_attention),
        prompt_cache=cache_dir, prompt_cache_key=cache_key,
        prompt_cache_size=s.prompt_cache_size, prompt_cache_ram=s.prompt_cache_ram,
        prompt_cache_min=s.prompt_cache_min, step_budget=s.step_budget,
        rpc=list(s.rpc_workers),
        rpc_split=[float(x) for x in s.rpc_split.split(",")] if s.rpc_split else None,
        gpu_layers=gpu_layers, device=devices, tensor_split=tensor_split, main_gpu=main_gpu,
        debug=s.debug, memory=memory, mmap=s.use_mmap,
        max_frame=ipc.MAX_FRAME)  # both sides must agree on the limit


def named_context(options: RunnerOptions) -> int:
    """The context something names for a load, 0 if nothing does: the merged options' num_ctx
    (the request's, the client's header, the Modelfile's), then LLMRUN_CONTEXT_LENGTH."""
    return options.num_ctx or config.context_length()


def spec_for(store: Store, manifest: Manifest, options: RunnerOptions,
             default_ctx: int = context.STEPS[0]) -> RunnerSpec:
    """The runner `options` (merged: request over Modelfile) ask for, their values
    capped (as Ollama does, quietly): num_ctx to the model's trained context, num_batch
    to bounds.MAX_NUM_BATCH, num_thread to the machine's cores. Values past these buy
    nothing, and each distinct spec would be another reload. Without num_thread (or
    LLMRUN_NUM_THREADS) the runner may use every core and uses fewer while other
    processes keep some busy. Where nothing names a context, `default_ctx` is it
    (the scheduler's `default_context`)."""
    n_ctx = named_context(options) or default_ctx
    trained = manifest.details.context_length
    if trained:
        n_ctx = min(n_ctx, trained)
    flash = options.flash_attention or config.flash_attention()
    kv_type = options.kv_cache_type or config.kv_cache_type()
    if kv_type != "f16" and flash == "off":
        # llama.cpp cannot quantize the V cache without flash attention (Ollama, too,
        # falls back to f16 then)
        log.warning("KV cache type %s needs flash attention, which is off: using f16",
                    kv_type)
        kv_type = "f16"
    draft_model, draft_paths = _draft_model(store, options.draft_model, manifest)
    fixed = options.num_thread or config.num_threads_fixed()
    cores = config.usable_cores()  # the runner's governor counts the same cores
    n_threads = min(fixed or cores, cores)
    return RunnerSpec(
        model_paths=tuple(store.model_paths(manifest)),
        n_ctx=n_ctx,
        n_slots=config.num_parallel(),
        n_threads=n_threads,
        n_batch=min(options.num_batch or 512, bounds.MAX_NUM_BATCH),
        lora_paths=tuple(store.adapter_paths(manifest)),
        projector_path=store.projector_path(manifest),
        sound_piece_seconds=store.sound_piece_seconds(manifest),
        draft_model=draft_model,
        draft_paths=draft_paths,
        adaptive_threads=not fixed,
        kv_type=kv_type,
        flash_attention=flash,
        prompt_cache_size=config.prompt_cache_size(),
        prompt_cache_ram=config.prompt_cache_ram() if config.prompt_cache_size() else 0,
        prompt_cache_min=config.prompt_cache_min_tokens(),
        step_budget=config.step_budget(),
        rpc_workers=config.rpc_workers(),
        rpc_split=config.rpc_split(),
        gpu_layers=-1 if options.num_gpu is None else options.num_gpu,
        main_gpu=-1 if options.main_gpu is None else options.main_gpu,
        use_mmap=options.use_mmap is not False,
        debug=config.debug(),
    )


def _draft_model(store: Store, name: str | None,
                 manifest: Manifest) -> tuple[str, tuple[Path, ...]]:
    """The draft model `name` (draft_model: a Modelfile PARAMETER or a request option)
    as (its full name, its files); a clear 400 when it is no local model."""
    if not name:
        return "", ()
    try:
        parsed, draft = store.get(name)
    except (ModelNotFound, InvalidName) as exc:
        raise EngineError(f"draft model {name!r} of {manifest.name}: {exc}",
                          code="invalid_request") from None
    if draft.remote is not None or draft.digest == manifest.digest:
        raise EngineError(f"draft model {name!r} of {manifest.name}: it must be another "
                          f"model in this store, not a remote one or the model itself",
                          code="invalid_request")
    return str(parsed), tuple(store.model_paths(draft))
