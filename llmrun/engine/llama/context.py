"""A llama context: the KV cache of a model's sequences, the decodes that fill it, the logits
and embeddings they leave, and the sequences' saved states.
"""

from __future__ import annotations

import ctypes

import llama_cpp.llama_cpp as C
import numpy as np

from llmrun.engine.llama.lib import SMALL_TILE_ROWS, LlamaError, set_tiled_rows
from llmrun.engine.llama.lora import LoraAdapter
from llmrun.engine.llama.model import Batch, Model, Sampler
from llmrun.engine.llama.vision import EmbdBatch

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
        # sequence's logits bit-identical alone or batched (tests/integration/test_engine.py)
        # with one thread or under 257 cells of context; past that, with several threads, llama.cpp
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
        self.memory = C.llama_get_memory(ptr)  # NULL for an encoder (no KV cache)
        self.pooling: int = C.llama_pooling_type(ptr)
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
        tiles = small_tiles and set_tiled_rows is not None
        if tiles:
            set_tiled_rows(SMALL_TILE_ROWS)
        if not causal:
            C.llama_set_causal_attn(self.ptr, False)
        try:
            return C.llama_decode(self.ptr, raw)
        finally:
            if not causal:
                C.llama_set_causal_attn(self.ptr, True)
            if tiles:
                set_tiled_rows(0)

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
        """The pooled embedding of sequence `seq` after a decode (a copy); with rank pooling,
        the classification head's n_cls_out outputs instead."""
        ptr = C.llama_get_embeddings_seq(self.ptr, seq)
        if not ptr:
            raise LlamaError("this context produced no pooled embedding")
        rank = self.pooling == C.LLAMA_POOLING_TYPE_RANK
        size = self.model.n_cls_out if rank else self.model.n_embd
        return np.ctypeslib.as_array(ptr, shape=(size,)).copy()

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
