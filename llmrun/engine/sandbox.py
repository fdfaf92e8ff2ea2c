"""Confine the runner process once its model is loaded (Linux).

The runner parses untrusted model files with a large C++ library. If a crafted file ever
turned a parser bug into code execution, the runner should be a poor place to have it: it
needs no new programs, no new network connections and no other processes, so after loading
it gives them up for good:

- no new privileges (`PR_SET_NO_NEW_PRIVS`): setuid binaries and file capabilities stop
  working, which also lets an unprivileged process install the filter below;
- a seccomp filter (through libseccomp, the library Docker and systemd use) that answers
  EPERM to running programs, creating sockets, forking, tracing or reading other processes,
  mounting, namespaces, kernel modules, BPF and key rings. Threads are still allowed (llama.cpp
  starts its thread pool at the first decode);
- no core dumps (they would hold the model and the prompts).

The daemon talks to the runner over a socket pair made before the filter, so nothing here
limits that. Where libseccomp is missing the rest still applies, with a warning.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import resource

log = logging.getLogger("llmrun.runner")

# Syscalls a loaded runner never needs.
DENIED = (
    "execve", "execveat",  # running programs
    "fork", "vfork",  # new processes (clone without CLONE_THREAD: below)
    "socket",  # new connections of any kind; the daemon's socket pair already exists
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "mount", "umount2", "pivot_root", "chroot", "setns", "unshare", "open_tree", "move_mount",
    "fsopen", "fsmount", "fsconfig", "fspick",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "swapon", "swapoff", "reboot", "acct", "settimeofday", "clock_settime", "adjtimex",
)

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_FLTATR_CTL_TSYNC = 4  # enum scmp_filter_attr
SCMP_FLTATR_CTL_SSB = 7
SCMP_CMP_MASKED_EQ = 7
CLONE_THREAD = 0x00010000
PR_SET_NO_NEW_PRIVS = 38


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)  # SCMP_ACT_ERRNO(code)


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


def _libseccomp() -> ctypes.CDLL | None:
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


def _install_filter(lib: ctypes.CDLL) -> None:
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
    if not ctx:
        raise OSError("seccomp_init failed")
    try:
        # every thread of the process, also any llama.cpp started while loading
        lib.seccomp_attr_set(ctx, SCMP_FLTATR_CTL_TSYNC, 1)
        # On some kernels a seccomp filter also switches on the speculative-store-bypass
        # mitigation, which slows number crunching; it guards against code running inside
        # the process, which a runner does not host (Docker passes the same flag).
        lib.seccomp_attr_set(ctx, SCMP_FLTATR_CTL_SSB, 1)
        eperm = _errno_action(errno.EPERM)
        for name in DENIED:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:
                continue  # not a syscall on this architecture
            rc = lib.seccomp_rule_add_array(ctx, eperm, nr, 0, None)
            if rc < 0:
                raise OSError(-rc, f"seccomp rule for {name}")
        # clone: threads only. clone3 passes its flags in memory a filter cannot read, so it
        # answers ENOSYS, and the C library falls back to clone (as under Docker's profile).
        clone = lib.seccomp_syscall_resolve_name(b"clone")
        no_thread = _ArgCmp(0, SCMP_CMP_MASKED_EQ, CLONE_THREAD, 0)
        rc = lib.seccomp_rule_add_array(ctx, eperm, clone, 1, ctypes.byref(no_thread))
        if rc < 0:
            raise OSError(-rc, "seccomp rule for clone")
        clone3 = lib.seccomp_syscall_resolve_name(b"clone3")
        if clone3 >= 0:
            rc = lib.seccomp_rule_add_array(ctx, _errno_action(errno.ENOSYS), clone3, 0, None)
            if rc < 0:
                raise OSError(-rc, "seccomp rule for clone3")
        rc = lib.seccomp_load(ctx)
        if rc < 0:
            raise OSError(-rc, "seccomp_load")
    finally:
        lib.seccomp_release(ctx)


def confine() -> list[str]:
    """Apply what this system supports; returns what was applied, for the log."""
    applied = []
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    applied.append("no core dumps")
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        one, zero = ctypes.c_ulong(1), ctypes.c_ulong(0)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, one, zero, zero, zero) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        applied.append("no new privileges")
    except (OSError, AttributeError) as exc:
        log.warning("sandbox: cannot set no_new_privs (%s)", exc)
        return applied  # seccomp needs it (or CAP_SYS_ADMIN); do not go further
    lib = _libseccomp()
    if lib is None:
        log.warning("sandbox: libseccomp not found; the runner runs without a syscall "
                    "filter (install libseccomp2 to get one)")
        return applied
    try:
        _install_filter(lib)
        applied.append("seccomp filter")
    except OSError as exc:
        log.warning("sandbox: seccomp filter not installed (%s)", exc)
    return applied
