"""Embeddings: a second llama context (pooled, one vector per input) on the runner's model,
or, for an encoder-only model (BERT and kin), the model's one context.

It has its own worker thread (engine/sidework.py), so embedding a batch of documents never
stalls the decode loop of the generation context. Inputs are packed several to a decode (one
sequence each; several requests' inputs share decodes), pooled as the GGUF declares (mean,
CLS, last; mean for a chat model, which declares none) and L2-normalised, as Ollama's
/api/embed returns them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from llmrun.engine.llama import Context, LlamaError
from llmrun.engine.sidework import Job, SideWorker

MAX_SEQ = 4


class EmbedError(ValueError):
    pass


def normalised(ctx: Context, seq: int, row: int) -> list[float]:
    """Sequence `seq`'s pooled vector, L2-normalised (a zero vector stays as it is)."""
    v = ctx.embedding(seq).astype(np.float64)
    norm = float(np.linalg.norm(v))
    return (v / norm if norm > 0 else v).tolist()


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

    def prepare(self, inputs: list[str], truncate: bool, offset: int = 0) -> Job:
        if self.model.rank_pooling:
            raise EmbedError("this model is a cross-encoder reranker (its GGUF's pooling "
                             "type is rank): it scores query-document pairs (/v1/rerank) "
                             "and has no embeddings")
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
        n_tokens = sum(len(t) for t in tokenized)

        def finish(vectors: list[Any]) -> tuple[str, dict[str, Any]]:
            return "embedding", {"embeddings": vectors, "prompt_tokens": n_tokens}

        return Job(tokenized, normalised, finish)
