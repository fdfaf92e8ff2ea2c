"""The namespaces of a confined process: a user namespace of its own, and in it an empty
network namespace.

In an empty network namespace there is no interface but a loopback that is down: no address
on this machine or elsewhere can be reached, whatever the seccomp filter or Landlock allow,
and abstract unix sockets of the host (a desktop's D-Bus, X11) are out of sight. The user
namespace is what lets an unprivileged process make one, and it gives RLIMIT_NPROC a count of
the runner's own threads (sandbox/limits.py). The process keeps its user and group IDs (each
mapped to itself), so the files it may read are those it could read before.

Not made: a PID namespace. A process enters one only by forking, and the first process in
it is the namespace's init, which the kernel shields from every signal it has no handler
for, its own included: llama.cpp's abort() would no longer end it with SIGABRT (glibc falls
back to an illegal instruction), and a test's or a user's `kill -ABRT` would do nothing. A
third process as init would avoid that, at the price of two more processes per model. What
the namespace would hide, Landlock and the seccomp filter already refuse: other processes'
/proc entries (EACCES), signals and ptrace to them (EPERM); tests/integration/test_redteam.py
tries each.

A mount namespace too, where the user namespace (or root) allows one: nothing changes in it
while Landlock confines the process's files, but where Landlock is missing, a process that
must write (a prompt-cache directory, a GPU's device nodes, the quantizer's output) remounts
everything read-only in it except its output (sandbox/mounts.py), which a filter on open
flags alone could not do. It has to be made here: a mount namespace, like a user namespace,
is a thread's, and only one made while the process had a single thread is every thread's.

`unshare` works only while the process has a single thread, so this is the runner's first
step after reading its Load message, before llama.cpp or any library starts a thread.
"""

from __future__ import annotations

import ctypes
import os

USER = "user-namespace"
NETWORK = "network-namespace"
MOUNT = "mount-namespace"

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000


def _unshare(flags: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(ctypes.c_int(flags)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _map_ids(uid: int, gid: int) -> None:
    """Map this process's IDs to themselves in its new user namespace (an unmapped ID would
    make every file it creates fail with EOVERFLOW). setgroups must be denied first, as the
    kernel requires of an unprivileged writer of gid_map."""
    with open("/proc/self/setgroups", "w") as fh:
        fh.write("deny")
    with open("/proc/self/uid_map", "w") as fh:
        fh.write(f"{uid} {uid} 1")
    with open("/proc/self/gid_map", "w") as fh:
        fh.write(f"{gid} {gid} 1")


def enter(keep_network: bool = False) -> tuple[list[str], list[str]]:
    """Move this process into a user namespace of its own, a mount namespace and, unless
    `keep_network` (a runner that talks to RPC workers), an empty network namespace.
    Returns the layers applied and, for those the kernel refused, "layer: why"."""
    uid, gid = os.getuid(), os.getgid()
    flags = CLONE_NEWUSER | CLONE_NEWNS | (0 if keep_network else CLONE_NEWNET)
    try:
        _unshare(flags)
    except OSError as exc:
        # Unprivileged user namespaces can be switched off (kernel.unprivileged_userns_clone,
        # user.max_user_namespaces=0, AppArmor's restriction on Ubuntu 24.04). Root can still
        # make a network and a mount namespace without one.
        why = f"{USER}: {exc.strerror or exc}"
        if uid != 0:
            return [], [why, f"{MOUNT}: needs a {USER}"] + (
                [] if keep_network else [f"{NETWORK}: needs a {USER}"])
        try:
            _unshare(CLONE_NEWNS | (0 if keep_network else CLONE_NEWNET))
        except OSError as ns_exc:
            return [], [why, f"{MOUNT}: {ns_exc.strerror or ns_exc}"] + (
                [] if keep_network else [f"{NETWORK}: {ns_exc.strerror or ns_exc}"])
        return [MOUNT, *([] if keep_network else [NETWORK])], [why]
    net = [] if keep_network else [NETWORK]
    try:
        _map_ids(uid, gid)
    except OSError as exc:
        # (the process still runs, as the overflow ID; it writes no file then)
        return [USER, MOUNT, *net], [f"user-id-map: {exc.strerror}"]
    return [USER, MOUNT, *net], []
