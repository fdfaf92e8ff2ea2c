"""Where Landlock is missing (a kernel before 5.13, or one that has it switched off), the
writes of a confined process that must write (a runner's prompt-cache directory, a GPU
runner's device nodes, the quantizer's output) are kept in place by its mount namespace
instead: every mount it sees is remounted read-only except its own output, and /dev shrinks
to a few harmless nodes and its GPU's.

The process entered a mount namespace of its own earlier (namespaces.enter(), while it had one
thread, inside its own user namespace, which gives it the right to remount there; root needs
no user namespace). The changes live in that namespace alone: the daemon and everything else
keep their mounts as they were. The seccomp filter that comes next refuses mount, umount2 and
the new mount API, so the process cannot undo them.

Why this holds where seccomp alone could not: once a process may open files for writing, the
filter cannot tell the prompt-cache directory from the user's home (it sees flags, not paths).
A read-only mount refuses every write-open of a file, directory or symlink on it (EROFS),
create, rename, unlink and truncate alike, whatever the permissions. What a read-only mount
does not refuse: opening a device node for writing (the kernel exempts special files), which
is why /dev is replaced by a tmpfs holding only /dev/null, /dev/zero, /dev/full, /dev/random,
/dev/urandom and the process's GPU nodes, each bind-mounted from the real one (as bubblewrap's
--dev does).

How each mount is made read-only: MS_REMOUNT | MS_BIND | MS_RDONLY on its mount point, with
the flags it already has (nosuid, nodev, noexec, atime): a user namespace may add MS_RDONLY
but not drop a flag the more privileged namespace set (EPERM). Then every mount point is
checked with statvfs: each one this process can reach must say ST_RDONLY, its output must not,
or the whole step fails (and the caller refuses to let the process write).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
from collections.abc import Iterable
from pathlib import Path

READ_ONLY = "read-only-mounts"

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOSYMFOLLOW, MS_NOATIME, MS_NODIRATIME = 32, 256, 1024, 2048
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
MS_RELATIME, MS_STRICTATIME = 1 << 21, 1 << 24
# A mount's own options in /proc/self/mountinfo (field 6), as mount flags.
_OPTION_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC,
                 "noatime": MS_NOATIME, "nodiratime": MS_NODIRATIME,
                 "relatime": MS_RELATIME, "nosymfollow": MS_NOSYMFOLLOW}
# The device nodes every process may keep: reading them gives nothing away, writing them
# does nothing (Landlock keeps /dev/null and /dev/urandom readable for the same reason).
HARMLESS_NODES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
# Mount points a path lookup cannot reach any more (a later mount covers a parent, the
# directory was removed, a permission on the way): nothing there can be opened either.
_UNREACHABLE = (errno.ENOENT, errno.EACCES, errno.ENOTDIR, errno.ELOOP)


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                           ctypes.c_char_p]
    return libc


def _mount(libc: ctypes.CDLL, source: str | None, target: str, fstype: str | None,
           flags: int, data: str | None = None) -> None:
    def enc(s: str | None) -> bytes | None:
        return None if s is None else os.fsencode(s)

    if libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"mount {target}: {os.strerror(code)}", target)


def _unescape(field: bytes) -> str:
    """A path from mountinfo, whose space, tab, newline and backslash are octal escapes."""
    return os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), field))


def mount_points() -> dict[str, int]:
    """Every mount point this process sees, with the flags of the mount on top there (the
    one a path reaches: a later line at the same point covers the earlier)."""
    points: dict[str, int] = {}
    with open("/proc/self/mountinfo", "rb") as fh:
        for line in fh:
            fields = line.split()
            if len(fields) < 6:
                continue
            options = fields[5].decode("ascii", "replace").split(",")
            flags = 0
            for option in options:
                flags |= _OPTION_FLAGS.get(option, 0)
            if not flags & (MS_NOATIME | MS_RELATIME):
                flags |= MS_STRICTATIME  # (a remount would otherwise switch it to relatime)
            points[_unescape(fields[4])] = flags
    return points


def _minimal_dev(libc: ctypes.CDLL, devices: Iterable[Path]) -> None:
    """Replace /dev with a tmpfs that holds only the harmless nodes and `devices`, each a
    bind mount of the real node (opened before the tmpfs hides them, then bound from its
    /proc/self/fd link)."""
    wanted = sorted({*HARMLESS_NODES, *(str(d) for d in devices)})
    held: dict[str, int] = {}
    try:
        for node in wanted:
            try:
                held[node] = os.open(node, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # not on this machine
        _mount(libc, "tmpfs", "/dev", "tmpfs", MS_NOSUID | MS_NOEXEC, "mode=0755,size=64k")
        for node, fd in held.items():
            target = Path(node)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.touch(mode=0o600)
            _mount(libc, f"/proc/self/fd/{fd}", node, None, MS_BIND)
    finally:
        for fd in held.values():
            os.close(fd)


def read_only_except(writable: Iterable[Path], devices: Iterable[Path] = ()) -> None:
    """In this process's own mount namespace: every mount read-only except `writable`
    (directories or files, bind-mounted onto themselves read-write), and /dev reduced to
    the harmless nodes and `devices`. Raises OSError when any reachable mount stays writable
    or an output is not writable (the caller must then not let the process write)."""
    libc = _libc()
    # nothing done here may reach the mounts of the namespace this one was copied from
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)
    _minimal_dev(libc, devices)
    outputs = []
    for path in writable:
        real = os.path.realpath(path)
        if not os.path.exists(real):
            raise OSError(errno.ENOENT, f"{path} does not exist", str(path))
        _mount(libc, real, real, None, MS_BIND)  # a mount of its own, left writable below
        outputs.append(real)
    points = mount_points()
    for point, flags in points.items():
        if point in outputs:
            continue
        try:
            _mount(libc, None, point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
        except OSError as exc:
            if exc.errno not in _UNREACHABLE and exc.errno != errno.EINVAL:
                raise
            # EINVAL: no mount point there any more (a later mount covers a parent); the
            # check below finds out whether something writable is still reachable
    _check(points, outputs)


def _check(points: Iterable[str], outputs: list[str]) -> None:
    """Every mount point reachable reads ST_RDONLY, each output does not."""
    still_writable = []
    for point in points:
        try:
            read_only = bool(os.statvfs(point).f_flag & os.ST_RDONLY)
        except OSError as exc:
            if exc.errno in _UNREACHABLE:
                continue
            raise
        if point in outputs and read_only:
            raise OSError(errno.EROFS, f"{point} is on a read-only file system", point)
        if point not in outputs and not read_only:
            still_writable.append(point)
    if still_writable:
        raise OSError(errno.EPERM, "these mounts could not be made read-only: "
                      + ", ".join(still_writable[:8]))
