"""Confine a process that parses untrusted model files: the runner and the quantizer child.

They run a large C++ library on files that came from anywhere. If a crafted file ever turned
a parser bug into code execution, the process should be a poor place to have it: it needs no
new programs, no network, no other processes and (a runner) no writable file, so it gives
them up for good *before* llama.cpp reads the first byte of the model:

- it first enters a user namespace of its own, a mount namespace and an empty network
  namespace (namespaces.py: isolate(), while it has one thread);
- resource limits (limits.py): no core dumps (they would hold the model and the prompts),
  the size a file may grow to (its output's bound), and for a runner its address space,
  open files and threads, from what its load needs;
- no new privileges (`PR_SET_NO_NEW_PRIVS`): setuid binaries and file capabilities stop
  working, which also lets an unprivileged process take on the two layers below;
- Landlock (Linux 5.13+): the file system becomes read-only and shrinks to the model files,
  the Python installation and the system libraries; nothing is writable except the paths a
  caller names (the quantizer's output file, a runner's prompt-cache directory), and the
  device nodes of the GPU a runner uses are its only other read-write files. Where the
  kernel knows them, TCP bind/connect, abstract unix sockets and signals to processes outside
  the sandbox are cut too (a future RPC client would need a NET_PORT rule for its workers);
- where Landlock is missing and the process must write: read-only mounts (mounts.py), in its
  mount namespace, every mount read-only but its output and /dev only the harmless nodes and
  its GPU's; where neither can be had, the filter below allows no write-open at all, so a
  process that must write writes nothing rather than anywhere (a GPU runner and the
  quantizer then refuse to start, saying why; a runner keeps its prompt states in memory);
- a seccomp filter (through libseccomp, the library Docker and systemd use) that is an
  allowlist: syscalls.py names, in groups with their reasons, the calls a confined process
  was traced making (scripts/trace_syscalls.py regenerates and checks it), and everything
  else is answered EPERM: running programs, creating sockets or connecting, forking,
  tracing or reading other processes, io_uring (which can open sockets and files behind the
  filter's back), namespaces, mounting, kernel modules, BPF, key rings, and any call nobody
  listed. Some allowed calls keep a condition on their arguments: clone only for threads,
  signals and prlimit64 only to itself, setpriority only on its calling thread, open/openat
  only for reading unless the process has a writable path or GPU nodes (then Landlock or the
  read-only mounts decide where); renaming, deleting and the
  like only with a writable path; what GPU drivers call beyond the CPU's needs only with GPU
  nodes. clone3 and openat2 answer ENOSYS, so that the C library falls back to the calls
  the filter can check.

`confine()` applies what the system allows and says what it applied and what is missing; the
caller decides whether a missing layer is fatal (LLMRUN_SANDBOX=strict). Already open file
descriptors (the daemon's socket pair, an RPC runner's connections to its workers, the log
pipe on stdout/stderr) keep working: Landlock, the read-only mounts and the write-open rule
act when a file is opened, not on descriptors held.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from llmrun.engine.sandbox import mounts, namespaces
from llmrun.engine.sandbox.landlock import c_library, gpu_nodes, landlock_abi, restrict_files
from llmrun.engine.sandbox.limits import CORE, OPEN_FILES_MAX, Limits
from llmrun.engine.sandbox.limits import apply as apply_limits
from llmrun.engine.sandbox.namespaces import enter as isolate
from llmrun.engine.sandbox.seccomp import libseccomp, restrict_syscalls

__all__ = ["LANDLOCK", "NO_CORE_DUMPS", "NO_NEW_PRIVS", "READ_ONLY", "SECCOMP", "Confinement",
           "Limits", "confine", "gpu_nodes", "isolate", "landlock_abi", "restrict_files",
           "restrict_syscalls", "writes_confinable"]

log = logging.getLogger("llmrun.runner")

# Layer names, as runners report them (/api/ps "sandbox").
NO_CORE_DUMPS = CORE
NO_NEW_PRIVS = "no-new-privs"
LANDLOCK = "landlock"
READ_ONLY = mounts.READ_ONLY
SECCOMP = "seccomp"
PR_SET_NO_NEW_PRIVS = 38


@dataclass
class Confinement:
    """What `confine()` achieved: layers applied, layers that failed (`missing`: strict mode
    refuses to go on), layers this kernel does not offer at all (`unavailable`: not a failure,
    but worth a warning)."""

    applied: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # "layer: why"
    unavailable: list[str] = field(default_factory=list)  # "layer: why"

    @property
    def confined(self) -> bool:
        return not self.missing and SECCOMP in self.applied

    def info(self) -> dict[str, Any]:
        """For the runner's ready message (the daemon shows it in /api/ps and `llmrun ps`)."""
        return {"sandbox": list(self.applied), "confined": self.confined,
                "sandbox_missing": [*self.missing, *self.unavailable]}

    def refusal(self) -> str:
        """Why strict mode refuses to run (empty when nothing is missing)."""
        if not self.missing:
            return ""
        return ("LLMRUN_SANDBOX=strict refuses to run a model unconfined, and this system "
                f"cannot apply: {'; '.join(self.missing)} (LLMRUN_SANDBOX=1 runs with the "
                "layers that are available)")



def _why(exc: BaseException) -> str:
    """An error as one readable phrase (no "[Errno N]")."""
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc)


def _no_new_privs() -> None:
    lib = c_library()
    one, zero = ctypes.c_ulong(1), ctypes.c_ulong(0)
    if lib.prctl(PR_SET_NO_NEW_PRIVS, one, zero, zero, zero) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(code)}")


def writes_confinable(isolated: tuple[list[str], list[str]]) -> bool:
    """Whether this process's writes can be kept to the paths it names: by Landlock, or,
    without it, in the mount namespace namespaces.enter() made (`isolated`: what it applied).
    A process that must write and cannot be kept so must not write at all."""
    try:
        landlock_abi()
        return True
    except OSError:
        return namespaces.MOUNT in isolated[0]


def confine(read: Iterable[Path] = (), read_write: Iterable[Path] = (),
            devices: Iterable[Path] = (), limits: Limits | None = None,
            isolated: tuple[list[str], list[str]] = ([], [])) -> Confinement:
    """Apply every layer this system allows, in the order they depend on each other.

    `read`: files and directories the process must still read (the model, its adapters);
    `read_write`: the only paths it may write (then opening for writing stays allowed in the
    seccomp filter, and Landlock or, without it, read-only mounts decide where); `devices`:
    the GPU device nodes it uses (gpu_nodes()), which it may open read-write (then only
    opening for writing stays allowed in the filter: renaming, deleting and the rest do not);
    `limits`: its resource limits (none but core dumps when None); `isolated`: what
    namespaces.enter() applied and could not apply, earlier, while the process had a single
    thread.

    Where neither Landlock nor read-only mounts can keep the writes in place (no Landlock,
    no mount namespace), the filter allows no write-open at all and `missing` says so: such
    a process writes nothing, rather than anywhere its user can."""
    read_write, devices = list(read_write), list(devices)
    result = Confinement(applied=list(isolated[0]), unavailable=list(isolated[1]))
    seccomp_lib = libseccomp()  # before Landlock: find_library runs ldconfig
    applied, unavailable = apply_limits(limits or Limits(None, OPEN_FILES_MAX, None))
    result.applied += applied
    result.unavailable += unavailable
    try:
        _no_new_privs()
        result.applied.append(NO_NEW_PRIVS)
    except (OSError, AttributeError) as exc:
        # Landlock and seccomp both need it (or CAP_SYS_ADMIN): do not go further
        result.missing += [f"{NO_NEW_PRIVS}: {_why(exc)}", f"{LANDLOCK}: needs {NO_NEW_PRIVS}",
                           f"{SECCOMP}: needs {NO_NEW_PRIVS}"]
        return result
    may_write = bool(read_write or devices)
    writes_kept = True
    try:
        abi = restrict_files(read, read_write, devices)
        result.applied.append(LANDLOCK)
        log.debug("sandbox: Landlock ABI %d", abi)
    except OSError as exc:
        absent = exc.errno in (errno.ENOSYS, errno.EOPNOTSUPP)
        why = f"{LANDLOCK}: {'not available in this kernel' if absent else _why(exc)}"
        if may_write:
            writes_kept = _read_only_mounts(result, read_write, devices)
        if absent:
            result.unavailable.append(why)
        else:  # a kernel that has it refused
            result.missing.append(why)
    try:
        # writes only where Landlock or the mounts keep them; else none (a GPU runner's
        # driver then fails its device opens: boot.py refuses such a runner first)
        restrict_syscalls(seccomp_lib, fs_changes=bool(read_write) and writes_kept,
                          write_opens=bool(devices) and writes_kept, gpu=bool(devices))
        result.applied.append(SECCOMP)
    except OSError as exc:
        result.missing.append(f"{SECCOMP}: {_why(exc)}")
    return result


def _read_only_mounts(result: Confinement, read_write: list[Path], devices: list[Path]) -> bool:
    """Without Landlock: keep the writes of a process that must write to `read_write` (and
    its device nodes) by remounting the rest read-only in its mount namespace. Whether that
    held; when not, `result.missing` says why its writes are refused instead."""
    if namespaces.MOUNT not in result.applied:
        result.missing.append(f"{mounts.READ_ONLY}: needs a {namespaces.MOUNT}, so this "
                              "process may write nothing")
        return False
    try:
        mounts.read_only_except(read_write, devices)
    except OSError as exc:
        result.missing.append(f"{mounts.READ_ONLY}: {_why(exc)}, so this process may write "
                              "nothing")
        return False
    result.applied.append(mounts.READ_ONLY)
    return True
