"""llama.cpp's library as the process holds it: its log routed to Python's logging, the
backend's one-time start, the error every wrapper raises, where the libraries are on disk,
and the small-tile hook of the patched CPU backend (scripts/llama-patches/0003).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from pathlib import Path
from typing import Any

import llama_cpp.llama_cpp as C

log = logging.getLogger("llmrun.llama")

DEFAULT_SEED = C.LLAMA_DEFAULT_SEED
_backend_lock = threading.Lock()
_backend_ready = False


@C.llama_log_callback
def on_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    # llama.cpp logs a great deal at load time; keep it at debug unless it is a warning/error.
    msg = text.decode("utf-8", "replace").rstrip()
    if msg:
        # ggml levels: 1 debug, 2 info, 3 warn, 4 error, 5 continuation of the previous line
        log.log({3: logging.WARNING, 4: logging.ERROR}.get(level, logging.DEBUG), msg)


def init_backend() -> None:
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            C.llama_log_set(on_log, ctypes.c_void_p(0))
            C.llama_backend_init()
            _backend_ready = True


class LlamaError(RuntimeError):
    pass


# With scripts/llama-patches/0003, a decode may have llama.cpp's CPU flash attention sum from
# this many query rows on in its tiled path (64 otherwise): twice as fast per row as its
# row-by-row path over a long context, in a different order of sums (Context.decode). The
# setting is the calling thread's: graphs other threads compute meanwhile keep the default.
SMALL_TILE_ROWS = 17


def lib_dir() -> Path:
    """Where the libllama in use and its ggml libraries are: llama-cpp-python's package, or
    LLAMA_CPP_LIB_PATH (a llama.cpp build of one's own, as scripts/gpu_check.sh uses)."""
    return Path(getattr(C, "_base_path", Path(C.__file__).parent / "lib"))


def _tiled_rows_setter() -> Any:
    """The patch's setter in the libggml-cpu llama.cpp loaded, or None on a build without it.
    (A wheel holds copies of the library under several names, not links: RTLD_NOLOAD finds
    the one in use, where loading another name would load a second copy.)"""
    base = lib_dir()
    for path in sorted(base.glob("libggml-cpu*")):
        try:
            lib = ctypes.CDLL(str(path), mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue  # not loaded under this name
        fn = getattr(lib, "llmrun_ggml_cpu_set_fa_tiled_min_rows", None)
        if fn is not None:
            fn.argtypes, fn.restype = [ctypes.c_int], None
        return fn
    return None


set_tiled_rows = _tiled_rows_setter()


def small_tiles_available() -> bool:
    return set_tiled_rows is not None


def meta_str(getter: Any, ptr: Any, key: str, size: int) -> str | None:
    """A metadata value as text through one of llama.cpp's `*_meta_val_str` getters,
    retrying with a buffer of the reported length when the first one is too small."""
    buf = ctypes.create_string_buffer(size)
    n = getter(ptr, key.encode(), buf, len(buf))
    if n < 0:
        return None
    if n >= len(buf):
        buf = ctypes.create_string_buffer(n + 1)
        getter(ptr, key.encode(), buf, len(buf))
    return buf.value.decode("utf-8", "replace")
