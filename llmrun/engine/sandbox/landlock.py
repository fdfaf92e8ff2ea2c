"""The Landlock layer of the sandbox: which files a confined process may still open, and
(where the kernel knows them) no TCP and no signals outside it. Also the GPU device nodes
a runner keeps. See the package's docstring for what the sandbox as a whole stops."""

from __future__ import annotations

import ctypes
import errno
import importlib.util
import os
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

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
# Test-only: set to 1, this process and the runners and quantizer children it starts behave
# as on a kernel without Landlock (landlock_abi() answers ENOSYS), so that the tests, on a
# machine that has it, can check what confines a process there instead (sandbox/mounts.py).
# It only ever takes a layer away; llmrun/childenv.py passes it on to those children.
TEST_NO_LANDLOCK = "LLMRUN_SANDBOX_TEST_NO_LANDLOCK"


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1  # __attribute__((packed)) in the kernel's header
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]



def c_library() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


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


def landlock_abi() -> int:
    """The kernel's Landlock ABI version; raises OSError (ENOSYS: not built in, EOPNOTSUPP:
    disabled at boot) when there is none."""
    if os.environ.get(TEST_NO_LANDLOCK) == "1":
        raise OSError(errno.ENOSYS, f"{os.strerror(errno.ENOSYS)} ({TEST_NO_LANDLOCK}=1)")
    libc = c_library()
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
    libc = c_library()
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

