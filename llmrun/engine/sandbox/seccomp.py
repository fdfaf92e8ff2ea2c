"""The seccomp layer of the sandbox: a filter, through libseccomp (the library Docker and
systemd use), on the system calls a confined process may make. See the package's docstring
for what the sandbox as a whole stops."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os

# Syscalls a confined process never needs.
DENIED = (
    "execve", "execveat",  # running programs
    "fork", "vfork",  # new processes (clone without CLONE_THREAD: below)
    "socket",  # new connections of any kind; the daemon's socket pair already exists
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd", "pidfd_open",
    "pidfd_send_signal", "tkill",  # signals: kill/tgkill to itself only (below)
    "io_uring_setup", "io_uring_enter", "io_uring_register",  # a second, unfiltered syscall path
    "mount", "umount2", "pivot_root", "chroot", "setns", "unshare", "open_tree", "move_mount",
    "fsopen", "fsmount", "fsconfig", "fspick", "mount_setattr",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "bpf", "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key",
    "swapon", "swapoff", "reboot", "acct", "settimeofday", "clock_settime", "adjtimex",
    "open_by_handle_at", "name_to_handle_at",
)
# What changes the file system other than writing into a file: denied unless the caller has
# paths to write (then Landlock alone decides where).
DENIED_FS_CHANGES = (
    "creat", "rename", "renameat", "renameat2", "unlink", "unlinkat", "rmdir", "mkdir",
    "mkdirat", "mknod", "mknodat", "symlink", "symlinkat", "link", "linkat",
    "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat",
    "truncate", "ftruncate", "setxattr", "lsetxattr", "fsetxattr", "removexattr",
    "lremovexattr", "fremovexattr", "utime", "utimes", "futimesat", "utimensat",
)
# open flags that ask for a writable file or change one (same values on x86_64 and aarch64)
O_WRONLY, O_RDWR, O_CREAT, O_TRUNC = 0o1, 0o2, 0o100, 0o1000
WRITE_FLAGS = (O_WRONLY, O_RDWR, O_CREAT, O_TRUNC)

SCMP_ACT_ALLOW = 0x7FFF0000
SCMP_FLTATR_CTL_TSYNC = 4  # enum scmp_filter_attr
SCMP_FLTATR_CTL_SSB = 7
SCMP_CMP_NE, SCMP_CMP_EQ, SCMP_CMP_MASKED_EQ = 1, 4, 7
CLONE_THREAD = 0x00010000


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]




def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)  # SCMP_ACT_ERRNO(code)


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



def _add_rules(f: _Filter, fs_changes: bool, write_opens: bool) -> None:
    eperm = _errno_action(errno.EPERM)
    for name in DENIED:
        f.rule(eperm, name)
    # clone: threads only. clone3 passes its flags in memory a filter cannot read, so it
    # answers ENOSYS and the C library falls back to clone (as under Docker's profile).
    f.rule(eperm, "clone", _ArgCmp(0, SCMP_CMP_MASKED_EQ, CLONE_THREAD, 0))
    f.rule(_errno_action(errno.ENOSYS), "clone3")
    # Signals: only to itself (abort(), pthread_kill go through tgkill(own pid, tid, sig)).
    pid = os.getpid()
    for name in ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"):
        f.rule(eperm, name, _ArgCmp(0, SCMP_CMP_NE, pid, 0))
    if fs_changes:
        return
    for name in DENIED_FS_CHANGES:
        f.rule(eperm, name)
    if write_opens:
        return
    # open for writing: one rule per flag (the rules of a syscall are OR-ed); openat2 passes
    # its flags in memory, so it answers ENOSYS and the C library falls back to openat.
    for flag in WRITE_FLAGS:
        f.rule(eperm, "open", _ArgCmp(1, SCMP_CMP_MASKED_EQ, flag, flag))
        f.rule(eperm, "openat", _ArgCmp(2, SCMP_CMP_MASKED_EQ, flag, flag))
    f.rule(_errno_action(errno.ENOSYS), "openat2")


def _install_filter(lib: ctypes.CDLL, fs_changes: bool, write_opens: bool) -> None:
    ctx = lib.seccomp_init(SCMP_ACT_ALLOW)
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
        _add_rules(_Filter(lib, ctx), fs_changes, write_opens)
        rc = lib.seccomp_load(ctx)
        if rc < 0:
            raise OSError(-rc, f"seccomp_load: {os.strerror(-rc)}")
    finally:
        lib.seccomp_release(ctx)


def restrict_syscalls(lib: ctypes.CDLL | None, *, fs_changes: bool = False,
                      write_opens: bool = False) -> None:
    """Install the seccomp filter with `lib` (libseccomp(), looked up before Landlock hides
    the tools find_library runs); needs no_new_privs first. `fs_changes` keeps opening for
    writing, renaming, deleting... allowed, for a process whose writes Landlock confines to
    named paths; `write_opens` keeps only opening for writing (a GPU driver opens its device
    nodes read-write, and Landlock allows no other file). Raises OSError when it cannot be
    installed."""
    if lib is None:
        raise OSError(errno.ENOENT, "libseccomp not found (install libseccomp2)")
    _install_filter(lib, fs_changes, write_opens)

