"""Sequences into slots: admission, placement, cancels, and the prompt cache's restore and save.

A realtime session's requests go to the slot that session used last, which others take
only when no other slot is free: the session's sequence stays in its cells between
requests, so each request reads only the sound and text that are new.

A new request goes to the free slot sharing the longest prefix with its prompt, and only the
rest is evaluated; a match is cut back to any image whose content differs. With a prompt
cache, a saved state covering clearly more of the prompt is loaded instead (read off the
engine thread first when it is only on disk), and a prompt read up to its save point has its
state kept after the step that read it.
"""

from __future__ import annotations

import logging
import time

from llmrun.chat.textstream import TextStream
from llmrun.engine.draft import History, common_prefix
from llmrun.engine.encoder import Encoder
from llmrun.engine.llama import LlamaError
from llmrun.engine.promptcache import Entry
from llmrun.engine.sequence import Event, Sequence, Slot, describe
from llmrun.request import error_event

log = logging.getLogger(__name__)

# A saved prompt state is loaded only when it covers at least this many tokens more than the
# slot already holds (and a 64th of its own length: loading costs in proportion to it).
RESTORE_MIN_GAIN = 64
# A sliding-window model's prompt state is kept at a multiple of this many tokens (see
# _save_point): 64 is the KV tile of llama.cpp's CPU flash attention.
SWA_STATE_ALIGN = 64
# A realtime session's slot is kept for it this long after its last request began (the
# daemon closes a session silent for 120 s; a session's requests come every piece of sound).
SESSION_KEEP_SECONDS = 150.0


class Slots(Encoder):
    """Which slot a request takes, what it reuses there, and the prompt states kept."""

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

    def _admit(self) -> None:
        events: list[Event] = []
        while self._waiting:
            free = [s for s in self.slots if s.seq is None]
            if not free:
                break
            seq = self._waiting.popleft()
            slot = self._choose(free, seq)
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
                    "invalid_request" if bad else "internal", describe(exc))))
                continue
            events.append((seq.id, "started", {"prompt_tokens": len(seq.prompt),
                                               "cached_tokens": seq.cached,
                                               "n_ctx": self.n_ctx_seq}))
        if events:  # at once, not with the step: a queued request learns it has a slot
            self.emit(events)

    def _choose(self, free: list[Slot], seq: Sequence) -> Slot:
        """The free slot for `seq`: its session's own slot, else the one sharing the longest
        prefix with its prompt among those no live session keeps (a kept one only when no
        other is free: a session's slot is a preference, never a reservation)."""
        now = time.monotonic()
        session = seq.params.session
        for slot in free:
            if slot.owner is not None and slot.owned_until < now:
                slot.owner = None  # its session went quiet
        mine = [s for s in free if session is not None and s.owner == session]
        unowned = [s for s in free if s.owner is None]
        slot = max(mine or unowned or free, key=lambda s: common_prefix(s.tokens, seq.prompt))
        slot.owner = session
        slot.owned_until = now + SESSION_KEEP_SECONDS if session is not None else 0.0
        return slot

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
        # (a budgeted thought never drafts: a token the budget forces would override the
        # sampler that checks the drafts)
        if seq.params.draft > 0 and seq.params.matcher is None and seq.params.lazy is None \
                and not seq.params.images and seq.params.budget is None:
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
