"""Continuous batching: one thread owns the llama context and decodes every sequence together.

Each step builds one batch holding the next token of every generating sequence plus chunks of
prompts still being read (chunked prefill, so a long prompt never stalls the others), calls
`llama_decode` once, samples each sequence with its own sampler chain and hands all new text
to `emit` in one call. New requests join at the next step; finished ones leave at once.

KV bookkeeping: a slot is one llama sequence id; `slot.tokens` is exactly the list of tokens
whose keys/values sit in that sequence's cells, positions 0..len-1. A new request goes to the
free slot sharing the longest prefix with its prompt, and only the rest is evaluated.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from llmrun.engine.llama import Batch, Context, Model, Sampler
from llmrun.engine.textstream import TextStream

log = logging.getLogger(__name__)

Event = tuple[str, str, Any]  # (request id, "chunk" | "done" | "error", payload)


@dataclass
class SeqParams:
    sampling: dict[str, Any]
    max_tokens: int = -1  # -1: until the context is full
    stops: list[str] = field(default_factory=list)
    grammar: str | None = None
    logprobs: int | None = None  # None: off; 0: the sampled token's; k: also the top k
    pieces: dict[int, bytes] = field(default_factory=dict)  # text for tokens shown as nothing
    context: bool = False  # report prompt + output token ids when done (Ollama's `context`)
    # score the prompt itself: each prompt token's logprob given the ones before it (and the
    # top k), sent as one "prompt_logprobs" event before any output; the prompt is then
    # evaluated whole (cached cells carry no logits)
    prompt_logprobs: int | None = None


@dataclass
class Slot:
    seq_id: int
    tokens: list[int] = field(default_factory=list)
    seq: Sequence | None = None


@dataclass
class Sequence:
    id: str
    prompt: list[int]
    params: SeqParams
    submitted: float
    slot: Slot | None = None
    sampler: Sampler | None = None
    text: TextStream | None = None
    pending: list[int] = field(default_factory=list)  # tokens still to feed to the model
    cached: int = 0
    generated: int = 0
    output: list[int] = field(default_factory=list)  # only with params.context
    next_token: int | None = None
    t_start: float = 0.0
    t_first: float = 0.0


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class Engine:
    def __init__(self, model: Model, ctx: Context, *, n_ctx_seq: int, n_slots: int,
                 emit: Callable[[list[Event]], None]) -> None:
        self.model = model
        self.ctx = ctx
        self.n_ctx_seq = n_ctx_seq
        self.slots = [Slot(i) for i in range(n_slots)]
        self.batch = Batch(ctx.n_batch)
        self.emit = emit
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._waiting: deque[Sequence] = deque()
        self._thread = threading.Thread(target=self._run, name="llmrun-engine", daemon=True)
        self._stopping = False

    # -- called from other threads --------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, req_id: str, prompt: list[int], params: SeqParams) -> None:
        self._inbox.put(("submit", Sequence(req_id, prompt, params, time.perf_counter())))

    def cancel(self, req_id: str) -> None:
        self._inbox.put(("cancel", req_id))

    def stop(self) -> None:
        self._stopping = True
        self._inbox.put(("stop", None))
        self._thread.join(timeout=10)

    # -- the engine thread ----------------------------------------------------------------

    def _active(self) -> list[Sequence]:
        return [s.seq for s in self.slots if s.seq is not None]

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "submit":
                self._waiting.append(payload)
            elif kind == "cancel":
                self._cancel(payload)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _cancel(self, req_id: str) -> None:
        for seq in list(self._waiting):
            if seq.id == req_id:
                self._waiting.remove(seq)
                self.emit([(req_id, "done", self._stats(seq, "cancel"))])
        for seq in self._active():
            if seq.id == req_id:
                self._finish(seq, "cancel", [])
                return

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox(block=not self._active() and not self._waiting)
                self._admit()
                if self._active():
                    self._step()
        except Exception as exc:  # never die silently: fail everything in flight
            log.exception("engine thread failed")
            err = {"message": f"engine failed: {exc}", "status": 500}
            events: list[Event] = [(s.id, "error", err) for s in self._active()]
            events += [(s.id, "error", err) for s in self._waiting]
            self.emit(events)
            raise

    def _admit(self) -> None:
        while self._waiting:
            free = [s for s in self.slots if s.seq is None]
            if not free:
                return
            seq = self._waiting.popleft()
            slot = max(free, key=lambda s: common_prefix(s.tokens, seq.prompt))
            try:
                self._place(seq, slot)
            except Exception as exc:
                self.emit([(seq.id, "error", {"message": str(exc), "status": 500})])

    def _place(self, seq: Sequence, slot: Slot) -> None:
        n = common_prefix(slot.tokens, seq.prompt)
        if seq.params.prompt_logprobs is not None:
            n = 0
        if n == len(seq.prompt):
            n -= 1  # the last prompt token must be evaluated to get logits to sample from
        if n > 0 and not self.ctx.seq_rm(slot.seq_id, n, -1):
            n = 0  # this memory cannot drop a tail (recurrent models): start the slot over
        if n == 0:
            self.ctx.seq_rm(slot.seq_id, -1, -1)
        del slot.tokens[n:]
        p = seq.params
        seq.sampler = Sampler(self.model, grammar=p.grammar, **p.sampling)
        # Penalties look at recent tokens: show the sampler the prompt it continues.
        last_n = p.sampling.get("repeat_last_n", 64)
        history = seq.prompt if last_n == -1 else seq.prompt[-last_n:] if last_n > 0 else []
        for tok in history:
            seq.sampler.accept(tok)
        seq.text = TextStream(p.stops)
        seq.cached = n
        seq.pending = seq.prompt[n:]
        seq.slot = slot
        seq.t_start = time.perf_counter()
        slot.seq = seq

    def _step(self) -> None:
        batch = self.batch
        batch.clear()
        outputs: list[tuple[Sequence, int]] = []
        prefilling: list[Sequence] = []
        for seq in self._active():
            slot = seq.slot
            assert slot is not None
            if seq.next_token is not None:
                idx = batch.add(seq.next_token, len(slot.tokens), slot.seq_id, True)
                outputs.append((seq, idx))
                slot.tokens.append(seq.next_token)
                seq.next_token = None
            elif seq.pending:
                prefilling.append(seq)
        budget = batch.capacity - batch.n
        # (seq, batch index of the logits, prompt token they score); index -1: the first token
        scored: list[tuple[Sequence, int, int]] = []
        for seq in prefilling:
            if budget <= 0:
                break
            slot = seq.slot
            assert slot is not None
            chunk = seq.pending[:budget]
            del seq.pending[: len(chunk)]
            last = len(chunk) - 1
            base = len(slot.tokens)
            score = seq.params.prompt_logprobs is not None
            for i, tok in enumerate(chunk):
                final = i == last and not seq.pending
                idx = batch.add(tok, base + i, slot.seq_id, final or score)
                if score and base + i == 0:
                    scored.append((seq, -1, tok))
                if score and not final:
                    scored.append((seq, idx, seq.prompt[base + i + 1]))
            slot.tokens.extend(chunk)
            budget -= len(chunk)
            if not seq.pending:
                outputs.append((seq, idx))
        rc = self.ctx.decode(batch)
        if rc != 0:
            self._decode_failed(rc)
            return
        events: list[Event] = []
        now = time.perf_counter()
        if scored:
            self._score_prompt(scored, events)
        for seq, idx in outputs:
            assert seq.sampler is not None
            if seq.params.max_tokens == 0:  # prompt only (scoring, or loading a prefix)
                seq.t_first = now
                self._finish(seq, "length", events)
                continue
            token = self.ctx.sample(seq.sampler, idx)
            if seq.generated == 0:
                seq.t_first = now
            self._on_token(seq, token, idx, events)
        if events:
            self.emit(events)

    def _on_token(self, seq: Sequence, token: int, idx: int, events: list[Event]) -> None:
        assert seq.slot is not None and seq.text is not None
        if self.model.is_eog(token):
            self._finish(seq, "stop", events)
            return
        seq.generated += 1
        if seq.params.context:
            seq.output.append(token)
        piece = seq.params.pieces.get(token) if seq.params.pieces else None
        if piece is None:
            piece = self.model.piece(token)
        text = seq.text.push(piece)
        if seq.params.logprobs is not None:
            events.append((seq.id, "chunk", [text, [self._logprob(token, piece, idx,
                                                                  seq.params.logprobs)]]))
        elif text:
            events.append((seq.id, "chunk", text))
        if seq.text.stopped:
            self._finish(seq, "stop", events)
        elif seq.generated == seq.params.max_tokens or len(seq.slot.tokens) + 1 >= self.n_ctx_seq:
            self._finish(seq, "length", events)
        else:
            seq.next_token = token

    def _score_prompt(self, scored: list[tuple[Sequence, int, int]], events: list[Event]) -> None:
        """Prompt logprobs of this step's prefill chunks, one event per sequence. Index -1 is
        a prompt's first token, which has nothing before it to be scored against."""
        per_seq: dict[str, list[dict[str, Any]]] = {}
        for seq, idx, token in scored:
            piece = self.model.piece(token)
            entry = ({"token": piece.decode("utf-8", "replace"), "logprob": None,
                      "bytes": list(piece), "top": []} if idx < 0
                     else self._logprob(token, piece, idx, seq.params.prompt_logprobs or 0))
            per_seq.setdefault(seq.id, []).append(entry)
        events += [(rid, "prompt_logprobs", entries) for rid, entries in per_seq.items()]

    def _logprob(self, token: int, piece: bytes, idx: int, top: int) -> dict[str, Any]:
        """Log-probability of the sampled token under the model's raw distribution (before
        temperature and truncation, as OpenAI reports it), with the `top` most likely."""
        logits = self.ctx.logits(idx)
        m = float(logits.max())
        log_z = m + float(np.log(np.exp(logits - m, dtype=np.float64).sum()))
        entry: dict[str, Any] = {
            "token": piece.decode("utf-8", "replace"),
            "logprob": float(logits[token]) - log_z,
            "bytes": list(piece),
            "top": [],
        }
        if top > 0:
            best = np.argpartition(-logits, top)[:top]
            best = best[np.argsort(-logits[best])]
            entry["top"] = [(self.model.piece(int(t)).decode("utf-8", "replace"),
                             float(logits[t]) - log_z) for t in best]
        return entry

    def _finish(self, seq: Sequence, reason: str, events: list[Event]) -> None:
        assert seq.slot is not None and seq.text is not None
        if reason != "cancel" and not seq.text.stopped:
            tail = seq.text.flush()
            if tail:
                events.append((seq.id, "chunk", tail))
        if seq.pending:
            # cancelled mid-prompt: the slot's cells hold a prefix of this prompt; keep it
            seq.pending = []
        seq.slot.seq = None
        if seq.sampler is not None:
            seq.sampler.close()
        events.append((seq.id, "done", self._stats(seq, reason)))
        if reason == "cancel":
            self.emit(events)
            events.clear()

    def _stats(self, seq: Sequence, reason: str) -> dict[str, Any]:
        end = time.perf_counter()
        first = seq.t_first or end
        extra = {"context": seq.prompt + seq.output} if seq.params.context else {}
        return {
            **extra,
            "prompt_tokens": len(seq.prompt),
            "cached_tokens": seq.cached,
            "completion_tokens": seq.generated,
            "prompt_ns": int(((first - seq.t_start) if seq.t_start else 0) * 1e9),
            "generate_ns": int((end - first) * 1e9),
            "finish_reason": reason,
            "stop_sequence": seq.text.matched if seq.text is not None else None,
        }

    def _decode_failed(self, rc: int) -> None:
        # The batch was not applied (or only partly): forget what each slot thinks it holds,
        # so the next request on it recomputes from scratch rather than trusting stale cells.
        msg = "the KV cache is full" if rc == 1 else f"llama_decode failed ({rc})"
        events: list[Event] = []
        for seq in self._active():
            assert seq.slot is not None
            self.ctx.seq_rm(seq.slot.seq_id, -1, -1)
            seq.slot.tokens.clear()
            seq.slot.seq = None
            if seq.sampler is not None:
                seq.sampler.close()
            events.append((seq.id, "error", {"message": msg, "status": 500}))
        self.emit(events)
