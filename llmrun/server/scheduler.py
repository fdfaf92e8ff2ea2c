"""Which models are loaded: load on first use, reuse while options match, unload when idle.

States of a loaded model, in one line each:
  busy     refs > 0: requests are using its runner; it is never unloaded
  idle     refs == 0: unloaded when its keep-alive expires, or first when room is needed
  dead     its runner died: dropped at the next lookup, and a fresh one is started

A request whose load options (num_ctx, num_batch, num_thread) differ from a busy runner's
waits until that runner is idle, then reloads it (Ollama's behaviour): a busy runner is
never replaced, and clients that alternate options cannot start runners side by side.
While such a request waits, new requests wait too (else it could starve).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmrun import bounds, config
from llmrun.request import EngineError, Options
from llmrun.server.runners import RunnerProcess, RunnerSpec
from llmrun.store import InvalidName, Manifest, ModelNotFound, Store, StoreError
from llmrun.store import gguf as gguf_reader
from llmrun.store.names import ModelName

log = logging.getLogger(__name__)

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


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
    return "+".join([manifest.model.digest, *(a.digest for a in manifest.adapters)])


def available_memory() -> int:
    """Bytes the kernel says can be allocated without swapping (MemAvailable)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 1 << 62  # unknown: do not refuse on a guess


def estimate_memory(info: gguf_reader.GGUFInfo, weights: int, spec: RunnerSpec) -> int:
    """Weights + f16 KV cache for every slot's full context + a compute-buffer allowance."""
    n_layer = int(info.arch_value("block_count", 0) or 0)
    n_embd = int(info.arch_value("embedding_length", 0) or 0)
    n_head = int(info.arch_value("attention.head_count", 1) or 1)
    n_head_kv = info.arch_value("attention.head_count_kv", n_head)
    n_head_kv = int(n_head_kv if isinstance(n_head_kv, int) else n_head)
    k_len = int(info.arch_value("attention.key_length", n_embd // max(n_head, 1)) or 0)
    v_len = int(info.arch_value("attention.value_length", k_len) or 0)
    kv = 2 * n_layer * n_head_kv * (k_len + v_len) * spec.n_ctx * spec.n_slots
    return weights + kv + (256 << 20)


def parse_keep_alive(value: str | float | int | None) -> float:
    """Seconds to keep a model loaded: `5m`, `1h30m`, `30s`, a number of seconds;
    negative means forever (math.inf), 0 means unload once idle."""
    if value is None:
        value = config.keep_alive()
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        text = value.strip().lower()
        try:
            seconds = float(text)
        except ValueError:
            sign = -1.0 if text.startswith("-") else 1.0
            body = text[1:] if text[:1] in "+-" else text
            parts = _DURATION.findall(body)
            if not parts or "".join(n + u for n, u in parts) != body:
                raise ValueError(f"invalid keep_alive duration {value!r}") from None
            seconds = sign * sum(float(n) * _UNITS[u] for n, u in parts)
    if math.isnan(seconds):
        raise ValueError(f"invalid keep_alive duration {value!r}")
    return math.inf if seconds < 0 else seconds


@dataclass
class Loaded:
    name: str
    manifest: Manifest
    spec: RunnerSpec
    runner: RunnerProcess
    refs: int = 0
    keep_alive: float = 300.0
    expires_at: float = math.inf
    last_used: float = field(default_factory=time.monotonic)
    unload_when_idle: bool = False  # `llmrun stop` or keep_alive 0 while requests ran
    idle: asyncio.Event = field(default_factory=asyncio.Event)  # set while refs == 0
    waiting: int = 0  # requests waiting for it to be idle (they count in the queue bound)
    reloads_waiting: int = 0  # of them, with other load options: no new request joins it


@dataclass
class Lease:
    """What a request holds while it uses a model."""

    loaded: Loaded
    load_seconds: float  # time this request spent waiting for a load (0 if already loaded)
    manifest: Manifest  # the requested name's: its parameters, template and system apply,
    # even when the runner was loaded for another name with the same weights


class Scheduler:
    def __init__(self, store: Store, logs: Path) -> None:
        self.store = store
        self.logs = logs
        self.loaded: dict[str, Loaded] = {}  # by model_key
        self._lock = asyncio.Lock()
        self._reaper: asyncio.Task[None] | None = None
        self._verified: set[tuple[str, int, int]] = set()

    def spec_for(self, manifest: Manifest, options: Options) -> RunnerSpec:
        """The runner `options` ask for, with their load-time values capped (as Ollama
        does, quietly): num_ctx to the model's trained context, num_batch to
        bounds.MAX_NUM_BATCH, num_thread to the machine's cores. Values past these buy
        nothing, and each distinct spec would be another reload."""
        n_ctx = options.num_ctx or manifest.options().num_ctx or config.context_length()
        trained = manifest.details.context_length
        if trained:
            n_ctx = min(n_ctx, trained)
        n_threads = min(options.num_thread or config.num_threads(), os.cpu_count() or 1)
        return RunnerSpec(
            model_paths=tuple(self.store.model_paths(manifest)),
            n_ctx=n_ctx,
            n_slots=config.num_parallel(),
            n_threads=n_threads,
            n_batch=min(options.num_batch or 512, bounds.MAX_NUM_BATCH),
            lora_paths=tuple(self.store.adapter_paths(manifest)),
        )

    @contextlib.asynccontextmanager
    async def use(self, name: str, options: Options,
                  keep_alive: str | float | None = None) -> AsyncIterator[Lease]:
        """Hold a loaded runner for `name` for the duration of the block."""
        try:
            ttl = parse_keep_alive(keep_alive)
        except ValueError as exc:
            raise EngineError(str(exc), status=400, kind="invalid_request") from None
        lease = await self._acquire(name, options)
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
                replaced = self.loaded.get(model_key(loaded.manifest)) is not loaded
                if ttl == 0 or replaced or loaded.unload_when_idle:
                    await self.unload(loaded)

    async def _acquire(self, name: str, options: Options) -> Lease:
        try:
            parsed, manifest = self.store.get(name)
        except ModelNotFound as exc:
            raise EngineError(str(exc), status=404, kind="not_found") from None
        except InvalidName as exc:
            raise EngineError(f"invalid model name: {exc}", status=400,
                              kind="invalid_request") from None
        spec = self.spec_for(manifest, options)
        key = model_key(manifest)
        while True:
            async with self._lock:
                current = self.loaded.get(key)
                if current is not None and current.runner.alive and current.refs > 0 and (
                        current.spec != spec or current.reloads_waiting):
                    # Busy, and either these load options differ or a request that needs
                    # other ones waits: wait until it is idle (as Ollama does) rather than
                    # start a second runner beside it; then the first waiter takes it, or
                    # reloads it with its own options.
                    self._check_queue(current, parsed.short)
                    reload = int(current.spec != spec)
                    current.waiting += 1
                    current.reloads_waiting += reload
                else:
                    return await self._lease_or_load(current, parsed, manifest, spec, key)
            try:
                await current.idle.wait()
            finally:
                current.waiting -= 1
                current.reloads_waiting -= reload

    def _check_queue(self, current: Loaded, short: str) -> None:
        """Answer at once rather than let clients pile up behind a full queue."""
        queued = current.refs + current.waiting - current.spec.n_slots
        if queued >= config.max_queue():
            raise EngineError(
                f"server busy: {current.refs + current.waiting} requests for '{short}' "
                f"already running or queued (LLMRUN_NUM_PARALLEL={current.spec.n_slots}, "
                f"LLMRUN_MAX_QUEUE={config.max_queue()}); retry shortly",
                status=503, kind="overloaded", retry_after=1)

    async def _lease_or_load(self, current: Loaded | None, parsed: ModelName,
                             manifest: Manifest, spec: RunnerSpec, key: str) -> Lease:
        """Under the lock: a lease on `current` if it fits `spec`, else a fresh runner (in
        place of `current` when that is idle or dead)."""
        if current is not None and current.runner.alive and current.spec == spec:
            self._check_queue(current, parsed.short)
            current.refs += 1
            current.idle.clear()
            current.expires_at = math.inf
            return Lease(current, 0.0, manifest)
        if current is not None and current.refs == 0:
            await self.unload(current)
        elif current is not None:
            # dead with requests still on it: they fail; it is dropped once they have
            self.loaded.pop(key, None)
        need = await asyncio.to_thread(self._check_files, parsed.short, manifest, spec)
        await self._make_room(need)
        runner = RunnerProcess(spec, self.logs / f"runner-{key[7:19]}.log")
        await runner.start()
        _warn_unconfined(runner.info)
        loaded = Loaded(str(parsed), manifest, spec, runner, refs=1)
        self.loaded[key] = loaded
        self._ensure_reaper()
        return Lease(loaded, runner.load_seconds, manifest)

    def _check_files(self, name: str, manifest: Manifest, spec: RunnerSpec) -> int:
        """Before llama.cpp reads a file: it must still hash to its digest (checked once per
        file version: size and mtime) and its GGUF header must pass the validator.
        Returns the memory the loaded model will need, in bytes (an estimate)."""
        files = (*spec.model_paths, *spec.lora_paths)
        try:
            versions = {(str(p), p.stat().st_size, p.stat().st_mtime_ns) for p in files}
            if not versions <= self._verified:
                self.store.verify(manifest)  # hashes every file of the model once
                for p in files[1:]:
                    gguf_reader.read(p)
            info = gguf_reader.read(files[0])
            self._verified |= versions
        except (OSError, StoreError, gguf_reader.GGUFError) as exc:
            raise EngineError(f"model '{name}' cannot be loaded: {exc}") from None
        return estimate_memory(info, manifest.size, spec)

    async def _make_room(self, need: int) -> None:
        """Unload idle models, least recently used first, until the model count is under
        LLMRUN_MAX_LOADED_MODELS and `need` bytes fit in available memory."""
        limit = config.max_loaded_models()
        for key in [k for k, v in self.loaded.items() if not v.runner.alive and v.refs == 0]:
            self.loaded.pop(key)
        while len(self.loaded) >= limit or need > available_memory():
            idle = [v for v in self.loaded.values() if v.refs == 0]
            if not idle:
                break
            log.info("unloading %s to make room", min(idle, key=lambda v: v.last_used).name)
            await self.unload(min(idle, key=lambda v: v.last_used))
        avail = available_memory()
        if need > avail:
            raise EngineError(
                f"model needs about {need / 2**30:.1f} GiB (weights and KV cache for "
                f"LLMRUN_NUM_PARALLEL slots of num_ctx tokens) but only {avail / 2**30:.1f} GiB "
                "is available; lower num_ctx or LLMRUN_NUM_PARALLEL, or stop other models",
                status=507, kind="insufficient_memory")

    async def unload(self, loaded: Loaded) -> None:
        key = model_key(loaded.manifest)
        if self.loaded.get(key) is loaded:
            del self.loaded[key]
        await loaded.runner.stop()

    async def unload_name(self, name: str) -> bool:
        try:
            _, manifest = self.store.get(name)
        except (ModelNotFound, InvalidName):
            return False
        loaded = self.loaded.get(model_key(manifest))
        if loaded is None:
            return False
        if loaded.refs == 0:
            await self.unload(loaded)
        else:
            loaded.unload_when_idle = True
        return True

    @staticmethod
    def expires_at_iso(loaded: Loaded) -> str:
        """When an idle model will be unloaded, as Ollama's /api/ps reports it."""
        from datetime import UTC, datetime, timedelta

        busy = loaded.refs > 0
        remaining = loaded.keep_alive if busy else loaded.expires_at - time.monotonic()
        if math.isinf(remaining):
            return "2318-01-01T00:00:00Z"  # "forever", far in the future as Ollama shows it
        when = datetime.now(UTC) + timedelta(seconds=max(0.0, remaining))
        return when.isoformat().replace("+00:00", "Z")

    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.create_task(self._reap())

    async def _reap(self) -> None:
        while self.loaded:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for loaded in list(self.loaded.values()):
                if loaded.refs == 0 and (loaded.expires_at <= now or not loaded.runner.alive):
                    log.info("unloading %s (idle)", loaded.name)
                    await self.unload(loaded)

    async def shutdown(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        await asyncio.gather(*(self.unload(v) for v in list(self.loaded.values())),
                             return_exceptions=True)
