#!/usr/bin/env python3
"""Trace the system calls confined processes really make, and check them against the
seccomp allowlist (llmrun/engine/sandbox/syscalls.py).

Runs the chosen pytest files under `strace -f -ff -ttt` (one trace file per thread), finds
every process that confined itself (the seccomp filter installed with TSYNC, as
sandbox.confine() does: a runner, the quantizer child, the sandbox tests' probes), and
collects the calls its threads made after that moment: the threads it already had from the
moment of the filter on, the threads it started afterwards whole. Then prints, per call, how
often and how it returned, and compares the union with the table:

- missing: made and answered by the kernel (not by the filter), but not in the table: the
  filter would now refuse it;
- refused: only ever answered EPERM/ENOSYS after confinement (the filter, or a probe trying
  what it must not): listed so that a reviewer sees them, not added;
- unused: in the table but never made here and not named in syscalls.UNTRACED (which says
  why each of its names is kept without a trace); kept_untraced: those named there;
- gpu_group_traced: calls of the GPU group (allowed only with GPU nodes) made here.

It is how the table is regenerated and reviewed, not a CI test (it takes minutes, and the
traces are large):

    scripts/trace_syscalls.py [--out DIR] [--keep] [--json FILE] [TEST_FILE ...]
    scripts/trace_syscalls.py --analyse DIR          # only re-read traces made before

The default pytest files cover what a runner does: load, decode, embeddings, vision, the
prompt cache on disk, RPC, the thread governor, draft models, LoRA, structured output,
Vulkan (lavapipe, when .venv-vulkan exists), the quantizer child and shutdown.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_TESTS = [
    "tests/integration/test_sandbox.py", "tests/integration/test_engine.py",
    "tests/integration/test_promptcache.py", "tests/integration/test_vision.py",
    "tests/integration/test_api_vision.py", "tests/integration/test_rpc.py",
    "tests/integration/test_draft.py", "tests/integration/test_lora.py",
    "tests/integration/test_threads.py", "tests/integration/test_quantize.py",
    "tests/integration/test_vulkan.py", "tests/integration/test_constraint.py",
    "tests/integration/test_api_chat.py", "tests/integration/test_structured.py",
]

LINE = re.compile(r"^(\d+\.\d+) (?:<\.\.\. )?([a-z_0-9]+)(?:\(| resumed>)(.*)$")
RESULT = re.compile(r"\)\s+= (-?\d+|0x[0-9a-f]+|\?)(?: (E[A-Z0-9]+))?")
CLONE_CHILD = re.compile(r"= (\d+)$")
REFUSED = {"EPERM", "ENOSYS"}  # what the filter answers (and what a probe is answered)


@dataclass
class Thread:
    tid: int
    lines: list[tuple[float, str, str]] = field(default_factory=list)  # (ts, name, rest)
    parent: int | None = None
    is_thread: bool = False  # started with CLONE_THREAD: shares its parent's process
    argv: str = ""


def read_traces(directory: Path) -> dict[int, Thread]:
    threads: dict[int, Thread] = {}
    for path in directory.glob("trace.*"):
        tid = int(path.suffix[1:])
        t = threads.setdefault(tid, Thread(tid))
        with path.open(errors="replace") as fh:
            for raw in fh:
                m = LINE.match(raw.rstrip("\n"))
                if not m:
                    continue
                ts, name, rest = float(m[1]), m[2], m[3]
                t.lines.append((ts, name, rest))
                if name == "execve" and not t.argv:
                    t.argv = rest[:300]
    for t in list(threads.values()):
        for _, name, rest in t.lines:
            if name in ("clone", "clone3", "fork", "vfork"):
                m = CLONE_CHILD.search(rest)
                if m and int(m[1]) > 0:
                    child = threads.setdefault(int(m[1]), Thread(int(m[1])))
                    child.parent, child.is_thread = t.tid, "CLONE_THREAD" in rest
    return threads


def tgid(threads: dict[int, Thread], tid: int) -> int:
    while threads[tid].is_thread and threads[tid].parent in threads:
        tid = threads[tid].parent  # type: ignore[assignment]
    return tid


def confined_processes(threads: dict[int, Thread]) -> dict[int, tuple[float, int]]:
    """Process (tgid) -> (time of its TSYNC seccomp filter, the thread that installed it)."""
    found: dict[int, tuple[float, int]] = {}
    for t in threads.values():
        for ts, name, rest in t.lines:
            if (name == "seccomp" and "SECCOMP_SET_MODE_FILTER" in rest and "TSYNC" in rest
                    and RESULT.search(rest) and RESULT.search(rest)[1] == "0"):  # type: ignore[index]
                pid = tgid(threads, t.tid)
                if pid not in found or ts < found[pid][0]:
                    found[pid] = (ts, t.tid)
    return found


@dataclass
class Calls:
    count: collections.Counter[str] = field(default_factory=collections.Counter)
    ok: collections.Counter[str] = field(default_factory=collections.Counter)
    errors: dict[str, collections.Counter[str]] = field(
        default_factory=lambda: collections.defaultdict(collections.Counter))
    notes: dict[str, set[str]] = field(default_factory=lambda: collections.defaultdict(set))


WRITE_FLAG = re.compile(r"O_WRONLY|O_RDWR|O_CREAT|O_TRUNC")


def note(calls: Calls, name: str, rest: str, pid: int) -> None:
    """The arguments the conditional rules look at."""
    if name in ("clone", "clone3"):
        calls.notes[name].add("thread" if "CLONE_THREAD" in rest else "PROCESS")
    elif name in ("open", "openat", "creat"):
        calls.notes[name].add("write" if WRITE_FLAG.search(rest) else "read")
    elif name in ("kill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo"):
        target = rest.split(",", 1)[0].strip()
        calls.notes[name].add("self" if target == str(pid) else f"other({target})")
    elif name in ("ioctl", "prctl", "fcntl", "futex", "madvise", "arch_prctl"):
        fields = [f.strip() for f in rest.split(",")]
        if len(fields) > 1:
            arg = fields[0] if name in ("prctl", "arch_prctl") else fields[1]
            calls.notes[name].add(re.sub(r"[(\s].*", "", arg)[:40])


def collect(threads: dict[int, Thread]) -> tuple[Calls, list[dict[str, object]]]:
    confined = confined_processes(threads)
    calls, processes = Calls(), []
    for pid, (since, installer) in confined.items():
        n = 0
        for t in threads.values():
            if tgid(threads, t.tid) != pid:
                continue
            after = False
            for ts, name, rest in t.lines:
                if not after:  # the filter's own call is not made under it
                    if t.tid == installer:
                        after = ts >= since and name == "seccomp" and "TSYNC" in rest
                        continue
                    after = ts > since
                    if not after:
                        continue
                n += 1
                calls.count[name] += 1
                m = RESULT.search(rest)
                if m and m[2]:
                    calls.errors[name][m[2]] += 1
                else:
                    calls.ok[name] += 1
                note(calls, name, rest, pid)
        processes.append({"pid": pid, "argv": threads[pid].argv or "?", "calls": n,
                          "threads": sum(tgid(threads, x) == pid for x in threads)})
    return calls, processes


def compare(calls: Calls) -> dict[str, list[str]]:
    from llmrun.engine.sandbox import syscalls as table

    allowed = set(table.allowed_names(fs_changes=True, gpu=False))  # what a CPU runner gets
    conditional = set(table.CONDITIONAL) | set(table.ENOSYS)
    made = {n for n in calls.count if calls.ok[n] or set(calls.errors[n]) - REFUSED}
    refused = {n for n in calls.count if n not in made}
    gpu = set(table.GPU_DRIVERS.names) - allowed
    return {
        "missing": sorted(made - allowed - conditional),
        "refused": sorted(refused),
        "unused": sorted((allowed | conditional) - set(calls.count) - set(table.UNTRACED)),
        "kept_untraced": sorted(set(table.UNTRACED) - set(calls.count)),
        "gpu_group_traced": sorted(gpu & set(calls.count)),
    }


def report(calls: Calls, processes: list[dict[str, object]], out: Path | None) -> int:
    print(f"\nconfined processes: {len(processes)}")
    kinds = collections.Counter(
        "runner" if "llmrun.engine.runner" in str(p["argv"])
        else "quantizer" if "quantizer" in str(p["argv"]) else "probe/other" for p in processes)
    print("  " + ", ".join(f"{k}: {v}" for k, v in sorted(kinds.items())))
    print(f"\n{'syscall':24} {'calls':>9} {'ok':>9}  errors / arguments seen")
    for name in sorted(calls.count):
        errs = ", ".join(f"{e}x{c}" for e, c in calls.errors[name].most_common(4))
        notes = ", ".join(sorted(calls.notes.get(name, ())))[:80]
        print(f"{name:24} {calls.count[name]:9} {calls.ok[name]:9}  {errs}"
              f"{' | ' if errs and notes else ''}{notes}")
    try:
        diff = compare(calls)
    except ImportError as exc:  # no table yet
        print(f"\n(no table to compare with: {exc})")
        diff = {}
    for key, names in diff.items():
        print(f"\n{key} ({len(names)}): {' '.join(names) or '-'}")
    if out:
        out.write_text(json.dumps({
            "processes": processes,
            "calls": {n: {"count": calls.count[n], "ok": calls.ok[n],
                          "errors": dict(calls.errors[n]),
                          "notes": sorted(calls.notes.get(n, ()))} for n in calls.count},
            **diff}, indent=1))
    return 1 if diff.get("missing") else 0


def run(tests: list[str], directory: Path, pytest_args: list[str]) -> None:
    strace = shutil.which("strace") or "/usr/bin/strace"
    venv_python = ROOT / ".venv" / "bin" / "python"
    python = str(venv_python) if venv_python.exists() else sys.executable
    cmd = [strace, "-f", "-ff", "-ttt", "-s", "64", "-o", str(directory / "trace"),
           python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args, *tests]
    print("+", " ".join(cmd), flush=True)
    rc = subprocess.call(cmd, cwd=ROOT)
    print(f"pytest under strace: exit {rc} (failures under strace can be timeouts: the "
          "traces are still read)", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, help="directory for the traces (default: a temporary "
                    "one, removed unless --keep)")
    ap.add_argument("--keep", action="store_true", help="keep the traces")
    ap.add_argument("--analyse", type=Path, help="only read the traces in this directory")
    ap.add_argument("--json", type=Path, help="write the result as JSON here")
    ap.add_argument("--pytest-arg", action="append", default=[], help="passed to pytest")
    ap.add_argument("tests", nargs="*", help=f"pytest files (default: {len(DEFAULT_TESTS)})")
    args = ap.parse_args()
    if args.analyse:
        directory = args.analyse
    else:
        directory = args.out or Path(tempfile.mkdtemp(prefix="llmrun-trace-"))
        directory.mkdir(parents=True, exist_ok=True)
        run(args.tests or [t for t in DEFAULT_TESTS if (ROOT / t).exists()], directory,
            args.pytest_arg)
    try:
        calls, processes = collect(read_traces(directory))
        return report(calls, processes, args.json)
    finally:
        if not args.analyse and not args.keep and not args.out:
            shutil.rmtree(directory, ignore_errors=True)
        elif not args.analyse:
            print(f"traces kept in {directory}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
