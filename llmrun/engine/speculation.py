"""Speculative decoding in the step: how many tokens each generating sequence drafts.

The guesses come from prompt lookup or a draft model (engine/draft.py); here they are sized
(each sequence guesses as far as it is expected to pay, within the rows a decode may hold
with every row's logits exactly as if decoded alone) and made. engine/sampling.py keeps the
drafts the sampler confirms.
"""

from __future__ import annotations

import logging

from llmrun.engine.draft import PROBE_ROWS, draft_length, probe_exact_rows
from llmrun.engine.llama import LlamaError
from llmrun.engine.sequence import Sequence
from llmrun.engine.state import EngineState

log = logging.getLogger(__name__)


class Speculation(EngineState):
    """The drafts of a step: their length, the rows probed exact, the draft model's calls."""

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
