"""The engine's state, shared by its parts (engine/batcher.py's step loop, engine/slots.py,
engine/sampling.py, engine/encoder.py, engine/speculation.py): each part is a layer of the
one `Engine` object, since all of them run on the engine thread, over the same slots and
context, with no lock between them.

Everything here but the inbox and the encoder's queue belongs to the engine thread.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from llmrun.engine.backend import Context, Model
from llmrun.engine.draft import DraftModel, StepCost
from llmrun.engine.llama import Batch, EmbdBatch, ImageChunk, Projector
from llmrun.engine.promptcache import PromptCache
from llmrun.engine.promptcost import PromptCost, attention_per_cell
from llmrun.engine.sequence import EngineStats, Event, Sequence, Slot
from llmrun.engine.threads import ThreadGovernor


class EngineState:
    """What every part of the engine reads and writes: the model and context, the slots,
    the requests waiting, the measured costs, the counters."""

    # the fewest prompt tokens (image rows) a step reads beside generating sequences: set by
    # Engine from the context's attention path (batcher.py)
    min_chunk: int
    image_min_chunk: int

    def __init__(self, model: Model, ctx: Context, *, n_ctx_seq: int, n_slots: int,
                 emit: Callable[[list[Event]], None],
                 on_fatal: Callable[[BaseException], None] | None = None,
                 governor: ThreadGovernor | None = None,
                 prompt_cache: PromptCache | None = None,
                 step_budget: tuple[float, int] = (0.0, 0),
                 projector: Projector | None = None,
                 drafter: DraftModel | None = None) -> None:
        self.model = model
        self.ctx = ctx
        self.n_ctx_seq = n_ctx_seq
        self.slots = [Slot(i) for i in range(n_slots)]
        self.batch = Batch(ctx.n_batch)
        self.emit = emit
        self.on_fatal = on_fatal  # None: the exception ends the thread (and is logged)
        self.governor = governor  # None: a fixed thread count
        self.prompt_cache = prompt_cache  # None: prefixes live only in the slots
        self.projector = projector  # None: a text-only model
        self.drafter = drafter  # None: drafts (when asked for) come from prompt lookup
        self.decode_token_s: float | None = None  # a generated token's share of a decode
        self.embd_batch = EmbdBatch(ctx.n_batch, projector.n_embd) if projector else None
        self._image_rows: dict[str, np.ndarray] = {}  # embeddings by image hash, oldest first
        self._encoder: threading.Thread | None = None
        self._to_encode: queue.SimpleQueue[tuple[Sequence, list[ImageChunk]] | None] = \
            queue.SimpleQueue()
        self._last_emit = time.monotonic()
        self.stats = EngineStats()
        self._last_stats = 0.0  # monotonic time the stats were last sent
        self._ended = False  # a sequence ended since then
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._waiting: deque[Sequence] = deque()
        self._loading: list[Sequence] = []  # waiting for their saved state to be read
        self._stopping = False
        # one row of llguidance's bitmask per slot: bit t%32 of int32 word t//32 is token t
        self._masks = np.zeros((n_slots, (model.n_vocab + 31) // 32), dtype=np.int32)
        self.step_cost = StepCost()  # what a row of a decode costs here, for drafting
        # stall-free batching: while others generate, a step reads at most this long (s) or
        # this many prompt tokens; (0, 0): no limit
        self.step_budget = step_budget
        # what a prompt token adds to a step that also decodes (the decode rows' own time
        # taken out), measured in the recent steps that read a prompt beside others
        self.prompt_cost = PromptCost(attention_per_cell(model), model.n_swa)
        self._saving_s = 0.0  # the time the last step spent keeping prompt states, after it
        # most rows a decode may hold with each row's logits exactly as if decoded alone
        # (draft.probe_exact_rows), by the bit length of the position drafted from: kernels
        # change with the context's length too (llama.cpp splits a single row's attention
        # over threads from 512 cells on). Probed when a sequence first drafts there.
        self.exact_rows: dict[int, int] = {}

    def _active(self) -> list[Sequence]:
        return [s.seq for s in self.slots if s.seq is not None]
