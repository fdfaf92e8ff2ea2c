"""A fake model and context for the engine (engine/backend.py's protocols): no model is
loaded, and a decode costs microseconds, so the engine's bookkeeping (slots, the step
budget, cancels, prefix reuse, saved prompt states, finish reasons) is tested in milliseconds.

The fake "model" continues any text deterministically: the token after a sequence's last
cell is `FakeModel.follow(last)` (by default the next id, and the end-of-generation token
after the last id). The context keeps each KV sequence's cells as a list of token ids and
checks that every decoded row lands at the position right after its sequence's last cell,
so an engine that lost track of what a slot holds fails loudly here. Batches are
llama.cpp's own buffers (engine/llama/ `Batch`): the fake reads the arrays a decode reads.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from llmrun.engine.llama import Batch, EmbdBatch

EOS = 0  # the fake vocabulary's end-of-generation token


def count_up(last: int, n_vocab: int) -> int:
    """The default continuation: the next id, the end after the last id."""
    return last + 1 if 0 < last < n_vocab - 1 else EOS


class FakeSampler:
    """A greedy chain that remembers what it was shown (the prompt, for penalties)."""

    def __init__(self, **params: Any) -> None:
        self.params = params
        self.accepted: list[int] = []
        self.closed = False

    def accept(self, token: int) -> None:
        self.accepted.append(token)

    def sample_masked(self, logits: np.ndarray, mask: np.ndarray) -> int:
        allowed = np.unpackbits(mask.view(np.uint8), bitorder="little")[: len(logits)]
        ids = np.flatnonzero(allowed)
        token = int(ids[np.argmax(logits[ids])])
        self.accepted.append(token)
        return token

    def close(self) -> None:
        self.closed = True


class FakeModel:
    """A vocabulary of `n_vocab` ids, id 0 the end of generation; id t reads "<t>"."""

    def __init__(self, n_vocab: int = 64,
                 follow: Callable[[int, int], int] = count_up) -> None:
        self.n_vocab = n_vocab
        self.n_params = 1_000_000
        self.n_embd = 64
        self.n_layer = 4
        self.n_head = 4
        self.n_swa = 0
        self.add_bos = False
        self.follow = follow
        self.samplers: list[FakeSampler] = []

    def head_dims(self) -> tuple[int, int]:
        return 16, 16

    def piece(self, token: int) -> bytes:
        return b"" if token == EOS else f"<{token}>".encode()

    def is_eog(self, token: int) -> bool:
        return token == EOS

    def sampler(self, **params: Any) -> FakeSampler:
        sampler = FakeSampler(**params)
        self.samplers.append(sampler)
        return sampler


class FakeContext:
    """KV sequences as lists of token ids, with logits that pick `model.follow` of each
    decoded row's sequence. `decoded` records every decode's rows, (seq, pos, token)."""

    def __init__(self, model: FakeModel, *, n_seq: int, n_batch: int = 512,
                 can_shift: bool = True, can_cut: bool = True) -> None:
        self.model = model
        self.n_batch = n_batch
        self.flash_attn: bool | None = False  # the chunk sizes without flash attention's
        self.can_shift = can_shift
        self.can_cut = can_cut  # False: a tail cannot be dropped (recurrent memory)
        self.cells: list[list[int]] = [[] for _ in range(n_seq)]
        self.decoded: list[list[tuple[int, int, int]]] = []
        self.fail_next: int = 0  # the code the next decode returns (0: it works)
        self.threads: int | None = None
        self._logits: list[np.ndarray] = []

    def rows_of(self, seq: int) -> int:
        """Prompt and generated rows decoded for `seq` in all decodes so far."""
        return sum(s == seq for rows in self.decoded for s, _, _ in rows)

    def decode(self, batch: Batch | EmbdBatch, causal: bool = True,
               small_tiles: bool = False, rows: tuple[int, int] | None = None) -> int:
        if self.fail_next:
            rc, self.fail_next = self.fail_next, 0
            return rc
        assert isinstance(batch, Batch), "the fake reads no image rows"
        raw = batch.raw
        start, stop = rows if rows is not None else (0, batch.n)
        self._logits = []
        seen: list[tuple[int, int, int]] = []
        for i in range(start, stop):
            token, pos, seq = int(raw.token[i]), int(raw.pos[i]), int(raw.seq_id[i][0])
            cells = self.cells[seq]
            assert pos == len(cells), f"row at {pos} in sequence {seq} holding {len(cells)}"
            cells.append(token)
            seen.append((seq, pos, token))
            if raw.logits[i]:
                row = np.zeros(self.model.n_vocab, dtype=np.float32)
                row[self.model.follow(token, self.model.n_vocab)] = 10.0
                self._logits.append(row)
            else:
                self._logits.append(np.full(self.model.n_vocab, np.nan, dtype=np.float32))
        self.decoded.append(seen)
        return 0

    def set_threads(self, n_threads: int) -> None:
        self.threads = n_threads

    def sample(self, sampler: FakeSampler, index: int, mask: np.ndarray | None = None) -> int:
        if mask is not None:
            return sampler.sample_masked(self.logits(index), mask)
        return int(self.logits(index).argmax())

    def logits(self, index: int) -> np.ndarray:
        row = self._logits[index]
        assert not np.isnan(row[0]), f"no logits for batch row {index}"
        return row

    def seq_rm(self, seq: int, p0: int, p1: int = -1) -> bool:
        cells = self.cells[seq]
        if p0 < 0:
            cells.clear()
            return True
        if not self.can_cut and p0 < len(cells):
            return False
        del cells[p0:p1 if p1 >= 0 else None]
        return True

    def shift(self, seq: int, keep: int, discard: int) -> bool:
        if not self.can_shift:
            return False
        del self.cells[seq][keep:keep + discard]
        return True

    def state_seq_get(self, seq: int) -> bytearray:
        return bytearray(np.array(self.cells[seq], dtype=np.int32).tobytes())

    def state_seq_set(self, seq: int, data: bytearray) -> bool:
        if not data:
            return False
        assert not self.cells[seq], "a state loads into an empty sequence"
        self.cells[seq] = np.frombuffer(bytes(data), dtype=np.int32).tolist()
        return True


class Rig:
    """An Engine over a fake model and context, turned by hand (`turn`: one round of its
    loop, on the test's thread) and recording what it emits, by request id."""

    def __init__(self, *, slots: int = 2, n_ctx: int = 256, n_vocab: int = 64,
                 follow: Callable[[int, int], int] = count_up, **engine: Any) -> None:
        from llmrun.engine.batcher import Engine

        self.model = FakeModel(n_vocab, follow)
        self.ctx = FakeContext(self.model, n_seq=slots, **engine.pop("context", {}))
        self.events: dict[str, list[tuple[str, Any]]] = {}
        self.stats: list[dict[str, Any]] = []
        self.engine = Engine(self.model, self.ctx, n_ctx_seq=n_ctx, n_slots=slots,
                             emit=self._emit, **engine)
        self._n = 0

    def _emit(self, events: list[tuple[str, str, Any]]) -> None:
        for rid, kind, payload in events:
            if kind == "engine":
                self.stats.append(payload)
            else:
                self.events.setdefault(rid, []).append((kind, payload))

    def submit(self, prompt: list[int], **params: Any) -> str:
        from llmrun.engine.batcher import SeqParams

        self._n += 1
        rid = f"r{self._n}"
        sampling = {"temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
                    "typical_p": 1.0, "repeat_last_n": 0, "repeat_penalty": 1.0,
                    "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": 0}
        self.engine.submit(rid, prompt, SeqParams(sampling=sampling, **params))
        return rid

    def turn(self, n: int = 1) -> None:
        for _ in range(n):
            self.engine._turn(block=False)

    def run(self, *rids: str, limit: int = 1000) -> None:
        """Turn until every one of `rids` is done (or failed)."""
        for _ in range(limit):
            if all(self.final(r) is not None for r in rids):
                return
            self.turn()
        raise AssertionError(f"not done after {limit} turns: {rids}")

    def kinds(self, rid: str) -> list[str]:
        return [kind for kind, _ in self.events.get(rid, [])]

    def started(self, rid: str) -> dict[str, Any]:
        return next(p for k, p in self.events[rid] if k == "started")

    def final(self, rid: str) -> tuple[str, Any] | None:
        last = self.events.get(rid, [])[-1:]
        return last[0] if last and last[0][0] in ("done", "error") else None

    def done(self, rid: str) -> dict[str, Any]:
        final = self.final(rid)
        assert final is not None and final[0] == "done", final
        payload: dict[str, Any] = final[1]
        return payload

    def text(self, rid: str) -> str:
        return "".join(p["text"] for k, p in self.events.get(rid, []) if k == "chunk")
