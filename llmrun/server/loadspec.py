"""The runner spec of a load: the merged runner options (request over client header over
Modelfile: service.merged) and the daemon's settings, with each value capped where more buys
nothing. One function, so that every road to a runner reads the same values the same way."""

from __future__ import annotations

import logging
from pathlib import Path

from llmrun import bounds, config
from llmrun.request import EngineError, RunnerOptions
from llmrun.server import context
from llmrun.server.runners import RunnerSpec
from llmrun.store import InvalidName, Manifest, ModelNotFound, Store

log = logging.getLogger(__name__)


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
