"""Quantize an F32/F16/BF16 GGUF model (to Q4_K_M, Q8_0, ...) with llama.cpp.

The work happens in a child process (`python -m llmrun.engine.quantizer SRC DST TYPE`), not in
the caller, because llama.cpp's llama_model_quantize is one long blocking C call:

* it cannot be interrupted: Python delivers Ctrl-C or a cancelled request only after it
  returns, possibly minutes later, whereas a child process can be killed at any moment;
* llama.cpp reports many problems with GGML_ASSERT, i.e. abort(): in the daemon's process that
  would take the whole server down, in a child it is an error message with the log's tail;
* its log goes to the child's stderr, which is where the reason for a failure is found.

The result is written to a temporary file in the caller's directory (the store's blob
directory, so importing it is a rename); on any failure no temporary file is left behind.
"""

from __future__ import annotations

import collections
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from llmrun import childenv, config
from llmrun.store import gguf

log = logging.getLogger("llmrun.quantize")

# The types llmrun offers: llama.cpp's legacy and K-quants (the IQ* types need an importance
# matrix, which llmrun does not compute), plus F16/BF16. Must match
# llmrun.engine.llama.QUANT_FTYPES (a test checks it; this module does not import the engine so
# that validation in the daemon does not load llama.cpp).
QUANT_TYPES: tuple[str, ...] = (
    "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K",
    "F16", "BF16",
)
SOURCE_TYPES = ("F32", "F16", "BF16")  # the only tensor types we quantize from
TAIL_LINES = 20  # lines of the child's log quoted in an error

# llama.cpp logs "[   3/ 291]   blk.0.attn_k.weight - [...], type = f16, " before each tensor
_PROGRESS = re.compile(r"^\[\s*(\d+)/\s*(\d+)\]")

Progress = Callable[[int, int], None]  # (tensor being quantized, 1-based; tensor count)


class QuantizeError(ValueError):
    """The model cannot be quantized (wrong input, unknown type, or llama.cpp failed)."""


def normalize_type(qtype: str) -> str:
    """The canonical name of `qtype` ('q4_k_m' -> 'Q4_K_M'); QuantizeError if not offered."""
    name = qtype.strip().upper()
    if name not in QUANT_TYPES:
        raise QuantizeError(
            f"unknown quantization type {qtype!r}; accepted types: {', '.join(QUANT_TYPES)}"
        )
    return name


def source_quantization(info: gguf.GGUFInfo) -> str | None:
    """None when `info` is an unquantized (F32/F16/BF16) model, else its quantization's name.

    Looks at both general.file_type and the matrices' tensor types (1-D tensors such as norms
    stay F32 in every quantization, so they tell nothing)."""
    declared = info.quantization
    if declared not in (*SOURCE_TYPES, "unknown"):
        return declared
    quantized = [gguf.GGML_TYPES[t.type][0] for t in info.tensors
                 if len(t.shape) >= 2 and gguf.GGML_TYPES[t.type][0] not in SOURCE_TYPES]
    if quantized:  # file_type missing or wrong: name the tensors' most common type
        return collections.Counter(quantized).most_common(1)[0][0]
    return None


def check_source(src: Path) -> gguf.GGUFInfo:
    """Validate that `src` is a GGUF model llmrun can quantize; return its header."""
    try:
        info = gguf.read(src)
    except gguf.GGUFError as exc:
        raise QuantizeError(f"cannot quantize {src.name}: {exc}") from exc
    current = source_quantization(info)
    if current is not None:
        raise QuantizeError(
            f"{src.name} is already quantized ({current}); quantizing it again would lose "
            f"quality: start from an {', '.join(SOURCE_TYPES[:-1])} or {SOURCE_TYPES[-1]} model"
        )
    return info


def quantize(src: Path, qtype: str, out_dir: Path, *, n_threads: int = 0,
             progress: Progress | None = None,
             cancel: threading.Event | None = None) -> Path:
    """Quantize the GGUF model `src` to `qtype` (a QUANT_TYPES name, any case).

    Returns the path of the result, a temporary file inside `out_dir` that the caller now owns
    (imports as a blob, then removes). Raises QuantizeError, leaving nothing in `out_dir`, on an
    unknown type, an input that is not an F32/F16/BF16 GGUF model, a llama.cpp failure or crash
    (the message quotes the end of its log), or when `cancel` is set (the child is killed).
    `progress(i, n)` is called, from a helper thread, as llama.cpp starts on tensor i of n.
    `n_threads` <= 0 lets llama.cpp use every core.
    """
    name = normalize_type(qtype)
    check_source(src)
    out_dir.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=".quantize-", suffix=".gguf.partial", dir=out_dir)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        _run_child(src, tmp, name, n_threads, progress, cancel)
        try:
            gguf.read(tmp)
        except gguf.GGUFError as exc:
            raise QuantizeError(f"llama.cpp wrote an invalid model: {exc}") from exc
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def _run_child(src: Path, dst: Path, name: str, n_threads: int, progress: Progress | None,
               cancel: threading.Event | None) -> None:
    cmd = [sys.executable, "-m", "llmrun.engine.quantizer", str(src), str(dst), name,
           str(n_threads)]
    # GGML_NO_BACKTRACE: on abort ggml would otherwise attach gdb to print a backtrace.
    # The child parses an uploaded file: it gets no credential from our environment, and
    # confines itself (LLMRUN_SANDBOX, resolved here) before reading it.
    env = childenv.scrubbed({"GGML_NO_BACKTRACE": "1", "PYTHONDONTWRITEBYTECODE": "1",
                             "LLMRUN_SANDBOX": config.sandbox_mode()})
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    try:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env, text=True, errors="replace")
    except OSError as exc:
        raise QuantizeError(f"cannot start the quantizer ({sys.executable}): {exc}") from exc

    def read_log() -> None:
        # Must drain the pipe to the end whatever happens, or the child blocks writing to it.
        report = progress
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip()
            if not line:
                continue
            tail.append(line)
            m = _PROGRESS.match(line)
            if m and report is not None:
                try:
                    report(int(m.group(1)), int(m.group(2)))
                except Exception:
                    log.exception("quantize progress callback failed; no more progress reports")
                    report = None

    reader = threading.Thread(target=read_log, name="quantize-log", daemon=True)
    reader.start()
    cancelled = False
    try:
        while True:
            try:
                rc = proc.wait(timeout=0.1 if cancel is not None else None)
                break
            except subprocess.TimeoutExpired:
                if cancel is not None and cancel.is_set():
                    cancelled = True
                    proc.kill()
    finally:
        if proc.poll() is None:  # interrupted (KeyboardInterrupt, ...): take the child along
            proc.kill()
            proc.wait()
        reader.join(5)
    if cancelled:
        raise QuantizeError(f"quantizing {src.name} to {name} was cancelled")
    if rc != 0:
        if rc == -signal.SIGKILL:
            why = "the quantizer was killed (out of memory?)"
        elif rc < 0:
            try:
                why = f"llama.cpp crashed ({signal.Signals(-rc).name})"
            except ValueError:
                why = f"llama.cpp crashed (signal {-rc})"
        else:
            why = f"the quantizer exited with status {rc}"
        text = "\n".join(tail)
        raise QuantizeError(f"quantizing {src.name} to {name} failed: {why}"
                            + (f"\n{text}" if text else ""))
