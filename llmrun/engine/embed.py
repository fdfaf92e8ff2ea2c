"""Embeddings: a second llama context (pooled, one vector per input) on the runner's model.

It has its own worker thread, so embedding a batch of documents never stalls the decode loop
of the generation context. Inputs are packed several to a decode (one sequence each),
vectors are L2-normalised, as Ollama's /api/embed returns them.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from llmrun.engine.llama import Batch, Context, LlamaError, Model

MAX_SEQ = 4


class EmbedError(ValueError):
    pass


class Embedder:
    def __init__(self, model: Model, n_ctx_seq: int, n_threads: int,
                 reply: Callable[[str, str, Any], None]) -> None:
        self.model = model
        self.n_ctx_seq = n_ctx_seq
        self.n_threads = n_threads
        self.reply = reply
        self._ctx: Context | None = None
        self._jobs: queue.SimpleQueue[tuple[str, list[str], bool] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="llmrun-embed", daemon=True)
        self._thread.start()

    def submit(self, req_id: str, inputs: list[str], truncate: bool) -> None:
        self._jobs.put((req_id, inputs, truncate))

    def stop(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            req_id, inputs, truncate = job
            try:
                vectors, n_tokens = self.embed(inputs, truncate)
            except (EmbedError, LlamaError) as exc:
                self.reply(req_id, "error", {"message": str(exc), "status": 400})
                continue
            except Exception as exc:
                self.reply(req_id, "error", {"message": f"embedding failed: {exc}", "status": 500})
                continue
            self.reply(req_id, "embedding", {"embeddings": vectors, "prompt_tokens": n_tokens})

    def _context(self) -> Context:
        if self._ctx is None:
            self._ctx = Context(self.model, n_ctx_seq=self.n_ctx_seq, n_seq=MAX_SEQ,
                                n_batch=self.n_ctx_seq, n_threads=self.n_threads,
                                embeddings=True)
        return self._ctx

    def embed(self, inputs: list[str], truncate: bool) -> tuple[list[list[float]], int]:
        ctx = self._context()
        tokenized = []
        for i, text in enumerate(inputs):
            toks = self.model.tokenize(text, add_special=True, parse_special=False)
            if len(toks) > self.n_ctx_seq:
                if not truncate:
                    raise EmbedError(f"input {i} is {len(toks)} tokens but the context is "
                                     f"{self.n_ctx_seq} (num_ctx); shorten it or set truncate")
                toks = toks[: self.n_ctx_seq]
            if not toks:
                toks = [self.model.bos] if self.model.bos >= 0 else [0]
            tokenized.append(toks)
        out: list[list[float]] = []
        batch = Batch(self.n_ctx_seq * MAX_SEQ)
        try:
            i = 0
            while i < len(tokenized):
                batch.clear()
                group = []
                while i < len(tokenized) and len(group) < MAX_SEQ and \
                        batch.n + len(tokenized[i]) <= self.n_ctx_seq:
                    for pos, tok in enumerate(tokenized[i]):
                        batch.add(tok, pos, len(group), True)
                    group.append(i)
                    i += 1
                if not group:  # one input fills a whole batch on its own
                    for pos, tok in enumerate(tokenized[i]):
                        batch.add(tok, pos, 0, True)
                    group.append(i)
                    i += 1
                for seq in range(len(group)):
                    ctx.seq_rm(seq, -1, -1)
                if ctx.decode(batch) != 0:
                    raise LlamaError("llama_decode failed while embedding")
                for seq in range(len(group)):
                    v = ctx.embedding(seq).astype(np.float64)
                    norm = float(np.linalg.norm(v))
                    out.append((v / norm if norm > 0 else v).tolist())
        finally:
            batch.close()
        return out, sum(len(t) for t in tokenized)
