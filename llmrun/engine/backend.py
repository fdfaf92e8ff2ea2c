"""What the engine needs of the model and of its llama context, as protocols: engine/llama/'s
`Model` and `Context` satisfy them (mypy checks it where the runner hands them to `Engine`),
and tests/fakes/engine.py's fakes do too, so the engine's bookkeeping (slots, the step
budget, cancels, prefix reuse, saved prompt states) is tested without loading a model.

Batches stay llama.cpp's own buffers (engine/llama/ `Batch`, `EmbdBatch`): the engine fills
them and the context reads them, so a fake reads the same arrays a real decode does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from llmrun.engine import llama
from llmrun.engine.llama import Batch, EmbdBatch
from llmrun.engine.promptcost import Shape


class Sampler(Protocol):
    """A sequence's sampler chain (made by `Model.sampler`, used by `Context.sample`)."""

    def accept(self, token: int) -> None: ...

    def sample_masked(self, logits: np.ndarray, mask: np.ndarray) -> int: ...

    def close(self) -> None: ...


class Model(Shape, Protocol):
    """The model's vocabulary and shape (the shape sizes the prompt budget: promptcost)."""

    add_bos: bool

    def piece(self, token: int) -> bytes: ...

    def is_eog(self, token: int) -> bool: ...

    def sampler(self, *, temperature: float, top_k: int, top_p: float, min_p: float,
                typical_p: float, repeat_last_n: int, repeat_penalty: float,
                presence_penalty: float, frequency_penalty: float, seed: int) -> Sampler: ...


class Context(Protocol):
    """A context holding one KV sequence per slot: decoding, logits and sampling, the
    sequences' cells, and their saved states."""

    n_batch: int
    flash_attn: bool | None  # None: llama.cpp's choice

    def decode(self, batch: Batch | EmbdBatch, causal: bool = True,
               small_tiles: bool = False, rows: tuple[int, int] | None = None) -> int: ...

    def set_threads(self, n_threads: int) -> None: ...

    # `sampler` is one this context's model made: each backend samples with its own chain
    # type (llama.cpp's holds a C pointer), which the engine only passes through.
    def sample(self, sampler: Any, index: int, mask: np.ndarray | None = None) -> int: ...

    def logits(self, index: int) -> np.ndarray: ...

    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> bool: ...

    def shift(self, seq: int, keep: int, discard: int) -> bool: ...

    def state_seq_get(self, seq: int) -> bytearray: ...

    def state_seq_set(self, seq: int, data: bytearray) -> bool: ...


if TYPE_CHECKING:
    def _llama_satisfies(model: llama.Model, ctx: llama.Context,
                         sampler: llama.Sampler) -> tuple[Model, Context, Sampler]:
        return model, ctx, sampler  # (mypy checks it here, whoever builds an Engine)
