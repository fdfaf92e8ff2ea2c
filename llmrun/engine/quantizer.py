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


def _confine(src: Path, dst: Path) -> str:
    """In the child, before llama.cpp opens `src`: read `src`, write only `dst` (Landlock),
    no programs, sockets, other processes (seccomp). Returns why LLMRUN_SANDBOX=strict
    refuses to go on, else ""."""
    mode = config.sandbox_mode()
    if mode == "off":
        return ""
    from llmrun.engine import sandbox

    result = sandbox.confine(read=[src], read_write=[dst])
    for why in (*result.missing, *result.unavailable):
        log.warning("sandbox: not applied: %s", why)
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

    from llmrun.engine.llama import LlamaError, quantize_file

    src, dst, qtype = args[:3]
    refusal = _confine(Path(src), Path(dst))
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
