"""ggml's devices and llama.cpp's RPC backend: what a model's layers may be placed on, here
or on other hosts. llama-cpp-python 0.3.36 binds none of ggml's device functions, so they are
typed here over libggml (and libggml-rpc) through ctypes.
"""

from __future__ import annotations

import ctypes
from typing import Any

from llmrun.engine.llama.lib import LlamaError, init_backend, lib_dir

# -- libggml: ggml's backend registry, typed on first use ------------------------------------

_CPU_DEVICE = 0  # enum ggml_backend_dev_type: GGML_BACKEND_DEVICE_TYPE_CPU
_ggml_lib: ctypes.CDLL | None = None


def _ggml() -> ctypes.CDLL:
    """ggml's backend registry and buffers (libggml, beside llama-cpp-python's libllama)."""
    global _ggml_lib
    if _ggml_lib is None:
        # by the name libllama was linked against (its SONAME): another name would load a
        # second copy of ggml, with a registry of its own that llama.cpp never sees
        lib = ctypes.CDLL(str(lib_dir() / "libggml.so.0"))
        for name, res, args in (
                ("ggml_backend_register", None, [ctypes.c_void_p]),
                ("ggml_backend_dev_by_type", ctypes.c_void_p, [ctypes.c_int]),
                ("ggml_backend_buft_alloc_buffer", ctypes.c_void_p,
                 [ctypes.c_void_p, ctypes.c_size_t])):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        _ggml_lib = lib
    return _ggml_lib


# -- ggml's devices: what a model's layers may be placed on -----------------------------------

# enum ggml_backend_dev_type, in its order (ggml-backend.h)
DEVICE_TYPES = ("cpu", "gpu", "igpu", "accel", "meta")
_dev_bound = False


def _dev_lib() -> ctypes.CDLL:
    """libggml with ggml's device functions typed. llama-cpp-python 0.3.36 binds none of
    them; ggml_backend_dev_name and the others live in libggml-base, which libggml links,
    so its handle resolves them too."""
    global _dev_bound
    lib = _ggml()
    if not _dev_bound:
        dev, size_p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)
        for name, res, args in (
                ("ggml_backend_dev_count", ctypes.c_size_t, []),
                ("ggml_backend_dev_get", dev, [ctypes.c_size_t]),
                ("ggml_backend_dev_by_name", dev, [ctypes.c_char_p]),
                ("ggml_backend_dev_name", ctypes.c_char_p, [dev]),
                ("ggml_backend_dev_description", ctypes.c_char_p, [dev]),
                ("ggml_backend_dev_type", ctypes.c_int, [dev]),
                ("ggml_backend_dev_memory", None, [dev, size_p, size_p]),
                ("ggml_backend_reg_count", ctypes.c_size_t, []),
                ("ggml_backend_reg_get", ctypes.c_void_p, [ctypes.c_size_t]),
                ("ggml_backend_reg_name", ctypes.c_char_p, [ctypes.c_void_p]),
                ("ggml_backend_reg_dev_count", ctypes.c_size_t, [ctypes.c_void_p])):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = res, args
        _dev_bound = True
    return lib


def list_devices() -> list[dict[str, Any]]:
    """The devices ggml registered (its backends', and RPC workers' once RpcWorkers added
    them), in its order: name, description, type (DEVICE_TYPES), total and free bytes."""
    init_backend()
    lib = _dev_lib()
    out = []
    for i in range(lib.ggml_backend_dev_count()):
        dev = lib.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        lib.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        kind = lib.ggml_backend_dev_type(dev)
        out.append({"name": (lib.ggml_backend_dev_name(dev) or b"").decode(errors="replace"),
                    "description": (lib.ggml_backend_dev_description(dev) or b"")
                    .decode(errors="replace"),
                    "type": DEVICE_TYPES[kind] if 0 <= kind < len(DEVICE_TYPES) else "other",
                    "total": total.value, "free": free.value})
    return out


def list_backends() -> dict[str, int]:
    """The backends this llama.cpp was built with (CPU, CUDA, Vulkan, RPC...) and how many
    devices each found: a GPU backend with none is a build whose GPU or driver is missing."""
    init_backend()
    lib = _dev_lib()
    regs = (lib.ggml_backend_reg_get(i) for i in range(lib.ggml_backend_reg_count()))
    return {(lib.ggml_backend_reg_name(r) or b"").decode(errors="replace"):
            lib.ggml_backend_reg_dev_count(r) for r in regs}


def devices_array(names: list[str]) -> Any:
    """A NULL-terminated array of the devices named (llama_model_params.devices)."""
    lib = _dev_lib()
    handles = []
    for name in names:
        dev = lib.ggml_backend_dev_by_name(name.encode())
        if not dev:
            raise LlamaError(f"llama.cpp has no device {name!r}")
        handles.append(dev)
    return (ctypes.c_void_p * (len(handles) + 1))(*handles, None)


# -- llama.cpp's RPC backend: a model's layers on other hosts ---------------------------------


def _rpc_proc(name: str, restype: Any, *argtypes: Any) -> Any:
    """A function of llama.cpp's RPC backend (libggml-rpc, there when llama-cpp-python was
    built with GGML_RPC); LlamaError when it is not."""
    init_backend()
    path = lib_dir() / "libggml-rpc.so.0"  # its SONAME: see _ggml
    try:
        fn = getattr(ctypes.CDLL(str(path)), name)
    except (OSError, AttributeError):
        raise LlamaError("this llama-cpp-python was built without llama.cpp's RPC backend "
                         "(reinstall with scripts/llama-wheel.sh, which turns on GGML_RPC)") \
            from None
    fn.restype, fn.argtypes = restype, list(argtypes)
    return fn


def rpc_serve(endpoint: str, n_threads: int) -> None:
    """Serve this machine's CPU to other hosts' runners as an RPC device, at `endpoint`
    (host:port); blocks for good (the process is stopped by a signal)."""
    start = _rpc_proc("ggml_backend_rpc_start_server", None, ctypes.c_char_p, ctypes.c_char_p,
                      ctypes.c_size_t, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p))
    cpu = _ggml().ggml_backend_dev_by_type(_CPU_DEVICE)
    if not cpu:
        raise LlamaError("llama.cpp found no CPU device to serve")
    start(endpoint.encode(), None, n_threads, 1, (ctypes.c_void_p * 1)(cpu))


class RpcWorkers:
    """RPC workers whose devices this process's models may use: each registered with ggml
    (so a model loaded with n_gpu_layers places layers on them, split by their free memory
    unless `tensor_split` says otherwise), and each held by one small buffer, whose connection
    stays open: a confined runner may open no new socket, so every connection is made here,
    before the sandbox."""

    def __init__(self, endpoints: list[str]) -> None:
        add = _rpc_proc("ggml_backend_rpc_add_server", ctypes.c_void_p, ctypes.c_char_p)
        buft = _rpc_proc("ggml_backend_rpc_buffer_type", ctypes.c_void_p, ctypes.c_char_p,
                         ctypes.c_uint32)
        memory = _rpc_proc("ggml_backend_rpc_get_device_memory", None, ctypes.c_char_p,
                           ctypes.c_uint32, ctypes.POINTER(ctypes.c_size_t),
                           ctypes.POINTER(ctypes.c_size_t))
        lib = _ggml()
        self.endpoints = endpoints
        self.memory: list[tuple[int, int]] = []  # (free, total) bytes of each
        self._pins: list[int] = []
        for endpoint in endpoints:
            reg = add(endpoint.encode())
            if not reg:
                raise LlamaError(f"RPC worker {endpoint}: llama.cpp could not add it")
            lib.ggml_backend_register(reg)
            pin = lib.ggml_backend_buft_alloc_buffer(buft(endpoint.encode(), 0), 64)
            if not pin:
                raise LlamaError(f"RPC worker {endpoint}: could not allocate on it")
            self._pins.append(pin)
            free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
            memory(endpoint.encode(), 0, ctypes.byref(free), ctypes.byref(total))
            self.memory.append((free.value, total.value))
