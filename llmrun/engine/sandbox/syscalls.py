"""The seccomp allowlist: every system call a confined process (a runner, the quantizer child)
may make once confined, in groups, each with why it is needed. A call named nowhere here is
answered EPERM by the filter (seccomp.py says why EPERM rather than killing the process).

How the table is made and checked: scripts/trace_syscalls.py runs the integration tests
under strace (model load, decode of several sequences, embeddings, vision, the prompt cache
on disk, RPC, the thread governor, draft models, LoRA, structured output, Vulkan on lavapipe,
the quantizer child, shutdown), collects what every confined process called after it
confined itself and compares that with this table. Every group below except GPU_DRIVERS is
what those traces showed, plus a few close relatives named in the reason (the *at/vector
variants of a traced call, which glibc or Python pick by version). GPU_DRIVERS cannot be
traced on a machine without a GPU: it is what the CUDA, ROCm and Vulkan drivers are known to
call (Docker's default profile allows all of it too), and only a runner with GPU device nodes
gets it.

Names are resolved per architecture by libseccomp when the filter is built: a name this
architecture does not have (open, stat, ... on aarch64) is skipped, so one table serves all.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Group:
    reason: str
    names: tuple[str, ...]


# Allowed whatever their arguments.
GROUPS: dict[str, Group] = {
    "memory": Group(
        "the weights are memory-mapped, llama.cpp and Python allocate (brk/mmap), free and "
        "advise the kernel about their buffers; mremap: glibc's realloc of large blocks",
        ("brk", "mmap", "munmap", "mprotect", "mremap", "madvise")),
    "threads": Group(
        "llama.cpp's thread pool, OpenMP and Python threads: starting (clone: see "
        "CONDITIONAL), waiting and waking (futex), glibc's per-thread registrations "
        "(robust futex list, restartable sequences), yielding, and the priority the prompt "
        "cache's writer and GGML_SCHED_PRIO give their own threads (an unprivileged process "
        "can only lower its user's priorities)",
        ("futex", "set_robust_list", "rseq", "set_tid_address", "sched_yield",
         "sched_getaffinity", "sched_setaffinity", "sched_getparam", "sched_getscheduler",
         "sched_setscheduler", "sched_get_priority_max", "sched_get_priority_min",
         "getpriority", "setpriority", "exit", "exit_group")),
    "time": Group(
        "clocks and sleeps (most clock reads go through the vDSO without a system call; "
        "these are its fallbacks), the thread governor's and watchdog's timing",
        ("clock_gettime", "clock_getres", "clock_nanosleep", "gettimeofday", "nanosleep",
         "time", "times")),
    "files": Group(
        "reading the model files and Python's modules, through descriptors already open or "
        "opened read-only (open/openat: see CONDITIONAL; Landlock decides which files): "
        "reads, seeks, metadata, directory listings, descriptor bookkeeping; writing to "
        "descriptors already held (the log on stdout/stderr, a prompt state or the "
        "quantizer's output once opened); faccessat2/statx/close_range: the calls newer "
        "glibc and Python use, which fall back only on ENOSYS, not on EPERM",
        ("read", "pread64", "readv", "preadv", "preadv2", "write", "pwrite64", "writev",
         "pwritev", "pwritev2", "lseek", "close", "close_range", "fstat", "stat", "lstat",
         "newfstatat", "statx", "fstatfs", "statfs", "access", "faccessat", "faccessat2",
         "readlink", "readlinkat", "getdents64", "getcwd", "fcntl", "dup", "dup2", "dup3",
         "fadvise64", "fsync", "fdatasync", "ioctl", "flock")),
    "ipc": Group(
        "the socket pair to the daemon and an RPC runner's connections to its workers, all "
        "made before confinement (socket() and connect() stay refused): sending, receiving, "
        "waiting for them; socketpair and pipe2 make only a local pair, nothing reachable "
        "from outside (Python's self-pipes use them); eventfd2: wake-ups between threads",
        ("recvfrom", "recvmsg", "recvmmsg", "sendto", "sendmsg", "sendmmsg", "shutdown",
         "getsockname", "getpeername", "getsockopt", "setsockopt", "socketpair", "pipe2",
         "eventfd2", "poll", "ppoll", "select", "pselect6", "epoll_create1", "epoll_ctl",
         "epoll_wait", "epoll_pwait")),
    "signals": Group(
        "signal handlers and masks (Python's, glibc's thread cancellation), returning from a "
        "handler, an interrupted call's restart; signals to itself: see CONDITIONAL",
        ("rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigpending",
         "rt_sigtimedwait", "rt_sigsuspend", "sigaltstack", "restart_syscall")),
    "process": Group(
        "what the process asks about itself and the machine: ids, limits (prlimit64: see "
        "CONDITIONAL), resource use, CPU count and memory (sysinfo: llama.cpp's and the "
        "scheduler's), random numbers (Python's hash seed, samplers' seeds), thread names "
        "(prctl PR_SET_NAME) and glibc's start-up arch_prctl",
        ("getpid", "getppid", "gettid", "getuid", "geteuid", "getgid", "getegid",
         "getgroups", "getresuid", "getresgid", "getrusage", "getrlimit", "uname", "sysinfo",
         "getcpu", "getrandom", "prctl", "arch_prctl")),
}

# Only for a runner with GPU device nodes (and only those beyond the groups above): what the
# GPU drivers call, which no trace here can show. The NVIDIA driver (libcuda, the UVM
# driver) and ROCm's runtime map device memory and pin host memory (mlock), place it on NUMA
# nodes (mbind, get/set_mempolicy), wait on their own event descriptors (epoll_pwait2,
# timerfd), read the kernel's view of the device (sysfs and /proc through the read-only
# calls above) and, for Vulkan drivers (Mesa, NVIDIA's), share buffers through anonymous
# memory files (memfd_create: a file in memory, nothing on disk; execveat stays refused, so
# it cannot be run). All of them are in Docker's default profile.
GPU_DRIVERS = Group(
    "what CUDA, ROCm and Vulkan drivers call beyond the CPU trace (not traceable without a "
    "GPU; all in Docker's default profile): pinned and NUMA-placed memory, their own event "
    "descriptors, anonymous memory files for shared buffers",
    ("mlock", "mlock2", "munlock", "mlockall", "munlockall", "mincore", "msync", "mbind",
     "get_mempolicy", "set_mempolicy", "membarrier", "memfd_create", "epoll_pwait2",
     "timerfd_create", "timerfd_settime", "timerfd_gettime", "eventfd", "pipe",
     "inotify_init1", "inotify_add_watch", "inotify_rm_watch", "fallocate", "ftruncate"))

# Allowed only with the argument conditions seccomp.py installs (the groups' reasons refer
# here): threads but not processes; signals to itself only; limits of itself only; opening
# for reading only, unless the process has a writable directory or GPU nodes, then Landlock
# decides where.
CONDITIONAL: dict[str, str] = {
    "clone": "threads only: CLONE_THREAD set and no CLONE_NEW* namespace flag",
    "kill": "to its own pid only (abort() and Python's os.kill(own pid) go through these)",
    "tgkill": "to its own pid only (pthread_kill, raise)",
    "tkill": "to its own pid (the main thread) only",
    "rt_sigqueueinfo": "to its own pid only",
    "rt_tgsigqueueinfo": "to its own pid only",
    "prlimit64": "its own limits only (pid 0 or its own): Python's resource module",
    "open": "read-only (no O_WRONLY, O_RDWR, O_CREAT, O_TRUNC) unless it may write",
    "openat": "read-only (no O_WRONLY, O_RDWR, O_CREAT, O_TRUNC) unless it may write",
}

# Answered ENOSYS rather than EPERM: their arguments are in memory a filter cannot read, and
# the C library falls back to the older call (clone, openat), which the filter can check,
# only on ENOSYS (as under Docker's profile).
ENOSYS: tuple[str, ...] = ("clone3", "openat2")

# Allowed only to a process given paths to write (the prompt cache's directory, the
# quantizer's output): writing a state to a temporary name and renaming it into place,
# removing old states, touching a state that was used, sizing the quantizer's output.
# Landlock alone decides where.
FS_CHANGES = Group(
    "the prompt cache's writer (temporary file, rename into place, unlink the oldest, "
    "utimensat on use) and the quantizer's output; only with a writable directory, where "
    "Landlock keeps them",
    ("rename", "renameat", "renameat2", "unlink", "unlinkat", "utimensat", "utimes",
     "futimesat", "ftruncate", "fallocate", "mkdir", "mkdirat", "rmdir"))

# Never allowed, named so that the tests can check none of them slips into the table (the
# default action refuses them anyway): running programs, new processes, new connections,
# reading or steering other processes, a second system-call path (io_uring), namespaces and
# mounts, kernel modules and BPF, key rings, the machine's clock, tracing and the like.
DENIED: tuple[str, ...] = (
    "execve", "execveat", "fork", "vfork", "socket", "connect", "bind", "listen", "accept",
    "accept4", "ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "kcmp",
    "pidfd_open", "pidfd_getfd", "pidfd_send_signal", "io_uring_setup", "io_uring_enter",
    "io_uring_register", "mount", "umount2", "pivot_root", "chroot", "setns", "unshare",
    "open_tree", "move_mount", "fsopen", "fsmount", "fsconfig", "fspick", "mount_setattr",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "bpf",
    "perf_event_open", "userfaultfd", "keyctl", "add_key", "request_key", "swapon", "swapoff",
    "reboot", "acct", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "open_by_handle_at", "name_to_handle_at", "personality", "syslog", "uselib", "quotactl",
    "lookup_dcookie", "vhangup", "iopl", "ioperm", "modify_ldt", "setuid", "setgid",
    "setreuid", "setregid", "setresuid", "setresgid", "setfsuid", "setfsgid", "setgroups",
    "capset", "migrate_pages", "move_pages", "get_robust_list", "seccomp",
    "landlock_create_ruleset", "landlock_add_rule", "landlock_restrict_self",
    "fanotify_init", "memfd_secret", "creat", "chmod", "fchmod", "fchmodat", "chown",
    "fchown", "lchown", "fchownat", "link", "linkat", "symlink", "symlinkat", "mknod",
    "mknodat", "truncate", "setxattr", "lsetxattr", "fsetxattr", "removexattr",
    "lremovexattr", "fremovexattr", "sethostname", "setdomainname", "shmget", "shmat",
    "msgget", "semget", "mq_open")


def allowed_names(*, fs_changes: bool, gpu: bool) -> tuple[str, ...]:
    """The names allowed whatever their arguments, for a process that may change files in a
    writable directory (`fs_changes`) and that uses GPU device nodes (`gpu`)."""
    names = [n for g in GROUPS.values() for n in g.names]
    if gpu:
        names += GPU_DRIVERS.names
    if fs_changes:
        names += FS_CHANGES.names
    return tuple(dict.fromkeys(names))
