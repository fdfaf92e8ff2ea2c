"""The side worker's one decode loop (engine/sidework.py) on a fake pooled context: jobs
queued while it works share its next decodes, sequences of one length only, and each job's
reply holds its own values in its own order; one job's bad input or a failed decode answers
with errors and the thread goes on."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import numpy as np

from llmrun.engine.llama import Batch, LlamaError
from llmrun.engine.sidework import Job, SideWorker


class PooledContext:
    """Records each decode's rows (seq, pos, token); a sequence's "embedding" is the sum of
    its tokens and its length, read from the last decode."""

    def __init__(self) -> None:
        self.decodes: list[list[tuple[int, int, int]]] = []
        self.fail_next = 0
        self._pooled: dict[int, list[int]] = {}

    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> bool:
        return True

    def decode(self, batch: Batch) -> int:
        if self.fail_next:
            rc, self.fail_next = self.fail_next, 0
            return rc
        raw = batch.raw
        rows = [(int(raw.seq_id[i][0]), int(raw.pos[i]), int(raw.token[i]))
                for i in range(batch.n)]
        self.decodes.append(rows)
        self._pooled = {}
        for seq, _, tok in rows:
            self._pooled.setdefault(seq, []).append(tok)
        return 0

    def embedding(self, seq: int) -> np.ndarray:
        tokens = self._pooled[seq]
        return np.array([sum(tokens), len(tokens)], dtype=np.float32)


class Worker(SideWorker):
    """Jobs are lists of token sequences; a sequence's value is (sum, length); a job whose
    first sequence is [0] sets `entered` and waits for `gate` while it is read (the worker
    is then busy)."""

    def __init__(self, encoder: bool = False) -> None:
        self.ctx = PooledContext()
        self.gate = threading.Event()
        self.entered = threading.Event()  # a gated job is being read
        self.replies: dict[str, tuple[str, Any]] = {}
        self.answered = threading.Semaphore(0)
        model = SimpleNamespace(encoder_only=encoder)
        super().__init__(model, n_ctx_seq=64, n_threads=1,  # type: ignore[arg-type]
                         reply=self._reply)

    def _reply(self, req_id: str, kind: str, payload: Any) -> None:
        self.replies[req_id] = (kind, payload)
        self.answered.release()

    def _context(self) -> Any:
        return self.ctx

    def prepare(self, sequences: list[list[int]]) -> Job:
        if any(not s for s in sequences):
            raise LlamaError("an empty sequence")

        def read(ctx: Any, seq: int, row: int) -> tuple[int, int]:
            if sequences[0] == [0]:
                self.entered.set()
                self.gate.wait(30)
            v = ctx.embedding(seq)
            return int(v[0]), int(v[1])

        def finish(values: list[Any]) -> tuple[str, dict[str, Any]]:
            return "values", {"values": values}

        return Job(sequences, read, finish)

    def wait(self, n: int) -> None:
        for _ in range(n):
            assert self.answered.acquire(timeout=30)


def owners(rows: list[tuple[int, int, int]]) -> set[str]:
    return {"a" if tok < 100 else "b" for _, _, tok in rows if tok}


def test_jobs_queued_meanwhile_share_decodes_and_get_their_own_values() -> None:
    w = Worker()
    w.queue("block", [[0]])
    assert w.entered.wait(30)  # busy: what comes now waits for the next round
    a = [[1, 2, 3], [4, 5], [6, 7, 8], [9]]
    b = [[101, 102, 103], [104, 105, 106], [107]]
    w.queue("a", a)
    w.queue("b", b)
    w.gate.set()
    w.wait(3)
    w.stop()
    assert w.replies["block"] == ("values", {"values": [(0, 1)]})
    assert w.replies["a"] == ("values", {"values": [(sum(s), len(s)) for s in a]})
    assert w.replies["b"] == ("values", {"values": [(sum(s), len(s)) for s in b]})
    decodes = w.ctx.decodes[1:]  # after the blocker's own
    # a's and b's sequences of one length went into the same decodes: 3 decodes for 7
    # sequences of lengths 1, 2, 3 (a job at a time would take 6)
    assert len(decodes) == 3
    assert sum(owners(rows) == {"a", "b"} for rows in decodes) == 2
    for rows in decodes:  # never two lengths in one decode
        lengths = {sum(1 for s, _, _ in rows if s == seq) for seq, _, _ in rows}
        assert len(lengths) == 1


def test_a_bad_job_or_a_failed_decode_answers_errors_and_the_worker_serves_on() -> None:
    w = Worker()
    w.queue("block", [[0]])
    assert w.entered.wait(30)
    w.queue("bad", [[1], []])
    w.queue("good", [[2, 3]])
    w.gate.set()
    w.wait(3)
    assert w.replies["bad"][0] == "error"
    assert w.replies["bad"][1]["code"] == "invalid_request"
    assert w.replies["good"] == ("values", {"values": [(5, 2)]})
    w.ctx.fail_next = -1
    w.queue("failed", [[4, 5]])
    w.wait(1)
    assert w.replies["failed"][0] == "error"
    assert "llama_decode failed" in w.replies["failed"][1]["message"]
    w.queue("after", [[6]])
    w.wait(1)
    w.stop()
    assert w.replies["after"] == ("values", {"values": [(6, 1)]})


def test_an_encoder_packs_each_request_apart_in_order() -> None:
    w = Worker(encoder=True)
    w.queue("block", [[0]])
    assert w.entered.wait(30)
    w.queue("a", [[1, 2], [3, 4, 5], [6]])
    w.queue("b", [[101, 102]])
    w.gate.set()
    w.wait(3)
    w.stop()
    assert w.replies["a"] == ("values", {"values": [(3, 2), (12, 3), (6, 1)]})
    assert w.replies["b"] == ("values", {"values": [(203, 2)]})
    # the block alone; a's three inputs of unequal lengths together, in order; b apart
    assert [sorted({seq for seq, _, _ in rows}) for rows in w.ctx.decodes] == \
        [[0], [0, 1, 2], [0]]
