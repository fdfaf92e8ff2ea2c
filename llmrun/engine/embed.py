"""Embeddings: a second llama context (pooled, one vector per input) on the runner's model.

It has its own worker thread (engine/sidework.py), so embedding a batch of documents never
stalls the decode loop of the generation context. Inputs are packed several to a decode (one
sequence each), vectors are L2-normalised, as Ollama's /api/embed returns them.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from llmrun.engine.llama import Batch, LlamaError
from llmrun.engine.sidework import SideWorker

MAX_SEQ = 4


class EmbedError(ValueError):
    pass


class Embedder(SideWorker):
    name = "llmrun-embed"
    what = "embedding"
    request_errors = (EmbedError, LlamaError)
    embeddings = True
    n_seq = MAX_SEQ

    def submit(self, req_id: str, inputs: list[str], truncate: bool, offset: int = 0) -> None:
        """Queue `inputs` (`offset`: the index of the first in the caller's whole list, for
        error messages about a batch the daemon sent in pieces)."""
        self.queue(req_id, inputs, truncate, offset)

    def work(self, *args: Any) -> tuple[str, dict[str, Any]]:
        vectors, n_tokens = self.embed(*args)
        return "embedding", {"embeddings": vectors, "prompt_tokens": n_tokens}

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
