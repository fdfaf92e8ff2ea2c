"""Confine a process that parses untrusted model files: the runner and the quantizer child.

They run a large C++ library on files that came from anywhere. If a crafted file ever turned
a parser bug into code execution, the process should be a poor place to have it: it needs no
new programs, no network, no other processes and (a runner) no writable file, so it gives
them up for good *before* llama.cpp reads the first byte of the model:

- no core dumps (they would hold the model and the prompts);
- no new privileges (`PR_SET_NO_NEW_PRIVS`): setuid binaries and file capabilities stop
  working, which also lets an unprivileged process take on the two layers below;
- Landlock (Linux 5.13+): the file system becomes read-only and shrinks to the model files,
  the Python installation and the system libraries; nothing is writable except the paths a
  caller names (the quantizer's output file, a runner's prompt-cache directory), and the
  device nodes of the GPU a runner uses are its only other read-write files. Where the
  kernel knows them, TCP bind/connect, abstract unix sockets and signals to processes outside
  the sandbox are cut too (a future RPC client would need a NET_PORT rule for its workers);
- a seccomp filter (through libseccomp, the library Docker and systemd use) that answers
  EPERM to running programs, creating sockets, forking, tracing or reading other processes,
  signalling other processes, io_uring (which can open sockets and files behind the filter's
  back), opening files for writing, renaming, deleting, linking, chmod/chown, truncation,
  mounting, namespaces, kernel modules, BPF and key rings. Threads, mmap and madvise stay
  allowed: llama.cpp's thread pool and memory-mapped weights need them.

`confine()` applies what the system allows and says what it applied and what is missing; the
caller decides whether a missing layer is fatal (LLMRUN_SANDBOX=strict). Already open file
descriptors (the daemon's socket pair, the log file on stdout/stderr) keep working: both
Landlock and the write-open rule act when a file is opened, not on descriptors held.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import importlib.util
import logging
import os
import resource
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("llmrun.runner")

# Layer names, as runners report them (/api/ps "sandbox").
NO_CORE_DUMPS = "no-core-dumps"
NO_NEW_PRIVS = "no-new-privs"
LANDLOCK = "landlock"
SECCOMP = "seccomp"

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
PR_SET_NO_NEW_PRIVS = 38

# Landlock (include/uapi/linux/landlock.h); the syscall numbers are the same on every
# architecture that has them.
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_REMOVE_DIR, FS_REMOVE_FILE, FS_MAKE_CHAR, FS_MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
FS_MAKE_REG, FS_MAKE_SOCK, FS_MAKE_FIFO, FS_MAKE_BLOCK = 1 << 8, 1 << 9, 1 << 10, 1 << 11
FS_MAKE_SYM, FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 12, 1 << 13, 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
# The file-system rights each ABI version knows (a kernel refuses bits it does not know).
_FS_BY_ABI = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 4: (1 << 15) - 1,
              5: (1 << 16) - 1}
_FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV
READ = FS_READ_FILE | FS_READ_DIR
WRITE = (FS_WRITE_FILE | FS_TRUNCATE | FS_REMOVE_FILE | FS_REMOVE_DIR | FS_MAKE_REG
         | FS_MAKE_DIR | FS_REFER)
# Device nodes of GPUs (NVIDIA's driver, DRM render nodes, AMD's compute node).
GPU_NODE_PREFIXES = ("/dev/nvidia", "/dev/dri/renderD", "/dev/kfd")
# Nodes NVIDIA's driver shares among its GPUs and may open after initialising one (the
# unified-memory node as memory is first allocated).
NVIDIA_SHARED_NODES = ("/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools")


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


class _ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int),
                ("datum_a", ctypes.c_uint64), ("datum_b", ctypes.c_uint64)]


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # __attribute__((packed)) in the kernel's header
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _why(exc: BaseException) -> str:
    """An error as one readable phrase (no "[Errno N]")."""
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc)


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)  # SCMP_ACT_ERRNO(code)


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


# --- seccomp -------------------------------------------------------------------------------

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


def gpu_nodes(prefixes: tuple[str, ...] = GPU_NODE_PREFIXES) -> list[Path]:
    """The GPU device nodes this process holds open: what its GPU backend opened as it
    initialised (listing the devices and their free memory creates CUDA's context and opens
    a Vulkan driver's render node), and for NVIDIA the nodes its driver shares. A runner
    keeps exactly these once confined; lavapipe, a CPU driver, opens none."""
    held: set[str] = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # (the directory's own descriptor, closed as it was listed)
        if target.startswith(prefixes):
            held.add(target)
    if any(t.startswith("/dev/nvidia") for t in held):
        held.update(n for n in NVIDIA_SHARED_NODES if os.path.exists(n))
    return sorted(Path(t) for t in held)


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
    """Install the seccomp filter with `lib` (_libseccomp(), looked up before Landlock hides
    the tools find_library runs); needs no_new_privs first. `fs_changes` keeps opening for
    writing, renaming, deleting... allowed, for a process whose writes Landlock confines to
    named paths; `write_opens` keeps only opening for writing (a GPU driver opens its device
    nodes read-write, and Landlock allows no other file). Raises OSError when it cannot be
    installed."""
    if lib is None:
        raise OSError(errno.ENOENT, "libseccomp not found (install libseccomp2)")
    _install_filter(lib, fs_changes, write_opens)


# --- Landlock ------------------------------------------------------------------------------

def landlock_abi() -> int:
    """The kernel's Landlock ABI version; raises OSError (ENOSYS: not built in, EOPNOTSUPP:
    disabled at boot) when there is none."""
    libc = _libc()
    abi = libc.syscall(ctypes.c_long(SYS_LANDLOCK_CREATE_RULESET), None, ctypes.c_size_t(0),
                       ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    if abi < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return int(abi)


def system_read_paths() -> list[Path]:
    """What a Python process running llama.cpp reads after start-up: the interpreter and its
    packages (imports happen lazily), shared libraries, ld.so and locale configuration, its
    own /proc entries, CPU topology (ggml sizes its thread pool from it), /dev/null and
    /dev/urandom. Not the working directory, not the user's home."""
    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
             "/usr", "/lib", "/lib64", "/lib32", "/libx32", "/etc", "/proc/self",
             "/proc/cpuinfo", "/proc/meminfo", "/sys", "/dev/null", "/dev/urandom"}
    cwd = os.getcwd()
    paths.update(p for p in sys.path if p and os.path.abspath(p) != cwd)
    # llama.cpp's libraries from a build of one's own (llama-cpp-python's variables)
    paths.update(os.environ[v] for v in ("LLAMA_CPP_LIB_PATH", "MTMD_CPP_LIB") if os.environ.get(v))
    for package in ("llmrun", "llama_cpp", "numpy", "jinja2", "pydantic", "pydantic_core"):
        spec = importlib.util.find_spec(package)
        if spec is not None and spec.origin:  # a package imported from the working directory
            paths.add(os.path.dirname(spec.origin))
    return sorted(Path(p) for p in paths)


def _syscall(libc: ctypes.CDLL, number: int, what: str, *args: Any) -> int:
    """A raw syscall; its result, or OSError naming `what` when it fails."""
    rc = libc.syscall(ctypes.c_long(number), *args)
    if rc < 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")
    return int(rc)


def _add_path(libc: ctypes.CDLL, ruleset: int, path: Path, rights: int) -> bool:
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except OSError:
        return False  # not on this system
    try:
        if not path.is_dir():
            rights &= _FILE_RIGHTS  # a rule on a file may only hold rights files have
        attr = _PathBeneathAttr(rights, fd)
        _syscall(libc, SYS_LANDLOCK_ADD_RULE, f"landlock_add_rule {path}", ctypes.c_int(ruleset),
                 ctypes.c_int(LANDLOCK_RULE_PATH_BENEATH), ctypes.byref(attr),
                 ctypes.c_uint32(0))
    finally:
        os.close(fd)
    return True


def restrict_files(read: Iterable[Path], read_write: Iterable[Path] = (),
                   devices: Iterable[Path] = ()) -> int:
    """Landlock: from now on this process opens only `read` (plus system_read_paths()) for
    reading, `read_write` for reading and writing, and the device nodes `devices` for
    reading, writing and ioctl; it binds and connects no TCP socket and signals no process
    outside itself. Needs no_new_privs (or CAP_SYS_ADMIN) first.
    Returns the ABI version used; raises OSError when Landlock cannot be applied."""
    abi = landlock_abi()
    handled = _FS_BY_ABI.get(abi, _FS_BY_ABI[5])
    attr = _RulesetAttr(handled, NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0,
                        SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0)
    libc = _libc()
    ruleset = _syscall(libc, SYS_LANDLOCK_CREATE_RULESET, "landlock_create_ruleset",
                       ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)),
                       ctypes.c_uint32(0))
    try:
        for path in [*system_read_paths(), *read]:
            _add_path(libc, ruleset, Path(path), READ & handled)
        for dev in devices:
            _add_path(libc, ruleset, Path(dev), (FS_READ_FILE | FS_WRITE_FILE | FS_IOCTL_DEV)
                      & handled)
        for path in read_write:
            if not _add_path(libc, ruleset, Path(path), (READ | WRITE) & handled):
                raise OSError(errno.ENOENT, f"landlock: {path} does not exist")
        _syscall(libc, SYS_LANDLOCK_RESTRICT_SELF, "landlock_restrict_self",
                 ctypes.c_int(ruleset), ctypes.c_uint32(0))
    finally:
        os.close(ruleset)
    return abi


# --- all together --------------------------------------------------------------------------

def _no_new_privs() -> None:
    libc = _libc()
    one, zero = ctypes.c_ulong(1), ctypes.c_ulong(0)
    if libc.prctl(PR_SET_NO_NEW_PRIVS, one, zero, zero, zero) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"prctl(PR_SET_NO_NEW_PRIVS): {os.strerror(code)}")


def confine(read: Iterable[Path] = (), read_write: Iterable[Path] = (),
            devices: Iterable[Path] = ()) -> Confinement:
    """Apply every layer this system allows, in the order they depend on each other.

    `read`: files and directories the process must still read (the model, its adapters);
    `read_write`: the only paths it may write (then opening for writing stays allowed in the
    seccomp filter and Landlock alone decides where; without Landlock such a process can
    write wherever its user can, and `missing` says so); `devices`: the GPU device nodes it
    uses (gpu_nodes()), which it may open read-write (then only opening for writing stays
    allowed in the filter: renaming, deleting and the rest do not)."""
    read_write, devices = list(read_write), list(devices)
    result = Confinement()
    seccomp_lib = _libseccomp()  # before Landlock: find_library runs ldconfig
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    result.applied.append(NO_CORE_DUMPS)
    try:
        _no_new_privs()
        result.applied.append(NO_NEW_PRIVS)
    except (OSError, AttributeError) as exc:
        # Landlock and seccomp both need it (or CAP_SYS_ADMIN): do not go further
        result.missing += [f"{NO_NEW_PRIVS}: {_why(exc)}", f"{LANDLOCK}: needs {NO_NEW_PRIVS}",
                           f"{SECCOMP}: needs {NO_NEW_PRIVS}"]
        return result
    try:
        abi = restrict_files(read, read_write, devices)
        result.applied.append(LANDLOCK)
        log.debug("sandbox: Landlock ABI %d", abi)
    except OSError as exc:
        absent = exc.errno in (errno.ENOSYS, errno.EOPNOTSUPP)
        why = f"{LANDLOCK}: {'not available in this kernel' if absent else _why(exc)}"
        if absent and not read_write and not devices:
            result.unavailable.append(why)
        else:  # a kernel that has it refused, or this process's writes would go unconfined
            result.missing.append(why + (" (its writes would go unconfined)" if absent else ""))
    try:
        restrict_syscalls(seccomp_lib, fs_changes=bool(read_write), write_opens=bool(devices))
        result.applied.append(SECCOMP)
    except OSError as exc:
        result.missing.append(f"{SECCOMP}: {_why(exc)}")
    return result
