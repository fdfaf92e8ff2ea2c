"""The devices llama.cpp can place layers on, as the daemon knows them.

The daemon never loads llama.cpp: a child process (the runner's entry point with
--list-devices, as Ollama asks llama-server for its devices) lists them, as JSON. The list is
kept; before each fit its free memory is listed again, unless the first list held no GPU
(a CPU-only build gains none later, and the host's free memory is read from /proc). A child
that fails leaves the CPU alone: a model then loads as on a CPU-only build.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from collections.abc import Sequence

from llmrun import config
from llmrun.server.fit import Device
from llmrun.server.runners import runner_env

log = logging.getLogger(__name__)
LIST_TIMEOUT = 60.0  # a first CUDA initialisation can take tens of seconds


def visible(devices: Sequence[Device], wanted: tuple[str, ...] | None) -> list[Device]:
    """`devices` less the GPUs LLMRUN_GPUS leaves out (`wanted`: names, or indices among
    the GPUs; None: all). Devices that hold no layers (the CPU) always stay."""
    if wanted is None:
        return list(devices)
    gpus = [d for d in devices if d.offloads]
    keep = {d.name for i, d in enumerate(gpus) if d.name in wanted or str(i) in wanted}
    unknown = [w for w in wanted if w not in keep and not (w.isdigit() and int(w) < len(gpus))]
    if unknown:
        log.warning("LLMRUN_GPUS names no such GPU: %s (GPUs: %s)", ", ".join(unknown),
                    ", ".join(d.name for d in gpus) or "none")
    return [d for d in devices if not d.offloads or d.name in keep]


def describe(devices: Sequence[Device]) -> str:
    """One line naming the devices, for the log: "CPU; CUDA0 (NVIDIA H200, 139.8 GiB free)"."""
    parts = []
    for d in devices:
        if d.offloads:
            parts.append(f"{d.name} ({d.description}, {d.free / 2**30:.1f} of "
                         f"{d.total / 2**30:.1f} GiB free)")
        else:
            parts.append(d.name)
    return "; ".join(parts) or "none listed"


# Backends that are no GPU's: the CPU's own, its BLAS helper, and RPC (workers added later)
NOT_GPU_BACKENDS = frozenset({"CPU", "BLAS", "RPC"})


def parse(text: str) -> tuple[list[Device], list[str]]:
    """The runner's --list-devices output: the devices, and the GPU backends built in that
    found no device (a CUDA build on a machine without an NVIDIA driver)."""
    listing = json.loads(text)
    devices = [Device(name=str(d["name"]), type=str(d["type"]), total=int(d["total"]),
                      free=int(d["free"]), description=str(d.get("description", "")))
               for d in listing["devices"]]
    idle = [str(name) for name, count in dict(listing.get("backends", {})).items()
            if name not in NOT_GPU_BACKENDS and int(count) == 0]
    return devices, idle


def _why(backend: str, stderr: str) -> str:
    """llama.cpp's own words on why `backend` found no device, from the runner's log."""
    lines = [ln.strip() for ln in stderr.splitlines()
             if backend.lower() in ln.lower() and ("fail" in ln.lower() or "no " in ln.lower())]
    return f" ({lines[-1][-200:]})" if lines else ""


async def list_devices() -> list[Device]:
    """The devices, listed by a runner child now; ([] when it fails, said in the log)."""
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "llmrun.engine.runner", "--list-devices",
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=runner_env())
        out, err = await asyncio.wait_for(proc.communicate(), LIST_TIMEOUT)
        stderr = err.decode(errors="replace")
        if proc.returncode != 0:
            raise OSError(f"exit status {proc.returncode}: {stderr[-500:]}")
        devices, idle = parse(out.decode())
        for backend in idle:
            log.warning("llama.cpp here has the %s backend, but it found no device%s: models "
                        "run on the CPU", backend, _why(backend, stderr))
        return devices
    except (OSError, TimeoutError, ValueError, KeyError, TypeError) as exc:
        log.warning("listing llama.cpp's devices failed (%s): models run on the CPU", exc)
        return []


class DeviceList:
    """The daemon's cached device list; `current()` refreshes free memory when GPUs exist."""

    def __init__(self) -> None:
        self._devices: list[Device] | None = None
        self._visible: list[Device] = []  # of the last listing, as current() returned them
        self._lock = asyncio.Lock()

    async def current(self) -> list[Device]:
        """The visible devices (LLMRUN_GPUS), with their free memory as of now."""
        async with self._lock:
            if self._devices is None or any(d.offloads for d in self._devices):
                first = self._devices is None
                self._devices = await list_devices()
                if first:
                    log.info("devices: %s", describe(self._devices))
            self._visible = visible(self._devices, config.gpus())
            return list(self._visible)

    def cached(self) -> list[Device]:
        """The visible devices as last listed (free memory as of then, at start or the last
        fit), without listing again: what /metrics and /api/show report, which must not
        start a child (a CUDA initialisation) per scrape or per client asking. Empty until
        the first listing ends."""
        return list(self._visible)
