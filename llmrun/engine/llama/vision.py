"""Vision and audio through llama.cpp's multimodal library (libmtmd): a projector that turns a
prompt's images and sounds into chunks of positions and each chunk into embedding rows
(Projector, ImageChunk), and the batch those rows are decoded from (EmbdBatch).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import llama_cpp.llama_cpp as C
import numpy as np

from llmrun.engine.llama.lib import LlamaError, init_backend, on_log
from llmrun.engine.llama.model import Model

# What a prompt's media are given as: an image (width, height, RGB bytes, content hash) or a
# sound (mono float32 samples at the projector's sample_rate, content hash)
Picture = tuple[int, int, bytes, str]
Sound = tuple[np.ndarray, str]


class ImageChunk:
    """One image (or piece of a sound) of a prompt, preprocessed for its projector and not
    yet encoded: the positions it takes in the sequence and the content hash that names it.
    (Named for images, which came first: an audio chunk is read the same way.)"""

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
    """A projector (an mmproj GGUF, architecture `clip`) beside a text model: the images or
    sounds of a prompt (what its GGUF says it encodes: `vision`, `audio`) become chunks of
    positions, and each chunk embeddings for them.

    Every call into libmtmd holds one lock: a prompt is tokenized on the runner's message
    thread while an image may be encoding on the engine's encoder thread, and the library
    keeps its last output in the context."""

    def __init__(self, path: Path, model: Model, n_threads: int,
                 piece_seconds: float | None = None) -> None:
        from llama_cpp import mtmd_cpp as M

        self._m = M
        init_backend()
        # the library logs on its own channel (every tensor of the projector at load)
        M.mtmd_log_set(on_log, ctypes.c_void_p(0))
        M.mtmd_helper_log_set(on_log, ctypes.c_void_p(0))
        params = M.mtmd_context_params_default()
        params.use_gpu = False
        params.print_timings = False
        params.warmup = False
        params.n_threads = n_threads
        # a marker no client can write: the template's text is split at it, and nothing a
        # message says can stand for an image it did not send
        self.marker = f"<__llmrun_media_{os.urandom(12).hex()}__>"
        self._marker_bytes = self.marker.encode()  # kept alive while the context lives
        params.media_marker = self._marker_bytes
        ptr = M.mtmd_init_from_file(str(path).encode(), model.ptr, params)
        if not ptr:
            raise LlamaError(f"llama.cpp could not load the projector {path.name} for "
                             f"this model (not a projector, or made for another model: its "
                             f"width must match the model's)")
        self.ptr = ptr
        self.vision = bool(M.mtmd_support_vision(ptr))
        self.audio = bool(M.mtmd_support_audio(ptr))
        # the rate sounds must be resampled to before tokenize (0: no audio)
        self.sample_rate = max(0, int(M.mtmd_get_audio_sample_rate(ptr))) if self.audio else 0
        # a sound is read in pieces of this length, each encoded on its own (None: whole)
        self.piece_seconds = piece_seconds if self.audio else None
        if not (self.vision or self.audio):
            self.close()
            raise LlamaError(f"{path.name} is a projector of neither images nor sound")
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

    def tokenize(self, text: str, images: list[Picture | Sound],
                 add_special: bool) -> list[list[int] | ImageChunk]:
        """`text` with one `marker` per image or sound, in order, as text tokens and media
        chunks (a long sound gives several)."""
        M = self._m
        bitmaps = []
        chunks = M.mtmd_input_chunks_init()
        try:
            for item in images:
                if len(item) == 2:  # a sound
                    samples, digest = item
                    pcm = np.ascontiguousarray(samples, dtype=np.float32)
                    bitmap = M.mtmd_bitmap_init_from_audio(
                        len(pcm), pcm.ctypes.data_as(ctypes.POINTER(ctypes.c_float)))
                else:
                    width, height, rgb, digest = item
                    data = (ctypes.c_uint8 * len(rgb)).from_buffer_copy(rgb)
                    bitmap = M.mtmd_bitmap_init(width, height, data)
                if not bitmap:
                    raise LlamaError("llama.cpp could not take an image or sound")
                bitmaps.append(bitmap)
                M.mtmd_bitmap_set_id(bitmap, digest.encode())
            raw = text.encode()
            inp = M.mtmd_input_text(raw, len(raw), add_special, True)
            arr = (M.mtmd_bitmap_p_ctypes * max(1, len(bitmaps)))(*bitmaps)
            with self._lock:
                rc = M.mtmd_tokenize(self.ptr, chunks, ctypes.byref(inp), arr, len(bitmaps))
            if rc != 0:
                raise ValueError({1: "the prompt's images or sounds and their places do not "
                                     "match",
                                  2: "an image or sound could not be preprocessed for this "
                                     "projector"}
                                 .get(rc, f"media could not be read (mtmd error {rc})"))
            parts = [M.mtmd_input_chunks_get(chunks, i)
                     for i in range(M.mtmd_input_chunks_size(chunks))]
            kinds = [M.mtmd_input_chunk_get_type(chunk) for chunk in parts]
            # Projectors that slice a large image (LLaVA-UHD, SmolVLM) give it several
            # chunks: each is named by the image's hash and its place among the image's
            # chunks (the same image twice in a prompt: the same names twice)
            sent = Counter(digest for *_, digest in images)
            media = (M.MTMD_INPUT_CHUNK_TYPE_IMAGE, M.MTMD_INPUT_CHUNK_TYPE_AUDIO)
            total = Counter((M.mtmd_input_chunk_get_id(chunk) or b"").decode()
                            for chunk, kind in zip(parts, kinds, strict=True) if kind in media)
            seen: Counter[str] = Counter()
            out: list[list[int] | ImageChunk] = []
            for chunk, kind in zip(parts, kinds, strict=True):
                if kind == M.MTMD_INPUT_CHUNK_TYPE_TEXT:
                    n = ctypes.c_size_t(0)
                    toks = M.mtmd_input_chunk_get_tokens_text(chunk, ctypes.byref(n))
                    out.append(list(toks[: n.value]) if n.value else [])
                elif kind in media:
                    n_tokens = M.mtmd_input_chunk_get_n_tokens(chunk)
                    if M.mtmd_input_chunk_get_n_pos(chunk) != n_tokens:
                        raise LlamaError("a media chunk whose positions differ from its rows")
                    image = (M.mtmd_input_chunk_get_id(chunk) or b"").decode()
                    k = seen[image] % max(1, total[image] // max(1, sent[image]))
                    seen[image] += 1
                    out.append(ImageChunk(M.mtmd_input_chunk_copy(chunk), n_tokens,
                                          f"{image}.{k}"))
                else:
                    raise ValueError(f"a prompt chunk of unknown kind {kind}")
            return out
        finally:
            for bitmap in bitmaps:
                M.mtmd_bitmap_free(bitmap)
            M.mtmd_input_chunks_free(chunks)

    def decode_sound(self, data: bytes) -> np.ndarray:
        """A sound file (WAV, MP3, FLAC) as mono float32 samples at `sample_rate`, decoded
        by libmtmd's helper (miniaudio). Only for files whose header was read and bounded
        first (engine/sound.py): the helper reads a whole file in one go, whatever length
        its frames add up to, and takes anything it does not know for an image."""
        M = self._m
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        bitmap = M.mtmd_helper_bitmap_init_from_buf(self.ptr, buf, len(data), False)
        if not bitmap:
            raise ValueError("a sound file could not be decoded")
        try:
            if not M.mtmd_bitmap_is_audio(bitmap):
                raise ValueError("not a sound file")
            n = M.mtmd_bitmap_get_n_bytes(bitmap) // 4
            ptr = ctypes.cast(M.mtmd_bitmap_get_data(bitmap), ctypes.POINTER(ctypes.c_float))
            return np.ctypeslib.as_array(ptr, shape=(n,)).copy() if n else \
                np.zeros(0, dtype=np.float32)
        finally:
            M.mtmd_bitmap_free(bitmap)

    def encode(self, chunk: ImageChunk) -> np.ndarray:
        """The embeddings of an image or audio chunk: one row of the model's width per
        position (a copy). Runs the encoder: the slow part, kept off the engine's thread."""
        M = self._m
        with self._lock:
            rc = M.mtmd_encode_chunk(self.ptr, chunk.handle)
            if rc != 0:
                raise LlamaError(f"the projector's encoder failed (error {rc})")
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
