"""Embeddings: a second llama context (pooled, one vector per input) on the runner's model.

It has its own worker thread, so embedding a batch of documents never stalls the decode loop
of the generation context. Inputs are packed several to a decode (one sequence each),
vectors are L2-normalised, as Ollama's /api/embed returns them.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from llmrun.engine.llama import Batch, Context, LlamaError, Model
from llmrun.request import error_event

MAX_SEQ = 4
HEARTBEAT_SECONDS = 1.0  # while a batch is being embedded (see batcher.HEARTBEAT_SECONDS)


class EmbedError(ValueError):
    pass


class Embedder:
    def __init__(self, model: Model, n_ctx_seq: int, n_threads: int,
                 reply: Callable[[str, str, Any], None],
                 heartbeat: Callable[[], None] | None = None) -> None:
        self.model = model
        self.n_ctx_seq = n_ctx_seq
        self.n_threads = n_threads
        self.reply = reply
        self.heartbeat = heartbeat
        self._ctx: Context | None = None
        self._jobs: queue.SimpleQueue[tuple[str, list[str], bool, int] | None] = \
            queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="llmrun-embed", daemon=True)
        self._thread.start()

    def submit(self, req_id: str, inputs: list[str], truncate: bool, offset: int = 0) -> None:
        """Queue `inputs` (`offset`: the index of the first in the caller's whole list, for
        error messages about a batch the daemon sent in pieces)."""
        self._jobs.put((req_id, inputs, truncate, offset))

    def stop(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            req_id, inputs, truncate, offset = job
            try:
                vectors, n_tokens = self.embed(inputs, truncate, offset)
            except (EmbedError, LlamaError) as exc:
                self.reply(req_id, "error", error_event("invalid_request", str(exc)))
                continue
            except Exception as exc:  # this request fails; the thread serves the next one
                self.reply(req_id, "error", error_event(
                    "internal", f"embedding failed: {type(exc).__name__}: {exc}"))
                continue
            self.reply(req_id, "embedding", {"embeddings": vectors, "prompt_tokens": n_tokens})

    def _context(self) -> Context:
        if self._ctx is None:
            self._ctx = Context(self.model, n_ctx_seq=self.n_ctx_seq, n_seq=MAX_SEQ,
                                n_batch=self.n_ctx_seq, n_threads=self.n_threads,
                                embeddings=True)
        return self._ctx

    def _beat(self, last: float) -> float:
        """Heartbeat if one is due; returns the time of the last one."""
        now = time.monotonic()
        if self.heartbeat is None or now - last < HEARTBEAT_SECONDS:
            return last
        self.heartbeat()
        return now

    def _groups(self, tokenized: list[list[int]]) -> list[list[int]]:
        """Indices of the inputs to decode together: up to MAX_SEQ of the same length and
        n_ctx_seq tokens in all. Same length, because llama.cpp splits sequences of unequal
        length across micro-batches and then pools only a part of the longer ones (measured:
        a vector off by 0.13 beside a shorter input)."""
        order = sorted(range(len(tokenized)), key=lambda i: len(tokenized[i]))
        groups: list[list[int]] = []
        for i in order:
            last = groups[-1] if groups else None
            n = len(tokenized[i])
            if last is not None and len(last) < MAX_SEQ and \
                    len(tokenized[last[0]]) == n and (len(last) + 1) * n <= self.n_ctx_seq:
                last.append(i)
            else:
                groups.append([i])  # (one input may fill a whole batch on its own)
        return groups

    def embed(self, inputs: list[str], truncate: bool,
              offset: int = 0) -> tuple[list[list[float]], int]:
        ctx = self._context()
        tokenized = []
        for i, text in enumerate(inputs):
            toks = self.model.tokenize(text, add_special=True, parse_special=False)
            if len(toks) > self.n_ctx_seq:
                if not truncate:
                    raise EmbedError(f"input {offset + i} is {len(toks)} tokens but the "
                                     f"context is {self.n_ctx_seq} (num_ctx); shorten it or "
                                     "set truncate")
                toks = toks[: self.n_ctx_seq]
            if not toks:
                toks = [self.model.bos] if self.model.bos >= 0 else [0]
            tokenized.append(toks)
        out: list[list[float]] = [[] for _ in tokenized]
        batch = Batch(self.n_ctx_seq * MAX_SEQ)
        last_beat = time.monotonic()
        try:
            for group in self._groups(tokenized):
                last_beat = self._beat(last_beat)
                batch.clear()
                for seq, i in enumerate(group):
                    for pos, tok in enumerate(tokenized[i]):
                        batch.add(tok, pos, seq, True)
                for seq in range(len(group)):
                    ctx.seq_rm(seq, -1, -1)
                if ctx.decode(batch) != 0:
                    raise LlamaError("llama_decode failed while embedding")
                for seq, i in enumerate(group):
                    v = ctx.embedding(seq).astype(np.float64)
                    norm = float(np.linalg.norm(v))
                    out[i] = (v / norm if norm > 0 else v).tolist()
        finally:
            batch.close()
        return out, sum(len(t) for t in tokenized)
