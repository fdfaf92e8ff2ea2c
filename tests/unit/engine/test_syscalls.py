"""The seccomp allowlist's table (engine/sandbox/syscalls.py) is well-formed: every name is a
system call libseccomp knows on x86_64 (else the filter would skip it without a word), no
name is both allowed and denied, and the calls that would let a compromised runner out are
allowed nowhere. No model, no filter installed."""

from __future__ import annotations

import ctypes

import pytest

from llmrun.engine.sandbox import seccomp, syscalls

SCMP_ARCH_X86_64 = 0xC000003E
SCMP_ARCH_AARCH64 = 0xC00000B7

# Names of calls the table may carry that some libseccomp builds do not know yet, or that
# exist only on other architectures (none today: every name must resolve on x86_64).
ARCH_SPECIFIC: frozenset[str] = frozenset()

# What a runner must never be able to do, whatever the table says.
DANGEROUS = ("execve", "execveat", "fork", "vfork", "ptrace", "socket", "connect", "bind",
             "listen", "accept", "accept4", "io_uring_setup", "io_uring_enter",
             "io_uring_register", "bpf", "perf_event_open", "userfaultfd", "process_vm_readv",
             "process_vm_writev", "unshare", "setns", "mount", "umount2", "pivot_root",
             "chroot", "keyctl", "add_key", "request_key", "init_module", "finit_module",
             "kexec_load", "pidfd_getfd", "pidfd_open", "kcmp", "personality", "syslog",
             "acct", "uselib", "clone3", "openat2")

EVERY_ALLOWED = set(syscalls.allowed_names(fs_changes=True, gpu=True)) | set(
    syscalls.CONDITIONAL)


def every_name() -> list[str]:
    return sorted({*EVERY_ALLOWED, *syscalls.ENOSYS, *syscalls.DENIED})


@pytest.fixture(scope="module")
def lib() -> ctypes.CDLL:
    lib = seccomp.libseccomp()
    if lib is None:
        pytest.skip("libseccomp is not installed")
    lib.seccomp_syscall_resolve_name_arch.argtypes = [ctypes.c_uint32, ctypes.c_char_p]
    return lib


def test_every_name_is_a_system_call_on_x86_64(lib: ctypes.CDLL) -> None:
    unknown = [n for n in every_name() if n not in ARCH_SPECIFIC
               and lib.seccomp_syscall_resolve_name_arch(SCMP_ARCH_X86_64, n.encode()) < 0]
    assert unknown == []


def test_what_aarch64_lacks_is_only_the_old_file_calls(lib: ctypes.CDLL) -> None:
    """On aarch64 the filter skips what the architecture does not have; that must be the
    calls it replaced with *at variants (which are in the table), nothing of substance."""
    missing = {n for n in EVERY_ALLOWED
               if lib.seccomp_syscall_resolve_name_arch(SCMP_ARCH_AARCH64, n.encode()) < 0}
    replaced_by = {"open": "openat", "stat": "newfstatat", "lstat": "newfstatat",
                   "access": "faccessat", "readlink": "readlinkat", "dup2": "dup3",
                   "pipe": "pipe2", "poll": "ppoll", "select": "pselect6",
                   "epoll_wait": "epoll_pwait", "eventfd": "eventfd2", "time": "clock_gettime",
                   "rename": "renameat2", "renameat": "renameat2", "unlink": "unlinkat",
                   "rmdir": "unlinkat", "mkdir": "mkdirat", "utimes": "utimensat",
                   "futimesat": "utimensat", "getrlimit": "prlimit64",
                   "arch_prctl": "prctl"}
    assert missing <= set(replaced_by), sorted(missing - set(replaced_by))
    for name in missing:
        assert replaced_by[name] in EVERY_ALLOWED | {"renameat2"}, name


def test_no_name_is_both_allowed_and_denied() -> None:
    denied = set(syscalls.DENIED) | set(syscalls.ENOSYS)
    assert EVERY_ALLOWED & denied == set()
    assert set(syscalls.ENOSYS) & set(syscalls.DENIED) == set()


def test_the_dangerous_calls_are_allowed_nowhere() -> None:
    assert set(DANGEROUS) & EVERY_ALLOWED == set()
    assert set(DANGEROUS) - {"clone3", "openat2"} <= set(syscalls.DENIED)


def test_conditional_calls_are_not_also_allowed_unconditionally() -> None:
    unconditional = set(syscalls.allowed_names(fs_changes=True, gpu=True))
    assert unconditional & set(syscalls.CONDITIONAL) == set()


def test_groups_have_reasons_and_no_name_twice_within_one() -> None:
    groups = [*syscalls.GROUPS.values(), syscalls.GPU_DRIVERS, syscalls.FS_CHANGES]
    for group in groups:
        assert len(group.reason) > 40 and group.names
        assert len(set(group.names)) == len(group.names), group.reason
    # the base groups do not overlap: a name has one reason
    base = [n for g in syscalls.GROUPS.values() for n in g.names]
    assert len(base) == len(set(base))
    # GPU_DRIVERS and FS_CHANGES hold only what the base groups do not
    for extra in (syscalls.GPU_DRIVERS, syscalls.FS_CHANGES):
        assert not set(extra.names) & set(base)


def test_the_conditions_widen_the_list_only_as_documented() -> None:
    plain = set(syscalls.allowed_names(fs_changes=False, gpu=False))
    writer = set(syscalls.allowed_names(fs_changes=True, gpu=False))
    gpu = set(syscalls.allowed_names(fs_changes=False, gpu=True))
    assert writer - plain == set(syscalls.FS_CHANGES.names)
    assert gpu - plain == set(syscalls.GPU_DRIVERS.names)
    for name in ("rename", "unlink", "utimensat"):  # the prompt cache's, never a plain runner's
        assert name in writer and name not in plain
    for name in ("memfd_create", "mlock", "mbind"):  # a GPU driver's, never a CPU runner's
        assert name in gpu and name not in plain


def test_what_is_kept_without_a_trace_is_named_and_in_a_group() -> None:
    assert set(syscalls.UNTRACED) <= EVERY_ALLOWED | set(syscalls.ENOSYS)


def test_no_terminal_injecting_ioctl_without_gpu_nodes() -> None:
    tiocsti, tioclinux, tiocsetd = 0x5412, 0x541C, 0x5423
    assert not {tiocsti, tioclinux, tiocsetd} & set(syscalls.IOCTLS.values())
    assert "ioctl" not in syscalls.allowed_names(fs_changes=True, gpu=True)  # conditional
