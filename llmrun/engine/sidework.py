"""Work beside the generation loop: a llama context and a thread of its own that serve one
queued job at a time (embedding, reranking), so a long batch never stalls the decode loop of
the generation context. While a job runs it sends heartbeats, so the daemon's watchdog knows
the runner is busy, not hung."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from llmrun.engine.llama import Context, LlamaError, Model
from llmrun.request import error_event

HEARTBEAT_SECONDS = 1.0  # while a job runs (see batcher.HEARTBEAT_SECONDS)


class SideWorker:
    """Subclasses say what a job does (`work`: its reply's kind and payload), which errors are
    the request's fault (`request_errors`: answered 400), and how their context is made."""

    name = "llmrun-side"
    what = "the work"  # for an unexpected failure's message: "<what> failed: ..."
    request_errors: tuple[type[Exception], ...] = (LlamaError,)
    embeddings = False  # a pooled context (one vector per sequence) rather than logits
    n_seq = 4  # sequences one decode may hold

    def __init__(self, model: Model, n_ctx_seq: int, n_threads: int,
                 reply: Callable[[str, str, Any], None],
                 heartbeat: Callable[[], None] | None = None) -> None:
        self.model = model
        self.n_ctx_seq = n_ctx_seq
        self.n_threads = n_threads
        self.reply = reply
        self.heartbeat = heartbeat
        self._ctx: Context | None = None
        self._jobs: queue.SimpleQueue[tuple[str, tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def work(self, *args: Any) -> tuple[str, dict[str, Any]]:
        raise NotImplementedError

    def queue(self, req_id: str, *args: Any) -> None:
        self._jobs.put((req_id, args))

    def stop(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            req_id, args = job
            try:
                kind, payload = self.work(*args)
            except self.request_errors as exc:
                self.reply(req_id, "error", error_event("invalid_request", str(exc)))
                continue
            except Exception as exc:  # this request fails; the thread serves the next one
                self.reply(req_id, "error", error_event(
                    "internal", f"{self.what} failed: {type(exc).__name__}: {exc}"))
                continue
            self.reply(req_id, kind, payload)

    def _context(self) -> Context:
        if self._ctx is None:
            self._ctx = Context(self.model, n_ctx_seq=self.n_ctx_seq, n_seq=self.n_seq,
                                n_batch=self.n_ctx_seq, n_threads=self.n_threads,
                                embeddings=self.embeddings)
        return self._ctx

    def _groups(self, sequences: list[list[int]]) -> list[list[int]]:
        """Indices of the token sequences to decode together: up to n_seq of the same length
        and n_ctx_seq tokens in all (one input may fill a whole batch on its own). Same
        length, because llama.cpp splits sequences of unequal length across micro-batches,
        and then a sequence's numbers are not those of the same sequence decoded alone: an
        embedding pooled only a part of the longer ones (a vector off by 0.13 beside a
        shorter input), and a rerank prompt's last tokens, read in a small slice of their
        own, went through other kernels (its score moved by up to 0.03 on SmolLM2 Q4_1, also
        when the decodes were sliced by hand so every micro-batch held equal parts).
        Sequences of one length decoded together come out the same to the bit as each
        alone."""
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        groups: list[list[int]] = []
        for i in order:
            last = groups[-1] if groups else None
            n = len(sequences[i])
            if last is not None and len(last) < self.n_seq and \
                    len(sequences[last[0]]) == n and (len(last) + 1) * n <= self.n_ctx_seq:
                last.append(i)
            else:
                groups.append([i])
        return groups

    def _beat(self, last: float) -> float:
        """Heartbeat if one is due; returns the time of the last one."""
        now = time.monotonic()
        if self.heartbeat is None or now - last < HEARTBEAT_SECONDS:
            return last
        self.heartbeat()
        return now
