"""A runner's start: from the daemon's Load message to a ModelHost ready to serve.

The order matters. What the sandbox would forbid happens first: the thread governor reads
/proc/stat, the RPC workers are connected, a GPU backend opens its device nodes (listing the
devices with their free memory creates CUDA's context), the image decoders' modules are
imported. Then the process confines itself (engine/sandbox/) to the files Load names, and
only then does llama.cpp read a byte of them.
"""

from __future__ import annotations

import logging
import socket
from pathlib import Path
from typing import Any

from llmrun import config
from llmrun.engine import pixels, sandbox
from llmrun.engine.draft import DraftModel
from llmrun.engine.host import ModelHost
from llmrun.engine.llama import (
    Context,
    LlamaError,
    LoraAdapter,
    Model,
    Projector,
    RpcWorkers,
    list_devices,
)
from llmrun.engine.promptcache import PromptCache
from llmrun.engine.sandbox import namespaces
from llmrun.engine.threads import ThreadGovernor
from llmrun.ipc import SyncChannel
from llmrun.protocol import Fatal, Load

log = logging.getLogger("llmrun.runner")

FLASH_ATTN: dict[str, bool | None] = {"auto": None, "on": True, "off": False}
GPU_UNCONFINABLE = (
    "the sandbox cannot confine a model runner on a GPU here: its driver opens the device "
    "read-write, and with neither Landlock (Linux 5.13+, in the kernel's lsm= list) nor "
    "unprivileged user namespaces (for a mount namespace) nothing would keep its writes to "
    "the device; run the model on the CPU (num_gpu 0), enable one of the two, or set "
    "LLMRUN_SANDBOX=0 to run it unconfined")


def _confine(load: Load, files: list[Path], writable: Path | None, devices: list[Path],
             isolated: tuple[list[str], list[str]]) -> tuple[dict[str, Any], str]:
    """Confine this process before llama.cpp reads a byte of the model files (`files`, the
    only ones it may still open besides the Python installation and system libraries), the
    prompt-cache directory `writable`, the only place it may write, and the GPU device
    nodes `devices` it uses, with the resource limits `load` calls for; `isolated`: the
    namespaces the runner entered as it started (sandbox.isolate).

    Returns the sandbox fields of the ready info and, in LLMRUN_SANDBOX=strict mode when a
    layer could not be applied, why the runner must not go on (else "")."""
    mode = config.sandbox_mode()
    if mode == "off":
        log.warning("sandbox: off (LLMRUN_SANDBOX=0): this runner is not confined")
        return {"sandbox": [], "confined": False, "sandbox_missing": ["off (LLMRUN_SANDBOX=0)"]}, ""
    limits = sandbox.Limits.for_runner(load.memory, load.threads, on_gpu=bool(load.device),
                                       own_user_namespace=namespaces.USER in isolated[0],
                                       prompt_cache=load.prompt_cache_size if writable else 0,
                                       ctx=load.ctx)
    result = sandbox.confine(read=files, read_write=[writable] if writable else [],
                             devices=devices, limits=limits, isolated=isolated)
    if devices:
        log.info("sandbox: GPU device nodes kept: %s", ", ".join(map(str, devices)))
    log.info("sandbox: %s", ", ".join(result.applied))
    for why in (*result.missing, *result.unavailable):
        log.warning("sandbox: not applied: %s", why)
    return result.info(), result.refusal() if mode == "strict" else ""


def _prompt_cache_dir(load: Load, isolated: tuple[list[str], list[str]]) -> Path | None:
    """Where this runner may keep prompt states on disk: the directory it was given, if the
    sandbox can keep its writes inside it (Landlock, else read-only mounts in the runner's
    mount namespace; else the states stay in memory)."""
    if load.prompt_cache is None or load.prompt_cache_size <= 0:
        return None
    directory = Path(load.prompt_cache)
    if config.sandbox_mode() != "off" and not sandbox.writes_confinable(isolated):
        log.warning("prompt cache: in memory only: with neither Landlock nor a mount "
                    "namespace the sandbox could not keep the runner's writes inside %s",
                    directory)
        return None
    if not directory.is_dir():
        log.warning("prompt cache: in memory only: %s is not a directory", directory)
        return None
    return directory


def _rpc_workers(endpoints: list[str]) -> RpcWorkers | None:
    """Connect to the RPC workers (None when there are none). Each is first reached with a
    plain connection, so a worker that is down is a clear error rather than llama.cpp's
    abort."""
    if not endpoints:
        return None
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
        except (OSError, ValueError) as exc:
            raise OSError(f"RPC worker {endpoint} does not answer ({exc}); start it with "
                          "`llmrun rpc-worker` or remove it from LLMRUN_RPC_WORKERS") from None
    return RpcWorkers(endpoints)


def _placement(workers: RpcWorkers, model: Model, offload: int,
               split: list[float] | None) -> dict[str, Any]:
    """Where the model's layers live, for `ps`: how many went to the workers (llama.cpp
    divides them by `split`, else by the workers' free memory) and how many stayed here."""
    placed = min(offload, model.n_layer + 1)  # + the output layer
    shares = split or [float(free) for free, _ in workers.memory]
    total = sum(shares) or 1.0
    return {"layers": model.n_layer + 1, "local_layers": model.n_layer + 1 - placed,
            "workers": [{"endpoint": e, "share": round(s / total, 3), "free": free,
                         "total": size}
                        for e, s, (free, size) in zip(workers.endpoints, shares,
                                                      workers.memory, strict=False)]}


def _device_free() -> dict[str, int]:
    """Free bytes of each offloading device, by name."""
    return {d["name"]: d["free"] for d in list_devices() if d["type"] in ("gpu", "igpu")}


def _device_use(free_before: dict[str, int]) -> dict[str, int]:
    """Bytes each device lost since `free_before`: what this runner's model, caches and
    buffers really took there (other processes' allocations meanwhile count too; the CPU's
    share is the daemon's estimate, since mapped weights make free host memory say little)."""
    after = _device_free()
    return {name: max(0, free - after.get(name, free)) for name, free in free_before.items()}


def _drafter(load: Load, model: Model, n_ctx_seq: int) -> DraftModel:
    """The draft model (Load.draft_model), with a KV sequence for each slot as long as the
    model's; LlamaError when its vocabulary is not the model's."""
    paths = [Path(p) for p in load.draft_model]
    draft = Model(paths, mmap=load.mmap)
    try:
        ctx = Context(draft, n_ctx_seq=n_ctx_seq, n_seq=load.slots, n_batch=load.batch,
                      n_threads=load.threads, kv_type=load.kv_type,
                      flash_attn=FLASH_ATTN[load.flash_attn])
    except LlamaError:
        draft.close()
        raise
    drafter = DraftModel(draft, ctx, load.slots)
    try:
        drafter.check_vocabulary(model)
    except LlamaError:
        drafter.close()
        raise
    log.info("draft model %s: its guesses are checked in the model's decodes", paths[0].name)
    return drafter


def boot(chan: SyncChannel, load: Load,
         isolated: tuple[list[str], list[str]] = ([], [])) -> ModelHost | None:
    """Confine this process and load the model as `load` says; None, after telling the
    daemon why (a Fatal message), when it cannot. `isolated`: the namespaces the runner
    entered as it started (sandbox.isolate), for the confinement's report."""
    try:
        step_budget = config.parse_step_budget(load.step_budget)
    except ValueError as exc:
        chan.send(Fatal(error=f"step_budget: {exc}"))
        return None
    model_paths = [Path(p) for p in load.model]
    mmproj = Path(load.mmproj) if load.mmproj is not None else None
    # before the sandbox: it reads /proc/stat, which the sandbox closes to new opens
    governor = ThreadGovernor(load.threads) if load.adaptive_threads else None
    cache_dir = _prompt_cache_dir(load, isolated)
    try:  # before the sandbox, which allows no new connection
        workers = _rpc_workers(load.rpc)
    except (OSError, LlamaError) as exc:
        chan.send(Fatal(error=str(exc)))
        return None
    # before the sandbox: a GPU backend opens its device nodes as it initialises (listing
    # the devices with their free memory creates CUDA's context), and a confined runner
    # keeps exactly those nodes; a runner kept on the CPU keeps none
    free_before = _device_free()
    on_gpu = bool(load.device) and workers is None
    if on_gpu and config.sandbox_mode() != "off" and not sandbox.writes_confinable(isolated):
        # its driver opens its device nodes read-write, and nothing here could keep such
        # opens to them: it would write wherever its user can
        chan.send(Fatal(error=GPU_UNCONFINABLE))
        return None
    gpu_nodes = sandbox.gpu_nodes() if on_gpu else []
    if mmproj is not None:
        pixels.preload()  # the decoders' modules, while files can still be opened
    files = [*model_paths, *(Path(lora.path) for lora in load.lora),
             *([mmproj] if mmproj else []), *(Path(p) for p in load.draft_model)]
    confinement, refusal = _confine(load, files, cache_dir, gpu_nodes, isolated)
    if refusal:
        chan.send(Fatal(error=refusal))
        return None
    if config.sandbox_mode() != "off" and not {sandbox.LANDLOCK, sandbox.READ_ONLY} & set(
            confinement["sandbox"]):
        # neither layer held after all (confine() says why): the filter allows no write
        if on_gpu:
            chan.send(Fatal(error=GPU_UNCONFINABLE))
            return None
        if cache_dir is not None:
            log.warning("prompt cache: in memory only: the sandbox could not keep the "
                        "runner's writes inside %s", cache_dir)
            cache_dir = None
    try:
        offload = load.gpu_layers if load.gpu_layers >= 0 else 10_000
        if workers is not None:
            model = Model(model_paths, n_gpu_layers=offload, tensor_split=load.rpc_split,
                          mmap=load.mmap)
            confinement["rpc"] = _placement(workers, model, offload, load.rpc_split)
        elif load.device:  # the daemon's fit (server/fit.py) decided the split
            model = Model(model_paths, n_gpu_layers=offload, tensor_split=load.tensor_split,
                          main_gpu=load.main_gpu, devices=load.device, mmap=load.mmap)
            log.info("%d of %d layers on %s", min(offload, model.n_layer + 1),
                     model.n_layer + 1, ", ".join(load.device))
        else:
            model = Model(model_paths, mmap=load.mmap)
        n_ctx_seq = min(load.ctx, model.n_ctx_train) if model.n_ctx_train > 0 else load.ctx
        # An encoder (BERT and kin) gets no generation context: llama.cpp gives it no KV
        # cache to generate with, and the pooled context of its side work is the one it uses.
        ctx = None if model.encoder_only else Context(
            model, n_ctx_seq=n_ctx_seq, n_seq=load.slots, n_batch=load.batch,
            n_threads=load.threads, kv_type=load.kv_type, flash_attn=FLASH_ATTN[load.flash_attn])
        if ctx is None:
            log.info("%s encodes only (%s, pooling %d): embeddings and reranking, no "
                     "generation", model_paths[0].name, model.arch, model.pooling)
        if load.lora and ctx is not None:
            loras = [LoraAdapter(model, Path(lora.path)) for lora in load.lora]
            ctx.set_loras(loras, [lora.scale for lora in load.lora])
            log.info("applied LoRA adapters: %s",
                     ", ".join(f"{Path(lora.path).name} x{lora.scale:g}" for lora in load.lora))
        projector = Projector(mmproj, model, load.threads,
                              load.sound_piece_seconds) if mmproj else None
        drafter = _drafter(load, model, n_ctx_seq) if load.draft_model else None
    except LlamaError as exc:
        chan.send(Fatal(error=str(exc)))
        return None
    log.info("loaded %s: ctx %d x %d slots, %s%d threads, KV %s, flash attention %s",
             model_paths[0].name, n_ctx_seq, load.slots, "at most " if governor else "",
             load.threads, load.kv_type, load.flash_attn)
    prompt_cache = None
    if load.prompt_cache_size > 0:
        try:
            prompt_cache = PromptCache(cache_dir, load.prompt_cache_key,
                                       max_bytes=load.prompt_cache_size,
                                       ram_bytes=load.prompt_cache_ram,
                                       min_tokens=load.prompt_cache_min, n_vocab=model.n_vocab,
                                       vouched=load.prompt_cache_vouched)
        except OSError as exc:
            log.warning("prompt cache: off (%s)", exc)
    if mmproj is not None:
        log.info("vision projector %s: images of this model are read here", mmproj.name)
    host = ModelHost(chan, model, ctx, n_ctx_seq, load.slots, load.threads, governor,
                     prompt_cache, step_budget=step_budget, projector=projector,
                     drafter=drafter)
    if on_gpu and free_before:
        confinement["devices"] = _device_use(free_before)
    host.sandbox_info = confinement
    return host
