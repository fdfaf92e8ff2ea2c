"""Which models are loaded: load on first use, reuse while options match, unload when idle.

States of a model in the table, in one line each:
  loading  its files are checked and its runner started, in a task of its own; requests for
           it wait for that one load, and each gets its error if it fails
  busy     loaded, refs > 0: requests are using its runner; it is never unloaded
  idle     loaded, refs == 0: unloaded when its keep-alive expires, or first when room is needed
  dead     its runner died: dropped at the next lookup, and a fresh one is started

The table needs no lock: each decision on it is taken between two awaits, so no other request
sees it half changed, and hashing a model file or starting a runner holds nothing, so a
request for a loaded model never waits on another model's load. One lock serialises making
room (evicting idle models, reading free memory), and a loading model's estimate counts as
used until it is loaded: two loads cannot both count the same free memory.

A request whose load options (num_ctx, num_batch, num_thread) differ from a busy runner's
waits until that runner is idle, then reloads it (Ollama's behaviour): a busy runner is
never replaced, and clients that alternate options cannot start runners side by side.
While such a request waits, new requests wait too (else it could starve), and the model's
snapshot says `reload_pending`.

Runners are made by `runner_factory` (RunnerProcess; the tests give a fake): the scheduler
needs of one only what `Runner` lists.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from llmrun import config
from llmrun.request import ChatRequest, Chunk, Done, EngineError, Progress, RunnerOptions, Started
from llmrun.server import context, fit, keepalive, loadspec, memory, work
from llmrun.server.fit import CPU, Device, Placement
from llmrun.server.loadspec import RunnerSpec
from llmrun.server.runners import RunnerProcess
from llmrun.store import InvalidName, Manifest, ModelNotFound, Store
from llmrun.store import gguf as gguf_reader
from llmrun.store.names import ModelName

log = logging.getLogger(__name__)

_warned_unconfined: list[bool] = []  # the sandbox warning is given once per daemon


def _warn_unconfined(info: dict[str, Any]) -> None:
    """Once per daemon: say in its log that runners run without some confinement layer
    (LLMRUN_SANDBOX=strict would refuse them; =0 turned it off on purpose)."""
    missing = info.get("sandbox_missing") or []
    if not missing or _warned_unconfined or config.sandbox_mode() == "off":
        return
    _warned_unconfined.append(True)
    log.warning("sandbox: model runners run without: %s (LLMRUN_SANDBOX=strict refuses to "
                "run a model unconfined)", "; ".join(missing))


def model_key(manifest: Manifest) -> str:
    """What makes two names the same loaded model: the same weights and the same adapters."""
    return "+".join([manifest.layer.digest, *(a.digest for a in manifest.adapters)])


def _main_gpu(spec: RunnerSpec) -> int | None:
    return spec.main_gpu if spec.main_gpu >= 0 else None


LOADING, READY = "loading", "ready"
T = TypeVar("T")


class Runner(Protocol):
    """What the scheduler and the service need of a runner: RunnerProcess, or a test's fake."""

    info: dict[str, Any]  # the runner's "ready" message: n_ctx_seq, sandbox, confined
    placement: Placement | None  # where its layers go, set by the scheduler before start()
    memory: int  # the estimate of what it needs (bytes), set with `placement`
    load_seconds: float  # how long start() took
    engine_stats: dict[str, Any]  # its engine's step counters, as last reported

    @property
    def alive(self) -> bool: ...

    @property
    def busy(self) -> int: ...  # requests in flight on it

    async def start(self) -> None: ...  # returns once the model is loaded; EngineError if not

    async def stop(self) -> None: ...

    def generate(self, req: ChatRequest
                 ) -> AsyncIterator[Started | Progress | Chunk | Done]: ...

    # a one-answer kind of work (server/work.py: count, tokenize, embed, rerank...)
    async def run(self, job: work.Work[T]) -> T: ...


RunnerFactory = Callable[[RunnerSpec, Path], Runner]  # (spec, log file) -> a runner not started


@dataclass(eq=False)
class Loaded:
    """A model in the table, loading or loaded (only this module reads it: others get
    ModelState snapshots)."""

    name: str
    manifest: Manifest
    spec: RunnerSpec
    runner: Runner
    state: str = LOADING
    refs: int = 0
    keep_alive: float = 300.0
    expires_at: float = math.inf
    last_used: float = field(default_factory=time.monotonic)
    unload_when_idle: bool = False  # `llmrun stop`, keep_alive 0 or `rm` while requests ran
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while loaded, refs == 0
    waiting: int = 0  # requests waiting for its load or for it to be idle (in the queue bound)
    reloads_waiting: int = 0  # of them, with other load options: no new request joins it
    settled: asyncio.Event = field(default_factory=asyncio.Event)  # its load ended, well or not
    error: EngineError | None = None  # why its load failed
    reserved: int = 0  # bytes counted as used while it loads (its estimate, once room was made)
    memory: int = 0  # its estimate (weights, KV cache, prompt states in memory, buffers)
    placement: Placement | None = None  # where its layers go (the fit), once room was made
    stopped: asyncio.Event = field(default_factory=asyncio.Event)  # its runner was stopped
    task: asyncio.Task[None] | None = None  # its load


@dataclass
class Lease:
    """What a request holds while it uses a model."""

    loaded: Loaded
    load_seconds: float  # time this request spent waiting for a load (0 if already loaded)
    manifest: Manifest  # the requested name's: its parameters, template and system apply,
    # even when the runner was loaded for another name with the same weights

    @property
    def runner(self) -> Runner:
        return self.loaded.runner


@dataclass(frozen=True)
class ModelState:
    """A loaded model as /api/ps, /health and the metrics show it (a snapshot)."""

    name: str
    manifest: Manifest
    expires_at: str  # ISO 8601 UTC, as Ollama's /api/ps reports it
    context_length: int
    slots: int
    slots_busy: int
    sandbox: list[str]  # confinement layers the runner applied
    confined: bool  # whether that is all of them
    reload_pending: bool  # requests with other load options wait for it to be idle
    memory: int = 0  # bytes it is estimated to take (Ollama's /api/ps `size`)
    vram: int = 0  # of them, on GPUs (`size_vram`): measured by the runner, else estimated
    devices: dict[str, int] = field(default_factory=dict)  # bytes per device (CPU: host)
    kv_cache_type: str = "f16"
    flash_attention: str = "auto"
    # with RPC workers: layers in all, those kept here, and each worker's share
    placement: dict[str, Any] | None = None
    engine: dict[str, Any] = field(default_factory=dict)  # its engine's step counters


def snapshot(m: Loaded) -> ModelState:
    """What `ps` shows of a loaded model, read off the table's entry."""
    info = m.runner.info
    # what the runner measured on each GPU, where it could; the estimate elsewhere
    measured = info.get("devices") or {}
    estimated = m.placement.memory if m.placement is not None else {CPU: m.memory}
    per_device = {k: int(measured.get(k) or v) for k, v in estimated.items()}
    vram = sum(v for k, v in per_device.items() if k != CPU)
    placed = m.placement
    # With every layer on GPUs, `size` is what they hold, as Ollama's `ps` reports a
    # full offload (size_vram == size, "100% GPU"): the host's part then is the input
    # embeddings and the prompt states, which compute nothing (an H200 run showed a fully
    # offloaded SmolLM2 as "46%/54% CPU/GPU" when they were counted). `devices` keeps it.
    full = placed is not None and placed.layers > 0 and placed.n_gpu_layers >= placed.layers
    return ModelState(name=m.name, manifest=m.manifest, expires_at=keepalive.expires_at_iso(
                          m.keep_alive if m.refs > 0 else m.expires_at - time.monotonic()),
                      context_length=info.get("n_ctx_seq", m.spec.n_ctx),
                      slots=m.spec.n_slots, slots_busy=m.runner.busy,
                      sandbox=list(info.get("sandbox", [])),
                      confined=bool(info.get("confined", False)),
                      reload_pending=m.reloads_waiting > 0,
                      memory=vram if full else sum(per_device.values()),
                      devices=per_device, vram=vram,
                      kv_cache_type=m.spec.kv_type, flash_attention=m.spec.flash_attention,
                      placement=info.get("rpc"), engine=dict(m.runner.engine_stats))


class Scheduler:
    def __init__(self, store: Store, logs: Path, runner_factory: RunnerFactory = RunnerProcess,
                 free_memory: Callable[[], int] = memory.available,
                 devices: Callable[[], Awaitable[list[Device]]] | None = None) -> None:
        self.store = store
        self.logs = logs
        self.runner_factory = runner_factory
        self.free_memory = free_memory  # bytes that can be allocated now
        # the devices with their free memory now (server/devices.py); None: the CPU alone
        self.devices = devices
        self._models: dict[str, Loaded] = {}  # by model_key: loading and loaded
        self._retiring: dict[str, list[Loaded]] = {}  # by model_key: runners being stopped
        self._room = asyncio.Lock()  # held by one load at a time while it makes room
        self._reaper: asyncio.Task[None] | None = None
        self._verified: set[tuple[str, int, int]] = set()
        self._default_ctx: dict[str, int] = {}  # by model_key: default_context's choice

    def spec_for(self, manifest: Manifest, options: RunnerOptions,
                 default_ctx: int = context.STEPS[0]) -> RunnerSpec:
        """The runner the merged `options` ask for (server/loadspec.py)."""
        return loadspec.spec_for(self.store, manifest, options, default_ctx)

    def models(self) -> list[ModelState]:
        """The loaded models (not those still loading), as snapshots."""
        return [snapshot(m) for m in self._models.values() if m.state == READY]

    def lookup(self, name: str) -> tuple[ModelName, Manifest]:
        """The store's entry for `name`, or the error a request for it gets (404, 400)."""
        try:
            return self.store.get(name)
        except ModelNotFound as exc:
            raise EngineError(str(exc), code="not_found") from None
        except InvalidName as exc:
            raise EngineError(f"invalid model name: {exc}", code="invalid_request") from None

    @contextlib.asynccontextmanager
    async def use(self, model: str | tuple[ModelName, Manifest], options: RunnerOptions,
                  keep_alive: float | None = None) -> AsyncIterator[Lease]:
        """Hold a loaded runner for `model` (a name, or what `lookup` gave for it: the
        service looks a request's model up once) for the duration of the block. `options`:
        the runner's, merged already (request over Modelfile: service.merged); `keep_alive`:
        seconds (inf: forever), None for LLMRUN_KEEP_ALIVE."""
        try:
            ttl = keepalive.seconds(keep_alive)
        except ValueError as exc:  # LLMRUN_KEEP_ALIVE itself
            raise EngineError(f"LLMRUN_KEEP_ALIVE: {exc}", code="invalid_request") from None
        parsed, manifest = self.lookup(model) if isinstance(model, str) else model
        lease = await self._acquire(parsed, manifest, options, ttl)
        loaded = lease.loaded
        try:
            yield lease
        finally:
            loaded.refs -= 1
            loaded.last_used = time.monotonic()
            loaded.keep_alive = ttl
            if loaded.refs == 0:
                loaded.idle.set()
                loaded.expires_at = loaded.last_used + ttl
                replaced = self._models.get(model_key(loaded.manifest)) is not loaded
                if ttl == 0 or replaced or loaded.unload_when_idle:
                    await self.unload(loaded)

    async def default_context(self, manifest: Manifest, options: RunnerOptions) -> int:
        """The context `manifest` is loaded with where nothing names one (server/context.py),
        chosen at its first load and kept: a default that followed free memory would
        reload runners under requests that name no context."""
        key = model_key(manifest)
        if key not in self._default_ctx:
            spec = self.spec_for(manifest, options)  # its KV type, slots and files
            try:
                info = await asyncio.to_thread(gguf_reader.read, spec.model_paths[0])
                n_layer = int(info.arch_value("block_count", 0) or 0)
                per_token = int(n_layer * fit.kv_width(info) * fit.KV_BYTES[spec.kv_type])
            except (OSError, IndexError, gguf_reader.GGUFError):
                per_token = 0  # the load will say what is wrong with the file
            devices = await self.devices() if self.devices is not None else []
            self._default_ctx[key] = context.STEPS[0] if per_token <= 0 else context.default(
                devices, self.free_memory(), manifest.size, per_token, spec.n_slots,
                manifest.details.context_length)
        return self._default_ctx[key]

    async def _acquire(self, parsed: ModelName, manifest: Manifest, options: RunnerOptions,
                       ttl: float) -> Lease:
        named = loadspec.named_context(options)
        spec = self.spec_for(manifest, options,
                             named or await self.default_context(manifest, options))
        key = model_key(manifest)
        load_seconds = 0.0
        while True:
            current = self._models.get(key)
            if current is not None and current.state == READY and current.runner.alive:
                if current.spec == spec and not (current.refs and current.reloads_waiting):
                    self._check_queue(current, parsed.short)
                    current.refs += 1
                    current.idle.clear()
                    current.expires_at = math.inf
                    return Lease(current, load_seconds, manifest)
                if current.refs > 0:
                    # Busy, and either these load options differ or a request that needs
                    # other ones waits: wait until it is idle (as Ollama does) rather than
                    # start a second runner beside it; then the first waiter takes it, or
                    # reloads it with its own options.
                    self._check_queue(current, parsed.short)
                    await self._wait(current, current.idle, reload=current.spec != spec)
                    continue
            if current is None or current.state == READY:
                # none, dead, or idle with other load options: (re)load it
                current = self._begin_load(current, parsed, manifest, spec, key, ttl)
            else:
                self._check_queue(current, parsed.short)  # its load is under way: join it
            await self._wait(current, current.settled, reload=False)
            if current.error is not None:
                raise copy.copy(current.error) from None  # each waiter gets its own
            load_seconds = current.runner.load_seconds
            if current.spec != spec:
                # the waiters that asked for this load (woken with this one) lease first;
                # this one then waits for them and reloads, rather than undo their load
                await asyncio.sleep(0)

    @staticmethod
    async def _wait(loaded: Loaded, event: asyncio.Event, reload: bool) -> None:
        loaded.waiting += 1
        loaded.reloads_waiting += reload
        try:
            await event.wait()
        finally:
            loaded.waiting -= 1
            loaded.reloads_waiting -= reload

    def _check_queue(self, current: Loaded, short: str) -> None:
        """Answer at once rather than let clients pile up behind a full queue."""
        queued = current.refs + current.waiting - current.spec.n_slots
        if queued >= config.max_queue():
            raise EngineError(
                f"server busy: {current.refs + current.waiting} requests for '{short}' "
                f"already running or queued (LLMRUN_NUM_PARALLEL={current.spec.n_slots}, "
                f"LLMRUN_MAX_QUEUE={config.max_queue()}); retry shortly",
                code="busy", retry_after=1)

    def _begin_load(self, old: Loaded | None, parsed: ModelName, manifest: Manifest,
                    spec: RunnerSpec, key: str, ttl: float) -> Loaded:
        """A loading entry for `key` in the table, in place of `old` (idle or dead), and the
        task that loads it. The load goes on if the request that began it goes away: others
        may be waiting for it."""
        if old is not None:
            del self._models[key]
        runner = self.runner_factory(spec, self.logs / f"runner-{key[7:19]}.log")
        loaded = Loaded(str(parsed), manifest, spec, runner, keep_alive=ttl)
        self._models[key] = loaded
        # an idle or dead runner is stopped first; a dead one that requests still hold
        # (they fail) is stopped when the last of them ends (see use)
        retire = old if old is not None and old.refs == 0 else None
        loaded.task = asyncio.create_task(self._load(loaded, key, parsed.short, retire))
        return loaded

    async def _load(self, loaded: Loaded, key: str, short: str, old: Loaded | None) -> None:
        """Check the files, make room, start the runner; then wake who waits for it."""
        try:
            if old is not None:
                await self.unload(old)
            for retiring in list(self._retiring.get(key, [])):
                await retiring.stopped.wait()  # never two runners for one model at once
            need, shape = await asyncio.to_thread(memory.check_files, self.store,
                                                  self._verified, short, loaded.manifest,
                                                  loaded.spec)
            loaded.memory = need
            await self._make_room(loaded, need, shape)
            await self._start(loaded, shape)
        except BaseException as exc:
            if self._models.get(key) is loaded:
                del self._models[key]
            if isinstance(exc, EngineError):
                loaded.error = exc
            elif isinstance(exc, Exception):
                log.exception("loading %s failed", loaded.name)
                loaded.error = EngineError(f"model '{short}' failed to load: {exc}")
            else:  # cancelled: the daemon is shutting down
                loaded.error = EngineError("the server is shutting down", code="busy")
            loaded.settled.set()
            with contextlib.suppress(Exception):
                await loaded.runner.stop()
            loaded.stopped.set()
            if not isinstance(exc, Exception):
                raise
            return
        _warn_unconfined(loaded.runner.info)
        loaded.state = READY
        loaded.reserved = 0  # in use now: free memory says so
        loaded.last_used = time.monotonic()
        loaded.expires_at = loaded.last_used + loaded.keep_alive  # if no waiter takes it
        loaded.idle.set()
        loaded.settled.set()
        self._ensure_reaper()
        if loaded.unload_when_idle and not loaded.waiting:
            await self.unload(loaded)

    async def _start(self, loaded: Loaded, shape: fit.ModelShape) -> None:
        """Start the runner with the layers the fit placed; when that load fails with layers
        on GPUs (out of their memory, most likely: estimates are estimates), again with
        half as many, then with none, each in a fresh runner, saying so in the log."""
        while True:
            placement = loaded.placement
            loaded.runner.placement = placement
            loaded.runner.memory = loaded.memory
            try:
                await loaded.runner.start()
                return
            except EngineError as exc:
                if placement is None or placement.n_gpu_layers == 0:
                    raise
                fewer = placement.n_gpu_layers // 2 if placement.n_gpu_layers > 1 else 0
                log.warning("%s did not load with %s (%s): retrying with %d layers on GPUs",
                            loaded.name, placement.reason, exc.message, fewer)
            with contextlib.suppress(Exception):
                await loaded.runner.stop()
            others = [v for v in self._models.values() if v is not loaded]
            loaded.placement = await self._fit(loaded, loaded.memory, shape, others,
                                               num_gpu=fewer)
            loaded.runner = self.runner_factory(
                loaded.spec, self.logs / f"runner-{model_key(loaded.manifest)[7:19]}.log")

    async def _make_room(self, loading: Loaded, need: int, shape: fit.ModelShape) -> None:
        """Fit the model on the devices (server/fit.py) and make room for it: unload idle
        models, least recently used first, until the other models (loaded or loading) are
        fewer than LLMRUN_MAX_LOADED_MODELS, its host part fits in the free memory less
        what the other loads reserved, and (fitted automatically) its layers all fit on the
        GPUs or no idle model holds GPU memory; then reserve its host part."""
        limit = config.max_loaded_models()
        async with self._room:
            while True:
                for dead in [v for v in self._models.values()
                             if v.state == READY and v.refs == 0 and not v.runner.alive]:
                    await self.unload(dead)
                others = [v for v in self._models.values() if v is not loading]
                placement = await self._fit(loading, need, shape, others)
                host = placement.memory.get(CPU, need)
                avail = self.free_memory() - sum(v.reserved for v in others)
                idle = [v for v in others if v.state == READY and v.refs == 0 and not v.waiting]
                if len(others) < limit and host <= avail:
                    # layers left on the CPU that an idle model's GPU memory could hold
                    short = placement.n_gpu_layers < placement.layers \
                        and loading.spec.gpu_layers < 0 and not loading.spec.rpc_workers
                    idle = [v for v in idle if short and v.placement is not None
                            and v.placement.vram > 0]
                    if not idle:
                        break
                if not idle:
                    break
                victim = min(idle, key=lambda v: v.last_used)
                log.info("unloading %s to make room", victim.name)
                await self.unload(victim)
            if host > avail:
                raise EngineError(
                    f"model needs about {host / 2**30:.1f} GiB (weights and KV cache for "
                    f"LLMRUN_NUM_PARALLEL slots of num_ctx tokens) but only "
                    f"{max(avail, 0) / 2**30:.1f} GiB is available; lower num_ctx or "
                    "LLMRUN_NUM_PARALLEL, or stop other models",
                    code="insufficient_memory")
            loading.reserved = host
            loading.placement = placement
            if placement.n_gpu_layers or placement.reason not in ("no GPU", ""):
                log.info("%s: %s", loading.name, placement.reason)

    async def _fit(self, loading: Loaded, need: int, shape: fit.ModelShape,
                   others: list[Loaded], num_gpu: int | None = None) -> Placement:
        """Where `loading`'s layers go, on the devices' free memory now less what the other
        loads placed there and their runners have not taken yet. A device's free memory is
        also at most its size less what the loaded models hold on it: a driver without a
        memory budget reports its whole heap free however much is allocated (Mesa's lavapipe:
        two models of 1.07 GiB each were both placed whole on its 2 GiB heap). `num_gpu`:
        the layers to place (a retry's), else the load's own option."""
        spec = loading.spec
        if self.devices is None or spec.rpc_workers:  # (RPC workers place layers as before)
            return Placement(memory={CPU: need}, layers=shape.n_layer + 1)
        devices = await self.devices()
        pending: dict[str, int] = {}
        held: dict[str, int] = {}
        for v in others:
            if v.placement is not None:
                into = pending if v.state == LOADING else held
                for name, size in v.placement.memory.items():
                    into[name] = into.get(name, 0) + size
        devices = [dataclasses.replace(d, free=min(d.free, d.total - held.get(d.name, 0))
                                       - pending.get(d.name, 0)) for d in devices]
        if num_gpu is None and spec.gpu_layers >= 0:
            num_gpu = spec.gpu_layers
        placement = fit.fit(shape, memory.needs_of(shape, spec, need), devices, num_gpu=num_gpu,
                            main_gpu=_main_gpu(spec), overhead=config.gpu_overhead())
        if placement.n_gpu_layers == 0:  # all on the CPU: the estimate, as without GPUs
            placement = dataclasses.replace(placement, memory={CPU: need})
        return placement

    async def unload(self, loaded: Loaded) -> None:
        key = model_key(loaded.manifest)
        if self._models.get(key) is loaded:
            del self._models[key]
        retiring = self._retiring.setdefault(key, [])
        retiring.append(loaded)
        try:
            await loaded.runner.stop()
        finally:
            retiring.remove(loaded)
            if not retiring and self._retiring.get(key) is retiring:
                del self._retiring[key]
            loaded.stopped.set()

    async def unload_name(self, name: str) -> bool:
        try:
            _, manifest = self.store.get(name)
        except (ModelNotFound, InvalidName):
            return False
        loaded = self._models.get(model_key(manifest))
        if loaded is None:
            return False
        await self._unload_once_idle(loaded)
        return True

    async def forget(self, name: str) -> None:
        """`name` left the store: unload the runner loaded under it, now if idle, else once
        its requests end. A runner of the same weights loaded under another name stays."""
        for loaded in [v for v in self._models.values() if v.name == name]:
            await self._unload_once_idle(loaded)

    async def _unload_once_idle(self, loaded: Loaded) -> None:
        """Unload `loaded` now if it is loaded and idle, else once its load and its requests
        are done."""
        if loaded.state == READY and loaded.refs == 0:
            await self.unload(loaded)
        else:
            loaded.unload_when_idle = True

    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.create_task(self._reap())

    async def _reap(self) -> None:
        while self._models:
            await asyncio.sleep(1.0)
            await self.reap()

    async def reap(self, now: float | None = None) -> None:
        """Unload the idle models whose keep-alive has expired by `now`, and idle ones whose
        runner died (the reaper's step, once a second)."""
        now = time.monotonic() if now is None else now
        for loaded in list(self._models.values()):
            if self._models.get(model_key(loaded.manifest)) is loaded \
                    and loaded.state == READY and loaded.refs == 0 and not loaded.waiting \
                    and (loaded.expires_at <= now or not loaded.runner.alive):
                log.info("unloading %s (idle)", loaded.name)
                await self.unload(loaded)

    async def shutdown(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        loads = [v.task for v in self._models.values() if v.state == LOADING and v.task]
        for task in loads:
            task.cancel()
        await asyncio.gather(*loads, return_exceptions=True)
        await asyncio.gather(*(self.unload(v) for v in list(self._models.values())),
                             return_exceptions=True)
