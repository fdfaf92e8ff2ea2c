"""The quantizer child: `python -m llmrun.engine.quantizer SRC DST TYPE [THREADS]`.

Started by llmrun/store/quantize.py, which explains why quantizing runs in its own process;
this is the only part that loads llama.cpp, so the store never imports the engine. Progress
lines go to stderr, where the parent reads them.
"""

from __future__ import annotations

import logging
import re
import signal
import sys
from pathlib import Path

from llmrun import config

log = logging.getLogger(__name__)

# llama.cpp's per-tensor progress line, "[  12/ 290] ...": store/quantize.py reads the same
_PROGRESS = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]")

class _ChildLog(logging.Filter):
    """In the child: pass llama.cpp's warnings, errors, per-tensor lines and size summary."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            return True
        msg = record.getMessage()
        return bool(_PROGRESS.match(msg)) or msg.startswith("llama_model_quantize_impl:")


def _isolate() -> tuple[list[str], list[str]]:
    """First, while this process has one thread (llama.cpp and numpy start threads as they
    load): its own user, mount and empty network namespaces (sandbox.isolate)."""
    if config.sandbox_mode() == "off":
        return [], []
    from llmrun.engine.sandbox import namespaces

    return namespaces.enter()


def _confine(src: Path, dst: Path,
             isolated: tuple[list[str], list[str]] | None = None) -> str:
    """In the child, before llama.cpp opens `src`: read `src`, write only `dst` (Landlock,
    else read-only mounts in its mount namespace), grow it no larger than `src` could make
    it, no programs, sockets, other processes (seccomp). `isolated`: what _isolate() applied
    (None: isolate now, in a process that still has one thread). Returns why it must not go
    on, else "": always when its writes could not be kept to `dst`, as it would write
    wherever its user can; in LLMRUN_SANDBOX=strict mode also when any layer is missing."""
    mode = config.sandbox_mode()
    if mode == "off":
        return ""
    from llmrun.engine import sandbox

    if isolated is None:
        isolated = _isolate()
    try:
        limits = sandbox.Limits.for_quantizer(src.stat().st_size)
    except OSError as exc:
        return f"cannot read {src}: {exc.strerror}"
    result = sandbox.confine(read=[src], read_write=[dst], limits=limits, isolated=isolated)
    for why in (*result.missing, *result.unavailable):
        log.warning("sandbox: not applied: %s", why)
    if not {sandbox.LANDLOCK, sandbox.READ_ONLY} & set(result.applied):
        return ("the sandbox cannot keep the quantizer's writes to its output here (with "
                "neither Landlock, Linux 5.13+, nor unprivileged user namespaces for a mount "
                f"namespace): {'; '.join(result.missing)}; set LLMRUN_SANDBOX=0 to quantize "
                "unconfined")
    return result.refusal() if mode == "strict" else ""


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (3, 4):
        print("usage: python -m llmrun.engine.quantizer SRC DST TYPE [THREADS]", file=sys.stderr)
        return 2
    # The parent kills us to cancel; a terminal's Ctrl-C should not wait for the C call either.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.addFilter(_ChildLog())
    llama_log = logging.getLogger("llmrun.llama")
    llama_log.addHandler(handler)
    llama_log.setLevel(logging.DEBUG)
    llama_log.propagate = False

    isolated = _isolate()
    from llmrun.engine.llama import LlamaError, quantize_file

    src, dst, qtype = args[:3]
    refusal = _confine(Path(src), Path(dst), isolated)
    if refusal:
        print(f"error: {refusal}", file=sys.stderr)
        return 1
    try:
        quantize_file(Path(src), Path(dst), qtype, int(args[3]) if len(args) == 4 else 0)
    except (LlamaError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
