"""Work beside the generation loop: a llama context and a thread of its own for embedding and
reranking, so a long batch never stalls the decode loop of the generation context. While it
works it sends heartbeats, so the daemon's watchdog knows the runner is busy, not hung.

Each queued job becomes token sequences (`prepare`), one value read from each right after its
decode (`Job.read`) and a reply made of those values (`Job.finish`). The worker takes every job
queued when it is free and packs their sequences into the same decodes under one rule
(`_groups`: same length, up to n_seq per decode), so several small requests share decodes,
and each request's numbers are those it gets alone, to the bit. (An encoder-only model
packs each request's inputs apart from the others': for it the rule does not keep that
promise; see __init__.)
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmrun.engine.llama import Batch, Context, LlamaError, Model
from llmrun.request import error_event

HEARTBEAT_SECONDS = 1.0  # while a job runs (see batcher.HEARTBEAT_SECONDS)
# an encoder's inputs per decode at most (llama-cpp-python's Llama.embed allows up to
# llama.cpp's parallel sequences, 256; inputs of 8 tokens fill a 512-token batch at 64)
ENCODER_SEQ = 64

# (context, the sequence's index in its decode, its last token's batch row) -> its value
Read = Callable[[Context, int, int], Any]


@dataclass
class Job:
    """One request's part of the side work: its token sequences, what to read from each
    after its decode, and its reply from those values (in the order of `sequences`)."""

    sequences: list[list[int]]
    read: Read
    finish: Callable[[list[Any]], tuple[str, dict[str, Any]]]
    req_id: str = ""
    values: list[Any] = field(default_factory=list)
    left: int = 0  # sequences not decoded yet


class SideWorker:
    """Subclasses say what a job is (`prepare`: from the arguments `queue` got to a Job),
    which errors are the request's fault (`request_errors`: answered 400), and how their
    context is made."""

    name = "llmrun-side"
    what = "the work"  # for an unexpected failure's message: "<what> failed: ..."
    request_errors: tuple[type[Exception], ...] = (LlamaError,)
    embeddings = False  # a pooled context (one vector per sequence) rather than logits
    last_only = False  # only each sequence's last token is an output (logits), else all
    n_seq = 4  # sequences one decode may hold

    def __init__(self, model: Model, n_ctx_seq: int, n_threads: int,
                 reply: Callable[[str, str, Any], None],
                 heartbeat: Callable[[], None] | None = None) -> None:
        self.model = model
        self.n_ctx_seq = n_ctx_seq
        self.n_threads = n_threads
        # An encoder has no KV cache: llama.cpp reads a whole decode as one ubatch whose
        # attention spans every row (masked per sequence), so a sequence's numbers depend on
        # the rows beside it, even of its own length (on the synthetic BERT of
        # tests/fakes/encodermodel.py, by up to 8e-4 without flash attention and 2e-3 with
        # it). Its inputs are therefore packed within one request only, in order, as plain
        # llama-cpp-python's Llama.embed packs a list (up to a batch of tokens): a request
        # gets the same numbers whatever else is queued, and the numbers llama-cpp-python
        # gives for the same list. One input per decode instead cost a third of the speed
        # (a bge-small-shaped BERT: 25 inputs/s against llama-server's 35, inputs of ~60
        # tokens, 2 threads).
        self.by_request = model.encoder_only
        if self.by_request:
            self.n_seq = ENCODER_SEQ
        self.reply = reply
        self.heartbeat = heartbeat
        self._ctx: Context | None = None
        self._jobs: queue.SimpleQueue[tuple[str, tuple[Any, ...]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def prepare(self, *args: Any) -> Job:
        raise NotImplementedError

    def queue(self, req_id: str, *args: Any) -> None:
        self._jobs.put((req_id, args))

    def stop(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (first := self._jobs.get()) is not None:
            pending = [first]
            stopping = False
            while True:  # every job queued meanwhile shares the decodes
                try:
                    more = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    stopping = True
                    break
                pending.append(more)
            jobs = []
            for req_id, args in pending:
                try:
                    job = self.prepare(*args)
                except Exception as exc:
                    self._fail(req_id, exc)
                    continue
                job.req_id = req_id
                jobs.append(job)
            self.run_jobs(jobs)
            if stopping:
                return

    def _fail(self, req_id: str, exc: Exception) -> None:
        """Answer one request's failure: 400 when it is the request's fault, else 500; the
        thread goes on with the others."""
        if isinstance(exc, self.request_errors):
            self.reply(req_id, "error", error_event("invalid_request", str(exc)))
        else:
            self.reply(req_id, "error", error_event(
                "internal", f"{self.what} failed: {type(exc).__name__}: {exc}"))

    def _finish(self, job: Job) -> None:
        try:
            kind, payload = job.finish(job.values)
        except Exception as exc:
            self._fail(job.req_id, exc)
            return
        self.reply(job.req_id, kind, payload)

    def run_jobs(self, jobs: list[Job]) -> None:
        """Decode every sequence of `jobs`, packed together (`_groups`), and answer each job
        as soon as its last sequence is read. A failed decode fails the jobs not answered."""
        flat: list[tuple[Job, int]] = []
        for job in jobs:
            job.values = [None] * len(job.sequences)
            job.left = len(job.sequences)
            flat += [(job, i) for i in range(len(job.sequences))]
            if not job.sequences:
                self._finish(job)
        if not flat:
            return
        try:
            ctx = self._context()
        except Exception as exc:
            for job in jobs:
                if job.sequences:
                    self._fail(job.req_id, exc)
            return
        sequences = [job.sequences[i] for job, i in flat]
        batch = Batch(self.n_ctx_seq)
        last_beat = time.monotonic()
        try:
            for group in self._groups(sequences, [id(job) for job, _ in flat]):
                last_beat = self._beat(last_beat)
                batch.clear()
                rows = []
                for seq, k in enumerate(group):
                    tokens = sequences[k]
                    for pos, tok in enumerate(tokens):
                        row = batch.add(tok, pos, seq,
                                        not self.last_only or pos == len(tokens) - 1)
                    rows.append(row)
                for seq in range(len(group)):
                    ctx.seq_rm(seq, -1, -1)
                if ctx.decode(batch) != 0:
                    raise LlamaError(f"llama_decode failed while {self.what}")
                for seq, k in enumerate(group):
                    job, i = flat[k]
                    job.values[i] = job.read(ctx, seq, rows[seq])
                    job.left -= 1
                    if job.left == 0:
                        self._finish(job)
        except Exception as exc:
            for job in jobs:
                if job.left > 0:
                    job.left = 0
                    self._fail(job.req_id, exc)
        finally:
            batch.close()

    def _context(self) -> Context:
        if self._ctx is None:
            # flash attention as llama.cpp chooses (on, on the CPU), for encoders too: without
            # it a bge-small-shaped BERT read 16-21 inputs/s against 21-27 with it (one input
            # per decode, ~100 tokens each, 2 threads), and llama-server uses it
            self._ctx = Context(self.model, n_ctx_seq=self.n_ctx_seq, n_seq=self.n_seq,
                                n_batch=self.n_ctx_seq, n_threads=self.n_threads,
                                embeddings=self.embeddings)
        return self._ctx

    def _groups(self, sequences: list[list[int]],
                owners: list[int] | None = None) -> list[list[int]]:
        """Indices of the token sequences to decode together: up to n_seq of the same length
        and n_ctx_seq tokens in all (one input may fill a whole batch on its own). Same
        length, because llama.cpp splits sequences of unequal length across micro-batches,
        and then a sequence's numbers are not those of the same sequence decoded alone: an
        embedding pooled only a part of the longer ones (a vector off by 0.13 beside a
        shorter input), and a rerank prompt's last tokens, read in a small slice of their
        own, went through other kernels (its score moved by up to 0.03 on SmolLM2 Q4_1, also
        when the decodes were sliced by hand so every micro-batch held equal parts).
        Sequences of one length decoded together come out the same to the bit as each
        alone. For an encoder (`by_request`), the groups of `_packed` instead."""
        if self.by_request:
            return self._packed(sequences, owners or [0] * len(sequences))
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

    def _packed(self, sequences: list[list[int]], owners: list[int]) -> list[list[int]]:
        """An encoder's groups: each request's (`owners`) sequences in order, as many to a
        decode as fit n_ctx_seq tokens and n_seq sequences, never two requests in one."""
        groups: list[list[int]] = []
        tokens = 0
        for i, seq in enumerate(sequences):
            last = groups[-1] if groups else None
            if last is not None and owners[last[0]] == owners[i] and len(last) < self.n_seq \
                    and tokens + len(seq) <= self.n_ctx_seq:
                last.append(i)
                tokens += len(seq)
            else:
                groups.append([i])
                tokens = len(seq)
        return groups

    def _beat(self, last: float) -> float:
        """Heartbeat if one is due; returns the time of the last one."""
        now = time.monotonic()
        if self.heartbeat is None or now - last < HEARTBEAT_SECONDS:
            return last
        self.heartbeat()
        return now
