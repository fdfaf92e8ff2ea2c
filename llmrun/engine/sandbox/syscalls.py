"""The seccomp allowlist: every system call a confined process (a runner, the quantizer child)
may make once confined, in groups, each with why it is needed. A call named nowhere here is
answered EPERM by the filter (seccomp.py says why EPERM rather than killing the process).

How the table is made and checked: scripts/trace_syscalls.py runs the integration tests
under strace (model load, decode of several sequences, embeddings, vision, the prompt cache
on disk, RPC, the thread governor, draft models, LoRA, structured output, Vulkan on lavapipe,
the quantizer child, shutdown), collects what every confined process called after it
confined itself and compares that with this table. Every group below except GPU_DRIVERS is
what those traces showed, plus the names in UNTRACED, each with why it stays without a trace
(the older or newer form of a traced call that glibc or Python pick by version, a vDSO
fallback, a path the tests do not reach confined). GPU_DRIVERS cannot be
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
        "the weights are memory-mapped; llama.cpp and Python allocate (brk, mmap), free, "
        "protect and advise on their buffers; mremap: glibc's realloc of large blocks",
        ("brk", "mmap", "munmap", "mprotect", "madvise", "mremap")),
    "threads": Group(
        "llama.cpp's thread pool, OpenMP and Python threads (started by clone: see "
        "CONDITIONAL): waiting and waking (futex), glibc's per-thread registrations "
        "(robust futex list, restartable sequences), yielding while spinning, the CPUs "
        "they may use, and the lowest priority the prompt cache's writer gives its own "
        "thread (setpriority: see CONDITIONAL)",
        ("futex", "set_robust_list", "rseq", "sched_yield", "sched_getaffinity",
         "exit", "exit_group")),
    "time": Group(
        "clock reads (the vDSO answers them without a system call where the clock source "
        "allows; these are its fallbacks, on some virtual machines every read) and sleeps",
        ("clock_gettime", "gettimeofday", "time", "clock_nanosleep", "nanosleep")),
    "files": Group(
        "reading the model files and Python's modules (opened read-only: see "
        "CONDITIONAL; Landlock decides which), the thread governor's /proc reads in place "
        "(pread64), metadata (newfstatat; fstat/stat/lstat where glibc is older, statx "
        "where newer), directory listings, descriptor flags; writing to descriptors already "
        "held (the log, a prompt state or the quantizer's output once opened) and fsync of "
        "a prompt state; faccessat2: glibc falls back to faccessat only on ENOSYS",
        ("read", "pread64", "write", "writev", "lseek", "close", "fstat", "stat", "lstat",
         "newfstatat", "statx", "access", "faccessat", "faccessat2", "getdents64",
         "getcwd", "fcntl", "fadvise64", "fsync")),
    "ipc": Group(
        "the socket pair to the daemon and an RPC runner's connections to its workers, all "
        "made before confinement (socket() and connect() are refused): sending, receiving, "
        "waiting (poll; ppoll where poll is not a call), their names, closing one side; "
        "socketpair and pipe2 make only a local pair nothing outside can reach; sendmsg: "
        "sendto with ancillary data, whose descriptors the daemon never takes in (it stops "
        "a runner that passes any, which the hostile-runner test checks)",
        ("recvfrom", "sendto", "sendmsg", "poll", "ppoll", "shutdown", "getsockname",
         "getpeername", "socketpair", "pipe2")),
    "signals": Group(
        "signal handlers and masks (Python's, glibc's), returning from a handler, the "
        "alternate stack of Python's faulthandler, and the kernel's restart of a sleep a "
        "signal interrupted; signals to itself: see CONDITIONAL",
        ("rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "sigaltstack", "restart_syscall")),
    "process": Group(
        "what the process asks about itself and the machine: its ids (getuid and geteuid "
        "for Mesa's look-up of the home directory), memory and CPU count (sysinfo), random "
        "numbers (Python's hash seed, the samplers' seeds), thread names (prctl "
        "PR_SET_NAME, by Mesa's and Python's threads)",
        ("getpid", "gettid", "getuid", "geteuid", "getgid", "getegid", "sysinfo",
         "getrandom", "prctl")),
}

# Only for a runner with GPU device nodes: what the GPU drivers call beyond the groups
# above, which no trace here can show (lavapipe, the Vulkan driver the tests run, is Mesa
# on the CPU and needs only the groups above). The NVIDIA driver (libcuda, its UVM driver)
# and ROCm's runtime talk to the device through ioctl (any request: their numbers are the
# driver's), map device memory and pin host memory (mlock), place memory on NUMA nodes
# (mbind, get/set_mempolicy), wait on their own event descriptors (eventfd, epoll, timerfd),
# find their own files (readlink of /proc/self/exe, uname for the kernel's version) and,
# for Vulkan drivers, share buffers through anonymous memory files (memfd_create and
# ftruncate: a file in memory only; execveat stays refused, so it cannot be run). Docker's
# default profile allows all of them.
GPU_DRIVERS = Group(
    "what CUDA, ROCm and Vulkan drivers call beyond the CPU trace (not traceable without a "
    "GPU; all in Docker's default profile): device ioctls, pinned and NUMA-placed memory, "
    "their own event descriptors, anonymous memory files for shared buffers",
    ("mlock", "mlock2", "munlock", "mincore", "msync", "mbind", "get_mempolicy",
     "set_mempolicy", "membarrier", "memfd_create", "ftruncate", "eventfd2",
     "epoll_create1", "epoll_ctl", "epoll_wait", "epoll_pwait", "epoll_pwait2",
     "timerfd_create", "timerfd_settime", "readlink", "readlinkat", "uname", "dup", "dup3",
     "sched_setaffinity", "getrlimit", "statfs", "fstatfs"))

# Allowed only with the argument conditions seccomp.py installs (the groups' reasons refer
# here).
CONDITIONAL: dict[str, str] = {
    "clone": "threads only: CLONE_THREAD set and no CLONE_NEW* namespace flag",
    "kill": "to its own pid only (Python's os.kill(own pid), abort())",
    "tgkill": "to its own pid only (pthread_kill, raise, abort())",
    "tkill": "to its own pid (its main thread) only",
    "rt_sigqueueinfo": "to its own pid only",
    "rt_tgsigqueueinfo": "to its own pid only",
    "prlimit64": "reading its own limits only (pid 0 or its own, no new limit)",
    "setpriority": "its calling thread only (PRIO_PROCESS, who 0): the prompt cache's writer "
                   "lowers its own priority; any other target (the daemon, PRIO_USER: every "
                   "process of the user) is refused, as an unprivileged user may renice all "
                   "its own processes",
    "open": "read-only (no O_WRONLY, O_RDWR, O_CREAT, O_TRUNC) unless it may write",
    "openat": "read-only (no O_WRONLY, O_RDWR, O_CREAT, O_TRUNC) unless it may write",
    "ioctl": "the requests Python makes on its descriptors (TCGETS, TIOCGWINSZ: is it a "
             "terminal; FIONBIO, FIOCLEX, FIONCLEX), not TIOCSTI or the like; any request "
             "with GPU nodes (their drivers' own)",
}
# The ioctl requests a process without GPU nodes may make, by number (x86_64 and aarch64
# share them). Compared on all 64 bits: the kernel reads only the low 32, so a request with
# high bits set (TIOCSTI + 2**32) matches none of these and is refused.
IOCTLS: dict[str, int] = {"TCGETS": 0x5401, "TIOCGWINSZ": 0x5413, "FIONBIO": 0x5421,
                          "FIONCLEX": 0x5450, "FIOCLEX": 0x5451}

# Kept in the groups above without a trace here, each with why (the trace script reports
# what else of the table no trace used).
UNTRACED: dict[str, str] = {
    "mremap": "glibc's realloc of large blocks (Python's growing buffers)",
    "sched_getaffinity": "the CPUs a thread may use (OpenMP, os.sched_getaffinity)",
    "clock_gettime": "vDSO fallback", "gettimeofday": "vDSO fallback", "time": "vDSO fallback",
    "clock_nanosleep": "time.sleep", "nanosleep": "usleep in llama.cpp and glibc",
    "pread64": "the thread governor reads /proc/stat in place (not confined in the tests)",
    "fstat": "older glibc", "stat": "older glibc", "lstat": "older glibc",
    "statx": "newer glibc and Python", "access": "os.access", "faccessat": "os.access",
    "faccessat2": "os.access through glibc 2.33+", "getcwd": "relative paths resolved",
    "fcntl": "descriptor flags (Python)", "ppoll": "poll where poll is not a call",
    "sigaltstack": "Python's faulthandler", "restart_syscall": "an interrupted sleep",
    "getgid": "with getuid", "getegid": "with geteuid",
    "sendmsg": "no runner's own use: kept so the daemon's refusal of passed descriptors "
               "stays the defence a test can see",
    "renameat": "rename's *at form", "renameat2": "rename where rename is not a call",
    "unlinkat": "unlink's *at form (and where unlink is not a call)",
    "open": "openat's older form", "openat2": "answered ENOSYS (see ENOSYS)",
    "prlimit64": "Python's resource module", "tkill": "signals to itself",
    "rt_sigqueueinfo": "signals to itself", "rt_tgsigqueueinfo": "signals to itself",
}

# Answered ENOSYS rather than EPERM: their arguments are in memory a filter cannot read, and
# the C library falls back to the older call (clone, openat), which the filter can check,
# only on ENOSYS (as under Docker's profile).
ENOSYS: tuple[str, ...] = ("clone3", "openat2")

# Allowed only to a process given paths to write (the prompt cache's directory, the
# quantizer's output): writing a state to a temporary name and renaming it into place,
# removing old states, touching a state that was used. Landlock alone decides where.
FS_CHANGES = Group(
    "the prompt cache's writer (a temporary file renamed into place, the oldest unlinked, "
    "utimensat on use) and the quantizer's output; only with a writable directory, where "
    "Landlock keeps them",
    ("rename", "renameat", "renameat2", "unlink", "unlinkat", "utimensat"))

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
    "fanotify_init", "memfd_secret", "creat", "truncate", "chmod", "fchmod", "fchmodat", "chown",
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
