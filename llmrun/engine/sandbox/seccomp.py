"""The seccomp layer of the sandbox: a filter, through libseccomp (the library Docker and
systemd use), on the system calls a confined process may make. See the package's docstring
for what the sandbox as a whole stops.

It is an allowlist: the calls syscalls.py names, in its groups, are allowed; a few only with
conditions on their arguments (clone for threads, signals and prlimit64 to itself,
setpriority on the calling thread, open and
openat read-only, ioctl for Python's few requests, unless the process may write or has GPU
nodes); clone3 and openat2 answer ENOSYS so that the C library falls back to clone and
openat, which the filter can check; every other call answers EPERM (DEFAULT_ACTION says why
EPERM rather than killing the process).

The cost: the kernel (5.11+) caches, per system call, whether a filter allows it whatever its
arguments, and then skips the filter, so futex, read, mmap and the other calls of a decoding
runner's hot path cost no more than unfiltered; only the conditional ones (clone, kill,
openat, ioctl...) run the filter, which libseccomp builds as a binary tree.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

from llmrun.engine.sandbox import syscalls

# open flags that ask for a writable file or change one (same values on x86_64 and aarch64)
O_WRONLY, O_RDWR, O_CREAT, O_TRUNC = 0o1, 0o2, 0o100, 0o1000
WRITE_FLAGS = O_WRONLY | O_RDWR | O_CREAT | O_TRUNC
CLONE_THREAD = 0x00010000
# clone flags that make new namespaces: never, not even for a thread
# (NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET; clone() has no NEWTIME, its
# low byte is the exit signal)
CLONE_NEW = (0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000
             | 0x40000000)

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_ACT_KILL_PROCESS = 0x80000000
SCMP_FLTATR_CTL_TSYNC = 4  # enum scmp_filter_attr
SCMP_FLTATR_CTL_SSB = 7
SCMP_FLTATR_CTL_OPTIMIZE = 8
SCMP_CMP_NE, SCMP_CMP_EQ, SCMP_CMP_MASKED_EQ = 1, 4, 7


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)  # SCMP_ACT_ERRNO(code)


# What every call outside the table gets. EPERM, as Docker's profile answers: a runner that
# meets a call nobody foresaw (a newer glibc or Python, a GPU driver's path no trace here
# could show) fails that call and says so in its log, and code that probes for a call and
# copes without it (rseq, getrandom, statx...) keeps working; killing the process
# (SCMP_ACT_KILL_PROCESS) would turn each such case into a runner that vanishes with SIGSYS
# mid-request. It is no less safe: a refused call does nothing either way, and an attacker
# who can make system calls learns nothing from an EPERM that the table here does not say.
DEFAULT_ACTION = _errno_action(errno.EPERM)


def libseccomp() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError:
        return None
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int,
                                           ctypes.c_uint, ctypes.POINTER(_ArgCmp)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_attr_set.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


class _Filter:
    """A libseccomp filter being built: rules by syscall name, errors as OSError."""

    def __init__(self, lib: ctypes.CDLL, ctx: int) -> None:
        self.lib, self.ctx = lib, ctx

    def rule(self, action: int, name: str, *cmps: _ArgCmp) -> None:
        nr = self.lib.seccomp_syscall_resolve_name(name.encode())
        if nr < 0:
            return  # not a syscall on this architecture (open, rename... on aarch64)
        arr = (_ArgCmp * len(cmps))(*cmps) if cmps else None
        rc = self.lib.seccomp_rule_add_array(self.ctx, action, nr, len(cmps), arr)
        if rc < 0:
            raise OSError(-rc, f"seccomp rule for {name}: {os.strerror(-rc)}")



PRIO_PROCESS = 0


def _add_rules(f: _Filter, fs_changes: bool, write_opens: bool, gpu: bool) -> None:
    for name in syscalls.allowed_names(fs_changes=fs_changes, gpu=gpu):
        f.rule(SCMP_ACT_ALLOW, name)
    for name in syscalls.ENOSYS:
        f.rule(_errno_action(errno.ENOSYS), name)
    # threads, never processes nor namespaces: CLONE_THREAD set, no CLONE_NEW* flag
    f.rule(SCMP_ACT_ALLOW, "clone",
           _ArgCmp(0, SCMP_CMP_MASKED_EQ, CLONE_THREAD | CLONE_NEW, CLONE_THREAD))
    # signals: only its own (abort() and pthread_kill go through tgkill(own pid, tid, sig));
    # limits: only read, and only its own (getrlimit is prlimit64(0, r, NULL, old)). The
    # resource limits are set before the filter (sandbox/limits.py), and root, which may
    # raise a hard limit, must not undo them.
    pid = os.getpid()
    for name in ("kill", "tgkill", "tkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"):
        f.rule(SCMP_ACT_ALLOW, name, _ArgCmp(0, SCMP_CMP_EQ, pid, 0))
    for target in (0, pid):
        f.rule(SCMP_ACT_ALLOW, "prlimit64", _ArgCmp(0, SCMP_CMP_EQ, target, 0),
               _ArgCmp(2, SCMP_CMP_EQ, 0, 0))
    # priority: only of the calling thread (who 0 with PRIO_PROCESS is the caller's thread on
    # Linux): another pid (the daemon) or PRIO_PGRP/PRIO_USER (every process of the user)
    # would let it slow down, or as root speed up, what is not its own
    f.rule(SCMP_ACT_ALLOW, "setpriority", _ArgCmp(0, SCMP_CMP_EQ, PRIO_PROCESS, 0),
           _ArgCmp(1, SCMP_CMP_EQ, 0, 0))
    # ioctl: a GPU driver's requests are its own; anyone else's only Python's few (not
    # TIOCSTI, which types into a terminal)
    if gpu:
        f.rule(SCMP_ACT_ALLOW, "ioctl")
    else:
        for request in syscalls.IOCTLS.values():
            f.rule(SCMP_ACT_ALLOW, "ioctl", _ArgCmp(1, SCMP_CMP_EQ, request, 0))
    if fs_changes or write_opens:  # Landlock or read-only mounts decide where it may write
        f.rule(SCMP_ACT_ALLOW, "open")
        f.rule(SCMP_ACT_ALLOW, "openat")
        return
    f.rule(SCMP_ACT_ALLOW, "open", _ArgCmp(1, SCMP_CMP_MASKED_EQ, WRITE_FLAGS, 0))
    f.rule(SCMP_ACT_ALLOW, "openat", _ArgCmp(2, SCMP_CMP_MASKED_EQ, WRITE_FLAGS, 0))


def _install_filter(lib: ctypes.CDLL, fs_changes: bool, write_opens: bool, gpu: bool) -> None:
    ctx = lib.seccomp_init(DEFAULT_ACTION)
    if not ctx:
        raise OSError("seccomp_init failed")
    try:
        # every thread of the process, also any llama.cpp started already
        rc = lib.seccomp_attr_set(ctx, SCMP_FLTATR_CTL_TSYNC, 1)
        if rc < 0:
            raise OSError(-rc, "the kernel accepts no seccomp filter for all threads "
                               f"({os.strerror(-rc)})")
        # On some kernels a seccomp filter also switches on the speculative-store-bypass
        # mitigation, which slows number crunching; it guards against code running inside
        # the process, which a runner does not host (Docker passes the same flag).
        lib.seccomp_attr_set(ctx, SCMP_FLTATR_CTL_SSB, 1)
        # A binary tree of the syscall numbers rather than a linear list of ~180 checks
        # (libseccomp 2.5+; older ones refuse the attribute and keep the list). The kernel
        # (5.11+) skips the filter altogether for calls it allows whatever their arguments,
        # such as futex, so this matters only on older kernels and for the conditional ones.
        lib.seccomp_attr_set(ctx, SCMP_FLTATR_CTL_OPTIMIZE, 2)
        _add_rules(_Filter(lib, ctx), fs_changes, write_opens, gpu)
        rc = lib.seccomp_load(ctx)
        if rc < 0:
            raise OSError(-rc, f"seccomp_load: {os.strerror(-rc)}")
    finally:
        lib.seccomp_release(ctx)


def restrict_syscalls(lib: ctypes.CDLL | None, *, fs_changes: bool = False,
                      write_opens: bool = False, gpu: bool | None = None) -> None:
    """Install the allowlist with `lib` (libseccomp(), looked up before Landlock hides the
    tools find_library runs); needs no_new_privs first. `fs_changes` also allows opening for
    writing and the calls that change the file system (rename, unlink...), for a process
    whose writes Landlock or read-only mounts confine to named paths; `write_opens` allows
    opening for writing, for a runner with GPU device nodes, which its driver opens
    read-write (Landlock, or the mounts, allow no other file); `gpu` (by default as
    `write_opens`) what GPU drivers call (syscalls.GPU_DRIVERS, any ioctl). Raises OSError
    when it cannot be installed."""
    if lib is None:
        raise OSError(errno.ENOENT, "libseccomp not found (install libseccomp2)")
    _install_filter(lib, fs_changes, write_opens, write_opens if gpu is None else gpu)
