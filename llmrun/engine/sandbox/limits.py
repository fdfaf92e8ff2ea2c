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
- file size (RLIMIT_FSIZE): the largest file the process may grow. A runner with a
  prompt-cache directory: the largest state file the cache would keep (its whole budget,
  plus the header and the prompt's tokens); a runner with nothing to write: 0, so no file of
  any size (its log is a pipe the daemon reads, server/runners.py); the quantizer: what its
  output can come to (the source's size plus headroom: every type it offers is at most as
  large as the F32/F16/BF16 tensors it starts from). Not for a runner with GPU layers: GPU
  drivers size anonymous memory files (memfd) by the buffers they share. Past the limit a
  write fails with EFBIG: the kernel's SIGXFSZ would kill the process instead, but Python
  ignores that signal from its start (and apply() makes sure). It bounds one file, not how
  many: the daemon also watches the size of a runner's prompt-cache directory.
"""

from __future__ import annotations

import contextlib
import os
import resource
import signal
from dataclasses import dataclass, field

CORE = "no-core-dumps"
ADDRESS_SPACE = "memory-limit"
OPEN_FILES = "open-files-limit"
THREADS = "threads-limit"
FILE_SIZE = "file-size-limit"

OPEN_FILES_MAX = 128
ADDRESS_SPACE_HEADROOM = 4 << 30
# a prompt state's file beyond its state: the magic, the header (promptcache.MAX_HEADER) and
# room to spare; its tokens (4 bytes each) come on top
STATE_FILE_HEADROOM = 1 << 20
# the quantizer's output beyond its source's size: metadata it adds (the quantization's
# version and type) and alignment, by far under this
QUANTIZED_HEADROOM = 16 << 20


@dataclass(frozen=True)
class Limits:
    """What one process may use; None: no bound of that kind."""

    address_space: int | None  # bytes
    open_files: int
    threads: int | None
    file_size: int | None = None  # bytes, the largest file it may grow
    # the kinds left unbounded on purpose, and why (shown by `ps` as layers not applied)
    unbounded: dict[str, str] = field(default_factory=dict)

    @classmethod
    def for_runner(cls, estimate: int, threads: int, on_gpu: bool,
                   own_user_namespace: bool, prompt_cache: int = 0, ctx: int = 0) -> Limits:
        """A runner's limits, from the daemon's memory estimate for its load (0: unknown),
        its thread count and, when it keeps prompt states on disk, their budget in bytes
        (`prompt_cache`, 0: none on disk) for a context of `ctx` tokens."""
        unbounded: dict[str, str] = {}
        file_size: int | None = 0
        if prompt_cache > 0:
            file_size = prompt_cache + 4 * max(0, ctx) + STATE_FILE_HEADROOM
        if on_gpu:
            file_size, unbounded[FILE_SIZE] = None, "GPU drivers size memory files (memfd)"
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
        return cls(address_space, OPEN_FILES_MAX, bound_threads, file_size, unbounded)

    @classmethod
    def for_quantizer(cls, source_size: int) -> Limits:
        """The quantizer child's: its output grows no larger than its source could make."""
        return cls(None, OPEN_FILES_MAX, None, source_size + QUANTIZED_HEADROOM)


def apply(limits: Limits) -> tuple[list[str], list[str]]:
    """Set `limits` on this process, soft and hard (so it cannot raise them again).
    Returns the layers applied and, for those that could not be, "layer: why"."""
    applied: list[str] = []
    unavailable: list[str] = []
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # they would hold the model and prompts
    applied.append(CORE)
    if limits.file_size is not None:
        # a write past it then fails with EFBIG instead of SIGXFSZ killing the process
        # (Python ignores the signal from its start; this makes sure)
        with contextlib.suppress(ValueError):  # (only the main thread sets handlers)
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    wanted = [(ADDRESS_SPACE, resource.RLIMIT_AS, limits.address_space),
              (OPEN_FILES, resource.RLIMIT_NOFILE, limits.open_files),
              (THREADS, resource.RLIMIT_NPROC, limits.threads),
              (FILE_SIZE, resource.RLIMIT_FSIZE, limits.file_size)]
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
