"""The resource limits of a confined process: how much memory it may map, how many files it
may hold open, how many threads it may run, and no core dumps.

A process that parses files from strangers can be driven, by a crafted file, to allocate
without end, open descriptors without end or start threads without end. The kernel's
per-process limits (setrlimit) stop each of these at a bound set from what the model really
needs, so such a process dies alone (a failed allocation, a refused thread) instead of
taking the machine's memory or process table from everything else.

The bounds, and why (measured on SmolLM2-135M and Gemma 3 270M runners, 2 slots):

- address space: the daemon's memory estimate for the load (weights, KV cache, prompt
  states kept in memory, compute buffers) times two, plus 4 GiB. A CPU runner maps 250-700
  MiB more than the estimate (the interpreter, its libraries, one malloc arena per thread,
  thread stacks), whatever the model's size; the factor covers estimates that run short.
  No limit for a runner with GPU layers: CUDA reserves address space by the terabyte for
  its unified addressing, which says nothing about memory used.
- open files: 128. A runner holds 9 (its socket, its log, the model, /proc/stat for the
  thread governor...); prompt states open one file at a time.
- threads: llama.cpp's pool (threads - 1), the engine's and a vision encoder's threads,
  Python's own: 2 x threads + 32. RLIMIT_NPROC counts the threads of the process's user
  *in its user namespace*: inside the runner's own namespace (sandbox/namespaces.py) that
  is the runner's threads alone. Outside one it would count every process of the user, so
  it is not set there; and the kernel never applies it to root.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass, field

CORE = "no-core-dumps"
ADDRESS_SPACE = "memory-limit"
OPEN_FILES = "open-files-limit"
THREADS = "threads-limit"

OPEN_FILES_MAX = 128
ADDRESS_SPACE_HEADROOM = 4 << 30


@dataclass(frozen=True)
class Limits:
    """What one process may use; None: no bound of that kind."""

    address_space: int | None  # bytes
    open_files: int
    threads: int | None
    # the kinds left unbounded on purpose, and why (shown by `ps` as layers not applied)
    unbounded: dict[str, str] = field(default_factory=dict)

    @classmethod
    def for_runner(cls, estimate: int, threads: int, on_gpu: bool,
                   own_user_namespace: bool) -> Limits:
        """A runner's limits, from the daemon's memory estimate for its load (0: unknown)
        and its thread count."""
        unbounded: dict[str, str] = {}
        address_space = None
        if on_gpu:
            unbounded[ADDRESS_SPACE] = "GPU drivers reserve address space by the terabyte"
        elif estimate > 0:
            address_space = 2 * estimate + ADDRESS_SPACE_HEADROOM
        bound_threads: int | None = 2 * max(1, threads) + 32
        if os.getuid() == 0:
            bound_threads, unbounded[THREADS] = None, "the kernel exempts root"
        elif not own_user_namespace:
            bound_threads, unbounded[THREADS] = None, "needs the runner's own user namespace"
        return cls(address_space, OPEN_FILES_MAX, bound_threads, unbounded)


def apply(limits: Limits) -> tuple[list[str], list[str]]:
    """Set `limits` on this process, soft and hard (so it cannot raise them again).
    Returns the layers applied and, for those that could not be, "layer: why"."""
    applied: list[str] = []
    unavailable: list[str] = []
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # they would hold the model and prompts
    applied.append(CORE)
    wanted = [(ADDRESS_SPACE, resource.RLIMIT_AS, limits.address_space),
              (OPEN_FILES, resource.RLIMIT_NOFILE, limits.open_files),
              (THREADS, resource.RLIMIT_NPROC, limits.threads)]
    for layer, kind, value in wanted:
        if value is None:
            continue
        hard = resource.getrlimit(kind)[1]
        if hard != resource.RLIM_INFINITY and hard < value:
            value = hard  # already lower: keep what the system set
        try:
            resource.setrlimit(kind, (value, value))
            applied.append(layer)
        except (OSError, ValueError) as exc:
            unavailable.append(f"{layer}: {exc}")
    unavailable += [f"{layer}: {why}" for layer, why in limits.unbounded.items()]
    return applied, unavailable
