"""The daemon's check of a prompt-cache state file before a runner other than its writer
may read it (the files themselves: engine/promptcache.py; their directories:
server/promptdirs.py).

A runner writes the files of its prompt-cache directory, and a later runner of the same model
hands what it reads there to llama.cpp's sequence-state loader (`llama_state_seq_set_data`):
C++ parsing bytes that a compromised runner could have chosen. Whatever the writer computed
(the key, the sizes, a checksum) it could have computed for hostile bytes too, so the daemon,
which never loads llama.cpp, parses each file here in pure Python and checks every count, type
and size in it against the shape the model's GGUF header gives, and the SHA-256 of the bytes
it checked is what a runner then requires of the file (promptdirs.vet).

The layout is llama.cpp's, as `llama_context::state_seq_get_data` writes it in the vendored
sources of llama-cpp-python 0.3.36 (src/llama-context.cpp, src/llama-kv-cache.cpp
`state_write`, `state_write_meta`, `state_write_data`; src/llama-kv-cache-iswa.cpp):

    u32 magic 0xaf143cd8, i32 seq_id, then per KV cache (one; two for sliding-window
    attention: the full-attention layers', then the windowed layers'):
      u32 n_stream, then per stream: u32 cell_count, and when it is not 0
        cell_count x (i32 pos, u32 n_seq_id, n_seq_id x i32 seq_id)
        u32 v_trans, u32 n_layer
        n_layer x (i32 k_type, u64 k_row_size, cell_count x k_row_size bytes)
        v_trans 0: n_layer x (i32 v_type, u64 v_row_size, cell_count x v_row_size bytes)
        v_trans 1: n_layer x (i32 v_type, u32 v_element_size, u32 n_embd_v_gqa,
                              n_embd_v_gqa x cell_count x v_element_size bytes)

Beyond what llama.cpp's reader checks itself (stream and layer counts, types, row sizes), the
positions are checked too, which it takes as they are: each cell's position within the
prompt, each once, the full-attention cache holding all of them and a windowed one the last
ones; one sequence id per cell, the one the state names.

Only architectures whose KV cache this module knows the shape of are accepted (`ARCHS`):
every layer holds K and V of the same width (`head_count_kv` x `key_length` and
`value_length`), no recurrent state, no extra per-cell fields (M-RoPE's positions). For any
other model `expected` raises `Unchecked`, and its states are not kept past their runner.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from llmrun.store import gguf as gguf_reader
from llmrun.store.gguf import ArraySummary

# engine/promptcache.py's file format (the daemon may not import the engine; a test holds
# the two to the same values)
MAGIC = b"LLMRUNKV"
VERSION = 2
MAX_HEADER = 4096
HEADER_FIELDS = frozenset({"version", "key", "n_tokens", "state_size"})
SUFFIX = ".kv"

SEQ_STATE_MAGIC = 0xAF143CD8  # llama-context.cpp io_magic
# the KV types a runner may be given (engine/llama KV_TYPES): ggml type id, bytes per
# block, elements per block (ggml.c type_traits)
KV_TYPES = {"f16": (1, 2, 1), "q8_0": (8, 34, 32), "q4_0": (2, 18, 32)}
# architectures whose KV cache is llama.cpp's plain one (src/models/<arch>.cpp set no
# sliding window, recurrent layers or per-cell extras), and those with a sliding window,
# whose states hold two caches: the full-attention layers', then the windowed ones'
# (llama-kv-cache-iswa.cpp), the windowed layers given by a pattern (`load_swa_pattern`)
PLAIN_ARCHS = frozenset({"llama", "qwen2", "qwen3"})
SWA_ARCHS = {"gemma3": 6}  # the default pattern period (src/models/gemma3.cpp)
ARCHS = PLAIN_ARCHS | SWA_ARCHS.keys()
PIECE = 4 << 20  # bytes read at once while hashing a state's rows
_CELL = np.dtype([("pos", "<i4"), ("n_seq_id", "<u4"), ("seq_id", "<i4")])


class Unchecked(ValueError):
    """The daemon cannot tell what a state of this model must look like."""


@dataclass(frozen=True)
class Layout:
    """What every state of one model under one set of load settings must look like."""

    key: str  # the prompt-cache key (promptdirs.key) the file's header must name
    n_vocab: int
    n_ctx: int  # tokens per sequence at most
    n_stream: int  # one KV stream per slot
    layers: tuple[int, ...]  # layers per cache, in the order the state holds the caches
    k_embd: int  # n_embd_k_gqa of every layer
    v_embd: int  # n_embd_v_gqa of every layer
    kv_type: str  # KV_TYPES
    v_trans: bool | None  # V stored transposed (no flash attention); None: either

    def row(self, n: int) -> int:
        """ggml_row_size of `n` elements of the KV type."""
        _, block_bytes, block = KV_TYPES[self.kv_type]
        return block_bytes * n // block


def _int(info: gguf_reader.GGUFInfo, key: str, default: int | None = None) -> int:
    value = info.arch_value(key, default)
    if type(value) is not int or value < 0:
        raise Unchecked(f"{info.architecture}.{key} is {value!r}")
    return value


def expected(info: gguf_reader.GGUFInfo, *, key: str, n_ctx: int, n_slots: int,
             kv_type: str, flash_attention: str) -> Layout:
    """The layout of every state of the model whose (first) GGUF header is `info`, loaded
    with these settings; Unchecked when this module does not know it."""
    arch = info.architecture
    if arch not in ARCHS:
        raise Unchecked(f"the KV cache of a {arch!r} model is not one the daemon can check")
    if kv_type not in KV_TYPES:
        raise Unchecked(f"KV type {kv_type!r}")
    n_layer = _int(info, "block_count")
    n_head = _int(info, "attention.head_count")
    n_embd = _int(info, "embedding_length")
    if not (0 < n_layer <= 4096 and n_head > 0 and n_embd > 0):
        raise Unchecked("no layers or heads")
    if info.arch_value("nextn_predict_layers", 0) or info.arch_value(
            "attention.key_length_swa") is not None or info.arch_value(
            "attention.value_length_swa") is not None:
        raise Unchecked("layers of more than one shape")
    n_head_kv = info.arch_value("attention.head_count_kv", n_head)
    if type(n_head_kv) is not int or n_head_kv <= 0:  # (an array: a width per layer)
        raise Unchecked(f"attention.head_count_kv is {n_head_kv!r}")
    k_len = _int(info, "attention.key_length", n_embd // n_head)
    v_len = _int(info, "attention.value_length", n_embd // n_head)
    k_embd, v_embd = n_head_kv * k_len, n_head_kv * v_len
    block = KV_TYPES[kv_type][2]
    if not (0 < k_embd <= 1 << 20 and 0 < v_embd <= 1 << 20) or k_embd % block \
            or v_embd % block:
        raise Unchecked(f"KV widths {k_embd}, {v_embd}")
    layers: tuple[int, ...] = (n_layer,)
    if arch in SWA_ARCHS and _int(info, "attention.sliding_window", 0) > 0:
        pattern = info.arch_value("attention.sliding_window_pattern", SWA_ARCHS[arch])
        if type(pattern) is int:  # llama_hparams::set_swa_pattern (dense_first false)
            windowed = sum(1 for il in range(n_layer)
                           if pattern == 0 or il % pattern < pattern - 1)
        elif isinstance(pattern, list) and len(pattern) == n_layer:
            windowed = sum(1 for x in pattern if x)
        else:  # (an array too long to keep: its values unknown)
            raise Unchecked("a sliding-window pattern the daemon cannot read")
        layers = (n_layer - windowed, windowed)
    tokens = info.metadata.get("tokenizer.ggml.tokens")
    n_vocab = tokens.length if isinstance(tokens, ArraySummary) else \
        len(tokens) if isinstance(tokens, list) else 0
    if n_vocab <= 0:
        raise Unchecked("no vocabulary")
    v_trans = {"on": False, "off": True}.get(flash_attention)
    if v_trans is True and KV_TYPES[kv_type][2] != 1:
        raise Unchecked("a quantized V cache without flash attention")
    return Layout(key=key, n_vocab=n_vocab, n_ctx=n_ctx, n_stream=n_slots,
                  layers=tuple(n for n in layers if n > 0), k_embd=k_embd, v_embd=v_embd,
                  kv_type=kv_type, v_trans=v_trans)


def layout_of(model: Path, *, key: str, n_ctx: int, n_slots: int, kv_type: str,
              flash_attention: str) -> Layout:
    try:
        info = gguf_reader.read(model)
    except (OSError, ValueError) as exc:
        raise Unchecked(f"its GGUF header cannot be read: {exc}") from None
    return expected(info, key=key, n_ctx=n_ctx, n_slots=n_slots, kv_type=kv_type,
                    flash_attention=flash_attention)


class _Source:
    """A file read once from start to end, every byte into a SHA-256."""

    def __init__(self, fh: BinaryIO, size: int) -> None:
        self.fh = fh
        self.left = size
        self.sha = hashlib.sha256()

    def read(self, n: int) -> bytes:
        if n > self.left:
            raise ValueError("it is cut short")
        data = self.fh.read(n)
        if len(data) != n:
            raise ValueError("it is cut short")
        self.left -= n
        self.sha.update(data)
        return data

    def unpack(self, fmt: str) -> tuple[int, ...]:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))

    def skip(self, n: int) -> None:
        """`n` bytes of K or V rows: hashed, not otherwise read."""
        if n > self.left:
            raise ValueError("its rows run past its end")
        while n:
            n -= len(self.read(min(n, PIECE)))


def check(path: Path, layout: Layout) -> tuple[str, int, int]:
    """Check the state file at `path` whole against `layout`; ValueError (or OSError) says
    why it may not be read. Returns the SHA-256 of the file's bytes as they were checked,
    with its inode and size (the file as it was opened: a link is not followed)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("it is not a plain file")
        src = _Source(fh, st.st_size)
        n_tokens, state_size = _check_head(src, layout, path.name)
        if state_size != src.left:
            raise ValueError(f"its header says {state_size} bytes of state, it holds "
                             f"{src.left}")
        _check_state(src, layout, n_tokens)
        if src.left or fh.read(1):
            raise ValueError("it holds bytes past its state")
        return src.sha.hexdigest(), st.st_ino, st.st_size


def _check_head(src: _Source, layout: Layout, name: str) -> tuple[int, int]:
    if src.read(len(MAGIC)) != MAGIC:
        raise ValueError("not a prompt-cache file")
    (n,) = src.unpack("<I")
    if n > MAX_HEADER:
        raise ValueError("its header is too large")
    try:
        head = json.loads(src.read(n))
    except ValueError:
        raise ValueError("its header is not JSON") from None
    if type(head) is not dict or set(head) != HEADER_FIELDS or head["version"] != VERSION:
        raise ValueError("another format version")
    if head["key"] != layout.key:
        raise ValueError("saved for another model or other load settings")
    n_tokens, size = head["n_tokens"], head["state_size"]
    if not (type(n_tokens) is int and 0 < n_tokens <= layout.n_ctx and type(size) is int
            and size > 0):
        raise ValueError("a header field is out of range")
    raw = src.read(4 * n_tokens)
    tokens = np.frombuffer(raw, dtype="<i4")
    if tokens.min() < 0 or tokens.max() >= layout.n_vocab:
        raise ValueError("a token is outside the vocabulary")
    if name != hashlib.sha256(raw).hexdigest() + SUFFIX:
        raise ValueError("its name is not its tokens' digest")
    return n_tokens, size


def _check_state(src: _Source, layout: Layout, n_tokens: int) -> None:
    magic, seq_id = src.unpack("<Ii")
    if magic != SEQ_STATE_MAGIC:
        raise ValueError("not a llama.cpp sequence state")
    if not 0 <= seq_id < layout.n_stream:
        raise ValueError(f"it names sequence {seq_id} of {layout.n_stream}")
    # with a stream per sequence, a sequence's cells are in its own stream only
    own = seq_id if layout.n_stream > 1 else 0
    v_trans: int | None = None if layout.v_trans is None else int(layout.v_trans)
    for c, n_layer in enumerate(layout.layers):
        where = f"cache {c}"
        (n_stream,) = src.unpack("<I")
        if n_stream != layout.n_stream:
            raise ValueError(f"{where}: {n_stream} streams, not {layout.n_stream}")
        for s in range(n_stream):
            (cells,) = src.unpack("<I")
            if s != own:
                if cells:
                    raise ValueError(f"{where}: cells in stream {s}, not the sequence's")
                continue
            # the full-attention cache holds every position; a windowed one, the last few
            windowed = c > 0
            if not (0 < cells <= n_tokens if windowed else cells == n_tokens):
                raise ValueError(f"{where}: {cells} cells for {n_tokens} tokens")
            meta = np.frombuffer(src.read(cells * _CELL.itemsize), dtype=_CELL)
            if (meta["n_seq_id"] != 1).any() or (meta["seq_id"] != seq_id).any():
                raise ValueError(f"{where}: a cell of another sequence")
            pos = np.sort(meta["pos"])
            if pos[0] != n_tokens - cells or pos[-1] != n_tokens - 1 \
                    or (cells > 1 and (np.diff(pos) != 1).any()):
                raise ValueError(f"{where}: positions that are not the prompt's last "
                                 f"{cells} of {n_tokens}")
            trans, layers = src.unpack("<II")
            if trans not in (0, 1) or (v_trans is not None and trans != v_trans):
                raise ValueError(f"{where}: V transposed {trans}, not as the context is")
            v_trans = trans
            if layers != n_layer:
                raise ValueError(f"{where}: {layers} layers, not {n_layer}")
            _check_rows(src, layout, cells, n_layer, bool(trans), where)


def _check_rows(src: _Source, layout: Layout, cells: int, n_layer: int, trans: bool,
                where: str) -> None:
    type_id, type_size, _ = KV_TYPES[layout.kv_type]
    k_row, v_row = layout.row(layout.k_embd), layout.row(layout.v_embd)
    for il in range(n_layer):
        kind, size = src.unpack("<iQ")
        if kind != type_id or size != k_row:
            raise ValueError(f"{where}, layer {il}: K of type {kind}, rows of {size} bytes; "
                             f"not {type_id}, {k_row}")
        src.skip(cells * k_row)
    for il in range(n_layer):
        if not trans:
            kind, size = src.unpack("<iQ")
            if kind != type_id or size != v_row:
                raise ValueError(f"{where}, layer {il}: V of type {kind}, rows of {size} "
                                 f"bytes; not {type_id}, {v_row}")
            src.skip(cells * v_row)
        else:
            kind, el, n_embd = src.unpack("<iII")
            if kind != type_id or el != type_size or n_embd != layout.v_embd:
                raise ValueError(f"{where}, layer {il}: V of type {kind}, {el}-byte "
                                 f"elements, {n_embd} wide; not {type_id}, {type_size}, "
                                 f"{layout.v_embd}")
            src.skip(n_embd * cells * el)
