"""The only module that calls llama-cpp-python's low-level API.

llama-cpp-python is pinned (0.3.36) because these ctypes bindings follow llama.cpp's C API,
which changes between releases; when it does, this file is the one that changes. Everything
here is a thin, typed wrapper: ownership (free on close), buffers and return-code checks.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import llama_cpp.llama_cpp as C
import numpy as np

log = logging.getLogger("llmrun.llama")

DEFAULT_SEED = C.LLAMA_DEFAULT_SEED
_backend_lock = threading.Lock()
_backend_ready = False


@C.llama_log_callback
def _on_log(level: int, text: bytes, _user: ctypes.c_void_p) -> None:
    # llama.cpp logs a great deal at load time; keep it at debug unless it is a warning/error.
    msg = text.decode("utf-8", "replace").rstrip()
    if msg:
        # ggml levels: 1 debug, 2 info, 3 warn, 4 error, 5 continuation of the previous line
        log.log({3: logging.WARNING, 4: logging.ERROR}.get(level, logging.DEBUG), msg)


def init_backend() -> None:
    global _backend_ready
    with _backend_lock:
        if not _backend_ready:
            C.llama_log_set(_on_log, ctypes.c_void_p(0))
            C.llama_backend_init()
            _backend_ready = True


class LlamaError(RuntimeError):
    pass


# With scripts/llama-patches/0003, a decode may have llama.cpp's CPU flash attention sum from
# this many query rows on in its tiled path (64 otherwise): twice as fast per row as its
# row-by-row path over a long context, in a different order of sums (Context.decode). The
# setting is the calling thread's: graphs other threads compute meanwhile keep the default.
SMALL_TILE_ROWS = 17


def _lib_dir() -> Path:
    """Where the libllama in use and its ggml libraries are: llama-cpp-python's package, or
    LLAMA_CPP_LIB_PATH (a llama.cpp build of one's own, as scripts/gpu_check.sh uses)."""
    return Path(getattr(C, "_base_path", Path(C.__file__).parent / "lib"))


def _tiled_rows_setter() -> Any:
    """The patch's setter in the libggml-cpu llama.cpp loaded, or None on a build without it.
    (A wheel holds copies of the library under several names, not links: RTLD_NOLOAD finds
    the one in use, where loading another name would load a second copy.)"""
    base = _lib_dir()
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


_set_tiled_rows = _tiled_rows_setter()


def small_tiles_available() -> bool:
    return _set_tiled_rows is not None


def _meta_str(getter: Any, ptr: Any, key: str, size: int) -> str | None:
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


# -- llama.cpp's RPC backend: a model's layers on other hosts ---------------------------------

_CPU_DEVICE = 0  # enum ggml_backend_dev_type: GGML_BACKEND_DEVICE_TYPE_CPU
_ggml_lib: ctypes.CDLL | None = None


def _ggml() -> ctypes.CDLL:
    """ggml's backend registry and buffers (libggml, beside llama-cpp-python's libllama)."""
    global _ggml_lib
    if _ggml_lib is None:
        # by the name libllama was linked against (its SONAME): another name would load a
        # second copy of ggml, with a registry of its own that llama.cpp never sees
        lib = ctypes.CDLL(str(_lib_dir() / "libggml.so.0"))
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


def _devices_array(names: list[str]) -> Any:
    """A NULL-terminated array of the devices named (llama_model_params.devices)."""
    lib = _dev_lib()
    handles = []
    for name in names:
        dev = lib.ggml_backend_dev_by_name(name.encode())
        if not dev:
            raise LlamaError(f"llama.cpp has no device {name!r}")
        handles.append(dev)
    return (ctypes.c_void_p * (len(handles) + 1))(*handles, None)


def _rpc_proc(name: str, restype: Any, *argtypes: Any) -> Any:
    """A function of llama.cpp's RPC backend (libggml-rpc, there when llama-cpp-python was
    built with GGML_RPC); LlamaError when it is not."""
    init_backend()
    path = _lib_dir() / "libggml-rpc.so.0"  # its SONAME: see _ggml
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


class Model:
    """Weights and vocabulary of one GGUF file."""

    def __init__(self, path: Path | list[Path], n_gpu_layers: int = 0,
                 tensor_split: list[float] | None = None, *, main_gpu: int = 0,
                 devices: list[str] | None = None) -> None:
        """Load one GGUF file, or the parts of a split GGUF in order. `n_gpu_layers`: the
        last layers (the output layer counts as one) placed on devices other than the CPU:
        `devices` (ggml names, in order; default every GPU and RPC worker ggml has), split
        by `tensor_split` (proportions, one per device) or by their free memory; with
        `main_gpu` >= 0 and no split, all of them on that one device."""
        init_backend()
        params = C.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        self.n_gpu_layers = n_gpu_layers
        keep: list[Any] = []  # arrays llama.cpp reads during the load only
        if devices:
            keep.append(_devices_array(devices))
            params.devices = ctypes.cast(keep[-1], ctypes.c_void_p)
        if tensor_split:
            split = (ctypes.c_float * C.LLAMA_MAX_DEVICES)(*tensor_split[:C.LLAMA_MAX_DEVICES])
            keep.append(split)
            params.tensor_split = split
        elif main_gpu >= 0 and devices and n_gpu_layers > 0:
            params.split_mode = C.LLAMA_SPLIT_MODE_NONE  # one device holds them all
            params.main_gpu = main_gpu
        paths = path if isinstance(path, list) else [path]
        if len(paths) == 1:
            ptr = C.llama_model_load_from_file(str(paths[0]).encode(), params)
        else:
            arr = (ctypes.c_char_p * len(paths))(*(str(p).encode() for p in paths))
            ptr = C.llama_model_load_from_splits(arr, len(paths), params)
        if not ptr:
            raise LlamaError(f"llama.cpp could not load {Path(paths[0]).name}")
        self.ptr = ptr
        self.vocab = C.llama_model_get_vocab(ptr)
        self.n_vocab: int = C.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train: int = C.llama_model_n_ctx_train(ptr)
        # sliding-window attention (Gemma 3): most layers see only the last n_swa positions,
        # and a saved sequence state keeps only those: it resumes exactly at its end only
        self.n_swa: int = C.llama_model_n_swa(ptr)
        self.add_bos: bool = bool(C.llama_vocab_get_add_bos(self.vocab))
        self.size: int = C.llama_model_size(ptr)
        self.n_params: int = C.llama_model_n_params(ptr)
        self.n_layer: int = C.llama_model_n_layer(ptr)
        self.n_head: int = C.llama_model_n_head(ptr)
        self.n_embd: int = C.llama_model_n_embd(ptr)
        self._pieces: dict[int, bytes] = {}
        self._piece_buf = ctypes.create_string_buffer(256)

    def meta(self, key: str) -> str | None:
        return _meta_str(C.llama_model_meta_val_str, self.ptr, key, 1 << 16)

    def head_dims(self) -> tuple[int, int]:
        """The width of an attention head's keys and of its values (GGUF's key_length and
        value_length, which most architectures leave at n_embd / n_head)."""
        arch = self.meta("general.architecture")
        default = self.n_embd // max(self.n_head, 1)
        dims = []
        for kind in ("key_length", "value_length"):
            value = self.meta(f"{arch}.attention.{kind}")
            dims.append(int(value) if value and value.isdigit() else default)
        return dims[0], dims[1]

    def chat_template(self) -> str | None:
        raw = C.llama_model_chat_template(self.ptr, None)
        return raw.decode("utf-8", "replace") if raw else None

    def token_text(self, token: int) -> str:
        """The vocabulary's text for a special token (e.g. '<|im_end|>'), for templates."""
        raw = C.llama_vocab_get_text(self.vocab, token)
        return raw.decode("utf-8", "replace") if raw else ""

    @property
    def bos(self) -> int:
        return C.llama_vocab_bos(self.vocab)

    @property
    def eos(self) -> int:
        return C.llama_vocab_eos(self.vocab)

    def fim_tokens(self) -> tuple[int, int, int] | None:
        """(prefix, suffix, middle) tokens for fill-in-the-middle, if the model has them."""
        toks = (C.llama_vocab_fim_pre(self.vocab), C.llama_vocab_fim_suf(self.vocab),
                C.llama_vocab_fim_mid(self.vocab))
        return None if any(t < 0 for t in toks) else toks

    def is_eog(self, token: int) -> bool:
        return bool(C.llama_vocab_is_eog(self.vocab, token))

    def tokenize(self, text: str, add_special: bool, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 8
        buf = (C.llama_token * cap)()
        n = C.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (C.llama_token * cap)()
            n = C.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
            if n < 0:
                raise LlamaError("tokenization failed")
        return list(buf[:n])

    def piece(self, token: int) -> bytes:
        """Bytes of one token as generated text (special tokens render as nothing)."""
        cached = self._pieces.get(token)
        if cached is not None:
            return cached
        buf = self._piece_buf
        n = C.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = C.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, False)
        out = buf.raw[:n]
        self._pieces[token] = out
        return out

    def sampler(self, *, temperature: float, top_k: int, top_p: float, min_p: float,
                typical_p: float, repeat_last_n: int, repeat_penalty: float,
                presence_penalty: float, frequency_penalty: float, seed: int) -> Sampler:
        """A sampler chain over this model's vocabulary (see Sampler)."""
        return Sampler(self, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                       typical_p=typical_p, repeat_last_n=repeat_last_n,
                       repeat_penalty=repeat_penalty, presence_penalty=presence_penalty,
                       frequency_penalty=frequency_penalty, seed=seed)

    def close(self) -> None:
        if self.ptr:
            C.llama_model_free(self.ptr)
            self.ptr = None


class Batch:
    """A reusable llama_batch; each token belongs to one sequence."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.raw = C.llama_batch_init(capacity, 0, 1)
        self._token = self.raw.token
        self._pos = self.raw.pos
        self._n_seq = self.raw.n_seq_id
        self._seq = self.raw.seq_id
        self._logits = self.raw.logits
        self.n = 0

    def clear(self) -> None:
        self.n = 0

    def add(self, token: int, pos: int, seq: int, logits: bool) -> int:
        """Append one token; returns its index (the row of its logits when requested)."""
        i = self.n
        self._token[i] = token
        self._pos[i] = pos
        self._n_seq[i] = 1
        self._seq[i][0] = seq
        self._logits[i] = logits
        self.n = i + 1
        return i

    def rows(self, start: int, stop: int) -> Any:
        """A llama_batch over rows start..stop-1 of this one (no copy: its arrays, offset),
        valid while this batch lives; llama.cpp numbers its rows from 0."""
        view = C.llama_batch()
        view.n_tokens = stop - start
        for name in ("token", "pos", "n_seq_id", "seq_id", "logits"):
            field = getattr(self.raw, name)
            size = ctypes.sizeof(field._type_)
            address = ctypes.cast(field, ctypes.c_void_p).value or 0
            setattr(view, name, ctypes.cast(address + start * size, type(field)))
        return view

    def close(self) -> None:
        if self.raw is not None:
            C.llama_batch_free(self.raw)
            self.raw = None


_TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])


class Sampler:
    """A llama.cpp sampler chain (runs in C; sampling adds no per-token Python work).

    Structured output does not live here: the batcher computes a token mask per constrained
    sequence (engine/constraint.py, llguidance) and samples with `sample_masked`, which runs
    this same chain over the allowed tokens only.
    """

    def __init__(self, model: Model, *, temperature: float, top_k: int, top_p: float,
                 min_p: float, typical_p: float, repeat_last_n: int, repeat_penalty: float,
                 presence_penalty: float, frequency_penalty: float, seed: int) -> None:
        params = C.llama_sampler_chain_default_params()
        params.no_perf = True
        chain = C.llama_sampler_chain_init(params)
        self.ptr = chain
        self.n_vocab = model.n_vocab
        self._cand: np.ndarray | None = None  # candidates buffer, made on first masked use
        add = C.llama_sampler_chain_add
        penalized = repeat_penalty != 1.0 or presence_penalty or frequency_penalty
        # greedy alone: the chain would pick the first highest logit and keep no state, so
        # Context.sample takes the argmax itself (see there)
        self.greedy = temperature <= 0.0 and not penalized
        if penalized:
            last_n = model.n_ctx_train if repeat_last_n == -1 else repeat_last_n
            add(chain, C.llama_sampler_init_penalties(
                model.n_vocab, last_n, repeat_penalty, frequency_penalty, presence_penalty))
        if temperature <= 0.0:
            add(chain, C.llama_sampler_init_greedy())
            return
        if top_k > 0:
            add(chain, C.llama_sampler_init_top_k(top_k))
        if 0.0 < typical_p < 1.0:
            add(chain, C.llama_sampler_init_typical(typical_p, 1))
        if 0.0 < top_p < 1.0:
            add(chain, C.llama_sampler_init_top_p(top_p, 1))
        if min_p > 0.0:
            add(chain, C.llama_sampler_init_min_p(min_p, 1))
        add(chain, C.llama_sampler_init_temp(temperature))
        add(chain, C.llama_sampler_init_dist(DEFAULT_SEED if seed < 0 else seed & 0xFFFFFFFF))

    def accept(self, token: int) -> None:
        """Show the chain a token (the prompt, for penalties)."""
        C.llama_sampler_accept(self.ptr, token)

    def sample_masked(self, logits: np.ndarray, mask: np.ndarray) -> int:
        """Sample from `logits` restricted to the tokens `mask` allows (llguidance's bitmask:
        bit t%32 of int32 word t//32), with this chain; the chain accepts the token.

        The chain runs over the allowed tokens only, as candidates copied out of `logits`
        (llama.cpp's own buffer, which is never written): with few tokens allowed, as inside
        JSON, that is a small array rather than the whole vocabulary, and truncation and
        temperature apply to the constrained distribution. Greedy picks the best allowed
        token, so a constrained greedy run is exactly the unconstrained one while the model
        follows the format."""
        allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[: self.n_vocab]
        ids = np.flatnonzero(allowed)
        if len(ids) == 0:
            raise LlamaError("the grammar allows no token here (the schema cannot be "
                             "completed with this model's vocabulary)")
        if self._cand is None:
            self._cand = np.zeros(self.n_vocab, dtype=_TOKEN_DATA)
        cand = self._cand[: len(ids)]
        cand["id"] = ids
        cand["logit"] = logits[ids]
        cand["p"] = 0.0
        arr = C.llama_token_data_array(
            data=cand.ctypes.data_as(C.llama_token_data_p), size=len(cand), selected=-1,
            sorted=False)
        C.llama_sampler_apply(self.ptr, ctypes.byref(arr))
        token = int(cand["id"][arr.selected])
        C.llama_sampler_accept(self.ptr, token)
        return token

    def close(self) -> None:
        if self.ptr:
            C.llama_sampler_free(self.ptr)
            self.ptr = None


# KV cache element types (llama.cpp's ggml types); a quantized V cache needs flash attention.
KV_TYPES = {"f16": C.GGML_TYPE_F16, "q8_0": C.GGML_TYPE_Q8_0, "q4_0": C.GGML_TYPE_Q4_0}


class Context:
    """A llama context holding the KV cache for `n_seq` sequences of up to `n_ctx_seq` each."""

    def __init__(self, model: Model, *, n_ctx_seq: int, n_seq: int, n_batch: int,
                 n_threads: int, flash_attn: bool | None = None,
                 embeddings: bool = False, kv_type: str = "f16") -> None:
        params = C.llama_context_default_params()
        # One KV stream per sequence, n_ctx_seq cells each (so every request gets its whole
        # num_ctx, as in Ollama). Not a unified pool: there a sequence's cells land wherever
        # others left room, which changes the summation order inside attention, and on a
        # quantized model that shifts logits by up to ~0.8 (measured on SmolLM2 Q4_1), so
        # greedy output would depend on who else is being served. Separate streams make a
        # sequence's logits bit-identical alone or batched (tests/test_engine.py) with one
        # thread or under 257 cells of context; past that, with several threads, llama.cpp
        # splits a lone query's attention over the threads (one stream in the batch) and not
        # a batch's, so the last bits differ (docs/benchmarks.md, speculative decoding).
        params.n_ctx = n_ctx_seq * n_seq
        params.n_seq_max = n_seq
        params.n_batch = n_batch
        params.n_ubatch = min(n_batch, 512)
        params.n_threads = n_threads
        params.n_threads_batch = n_threads
        params.kv_unified = False
        params.no_perf = True
        # llama.cpp sends a large batch's matrix products to a GPU even for weights kept on
        # the CPU (op_offload): a model asked to stay off the GPU (num_gpu 0) read its prompts
        # there anyway (measured on lavapipe: the prompt's numbers were the GPU's to the bit)
        params.op_offload = model.n_gpu_layers > 0
        if kv_type not in KV_TYPES:
            raise LlamaError(f"unknown KV cache type {kv_type!r}; accepted: {', '.join(KV_TYPES)}")
        params.type_k = params.type_v = KV_TYPES[kv_type]
        if embeddings:
            # One pooled vector per sequence. Generative models declare no pooling; mean
            # pooling is what a caller of /api/embed expects from them.
            params.embeddings = True
            params.n_ubatch = n_batch  # a whole input must fit one ubatch for pooling
            pooling = model.meta(f"{model.meta('general.architecture')}.pooling_type")
            if pooling is None or pooling == "0":
                params.pooling_type = C.LLAMA_POOLING_TYPE_MEAN
        params.flash_attn_type = {
            None: C.LLAMA_FLASH_ATTN_TYPE_AUTO,
            True: C.LLAMA_FLASH_ATTN_TYPE_ENABLED,
            False: C.LLAMA_FLASH_ATTN_TYPE_DISABLED,
        }[flash_attn]
        self.flash_attn = flash_attn  # None: llama.cpp's choice (on, on the CPU)
        ptr = C.llama_init_from_model(model.ptr, params)
        if not ptr:
            raise LlamaError("llama.cpp could not create a context (out of memory?)")
        self.ptr = ptr
        self.model = model
        self.n_ctx = C.llama_n_ctx(ptr)
        self.n_batch = C.llama_n_batch(ptr)
        self.n_ubatch = C.llama_n_ubatch(ptr)
        self.memory = C.llama_get_memory(ptr)
        self._logits_row = ctypes.c_float * model.n_vocab  # one row of logits, as ctypes sees it

    def decode(self, batch: Batch | EmbdBatch, causal: bool = True,
               small_tiles: bool = False, rows: tuple[int, int] | None = None) -> int:
        """0 on success; 1 when no KV slot was found; negative on error. `causal` False:
        the rows attend to each other both ways (an image, for some projectors).
        `small_tiles`: flash attention sums a sequence's rows in its tiled path from
        SMALL_TILE_ROWS on (where the build allows it), so a short prompt chunk reads about
        as fast per token as a long one; its numbers then differ in the last bits from those
        of the same rows in a ubatch under 64 without it. `rows` (start, stop): decode only
        those rows of a token batch; their logits are then rows 0.. of this decode."""
        batch.raw.n_tokens = batch.n
        raw = batch.raw if rows is None else batch.rows(*rows)  # type: ignore[union-attr]
        tiles = small_tiles and _set_tiled_rows is not None
        if tiles:
            _set_tiled_rows(SMALL_TILE_ROWS)
        if not causal:
            C.llama_set_causal_attn(self.ptr, False)
        try:
            return C.llama_decode(self.ptr, raw)
        finally:
            if not causal:
                C.llama_set_causal_attn(self.ptr, True)
            if tiles:
                _set_tiled_rows(0)

    def set_threads(self, n_threads: int) -> None:
        """Decode (and prefill) with `n_threads` threads from the next decode on."""
        C.llama_set_n_threads(self.ptr, n_threads, n_threads)

    def sample(self, sampler: Sampler, index: int, mask: np.ndarray | None = None) -> int:
        """Sample from the logits of batch row `index`, among the tokens `mask` allows when
        one is given (structured output); the sampler accepts the token."""
        if mask is not None:
            return sampler.sample_masked(self.logits(index), mask)
        if sampler.greedy:
            # The same token as the chain's (the first highest logit; greedy keeps no state
            # to accept it into), without llama_sampler_sample's candidates array of the
            # whole vocabulary: 35 against 5 us here, and up to 100 us right after a
            # decode, when that array is cold in the cache (on every token of a greedy
            # stream, the engine thread's largest Python-side cost but the decode). numpy
            # stops at a NaN where the chain skips it: then the chain decides.
            row = self.logits(index)
            token = int(row.argmax())
            if not np.isnan(row[token]):
                return token
        return C.llama_sampler_sample(sampler.ptr, self.ptr, index)

    def logits(self, index: int) -> np.ndarray:
        """Zero-copy view of the logits of batch row `index` (valid until the next decode)."""
        ptr = C.llama_get_logits_ith(self.ptr, index)
        if not ptr:
            raise LlamaError(f"no logits for batch row {index}")
        row = self._logits_row.from_address(ctypes.addressof(ptr.contents))
        # (a ctypes array is a buffer; numpy's stubs name only the builtin buffer types)
        return np.frombuffer(row, dtype=np.float32)  # type: ignore[call-overload]

    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> bool:
        return bool(C.llama_memory_seq_rm(self.memory, seq, p0, p1))

    def shift(self, seq: int, keep: int, discard: int) -> bool:
        """Drop positions keep..keep+discard-1 of `seq` and move the later ones back by
        `discard` (llama.cpp re-rotates their keys); False when this memory cannot shift."""
        if not C.llama_memory_can_shift(self.memory):
            return False
        if not self.seq_rm(seq, keep, keep + discard):
            return False
        C.llama_memory_seq_add(self.memory, seq, keep + discard, -1, -discard)
        return True

    def embedding(self, seq: int) -> np.ndarray:
        """The pooled embedding of sequence `seq` after a decode (a copy)."""
        ptr = C.llama_get_embeddings_seq(self.ptr, seq)
        if not ptr:
            raise LlamaError("this context produced no pooled embedding")
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_embd,)).copy()

    def state_seq_get(self, seq: int) -> bytearray:
        """The state of sequence `seq` (its K/V cells with their positions) as bytes that
        state_seq_set can load into any sequence of a context like this one."""
        size = C.llama_state_seq_get_size(self.ptr, seq)
        data = bytearray(size)
        if size:
            n = C.llama_state_seq_get_data(
                self.ptr, (ctypes.c_uint8 * size).from_buffer(data), size, seq)
            if n != size:
                raise LlamaError(f"llama.cpp wrote {n} of {size} bytes of a sequence state")
        return data

    def state_seq_set(self, seq: int, data: bytearray) -> bool:
        """Load a state from state_seq_get into sequence `seq`, which must be empty; False
        when llama.cpp refuses it (another model or layout, damaged), the sequence then
        empty."""
        if not data:
            return False
        n = C.llama_state_seq_set_data(
            self.ptr, (ctypes.c_uint8 * len(data)).from_buffer(data), len(data), seq)
        if n != len(data):
            self.seq_rm(seq, -1, -1)
            return False
        return True

    def seq_pos_max(self, seq: int) -> int:
        """Largest position held for `seq`, -1 when it holds none."""
        return C.llama_memory_seq_pos_max(self.memory, seq)

    def set_loras(self, adapters: list[LoraAdapter], scales: list[float]) -> None:
        """Apply LoRA `adapters` (each scaled by its entry in `scales`; 0 disables one) to every
        later decode; an empty list removes them. KV cells written before stay as they were."""
        if len(adapters) != len(scales):
            raise ValueError("set_loras needs one scale per adapter")
        for a in adapters:
            if not a.ptr or a.model is not self.model:
                raise LlamaError(f"LoRA adapter {a.path} is closed or belongs to another model")
        n = len(adapters)
        arr = (C.llama_adapter_lora_p_ctypes * n)(*(a.ptr for a in adapters)) if n else None
        factors = (ctypes.c_float * n)(*scales) if n else None
        rc = C.llama_set_adapters_lora(self.ptr, arr, n, factors)
        if rc != 0:
            raise LlamaError(f"llama.cpp could not apply the LoRA adapters (error {rc})")
        self.loras = list(adapters)  # the context uses them until the next set_loras

    def close(self) -> None:
        if self.ptr:
            C.llama_free(self.ptr)
            self.ptr = None


# Quantization types quantize_file accepts: llama.cpp's llama_ftype for each. Not the IQ* and
# Q2_K_S types: llama.cpp refuses those without an importance matrix.
QUANT_FTYPES: dict[str, int] = {
    "Q4_0": C.LLAMA_FTYPE_MOSTLY_Q4_0,
    "Q4_1": C.LLAMA_FTYPE_MOSTLY_Q4_1,
    "Q5_0": C.LLAMA_FTYPE_MOSTLY_Q5_0,
    "Q5_1": C.LLAMA_FTYPE_MOSTLY_Q5_1,
    "Q8_0": C.LLAMA_FTYPE_MOSTLY_Q8_0,
    "Q2_K": C.LLAMA_FTYPE_MOSTLY_Q2_K,
    "Q3_K_S": C.LLAMA_FTYPE_MOSTLY_Q3_K_S,
    "Q3_K_M": C.LLAMA_FTYPE_MOSTLY_Q3_K_M,
    "Q3_K_L": C.LLAMA_FTYPE_MOSTLY_Q3_K_L,
    "Q4_K_S": C.LLAMA_FTYPE_MOSTLY_Q4_K_S,
    "Q4_K_M": C.LLAMA_FTYPE_MOSTLY_Q4_K_M,
    "Q5_K_S": C.LLAMA_FTYPE_MOSTLY_Q5_K_S,
    "Q5_K_M": C.LLAMA_FTYPE_MOSTLY_Q5_K_M,
    "Q6_K": C.LLAMA_FTYPE_MOSTLY_Q6_K,
    "F16": C.LLAMA_FTYPE_MOSTLY_F16,
    "BF16": C.LLAMA_FTYPE_MOSTLY_BF16,
}


def quantize_file(src: Path, dst: Path, ftype: str, n_threads: int = 0) -> None:
    """Quantize the GGUF model `src` to `ftype` (a QUANT_FTYPES name, any case) into `dst`.

    Blocks until done, with no progress reports (llama.cpp has no callback for it) and no way
    to interrupt it; llama.cpp may also abort() the process on a malformed model. Callers run
    it in a child process (llmrun.store.quantize). Already-quantized tensors are refused
    (allow_requantize stays off). `n_threads` <= 0 uses every core.
    """
    name = ftype.strip().upper()
    if name not in QUANT_FTYPES:
        raise LlamaError(f"unknown quantization type {ftype!r}; "
                         f"accepted: {', '.join(QUANT_FTYPES)}")
    init_backend()
    params = C.llama_model_quantize_default_params()
    params.ftype = QUANT_FTYPES[name]
    params.nthread = n_threads
    rc = C.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params))
    if rc != 0:
        raise LlamaError(f"llama.cpp could not quantize {src} to {name} (error {rc}; "
                         "its log says why)")


class _ErrorLog(logging.Handler):
    """Collects llama.cpp's error lines (they arrive through _on_log) while it is attached."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        head, sep, rest = msg.partition(": ")
        self.lines.append(rest if sep and head.isidentifier() else msg)  # drop "func: "


class LoraAdapter:
    """A LoRA adapter GGUF (general.type `adapter`) loaded for `model`; Context.set_loras
    applies it. llama.cpp also frees an adapter with its model, so close() it before the
    model's close() (afterwards close() only forgets the pointer)."""

    def __init__(self, model: Model, path: Path) -> None:
        init_backend()
        if not model.ptr:
            raise LlamaError(f"cannot load LoRA adapter {Path(path).name}: the model is closed")
        if not Path(path).is_file():
            raise LlamaError(f"LoRA adapter {Path(path).name}: no such file")
        errors = _ErrorLog()
        log.addHandler(errors)
        try:
            ptr = C.llama_adapter_lora_init(model.ptr, str(path).encode())
        finally:
            log.removeHandler(errors)
        if not ptr:
            why = "; ".join(errors.lines) or "see the log"
            raise LlamaError(f"llama.cpp could not load the LoRA adapter {Path(path).name}: "
                             f"{why}")
        self.ptr = ptr
        self.model = model
        self.path = path

    def meta(self, key: str) -> str | None:
        """A metadata value of the adapter GGUF as text (e.g. `adapter.lora.alpha`)."""
        return _meta_str(C.llama_adapter_meta_val_str, self.ptr, key, 1 << 12)

    def close(self) -> None:
        if self.ptr:
            if self.model.ptr:  # else llama_model_free already freed it
                C.llama_adapter_lora_free(self.ptr)
            self.ptr = None


# -- vision: llama.cpp's multimodal library (libmtmd) -------------------------------------------


class ImageChunk:
    """One image of a prompt, preprocessed for its projector and not yet encoded: the
    positions it takes in the sequence and the content hash that names it."""

    def __init__(self, handle: Any, n_tokens: int, digest: str) -> None:
        from llama_cpp import mtmd_cpp as M

        self._free = M.mtmd_input_chunk_free
        self.handle = handle  # an owned mtmd_input_chunk (a copy)
        self.n_tokens = n_tokens
        self.digest = digest

    def __del__(self) -> None:
        # owned by whichever prompt still holds it (a request may end anywhere on its way)
        if self.handle:
            self._free(self.handle)
            self.handle = None


class Projector:
    """A vision projector (an mmproj GGUF, architecture `clip`) beside a text model: images
    in a prompt become chunks of positions, and each chunk embeddings for them.

    Every call into libmtmd holds one lock: a prompt is tokenized on the runner's message
    thread while an image may be encoding on the engine's encoder thread, and the library
    keeps its last output in the context."""

    def __init__(self, path: Path, model: Model, n_threads: int) -> None:
        from llama_cpp import mtmd_cpp as M

        self._m = M
        init_backend()
        # the library logs on its own channel (every tensor of the projector at load)
        M.mtmd_log_set(_on_log, ctypes.c_void_p(0))
        M.mtmd_helper_log_set(_on_log, ctypes.c_void_p(0))
        params = M.mtmd_context_params_default()
        params.use_gpu = False
        params.print_timings = False
        params.warmup = False
        params.n_threads = n_threads
        # a marker no client can write: the template's text is split at it, and nothing a
        # message says can stand for an image it did not send
        self.marker = f"<__llmrun_image_{os.urandom(12).hex()}__>"
        self._marker_bytes = self.marker.encode()  # kept alive while the context lives
        params.media_marker = self._marker_bytes
        ptr = M.mtmd_init_from_file(str(path).encode(), model.ptr, params)
        if not ptr:
            raise LlamaError(f"llama.cpp could not load the vision projector {path.name} for "
                             f"this model (not a projector, or made for another model: its "
                             f"width must match the model's)")
        self.ptr = ptr
        if not M.mtmd_support_vision(ptr):
            self.close()
            raise LlamaError(f"{path.name} is a projector without vision (audio only)")
        if M.mtmd_decode_use_mrope(ptr):
            # M-RoPE (Qwen2-VL) gives an image's rows 2-D positions, and later text positions
            # that are not the row count: the engine's one-position-per-row bookkeeping
            # cannot hold that yet
            self.close()
            raise LlamaError(f"{path.name}: projectors with M-RoPE positions (Qwen2-VL "
                             f"family) are not supported yet")
        # Gemma 3 attends over an image's rows in both directions: they go in one decode
        self.non_causal = bool(M.mtmd_decode_use_non_causal(ptr, None))  # (None: vision)
        self.n_embd: int = model.n_embd
        self._lock = threading.Lock()

    def tokenize(self, text: str, images: list[tuple[int, int, bytes, str]],
                 add_special: bool) -> list[list[int] | ImageChunk]:
        """`text` with one `marker` per image, in order, as text tokens and image chunks;
        `images` are (width, height, RGB bytes, content hash)."""
        M = self._m
        bitmaps = []
        chunks = M.mtmd_input_chunks_init()
        try:
            for width, height, rgb, digest in images:
                data = (ctypes.c_uint8 * len(rgb)).from_buffer_copy(rgb)
                bitmap = M.mtmd_bitmap_init(width, height, data)
                if not bitmap:
                    raise LlamaError("llama.cpp could not take an image")
                bitmaps.append(bitmap)
                M.mtmd_bitmap_set_id(bitmap, digest.encode())
            raw = text.encode()
            inp = M.mtmd_input_text(raw, len(raw), add_special, True)
            arr = (M.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            with self._lock:
                rc = M.mtmd_tokenize(self.ptr, chunks, ctypes.byref(inp), arr, len(bitmaps))
            if rc != 0:
                raise ValueError({1: "the prompt's images and their places do not match",
                                  2: "an image could not be preprocessed for this projector"}
                                 .get(rc, f"images could not be read (mtmd error {rc})"))
            parts = [M.mtmd_input_chunks_get(chunks, i)
                     for i in range(M.mtmd_input_chunks_size(chunks))]
            kinds = [M.mtmd_input_chunk_get_type(chunk) for chunk in parts]
            # Projectors that slice a large image (LLaVA-UHD, SmolVLM) give it several
            # chunks: each is named by the image's hash and its place among the image's
            # chunks (the same image twice in a prompt: the same names twice)
            sent = Counter(digest for *_, digest in images)
            total = Counter((M.mtmd_input_chunk_get_id(chunk) or b"").decode()
                            for chunk, kind in zip(parts, kinds, strict=True)
                            if kind == M.MTMD_INPUT_CHUNK_TYPE_IMAGE)
            seen: Counter[str] = Counter()
            out: list[list[int] | ImageChunk] = []
            for chunk, kind in zip(parts, kinds, strict=True):
                if kind == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    n = ctypes.c_size_t(0)
                    toks = M.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                    out.append(list(toks[: n.value]) if n.value else [])
                elif kind == M.MTMD_INPUT_CHUNK_TYPE_IMAGE:
                    n_tokens = M.mtmd_input_chunk_get_n_tokens(chunk)
                    if M.mtmd_input_chunk_get_n_pos(chunk) != n_tokens:
                        raise LlamaError("an image chunk whose positions differ from its rows")
                    image = (M.mtmd_input_chunk_get_id(chunk) or b"").decode()
                    k = seen[image] % max(1, total[image] // max(1, sent[image]))
                    seen[image] += 1
                    out.append(ImageChunk(M.mtmd_input_chunk_copy(chunk), n_tokens,
                                          f"{image}.{k}"))
                else:
                    raise ValueError("audio input is not supported")
            return out
        finally:
            for bitmap in bitmaps:
                M.mtmd_bitmap_free(bitmap)
            M.mtmd_input_chunks_free(chunks)

    def encode(self, chunk: ImageChunk) -> np.ndarray:
        """The embeddings of an image chunk: one row of the model's width per position (a
        copy). Runs the vision encoder: the slow part, kept off the engine's thread."""
        M = self._m
        with self._lock:
            rc = M.mtmd_encode_chunk(self.ptr, chunk.handle)
            if rc != 0:
                raise LlamaError(f"the vision encoder failed (error {rc})")
            ptr = M.mtmd_get_output_embd(self.ptr)
            return np.ctypeslib.as_array(ptr, shape=(chunk.n_tokens, self.n_embd)).copy()

    def close(self) -> None:
        if self.ptr:
            self._m.mtmd_free(self.ptr)
            self.ptr = None


class EmbdBatch:
    """A reusable llama_batch of embedding rows (an image's), all of one sequence."""

    def __init__(self, capacity: int, n_embd: int) -> None:
        self.capacity = capacity
        self.raw = C.llama_batch_init(capacity, n_embd, 1)
        self._embd = np.ctypeslib.as_array(self.raw.embd, shape=(capacity, n_embd))
        self.n = 0

    def fill(self, rows: np.ndarray, pos: int, seq: int) -> None:
        """Rows at positions pos, pos+1, ... of `seq` (no logits: text always follows)."""
        n = len(rows)
        self._embd[:n] = rows
        for i in range(n):
            self.raw.pos[i] = pos + i
            self.raw.n_seq_id[i] = 1
            self.raw.seq_id[i][0] = seq
            self.raw.logits[i] = False
        self.n = n

    def close(self) -> None:
        if self.raw is not None:
            C.llama_batch_free(self.raw)
            self.raw = None
