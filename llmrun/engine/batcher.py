"""Continuous batching: one thread owns the llama context and decodes every sequence together.

Each step builds one batch holding the next token of every generating sequence plus chunks of
prompts still being read (chunked prefill, so a long prompt never stalls the others), calls
`llama_decode` once, samples each sequence with its own sampler chain and hands all new text
to `emit` in one call. New requests join at the next step; finished ones leave at once.

This module holds the step loop and its prompt budget; the rest of `Engine` is in layers
below it, one job each: engine/slots.py (admission, placement, the prompt cache's restore and
save), engine/encoder.py (the vision encoder thread and image rows), engine/sampling.py
(masks, grammar gates, logprobs, finish), engine/speculation.py (drafting), on the shared
state of engine/state.py; engine/sequence.py holds the request's and the slot's records and
the events, engine/backend.py what the engine needs of the model and its context.

Failures: whatever one sequence brings ends that sequence with an error event; the others go
on. Only a failure of the step itself (building the batch, decoding) reaches `_run`, which
fails every request in flight and hands the exception to `on_fatal` (the runner process then
exits, so the daemon starts a fresh one rather than queueing requests to a thread that is
gone).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from llmrun.engine.backend import Context, Model
from llmrun.engine.draft import DraftModel
from llmrun.engine.llama import SMALL_TILE_ROWS, Projector, small_tiles_available
from llmrun.engine.promptcache import PromptCache
from llmrun.engine.sequence import (
    SAMPLING_KEYS,
    EngineStats,
    Event,
    SeqParams,
    Sequence,
    Slot,
    image_ids,
)
from llmrun.engine.slots import Slots
from llmrun.engine.speculation import Speculation
from llmrun.engine.threads import ThreadGovernor
from llmrun.request import error_event

# (what the runner and the tests take from here with Engine)
__all__ = ["SAMPLING_KEYS", "Engine", "EngineStats", "Event", "SeqParams", "Slot", "image_ids"]

log = logging.getLogger(__name__)


# After a step that produced no events (a long prompt being read), the engine still emits an
# empty list at most this often, so the daemon's watchdog tells slow progress from a hang.
HEARTBEAT_SECONDS = 1.0
# How often the step counters (EngineStats) go to the daemon, for /metrics; and whenever a
# sequence ends, so a finished request's steps are counted.
STATS_SECONDS = 1.0

# Beside sequences that generate, a step reads at least this many prompt tokens (so a long
# prompt always moves on), and this many until the time of a prompt token is measured.
MIN_PROMPT_CHUNK = 8
FIRST_PROMPT_CHUNK = 16
# With flash attention on the CPU, a chunk under 64 rows takes llama.cpp's row-by-row
# attention path, at half the speed per token over a long context (docs/benchmarks.md,
# stall-free batching), which would double the long prompt's time for what it saves the
# others. And llama.cpp splits a step over separate KV streams into a first ubatch holding
# one token of every sequence, then the rest of the prompt's chunk: 65 keeps that rest at 64.
# A step that reads beside others lowers that path's threshold to SMALL_TILE_ROWS where the
# build allows it (scripts/llama-patches/0003): there 18 is enough. (Image rows are read in
# a decode of their own, without it: 65.)
FLASH_PROMPT_CHUNK = 65
SMALL_TILE_CHUNK = SMALL_TILE_ROWS + 1


@dataclass
class StepPlan:
    """What one step decodes, as its batch is built: the rows whose logits give a token,
    the drafts, the prompt pieces read."""

    outputs: list[tuple[Sequence, int]] = field(default_factory=list)  # (seq, its row)
    prefilling: list[Sequence] = field(default_factory=list)  # reading a prompt
    drafted: list[tuple[Sequence, Slot]] = field(default_factory=list)  # with draft rows
    # (seq, batch index of the logits, prompt token they score); index -1: the first token
    scored: list[tuple[Sequence, int, int]] = field(default_factory=list)
    fed: list[Sequence] = field(default_factory=list)  # whose prompt this step reads further
    pieces: list[tuple[int, int]] = field(default_factory=list)  # each: (cells before, tokens)
    image: tuple[Sequence, int] | None = None  # image rows this step reads: whose, how many
    whole: bool = False  # a prompt read from its start to its end in this step
    generating: int = 0  # rows of sequences that generate; prompt rows follow them
    mixed: bool = False  # a prompt is read beside generating sequences

    @property
    def read(self) -> int:
        """Prompt tokens (and image rows) this step reads."""
        return sum(n for _, n in self.pieces)


class Engine(Slots, Speculation):
    """The engine thread's loop: takes requests in, steps, and hands events to `emit`."""

    def __init__(self, model: Model, ctx: Context, *, n_ctx_seq: int, n_slots: int,
                 emit: Callable[[list[Event]], None],
                 on_fatal: Callable[[BaseException], None] | None = None,
                 governor: ThreadGovernor | None = None,
                 prompt_cache: PromptCache | None = None,
                 step_budget: tuple[float, int] = (0.0, 0),
                 projector: Projector | None = None,
                 drafter: DraftModel | None = None) -> None:
        super().__init__(model, ctx, n_ctx_seq=n_ctx_seq, n_slots=n_slots, emit=emit,
                         on_fatal=on_fatal, governor=governor, prompt_cache=prompt_cache,
                         step_budget=step_budget, projector=projector, drafter=drafter)
        # the least a step reads of a prompt beside others (the budget's floor, see above)
        self.image_min_chunk = MIN_PROMPT_CHUNK if ctx.flash_attn is False \
            else FLASH_PROMPT_CHUNK
        self.min_chunk = SMALL_TILE_CHUNK if ctx.flash_attn is not False and \
            small_tiles_available() else self.image_min_chunk
        self._thread = threading.Thread(target=self._run, name="llmrun-engine", daemon=True)

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
        self._to_encode.put(None)
        self._thread.join(timeout=10)

    # -- the engine thread ----------------------------------------------------------------

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, payload = item
            if kind == "submit":
                self._waiting.append(payload)
            elif kind == "loaded":
                seq, entry, data = payload
                if seq in self._loading:  # (not cancelled meanwhile)
                    self._loading.remove(seq)
                    seq.prefetched = (entry, data)
                    self._waiting.appendleft(seq)
            elif kind == "cancel":
                self._cancel(payload)
            elif kind == "encoded":
                self._encoded(*payload)
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _runnable(self) -> bool:
        """Whether a step has work: a sequence not waiting for its images, or one waiting
        for a free slot (_admit places it)."""
        return any(not s.blocked for s in self._active()) or (
            bool(self._waiting) and any(s.seq is None for s in self.slots))

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._turn(block=not self._runnable())
        except Exception as exc:  # never die silently: fail everything in flight
            log.exception("engine thread failed")
            err = error_event("runner_failed", f"the model runner's engine failed "
                                               f"({type(exc).__name__}) and will be restarted")
            events: list[Event] = [(s.id, "error", err) for s in self._active()]
            events += [(s.id, "error", err) for s in (*self._waiting, *self._loading)]
            try:
                self.emit(events)
            finally:
                if self.on_fatal is None:
                    raise
                self.on_fatal(exc)

    def _turn(self, block: bool) -> None:
        """One round of the loop: take in what came (waiting for it when `block`), place
        what waits for a slot, and step when a sequence can move."""
        self._drain_inbox(block=block)
        self._admit()
        if any(not s.blocked for s in self._active()):
            self._step()

    def _step(self) -> None:
        """One step: a batch of every generating sequence's next token (and its drafts), and
        of prompt chunks within the budget; decoded, sampled, and its events emitted."""
        self._advise_threads()
        self.batch.clear()
        saving, self._saving_s = self._saving_s, 0.0  # (the last step's, after its tokens)
        plan = StepPlan()
        self._add_generating(plan, self._active())
        self._add_prompts(plan, saving)
        t0 = time.perf_counter()
        events: list[Event] = []
        sampling = self._decode(plan, events)
        if sampling is None:
            return
        self._measure(plan, time.perf_counter() - t0 - sampling, sampling, saving)
        now = time.perf_counter()
        for seq in (s for s in plan.fed if s.pending):  # a prompt that takes steps: how far
            # it is (llama-server's prompt_progress), for clients that show it
            events.append((seq.id, "progress", {
                "total": len(seq.prompt), "cached": seq.cached,
                "processed": len(seq.slot.tokens) if seq.slot else 0}))
        self._sample(plan.outputs, plan.scored, now, events)
        for seq, slot in plan.drafted:  # the cells of drafted tokens that did not come true
            seq.drafts = []
            self.ctx.seq_rm(slot.seq_id, len(slot.tokens), -1)
        clock = time.monotonic()
        if self._ended or clock - self._last_stats >= STATS_SECONDS:
            self._ended, self._last_stats = False, clock
            events.append(("", "engine", self.stats.payload()))
        if events or clock - self._last_emit >= HEARTBEAT_SECONDS:
            self._last_emit = clock
            self.emit(events)  # (empty: a heartbeat)
        self._saving_s = self._save_prompts(plan.fed) if self.prompt_cache is not None else 0.0

    def _advise_threads(self) -> None:
        if self.governor is not None:
            n_threads = self.governor.advise()
            if n_threads is not None:
                log.info("decoding with %d threads (other processes use %.1f cores)",
                         n_threads, self.governor.others)
                self.ctx.set_threads(n_threads)

    def _add_generating(self, plan: StepPlan, active: list[Sequence]) -> None:
        """Each generating sequence's next token, then its drafts; the sequences reading a
        prompt (not waiting for an image) go to `plan.prefilling`."""
        batch = self.batch
        decoding = sum(seq.next_token is not None for seq in active)
        row_share = self.step_cost.row_share(decoding, decoding) if decoding else 0.0
        # no drafts beside a prompt being read: its rows would share the drafts' kernels
        reading = any(seq.pending and seq.next_token is None for seq in active)
        guesses = self._model_drafts(active, row_share) if self.drafter and not reading else {}
        for seq in active:
            slot = seq.slot
            assert slot is not None
            if seq.next_token is not None:
                idx = batch.add(seq.next_token, len(slot.tokens), slot.seq_id, True)
                plan.outputs.append((seq, idx))
                slot.tokens.append(seq.next_token)
                seq.next_token = None
                decoding -= 1
                if seq.model_drafts:
                    seq.drafts = guesses.get(seq.id, [])
                elif not reading:
                    seq.drafts = self._draft(seq, row_share, batch.n + decoding)
                for i, tok in enumerate(seq.drafts):
                    batch.add(tok, len(slot.tokens) + i, slot.seq_id, True)
                if seq.drafts:
                    plan.drafted.append((seq, slot))
            elif seq.pending and not seq.blocked:
                plan.prefilling.append(seq)

    def _add_prompts(self, plan: StepPlan, saving: float) -> None:
        """Prompt chunks after the generating rows: all a batch holds when no sequence
        generates, else what the budget allows (`saving`: seconds the last step spent
        after its tokens went out, keeping prompt states)."""
        batch = self.batch
        plan.generating = batch.n
        budget = batch.capacity - batch.n
        plan.mixed = bool(plan.outputs and plan.prefilling)
        if plan.mixed:  # others generate: a prompt is read in bounded chunks
            furthest = max((len(s.slot.tokens) for s in plan.prefilling if s.slot), default=0)
            budget = min(budget, self._prompt_budget(batch.n, furthest, saving))
            self.stats.budget_tokens = budget
        # a prompt that fits the budget whole goes first (a short one is not stuck behind a
        # long one), then the oldest
        plan.prefilling.sort(key=lambda s: (len(s.pending) > budget, s.submitted))
        for seq in plan.prefilling:
            if budget <= 0:
                break
            assert seq.slot is not None
            base = len(seq.slot.tokens)
            if seq.pending[0] < 0:  # an image's rows next: one image piece per step
                if plan.image is None:
                    plan.image = (seq, self._image_piece(seq, budget, plan.mixed))
                    plan.pieces.append((base, plan.image[1]))
                    budget -= plan.image[1]
                    plan.fed.append(seq)
                continue
            budget -= self._add_chunk(plan, seq, base, budget)

    def _add_chunk(self, plan: StepPlan, seq: Sequence, base: int, budget: int) -> int:
        """The next chunk of `seq`'s prompt, `base` tokens in, within `budget`: up to its
        save point or its next image; how many tokens that is."""
        slot = seq.slot
        assert slot is not None
        size = budget
        if self.prompt_cache is not None:
            point = self._save_point(seq)
            if base < point:
                size = min(size, point - base)  # end a chunk at the save point
        chunk = seq.pending[:size]
        if seq.params.images:  # text up to the next image
            cut = next((i for i, tok in enumerate(chunk) if tok < 0), len(chunk))
            chunk = chunk[:cut]
        del seq.pending[: len(chunk)]
        last = len(chunk) - 1
        score = seq.params.prompt_logprobs is not None
        for i, tok in enumerate(chunk):
            final = i == last and not seq.pending
            idx = self.batch.add(tok, base + i, slot.seq_id, final or score)
            if score and base + i == 0:
                plan.scored.append((seq, -1, tok))
            if score and not final:
                plan.scored.append((seq, idx, seq.prompt[base + i + 1]))
        slot.tokens.extend(chunk)
        plan.pieces.append((base, len(chunk)))
        plan.fed.append(seq)
        plan.whole = plan.whole or (base == seq.cached and not seq.pending)
        if not seq.pending:
            plan.outputs.append((seq, idx))
        return len(chunk)

    def _decode(self, plan: StepPlan, events: list[Event]) -> float | None:
        """Decode the step's batch (and its image rows); the seconds spent sampling between
        the two decodes of a split step, or None when a decode failed (every request in
        flight has then failed)."""
        batch, generating = self.batch, plan.generating
        if plan.image is not None:
            rc = self._read_image(*plan.image)
            if rc != 0:
                self._decode_failed(rc)
                return None
        sampling = 0.0
        if plan.mixed and 0 < generating < batch.n:
            # Prompt pieces beside generating rows are decoded after those rows, apart: in
            # one llama_decode llama.cpp would put each piece's first token in a ubatch with
            # them (one token of each sequence), where attention sums it in another order
            # than a read alone does. Apart, a piece's rows take flash attention's tiled path
            # together (small_tiles), as they do in a read alone, and the generating rows
            # decode as in a step of their own; the weights are read twice either way.
            rc = self.ctx.decode(batch, rows=(0, generating))
            if rc != 0:
                self._decode_failed(rc)
                return None
            t1 = time.perf_counter()
            self._sample([(seq, i) for seq, i in plan.outputs if i < generating], [], t1,
                         events)
            plan.outputs = [(seq, i - generating) for seq, i in plan.outputs
                            if i >= generating]
            plan.scored = [(seq, i - generating if i >= 0 else i, tok)
                           for seq, i, tok in plan.scored]
            sampling = time.perf_counter() - t1
            rc = self.ctx.decode(batch, small_tiles=not plan.whole, rows=(generating, batch.n))
        else:
            rc = self.ctx.decode(batch, small_tiles=plan.mixed and not plan.whole) \
                if batch.n else 0
        if rc != 0:
            if events:
                self.emit(events)
            self._decode_failed(rc)
            return None
        return sampling

    def _measure(self, plan: StepPlan, elapsed: float, sampling: float, saving: float) -> None:
        """Count the step (EngineStats), and learn from its `elapsed` decode time what a
        row costs: a generated token's (drafting, the budget), a prompt token's (the
        budget)."""
        batch, read = self.batch, plan.read
        if log.isEnabledFor(logging.DEBUG):  # LLMRUN_DEBUG: where a stream's latency goes
            log.debug("step: %d rows, %d generating; prompt pieces (cells before, tokens) %s; "
                      "%.1f ms decoding, %.1f ms sampling between; %.1f ms keeping states "
                      "before it", batch.n, plan.generating, plan.pieces, elapsed * 1e3,
                      sampling * 1e3, saving * 1e3)
        st = self.stats
        st.steps += 1
        st.step_seconds += elapsed
        st.step_seconds_max = max(st.step_seconds_max, elapsed)
        if plan.fed:
            st.prompt_tokens += read
            st.mixed_steps += plan.mixed
        if not plan.fed:  # every row is a token to sample: the steps drafting is weighed by
            self.step_cost.observe(batch.n, elapsed)
            if not plan.drafted:
                per = elapsed / batch.n
                self.decode_token_s = per if self.decode_token_s is None else \
                    0.8 * self.decode_token_s + 0.2 * per
        elif plan.mixed and read >= self.min_chunk:
            # (an image's rows cost about what tokens do)
            decode_rows = batch.n + (plan.image[1] if plan.image is not None else 0) - read
            self.prompt_cost.observe(plan.pieces, elapsed - self._decode_time(decode_rows))

    def _prompt_budget(self, decode_rows: int, base: int, spent: float = 0.0) -> int:
        """Prompt tokens a step may read beside `decode_rows` rows of generating sequences
        (LLMRUN_STEP_BUDGET), for a prompt already `base` tokens in, when `spent` seconds
        since the last tokens went out are gone already: Sarathi-Serve's stall-free
        batching, so that a long prompt costs the others a bounded delay per token rather
        than a freeze."""
        seconds, tokens = self.step_budget
        if tokens:
            return max(1, tokens)
        if seconds <= 0:
            return self.batch.capacity
        left = seconds - self._decode_time(decode_rows) - spent
        fits = self.prompt_cost.fit(base, left, self.batch.capacity)
        if fits is None:
            return max(FIRST_PROMPT_CHUNK, self.min_chunk)
        return max(self.min_chunk, fits)

    def _decode_time(self, rows: int) -> float:
        """About how long a decode of `rows` generating rows takes (0 until measured): a
        step's part that does not depend on the prompt chunk beside them."""
        return (self.decode_token_s or 0.0) * rows

    def _decode_failed(self, rc: int) -> None:
        # The batch was not applied (or only partly): forget what each slot thinks it holds,
        # so the next request on it recomputes from scratch rather than trusting stale cells.
        msg = "the KV cache is full" if rc == 1 else f"llama_decode failed ({rc})"
        events: list[Event] = []
        for seq in self._active():
            assert seq.slot is not None
            self.ctx.seq_rm(seq.slot.seq_id, -1, -1)
            seq.slot.tokens.clear()
            seq.slot.images.clear()
            seq.slot.seq = None
            if seq.sampler is not None:
                seq.sampler.close()
            events.append((seq.id, "error", error_event("internal", msg)))
        self.emit(events)
