"""Continuous batching: one thread owns the llama context and decodes every sequence together.

Each step builds one batch holding the next token of every generating sequence plus chunks of
prompts still being read (chunked prefill, so a long prompt never stalls the others), calls
`llama_decode` once, samples each sequence with its own sampler chain and hands all new text
to `emit` in one call. New requests join at the next step; finished ones leave at once.

Events (request id, kind, payload): a sequence placed in a slot first sends "started"
(`{"prompt_tokens", "cached_tokens", "n_ctx"}`: the cached prefix is known only then), then
"chunk"s, always a dict (`{"text"}`, plus `logprobs` or `prompt_logprobs` when asked), then
"done" with its statistics, or "error" (request.error_event: a code with its fields).

KV bookkeeping: a slot is one llama sequence id; `slot.tokens` is exactly the list of tokens
whose keys/values sit in that sequence's cells, positions 0..len-1. A new request goes to the
free slot sharing the longest prefix with its prompt, and only the rest is evaluated.

Images (a model with a vision projector): an image takes positions like tokens, written in
the prompt as negative stand-in ids derived from its content hash (`image_ids`), so prefix
reuse works across images as across text; `slot.images` records which image starts where,
and a match is cut back to any image whose content differs. An image is encoded only if the
slot does not already hold it, on the encoder thread (the vision encoder is the slow part:
others go on decoding meanwhile); its rows are then read like a prompt's tokens, a bounded
piece per step beside generating sequences, in a decode of their own (a batch holds tokens
or embeddings, not both).

Structured output: a sequence may carry an llguidance matcher (engine/constraint.py, built
off this thread). Each step the token masks of all constrained sequences are computed in one
parallel call into one bitmask array (a row per sequence), each sequence samples with its own
chain among the tokens its row allows, and its matcher consumes the token. A sequence without
a matcher does no mask work at all. A thinking model's thought stays free: the matcher starts
once the end-of-thought marker has been generated (`SeqParams.constrain_after`).

Failures: whatever one sequence brings (a grammar that does not build or reaches a dead end,
a sampler or text stream that raises) ends that sequence with an error event; the others go
on. Only a failure
of the step itself (building the batch, decoding) reaches `_run`, which fails every request
in flight and hands the exception to `on_fatal` (the runner process then exits, so the
daemon starts a fresh one rather than queueing requests to a thread that is gone).
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par

from llmrun.chat.textstream import TextStream
from llmrun.engine import constraint
from llmrun.engine.draft import (
    DRAFT_DEFAULT,
    DRAFT_MAX,
    PROBE_ROWS,
    Acceptance,
    DraftModel,
    History,
    StepCost,
    common_prefix,
    draft_length,
    probe_exact_rows,
)
from llmrun.engine.llama import (
    SMALL_TILE_ROWS,
    Batch,
    Context,
    EmbdBatch,
    ImageChunk,
    LlamaError,
    Model,
    Projector,
    Sampler,
    small_tiles_available,
)
from llmrun.engine.promptcache import Entry, PromptCache
from llmrun.engine.promptcost import PromptCost, attention_per_cell
from llmrun.engine.threads import ThreadGovernor
from llmrun.request import ChatRequest, ErrorCode, error_event

log = logging.getLogger(__name__)

Event = tuple[str, str, Any]  # (request id, "started" | "chunk" | "done" | "error", payload)

# The options that make a sequence's sampler chain (Options' names, engine/llama.py Sampler's).
SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_last_n",
                 "repeat_penalty", "presence_penalty", "frequency_penalty", "seed")

# After a step that produced no events (a long prompt being read), the engine still emits an
# empty list at most this often, so the daemon's watchdog tells slow progress from a hang.
HEARTBEAT_SECONDS = 1.0
# How often the step counters (EngineStats) go to the daemon, for /metrics; and whenever a
# sequence ends, so a finished request's steps are counted.
STATS_SECONDS = 1.0


@dataclass
class EngineStats:
    """Counters of the engine's steps since the runner started, and the latest budget: what
    /metrics shows of stall-free batching."""

    steps: int = 0
    step_seconds: float = 0.0
    mixed_steps: int = 0  # steps that read a prompt beside generating sequences
    prompt_tokens: int = 0  # prompt tokens read, in all steps
    step_seconds_max: float = 0.0  # the longest step since the last report
    budget_tokens: int = 0  # prompt tokens the last mixed step could read

    def payload(self) -> dict[str, Any]:
        out = dict(self.__dict__)
        self.step_seconds_max = 0.0
        return out
# With `shift` and no num_predict, generation still ends after this many contexts' worth of
# tokens: a request cannot hold its slot forever.
SHIFT_LIMIT = 10
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
# A saved prompt state is loaded only when it covers at least this many tokens more than the
# slot already holds (and a 64th of its own length: loading costs in proportion to it).
RESTORE_MIN_GAIN = 64
# A sliding-window model's prompt state is kept at a multiple of this many tokens (see
# _save_point): 64 is the KV tile of llama.cpp's CPU flash attention.
SWA_STATE_ALIGN = 64
# Image embeddings kept after their sequence (by content hash, least recently used out), so
# an image sent again is not encoded again even when no slot holds it any more.
IMAGE_CACHE_BYTES = 128 * 1024 * 1024


def image_ids(digest: str, n: int) -> list[int]:
    """Stand-in token ids for the `n` positions of the image with content hash `digest`:
    negative (no token is one), int32 (prompt-cache keys are), and the same for the same
    image. Equal ids are not trusted alone: `Slot.images` confirms the content."""
    h = int.from_bytes(hashlib.blake2b(digest.encode(), digest_size=8).digest())
    return [-1 - (h + i) % 0x7FFFFFFE for i in range(n)]


@dataclass
class SeqParams:
    sampling: dict[str, Any]
    max_tokens: int = -1  # -1: until the context is full
    stops: list[str] = field(default_factory=list)
    # structured output: an llguidance LLMatcher for this sequence alone (None: free)
    matcher: Any = None
    # tool_choice "auto": a constraint.Lazy, whose matcher becomes `matcher` once the model
    # begins a tool call (None: no steering, or it has started or given up)
    lazy: Any = None
    # a thinking model: the matcher starts after this end-of-thought marker is generated
    # (the prompt left the output inside a thought, or the model may open one itself)
    constrain_after: bytes | None = None
    # the model may open a thought with this marker: when its first token starts one, the
    # matcher waits for `constrain_after`; otherwise it applies from that first token
    think_open: bytes | None = None
    logprobs: int | None = None  # None: off; 0: the sampled token's; k: also the top k
    pieces: dict[int, bytes] = field(default_factory=dict)  # text for tokens shown as nothing
    context: bool = False  # report prompt + output token ids when done (Ollama's `context`)
    # score the prompt itself: each prompt token's logprob given the ones before it (and the
    # top k), sent as chunks with `prompt_logprobs` before any output; the prompt is then
    # evaluated whole (cached cells carry no logits)
    prompt_logprobs: int | None = None
    # keep the prompt's state when this many of its tokens are in the slot (a message
    # boundary, engine/promptcache.py); None: at the end of the prompt
    save_at: int | None = None
    # a full context drops its oldest half after `keep` tokens and generation goes on,
    # rather than ending with "length" (Ollama's `shift`)
    shift: bool = False
    keep: int = 0
    truncated: tuple[int, int] = (0, 0)  # (messages, tokens) the runner dropped to fit
    # most tokens guessed by prompt lookup and checked in the same decode (engine/draft.py);
    # 0: none (the default: opt-in, see DRAFT_DEFAULT). A constrained sequence never drafts.
    draft: int = DRAFT_DEFAULT
    # the prompt's images: (index of its first position in the prompt, its chunk); their
    # positions hold image_ids
    images: list[tuple[int, ImageChunk]] = field(default_factory=list)

    @classmethod
    def of(cls, req: ChatRequest, **engine: Any) -> SeqParams:
        """The parameters of `req` (its options already merged with the model's defaults);
        `engine` adds what the runner builds itself (matcher, pieces, gates)."""
        o = req.options
        return cls(sampling={k: getattr(o, k) for k in SAMPLING_KEYS},
                   max_tokens=o.num_predict if o.num_predict is not None else -1,
                   stops=list(o.stop or []), logprobs=req.logprobs,
                   context=req.return_context, prompt_logprobs=req.prompt_logprobs,
                   shift=bool(o.shift), keep=max(0, o.num_keep or 0),
                   draft=DRAFT_DEFAULT if o.num_draft is None else min(o.num_draft, DRAFT_MAX),
                   **engine)


@dataclass
class Slot:
    seq_id: int
    tokens: list[int] = field(default_factory=list)
    seq: Sequence | None = None
    images: dict[int, str] = field(default_factory=dict)  # first position -> content hash


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
    # with a matcher: None once it applies; "after": inside a thought, waiting for
    # params.constrain_after; "maybe": the first token may open a thought (params.think_open)
    gate: str | None = None
    tail: bytes = b""  # the last bytes generated while gate is "after" (marker search)
    shifted: int = 0  # context tokens dropped by shifts
    # a saved state read for it off the engine thread (None when the read found nothing)
    prefetched: tuple[Entry, bytearray | None] | None = None
    kept: int = 0  # of them, the head that stayed in place
    # prompt lookup (engine/draft.py): the tokens so far, how often guesses came true, the
    # tokens drafted in this step's batch after next_token, and a guess made but not sent
    history: History | None = None
    accept: Acceptance = field(default_factory=Acceptance)
    drafts: list[int] = field(default_factory=list)
    shadow: int | None = None
    drafted: int = 0
    accepted: int = 0
    model_drafts: bool = False  # guessed ahead by the draft model (else by prompt lookup)
    encoding: bool = False  # its images are with the encoder thread (text is read meanwhile)
    embeds: dict[str, np.ndarray] = field(default_factory=dict)  # image hash -> its rows

    @property
    def blocked(self) -> bool:
        """Waiting for the encoder: its next positions are an image's, not encoded yet."""
        return self.encoding and bool(self.pending) and self.pending[0] < 0


class ConstraintError(ValueError):
    """The sequence's grammar failed (a dead end, a limit): that request's fault (400)."""


class Engine:
    def __init__(self, model: Model, ctx: Context, *, n_ctx_seq: int, n_slots: int,
                 emit: Callable[[list[Event]], None],
                 on_fatal: Callable[[BaseException], None] | None = None,
                 governor: ThreadGovernor | None = None,
                 prompt_cache: PromptCache | None = None,
                 step_budget: tuple[float, int] = (0.0, 0),
                 projector: Projector | None = None,
                 drafter: DraftModel | None = None) -> None:
        self.model = model
        self.ctx = ctx
        self.n_ctx_seq = n_ctx_seq
        self.slots = [Slot(i) for i in range(n_slots)]
        self.batch = Batch(ctx.n_batch)
        self.emit = emit
        self.on_fatal = on_fatal  # None: the exception ends the thread (and is logged)
        self.governor = governor  # None: a fixed thread count
        self.prompt_cache = prompt_cache  # None: prefixes live only in the slots
        self.projector = projector  # None: a text-only model
        self.drafter = drafter  # None: drafts (when asked for) come from prompt lookup
        self.decode_token_s: float | None = None  # a generated token's share of a decode
        self.embd_batch = EmbdBatch(ctx.n_batch, projector.n_embd) if projector else None
        self._image_rows: dict[str, np.ndarray] = {}  # embeddings by image hash, oldest first
        self._encoder: threading.Thread | None = None
        self._to_encode: queue.SimpleQueue[tuple[Sequence, list[ImageChunk]] | None] = \
            queue.SimpleQueue()
        self._last_emit = time.monotonic()
        self.stats = EngineStats()
        self._last_stats = 0.0  # monotonic time the stats were last sent
        self._ended = False  # a sequence ended since then
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._waiting: deque[Sequence] = deque()
        self._loading: list[Sequence] = []  # waiting for their saved state to be read
        self._thread = threading.Thread(target=self._run, name="llmrun-engine", daemon=True)
        self._stopping = False
        # one row of llguidance's bitmask per slot: bit t%32 of int32 word t//32 is token t
        self._masks = np.zeros((n_slots, (model.n_vocab + 31) // 32), dtype=np.int32)
        self.step_cost = StepCost()  # what a row of a decode costs here, for drafting
        # stall-free batching: while others generate, a step reads at most this long (s) or
        # this many prompt tokens; (0, 0): no limit
        self.step_budget = step_budget
        # what a prompt token adds to a step that also decodes (the decode rows' own time
        # taken out), measured in the recent steps that read a prompt beside others
        self.prompt_cost = PromptCost(attention_per_cell(model), model.n_swa)
        self._saving_s = 0.0  # the time the last step spent keeping prompt states, after it
        self.image_min_chunk = MIN_PROMPT_CHUNK if ctx.flash_attn is False \
            else FLASH_PROMPT_CHUNK
        self.min_chunk = SMALL_TILE_CHUNK if ctx.flash_attn is not False and \
            small_tiles_available() else self.image_min_chunk
        # most rows a decode may hold with each row's logits exactly as if decoded alone
        # (draft.probe_exact_rows), by the bit length of the position drafted from: kernels
        # change with the context's length too (llama.cpp splits a single row's attention
        # over threads from 512 cells on). Probed when a sequence first drafts there.
        self.exact_rows: dict[int, int] = {}

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

    def _encode_loop(self) -> None:
        """The encoder thread: runs the vision encoder on the images a placed sequence
        needs, while the engine thread goes on decoding the others."""
        assert self.projector is not None
        while (job := self._to_encode.get()) is not None:
            seq, chunks = job
            try:
                t0 = time.perf_counter()
                rows = {chunk.digest: self.projector.encode(chunk) for chunk in chunks}
                log.info("request %s: %d image chunks (%d positions) encoded in %.2f s", seq.id,
                         len(chunks), sum(c.n_tokens for c in chunks), time.perf_counter() - t0)
                self._inbox.put(("encoded", (seq, rows)))
            except Exception as exc:
                self._inbox.put(("encoded", (seq, exc)))

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

    def _cancel(self, req_id: str) -> None:
        for seq in [*self._waiting, *self._loading]:
            if seq.id == req_id:
                if seq in self._waiting:
                    self._waiting.remove(seq)
                else:
                    self._loading.remove(seq)
                self.emit([(req_id, "done", self._stats(seq, "cancel"))])
        for seq in self._active():
            if seq.id == req_id:
                self._finish(seq, "cancel", [])
                return

    def _encoded(self, seq: Sequence, rows: dict[str, np.ndarray] | Exception) -> None:
        if seq.slot is None or seq.slot.seq is not seq:
            return  # cancelled meanwhile
        seq.encoding = False
        if isinstance(rows, Exception):
            events: list[Event] = []
            self._fail(seq, rows, events)
            self.emit(events)
            return
        seq.embeds.update(rows)
        for digest, value in rows.items():
            self._image_rows.pop(digest, None)
            self._image_rows[digest] = value
        total = sum(v.nbytes for v in self._image_rows.values())
        while total > IMAGE_CACHE_BYTES and len(self._image_rows) > 1:
            total -= self._image_rows.pop(next(iter(self._image_rows))).nbytes

    def _runnable(self) -> bool:
        """Whether a step has work: a sequence not waiting for its images, or one waiting
        for a free slot (_admit places it)."""
        return any(not s.blocked for s in self._active()) or (
            bool(self._waiting) and any(s.seq is None for s in self.slots))

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox(block=not self._runnable())
                self._admit()
                if any(not s.blocked for s in self._active()):
                    self._step()
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

    def _admit(self) -> None:
        events: list[Event] = []
        while self._waiting:
            free = [s for s in self.slots if s.seq is None]
            if not free:
                break
            seq = self._waiting.popleft()
            slot = max(free, key=lambda s: common_prefix(s.tokens, seq.prompt))
            if self._prefetch(seq, slot):
                continue
            try:
                self._place(seq, slot)
            except Exception as exc:
                # a grammar llama.cpp refuses is the request's fault; anything else is ours
                bad = isinstance(exc, LlamaError | ValueError)
                if not bad:
                    log.exception("request %s could not start", seq.id)
                events.append((seq.id, "error", error_event(
                    "invalid_request" if bad else "internal", _describe(exc))))
                continue
            events.append((seq.id, "started", {"prompt_tokens": len(seq.prompt),
                                               "cached_tokens": seq.cached,
                                               "n_ctx": self.n_ctx_seq}))
        if events:  # at once, not with the step: a queued request learns it has a slot
            self.emit(events)

    def _place(self, seq: Sequence, slot: Slot) -> None:
        seq.sampler = self._sampler(seq)  # first: if it fails, the slot is left as it was
        p = seq.params
        if p.matcher is not None and p.constrain_after:
            seq.gate = "maybe" if p.think_open else "after"
        n = common_prefix(slot.tokens, seq.prompt)
        for start, chunk in seq.params.images:  # an image's ids matched: is it the same?
            if start < n and slot.images.get(start) != chunk.digest:
                n = start
            elif start < n < start + chunk.n_tokens and self.projector is not None \
                    and self.projector.non_causal:
                n = start  # its rows attend to each other: all are read again, at once
        if seq.params.prompt_logprobs is not None:
            n = 0
        if n == len(seq.prompt):
            n -= 1  # the last prompt token must be evaluated to get logits to sample from
        if self.prompt_cache is not None:
            n = self._restore(seq, slot, n)
        if n > 0 and not self.ctx.seq_rm(slot.seq_id, n, -1):
            n = 0  # this memory cannot drop a tail (recurrent models): start the slot over
        if n == 0:
            self.ctx.seq_rm(slot.seq_id, -1, -1)
        del slot.tokens[n:]
        slot.images = {k: v for k, v in slot.images.items() if k < n}
        seq.text = TextStream(seq.params.stops)
        if seq.params.draft > 0 and seq.params.matcher is None and seq.params.lazy is None \
                and not seq.params.images:
            if self.drafter is not None:
                seq.model_drafts = True
            else:
                seq.history = History(seq.prompt)
        seq.cached = n
        seq.pending = seq.prompt[n:]
        seq.slot = slot
        seq.t_start = time.perf_counter()
        slot.seq = seq
        self._need_images(seq, n)

    def _need_images(self, seq: Sequence, n: int) -> None:
        """The embeddings of the images `seq` reads beyond the `n` positions its slot holds:
        from the cache, else from the encoder thread (the sequence waits; others go on)."""
        missing: dict[str, ImageChunk] = {}
        slot = seq.slot
        assert slot is not None
        for start, chunk in seq.params.images:
            slot.images[start] = chunk.digest  # (its positions join slot.tokens as read)
            if start + chunk.n_tokens <= n or chunk.digest in seq.embeds:
                continue
            rows = self._image_rows.get(chunk.digest)
            if rows is not None:
                seq.embeds[chunk.digest] = rows
            else:
                missing[chunk.digest] = chunk  # (once, if it comes twice)
        if missing:
            seq.encoding = True
            if self._encoder is None:
                self._encoder = threading.Thread(target=self._encode_loop, daemon=True,
                                                 name="llmrun-vision")
                self._encoder.start()
            self._to_encode.put((seq, list(missing.values())))

    def _restorable(self, seq: Sequence, n: int) -> tuple[Entry, int] | None:
        """The saved state to load for `seq` into a slot holding `n` of its tokens, and how
        many tokens of the prompt it gives: only when it gives clearly more than `n`."""
        assert self.prompt_cache is not None
        if seq.params.prompt_logprobs is not None:
            return None
        hit = self.prompt_cache.best(seq.prompt, whole=self.model.n_swa > 0)
        if hit is None:
            return None
        m = min(hit.n, len(seq.prompt) - 1)
        # loading costs in proportion to the whole saved state; reading a token, far more
        if m - n < max(RESTORE_MIN_GAIN, len(hit.entry.tokens) // 64):
            return None
        return hit.entry, m

    def _prefetch(self, seq: Sequence, slot: Slot) -> bool:
        """Start reading `seq`'s saved state off this thread if it is only on disk; the
        sequence waits aside (others go on) and comes back first in line once it is read."""
        if self.prompt_cache is None or seq.prefetched is not None:
            return False
        found = self._restorable(seq, common_prefix(slot.tokens, seq.prompt))
        if found is None or self.prompt_cache.in_memory(found[0]):
            return False
        entry = found[0]
        self._loading.append(seq)
        self.prompt_cache.load_later(
            entry, lambda data: self._inbox.put(("loaded", (seq, entry, data))))
        return True

    def _restore(self, seq: Sequence, slot: Slot, n: int) -> int:
        """Load the saved state sharing the longest prefix with `seq`'s prompt into `slot`
        when it covers clearly more than the slot's own `n` tokens; the tokens `slot` then
        holds of the prompt (its old content is gone once a state is loaded)."""
        assert self.prompt_cache is not None
        found = self._restorable(seq, n)
        if found is None:
            return n
        entry, m = found
        prefetched, seq.prefetched = seq.prefetched, None
        # read off this thread (_prefetch) when it was on disk; in memory, at once
        data = prefetched[1] if prefetched is not None and prefetched[0] is entry \
            else self.prompt_cache.load(entry)
        if data is None:
            return n
        self.ctx.seq_rm(slot.seq_id, -1, -1)
        slot.tokens.clear()
        slot.images.clear()
        if not self.ctx.state_seq_set(slot.seq_id, data):
            self.prompt_cache.drop(entry)
            return 0
        if m < len(entry.tokens) and not self.ctx.seq_rm(slot.seq_id, m, -1):
            self.ctx.seq_rm(slot.seq_id, -1, -1)  # cannot cut it back (recurrent memory)
            return 0
        slot.tokens.extend(entry.tokens[:m].tolist())
        log.info("request %s: %d prompt tokens restored from the prompt cache", seq.id, m)
        return m

    def _save_point(self, seq: Sequence) -> int:
        """How many prompt tokens `seq`'s slot holds when its state is to be kept."""
        at = seq.params.save_at
        point = at if at is not None and 0 < at < len(seq.prompt) else len(seq.prompt)
        if self.model.n_swa > 0:
            # Such a state holds only the window of the sliding layers, and a restore puts
            # its first cell at the stream's first: the cells then sit shifted from where a
            # straight read puts them, and attention sums in tiles of 64 cells (flash
            # attention's tiled path; 8-32 wide without it), so a shift that is not a
            # multiple of 64 changes the numbers (logits 1.3 apart on Gemma 3 270M).
            point -= point % SWA_STATE_ALIGN
        return point

    def _save_prompt(self, seq: Sequence) -> None:
        """Keep the state of a long prompt, read up to its save point (the slot holds exactly
        that many of its tokens now), unless it was mostly cached or is kept already."""
        cache, slot = self.prompt_cache, seq.slot
        assert cache is not None and slot is not None
        tokens = slot.tokens
        if len(tokens) - seq.cached < cache.min_tokens or cache.covers(tokens) \
                or (seq.params.images and min(tokens) < 0):
            return  # (a state holding an image is kept in its slot only)
        cache.add(list(tokens), self.ctx.state_seq_get(slot.seq_id))

    def _sampler(self, seq: Sequence) -> Sampler:
        p = seq.params
        sampler = Sampler(self.model, **p.sampling)
        try:
            # Penalties look at recent tokens: show the sampler the prompt it continues.
            last_n = p.sampling.get("repeat_last_n", 64)
            history = seq.prompt if last_n == -1 else seq.prompt[-last_n:] if last_n > 0 else []
            for tok in history:
                if tok >= 0:  # (an image's positions are no tokens)
                    sampler.accept(tok)
        except BaseException:
            sampler.close()
            raise
        return sampler

    def _step(self) -> None:
        if self.governor is not None:
            n_threads = self.governor.advise()
            if n_threads is not None:
                log.info("decoding with %d threads (other processes use %.1f cores)",
                         n_threads, self.governor.others)
                self.ctx.set_threads(n_threads)
        batch = self.batch
        batch.clear()
        saving, self._saving_s = self._saving_s, 0.0  # (the last step's, after its tokens)
        outputs: list[tuple[Sequence, int]] = []
        prefilling: list[Sequence] = []
        active = self._active()
        decoding = sum(seq.next_token is not None for seq in active)
        row_share = self.step_cost.row_share(decoding, decoding) if decoding else 0.0
        # no drafts beside a prompt being read: its rows would share the drafts' kernels
        reading = any(seq.pending and seq.next_token is None for seq in active)
        drafted: list[tuple[Sequence, Slot]] = []  # whose draft rows are in this batch
        guesses = self._model_drafts(active, row_share) if self.drafter and not reading else {}
        for seq in active:
            slot = seq.slot
            assert slot is not None
            if seq.next_token is not None:
                idx = batch.add(seq.next_token, len(slot.tokens), slot.seq_id, True)
                outputs.append((seq, idx))
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
                    drafted.append((seq, slot))
            elif seq.pending and not seq.blocked:
                prefilling.append(seq)
        generating = batch.n  # rows of sequences that generate; prompt rows follow them
        budget = batch.capacity - batch.n
        mixed = bool(outputs and prefilling)
        if mixed:  # others generate: a prompt is read in bounded chunks
            furthest = max((len(s.slot.tokens) for s in prefilling if s.slot), default=0)
            budget = min(budget, self._prompt_budget(batch.n, furthest, saving))
            self.stats.budget_tokens = budget
        # a prompt that fits the budget whole goes first (a short one is not stuck behind a
        # long one), then the oldest
        prefilling.sort(key=lambda s: (len(s.pending) > budget, s.submitted))
        # (seq, batch index of the logits, prompt token they score); index -1: the first token
        scored: list[tuple[Sequence, int, int]] = []
        fed: list[Sequence] = []  # sequences whose prompt this step reads further
        pieces: list[tuple[int, int]] = []  # what it reads of each: (cells before, tokens)
        image: tuple[Sequence, int] | None = None  # image rows this step reads: whose, how many
        whole = False  # a prompt read from its start to its end in this step
        for seq in prefilling:
            if budget <= 0:
                break
            slot = seq.slot
            assert slot is not None
            base = len(slot.tokens)
            if seq.pending[0] < 0:  # an image's rows next: one image piece per step
                if image is None:
                    image = (seq, self._image_piece(seq, budget, mixed))
                    pieces.append((base, image[1]))
                    budget -= image[1]
                    fed.append(seq)
                continue
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
                idx = batch.add(tok, base + i, slot.seq_id, final or score)
                if score and base + i == 0:
                    scored.append((seq, -1, tok))
                if score and not final:
                    scored.append((seq, idx, seq.prompt[base + i + 1]))
            slot.tokens.extend(chunk)
            pieces.append((base, len(chunk)))
            budget -= len(chunk)
            fed.append(seq)
            whole = whole or (base == seq.cached and not seq.pending)
            if not seq.pending:
                outputs.append((seq, idx))
        read = sum(n for _, n in pieces)  # prompt tokens (and image rows) this step reads
        t0 = time.perf_counter()
        if image is not None:
            rc = self._read_image(*image)
            if rc != 0:
                self._decode_failed(rc)
                return
        events: list[Event] = []
        sampling = 0.0  # seconds spent sampling between the two decodes of a split step
        if mixed and 0 < generating < batch.n:
            # Prompt pieces beside generating rows are decoded after those rows, apart: in
            # one llama_decode llama.cpp would put each piece's first token in a ubatch with
            # them (one token of each sequence), where attention sums it in another order
            # than a read alone does. Apart, a piece's rows take flash attention's tiled path
            # together (small_tiles), as they do in a read alone, and the generating rows
            # decode as in a step of their own; the weights are read twice either way.
            rc = self.ctx.decode(batch, rows=(0, generating))
            if rc != 0:
                self._decode_failed(rc)
                return
            t1 = time.perf_counter()
            self._sample([(seq, i) for seq, i in outputs if i < generating], [], t1, events)
            outputs = [(seq, i - generating) for seq, i in outputs if i >= generating]
            scored = [(seq, i - generating if i >= 0 else i, tok) for seq, i, tok in scored]
            sampling = time.perf_counter() - t1
            rc = self.ctx.decode(batch, small_tiles=not whole, rows=(generating, batch.n))
        else:
            rc = self.ctx.decode(batch, small_tiles=mixed and not whole) if batch.n else 0
        if rc != 0:
            if events:
                self.emit(events)
            self._decode_failed(rc)
            return
        elapsed = time.perf_counter() - t0 - sampling
        if log.isEnabledFor(logging.DEBUG):  # LLMRUN_DEBUG: where a stream's latency goes
            log.debug("step: %d rows, %d generating; prompt pieces (cells before, tokens) %s; "
                      "%.1f ms decoding, %.1f ms sampling between; %.1f ms keeping states "
                      "before it", batch.n, generating, pieces, elapsed * 1e3, sampling * 1e3,
                      saving * 1e3)
        st = self.stats
        st.steps += 1
        st.step_seconds += elapsed
        st.step_seconds_max = max(st.step_seconds_max, elapsed)
        if fed:
            st.prompt_tokens += read
            st.mixed_steps += mixed
        if not fed:  # every row is a token to sample: the steps drafting is weighed by
            self.step_cost.observe(batch.n, elapsed)
            if not drafted:
                per = elapsed / batch.n
                self.decode_token_s = per if self.decode_token_s is None else \
                    0.8 * self.decode_token_s + 0.2 * per
        elif mixed and read >= self.min_chunk:
            # (an image's rows cost about what tokens do)
            decode_rows = batch.n + (image[1] if image is not None else 0) - read
            self.prompt_cost.observe(pieces, elapsed - self._decode_time(decode_rows))
        now = time.perf_counter()
        for seq in (s for s in fed if s.pending):  # a prompt that takes steps: how far it
            # is (llama-server's prompt_progress), for clients that show it
            events.append((seq.id, "progress", {
                "total": len(seq.prompt), "cached": seq.cached,
                "processed": len(seq.slot.tokens) if seq.slot else 0}))
        self._sample(outputs, scored, now, events)
        for seq, slot in drafted:  # the cells of drafted tokens that did not come true
            seq.drafts = []
            self.ctx.seq_rm(slot.seq_id, len(slot.tokens), -1)
        clock = time.monotonic()
        if self._ended or clock - self._last_stats >= STATS_SECONDS:
            self._ended, self._last_stats = False, clock
            events.append(("", "engine", self.stats.payload()))
        if events or clock - self._last_emit >= HEARTBEAT_SECONDS:
            self._last_emit = clock
            self.emit(events)  # (empty: a heartbeat)
        self._saving_s = self._save_prompts(fed) if self.prompt_cache is not None else 0.0

    def _save_prompts(self, fed: list[Sequence]) -> float:
        """Keep the state of each prompt this step read up to its save point; returns the
        seconds that took. Done after the step's tokens went out, and charged to the next
        step's prompt budget: copying a state out takes 35 ms for 3,000 tokens of SmolLM2, and
        up to 230 ms on a VM where the copy's memory is fresh to the host, which inside the
        step put the streams beside it 390 ms apart. (Sampling does not change a sequence's
        cells, unless its first token made room by shifting them: then none is kept.)"""
        t0 = time.perf_counter()
        for seq in fed:
            if seq.slot is not None and not seq.shifted \
                    and len(seq.slot.tokens) == self._save_point(seq):
                try:
                    self._save_prompt(seq)
                except Exception:  # a cache that fails costs speed, never the answer
                    log.exception("prompt cache: saving a prompt failed")
        return time.perf_counter() - t0

    def _sample(self, outputs: list[tuple[Sequence, int]],
                scored: list[tuple[Sequence, int, int]], now: float,
                events: list[Event]) -> None:
        """After a decode: score the prompt rows in `scored`, then take each output's next
        token (and check its drafts) from the logits of the row it names."""
        if scored:
            self._score_prompt(scored, events)
        masks = self._compute_masks(outputs, events)
        for seq, idx in outputs:
            if seq.slot is None or seq.slot.seq is not seq:
                continue  # failed while its prompt was scored, or its mask
            try:
                self._output(seq, idx, now, events, masks.get(seq.id))
                if seq.drafts:
                    self._verify(seq, idx, events)
            except Exception as exc:
                self._fail(seq, exc, events)

    def _image_piece(self, seq: Sequence, budget: int, mixed: bool) -> int:
        """How many rows of the image `seq` reads next go in this step: what the budget
        allows (at least image_min_chunk beside others), or the whole image
        for a projector whose rows attend both ways (one decode, up to a batch)."""
        assert seq.slot is not None and self.projector is not None
        start, chunk = self._image_at(seq, len(seq.slot.tokens))
        left = start + chunk.n_tokens - len(seq.slot.tokens)
        if self.projector.non_causal:
            return left
        piece = max(budget, self.image_min_chunk) if mixed else budget
        return min(left, piece, self.embd_batch.capacity if self.embd_batch else 0)

    def _image_at(self, seq: Sequence, pos: int) -> tuple[int, ImageChunk]:
        for start, chunk in seq.params.images:
            if start <= pos < start + chunk.n_tokens:
                return start, chunk
        raise AssertionError(f"no image at position {pos}")

    def _read_image(self, seq: Sequence, n: int) -> int:
        """Decode the next `n` rows of the image `seq` is reading (their own decode: a batch
        holds tokens or embeddings). Returns llama_decode's code."""
        slot, batch, projector = seq.slot, self.embd_batch, self.projector
        assert slot is not None and batch is not None and projector is not None
        base = len(slot.tokens)
        start, chunk = self._image_at(seq, base)
        rows = seq.embeds[chunk.digest]
        batch.fill(rows[base - start: base - start + n], base, slot.seq_id)
        rc = self.ctx.decode(batch, causal=not projector.non_causal)
        if rc == 0:
            slot.tokens.extend(seq.pending[:n])
            del seq.pending[:n]
        return rc

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

    def _model_drafts(self, active: list[Sequence], row_share: float) -> dict[str, list[int]]:
        """The draft model's guesses for this step's generating sequences that draft with it
        (by request id), all made in its batched decodes before the step's own. A guess
        costs a row here and the draft model's time there: each sequence guesses as far as
        both are expected to pay (draft_length), within the rows that stay exact."""
        drafter = self.drafter
        assert drafter is not None
        share = row_share + self._drafter_share()
        used = sum(seq.next_token is not None for seq in active)
        wants: list[tuple[int, object, list[int], int, int]] = []
        owners: dict[int, Sequence] = {}
        for seq in active:
            slot = seq.slot
            if not seq.model_drafts or seq.next_token is None or slot is None:
                continue
            pos = len(slot.tokens)  # where its next token goes
            k = draft_length(seq.accept.p, share, self._draft_room(seq, pos, used))
            k = self._exact_drafts(seq, pos, k, used)
            if k > 0:
                wants.append((slot.seq_id, (seq.id, seq.shifted), slot.tokens, seq.next_token,
                              k))
                owners[slot.seq_id] = seq
                used += k
        if not wants:
            return {}
        try:
            made = drafter.propose(wants)
        except LlamaError:  # a draft costs speed, never the answer
            log.exception("the draft model failed; no drafts this step")
            return {}
        out = {}
        for slot_id, guess in made.items():
            owners[slot_id].drafted += len(guess)
            out[owners[slot_id].id] = guess
        return out

    def _drafter_share(self) -> float:
        """What a draft model's guess costs, over what a generated token costs here (0
        until both were measured)."""
        token_s = self.drafter.token_s if self.drafter is not None else None
        if token_s is None or not self.decode_token_s:
            return 0.0
        return token_s / self.decode_token_s

    def _draft_room(self, seq: Sequence, pos: int, used: int) -> int:
        """The most tokens `seq` may draft after its token at position `pos`, with `used`
        rows in the batch: within its num_draft, the rows known to stay exact there, the
        context and its num_predict (each kept draft and the token after it are output)."""
        rows = min(self.batch.capacity, self.exact_rows.get(pos.bit_length(), PROBE_ROWS))
        limit = min(seq.params.draft, rows - used, self.n_ctx_seq - pos - 2)
        if seq.params.max_tokens > 0:
            limit = min(limit, seq.params.max_tokens - seq.generated - 1)
        return limit

    def _exact_drafts(self, seq: Sequence, pos: int, k: int, used: int) -> int:
        """`k`, or fewer when the rows a decode may hold exactly from `pos` on are not
        known yet: they are probed then (in the sequence's own cells, from `pos`)."""
        where = pos.bit_length()
        if not k or where in self.exact_rows:
            return k
        slot = seq.slot
        assert slot is not None
        if self.n_ctx_seq - pos - 1 < PROBE_ROWS:
            return 0  # no room to probe in: another time
        exact = probe_exact_rows(self.ctx, slot.seq_id, pos, seq.prompt[-PROBE_ROWS:])
        self.exact_rows[where] = exact
        log.info("speculative decoding: from position %d, a decode of up to %d rows "
                 "gives each row the logits it has alone; drafts stay within that",
                 1 << (where - 1) if where else 0, exact)
        return max(0, min(k, exact - used))

    def _draft(self, seq: Sequence, row_share: float, used: int) -> list[int]:
        """The tokens to feed after `seq`'s next token (now the last of its slot, not yet
        decoded) as a guess of what follows, or none, when the batch holds `used` rows
        with those of the sequences still to add; a guess not worth its rows is kept to be
        checked against the token that comes (shadow)."""
        if seq.history is None:
            return []
        slot = seq.slot
        assert slot is not None
        pos = len(slot.tokens) - 1  # (its next token is in the slot's list already)
        limit = self._draft_room(seq, pos, used)
        guess = seq.history.propose(max(limit, 1))
        k = draft_length(seq.accept.p, row_share, min(limit, len(guess)))
        if k and pos.bit_length() not in self.exact_rows and \
                self.n_ctx_seq - pos - 1 < PROBE_ROWS:
            return []  # no room to probe the rows that stay exact: another time
        k = self._exact_drafts(seq, pos, k, used)
        seq.shadow = guess[0] if guess and not k else None
        seq.drafted += k
        return guess[:k]

    def _verify(self, seq: Sequence, idx: int, events: list[Event]) -> None:
        """Keep `seq`'s drafted tokens while its sampler, row by row, samples exactly them:
        row `idx` (its next token's) gave a token; when that is the first draft, whose row
        follows, the draft is in the cache already and its row gives the next token, and so
        on. The cells of the rest are dropped by the caller."""
        slot = seq.slot
        assert slot is not None and seq.sampler is not None
        hits, missed = 0, False
        for i, token in enumerate(seq.drafts):
            if slot.seq is not seq:
                break  # ended (a stop, the length, an end-of-generation token)
            if seq.next_token != token:
                missed = True
                break
            slot.tokens.append(token)
            seq.next_token = None
            hits += 1
            seq.accepted += 1
            row = idx + 1 + i
            self._on_token(seq, self.ctx.sample(seq.sampler, row), row, events)
        seq.accept.update(hits, missed)

    def _compute_masks(self, outputs: list[tuple[Sequence, int]],
                       events: list[Event]) -> dict[str, np.ndarray]:
        """The token masks of this step's constrained sequences (by request id), computed in
        one call across llguidance's threads, outside the GIL; none for free sequences."""
        todo = [seq for seq, _ in outputs
                if seq.params.matcher is not None and seq.gate != "after"
                and seq.params.max_tokens != 0 and seq.slot is not None
                and seq.slot.seq is seq]
        if not todo:
            return {}
        rows = self._masks[: len(todo)]  # leading rows of a C-contiguous array: contiguous
        try:
            fill_next_token_bitmask_par(constraint.executor(),
                                        [(seq.params.matcher, i) for i, seq in enumerate(todo)],
                                        rows)
        except Exception as exc:  # API misuse only (matchers report errors in-band)
            for seq in todo:
                self._fail(seq, exc, events)
            return {}
        return {seq.id: rows[i] for i, seq in enumerate(todo)}

    def _output(self, seq: Sequence, idx: int, now: float, events: list[Event],
                mask: np.ndarray | None = None) -> None:
        """Sample `seq`'s next token from batch row `idx` (among the tokens `mask` allows,
        for a constrained sequence) and hand its text on."""
        assert seq.sampler is not None
        if seq.params.max_tokens == 0:  # prompt only (scoring, or loading a prefix)
            seq.t_first = now
            self._finish(seq, "length", events)
            return
        matcher = seq.params.matcher
        if mask is None:
            token = self.ctx.sample(seq.sampler, idx)
        else:
            if matcher.is_error():
                raise ConstraintError(f"structured output failed: {matcher.get_error()}")
            if matcher.is_stopped():  # the grammar is complete: only EOS could follow
                if seq.generated == 0:
                    seq.t_first = now
                self._finish(seq, "stop", events)
                return
            token = self._sample_gated(seq, idx, mask) if seq.gate == "maybe" else \
                self.ctx.sample(seq.sampler, idx, mask)
            if seq.gate is None and not matcher.consume_token(token):
                raise ConstraintError(f"structured output failed: {matcher.get_error()}")
        if seq.generated == 0:
            seq.t_first = now
        self._on_token(seq, token, idx, events)

    def _sample_gated(self, seq: Sequence, idx: int, mask: np.ndarray) -> int:
        """The first token of a model that may think: sampled free; if it opens a thought
        (or is blank) the constraint waits, else the constraint applies from this token on
        (resampled under the mask when refused; the chain has then seen one extra token,
        which only its penalties notice)."""
        assert seq.sampler is not None
        token = self.ctx.sample(seq.sampler, idx)
        opener = seq.params.think_open or b""
        piece = (seq.params.pieces.get(token) if seq.params.pieces else None) \
            or self.model.piece(token)
        head = piece.lstrip()
        if not self.model.is_eog(token):
            if not head:
                return token  # blank: still undecided
            if head.startswith(opener) or opener.startswith(head):
                seq.gate = "after"
                return token
        seq.gate = None
        if not (int(mask[token >> 5]) >> (token & 31)) & 1:
            token = seq.sampler.sample_masked(self.ctx.logits(idx), mask)
        return token

    def _fail(self, seq: Sequence, exc: BaseException, events: list[Event]) -> None:
        """End `seq` alone with an error. Its slot keeps the cells decoded so far: they match
        `slot.tokens` (a token joins both only when it is decoded), so later requests may
        reuse them."""
        log.error("request %s failed", seq.id, exc_info=exc)
        if seq.slot is not None and seq.slot.seq is seq:
            seq.slot.seq = None
        seq.next_token = None
        seq.pending = []
        if seq.sampler is not None:
            seq.sampler.close()
        code: ErrorCode = "invalid_request" if isinstance(exc, ConstraintError) else "internal"
        events.append((seq.id, "error", error_event(code, _describe(exc))))

    def _on_token(self, seq: Sequence, token: int, idx: int, events: list[Event]) -> None:
        assert seq.slot is not None and seq.text is not None
        if seq.shadow is not None:  # the guess not sent last step: would it have come true?
            seq.accept.update(int(token == seq.shadow), token != seq.shadow)
            seq.shadow = None
        if self.model.is_eog(token):
            self._finish(seq, "stop", events)
            return
        seq.generated += 1
        if seq.history is not None:
            seq.history.append(token)
        if seq.params.context:
            seq.output.append(token)
        piece = seq.params.pieces.get(token) if seq.params.pieces else None
        if piece is None:
            piece = self.model.piece(token)
        if seq.gate == "after":
            self._await_marker(seq, piece)
        if seq.params.lazy is not None:
            self._steer(seq, piece)
        text = seq.text.push(piece)
        if seq.params.logprobs is not None:
            events.append((seq.id, "chunk", {"text": text, "logprobs": [
                self._logprob(token, piece, idx, seq.params.logprobs)]}))
        elif text:
            events.append((seq.id, "chunk", {"text": text}))
        if seq.text.stopped:
            self._finish(seq, "stop", events)
        elif seq.gate is None and seq.params.matcher is not None and \
                seq.params.matcher.is_stopped():
            # the grammar is complete and allows nothing more: end here rather than decode a
            # step only to sample the EOS the mask would force
            self._finish(seq, "stop", events)
        elif self._at_length(seq):
            self._finish(seq, "length", events)
        else:
            seq.next_token = token

    def _at_length(self, seq: Sequence) -> bool:
        """Whether `seq` has generated all it may: its num_predict, or a full context that
        it may not (or cannot) shift."""
        assert seq.slot is not None
        if seq.generated in (seq.params.max_tokens, SHIFT_LIMIT * self.n_ctx_seq):
            return True
        full = len(seq.slot.tokens) + 1 >= self.n_ctx_seq
        return full and not (seq.params.shift and self._shift(seq))

    def _shift(self, seq: Sequence) -> bool:
        """Make room in a full context: drop the older half of what follows the first
        `keep` tokens and move the rest back (llama.cpp shifts their positions); False when
        this memory cannot."""
        slot = seq.slot
        assert slot is not None
        keep = min(max(seq.params.keep, 1 if self.model.add_bos else 0), len(slot.tokens) // 2)
        discard = (len(slot.tokens) - keep) // 2
        if discard <= 0 or not self.ctx.shift(slot.seq_id, keep, discard):
            return False
        del slot.tokens[keep:keep + discard]
        slot.images.clear()  # (positions moved: no image is where it was)
        seq.shifted += discard
        seq.kept = keep
        return True

    def _steer(self, seq: Sequence, piece: bytes) -> None:
        """tool_choice "auto": once the output begins a tool call, its grammar constrains
        the rest (constraint.Lazy). Such a sequence never drafts: drafts bypass matchers."""
        lazy = seq.params.lazy
        matcher = lazy.feed(piece)
        if matcher is not None:  # (no gate waits: a sequence with lazy has no matcher yet)
            seq.params.matcher = matcher
        if lazy.over:
            seq.params.lazy = None

    @staticmethod
    def _await_marker(seq: Sequence, piece: bytes) -> None:
        """Inside a thought: the constraint starts with the token after the end marker."""
        marker = seq.params.constrain_after or b""
        tail = seq.tail + piece
        if marker in tail:
            seq.gate = None
            seq.tail = b""
        else:
            seq.tail = tail[-(len(marker) - 1):] if len(marker) > 1 else b""

    def _score_prompt(self, scored: list[tuple[Sequence, int, int]], events: list[Event]) -> None:
        """Prompt logprobs of this step's prefill chunks, one chunk per sequence. Index -1 is
        a prompt's first token, which has nothing before it to be scored against."""
        per_seq: dict[str, list[dict[str, Any]]] = {}
        failed: set[str] = set()
        for seq, idx, token in scored:
            if seq.id in failed:
                continue
            try:
                piece = self.model.piece(token)
                entry = ({"token": piece.decode("utf-8", "replace"), "logprob": None,
                          "bytes": list(piece), "top": []} if idx < 0
                         else self._logprob(token, piece, idx, seq.params.prompt_logprobs or 0))
            except Exception as exc:
                failed.add(seq.id)
                per_seq.pop(seq.id, None)
                self._fail(seq, exc, events)
                continue
            per_seq.setdefault(seq.id, []).append(entry)
        events += [(rid, "chunk", {"text": "", "prompt_logprobs": entries})
                   for rid, entries in per_seq.items()]

    def _logprob(self, token: int, piece: bytes, idx: int, top: int) -> dict[str, Any]:
        """Log-probability of the sampled token under the model's raw distribution (before
        temperature and truncation, as OpenAI reports it), with the `top` most likely."""
        logits = self.ctx.logits(idx)
        m = float(logits.max())
        log_z = m + float(np.log(np.exp(logits - m, dtype=np.float64).sum()))
        entry: dict[str, Any] = {
            "token": piece.decode("utf-8", "replace"),
            "logprob": _finite(float(logits[token]) - log_z),
            "bytes": list(piece),
            "top": [],
        }
        top = min(top, len(logits) - 1)  # argpartition needs kth < n
        if top > 0:
            best = np.argpartition(-logits, top)[:top]
            best = best[np.argsort(-logits[best])]
            entry["top"] = [(self.model.piece(int(t)).decode("utf-8", "replace"),
                             _finite(float(logits[t]) - log_z)) for t in best]
        return entry

    def _finish(self, seq: Sequence, reason: str, events: list[Event]) -> None:
        self._ended = True
        assert seq.slot is not None and seq.text is not None
        if reason != "cancel" and not seq.text.stopped:
            tail = seq.text.flush()
            if tail:
                events.append((seq.id, "chunk", {"text": tail}))
        if seq.pending:
            # cancelled mid-prompt: the slot's cells hold a prefix of this prompt; keep it
            seq.pending = []
        if seq.shifted:
            # moved keys are not what a fresh read gives: later requests reuse the head only
            self.ctx.seq_rm(seq.slot.seq_id, seq.kept, -1)
            del seq.slot.tokens[seq.kept:]
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
            "truncated_messages": seq.params.truncated[0],
            "truncated_tokens": seq.params.truncated[1],
            "shifted_tokens": seq.shifted,
            "draft_tokens": seq.drafted,
            "draft_accepted": seq.accepted,
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
            seq.slot.images.clear()
            seq.slot.seq = None
            if seq.sampler is not None:
                seq.sampler.close()
            events.append((seq.id, "error", error_event("internal", msg)))
        self.emit(events)


def _finite(logprob: float) -> float:
    """A logprob JSON can carry: a token the model rules out (a -inf logit) gets -9999.0, the
    value OpenAI reports for such tokens (NaN and infinities are not JSON)."""
    return logprob if logprob > -9999.0 else -9999.0


def _describe(exc: BaseException) -> str:
    """An exception as a request's error message (its type where the text alone is vague)."""
    if isinstance(exc, LlamaError | ValueError) and str(exc):
        return str(exc)
    return f"generation failed: {type(exc).__name__}: {exc}" if str(exc) else \
        f"generation failed: {type(exc).__name__}"
