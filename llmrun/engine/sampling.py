"""After a decode: each sequence's next token, and what it does to the sequence.

Each step the token masks of all constrained sequences are computed in one parallel call
into one bitmask array (a row per sequence), each sequence samples with its own chain among
the tokens its row allows, and its matcher consumes the token. A sequence without a matcher
does no mask work at all. A thinking model's thought stays free: the matcher starts once the
end-of-thought marker has been generated (`SeqParams.constrain_after`).

Then the token's text goes to the sequence's text stream (stop strings), with its logprobs
when asked; drafted tokens are kept while the sampler picks exactly them (`_verify`); and a
sequence ends here: a stop, its length, a full context it may not shift, or a failure of its
own (a grammar that does not build or reaches a dead end, a sampler or text stream that
raises), which ends that sequence with an error event while the others go on.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
from llguidance.numpy import fill_next_token_bitmask_par

from llmrun.engine import constraint
from llmrun.engine.backend import Sampler
from llmrun.engine.sequence import ConstraintError, Event, Sequence, describe
from llmrun.engine.state import EngineState
from llmrun.request import ErrorCode, error_event

log = logging.getLogger(__name__)

# With `shift` and no num_predict, generation still ends after this many contexts' worth of
# tokens: a request cannot hold its slot forever.
SHIFT_LIMIT = 10


class Sampling(EngineState):
    """Sampling, grammar gates, logprobs, and the end of a sequence (finish or failure)."""

    def _sampler(self, seq: Sequence) -> Sampler:
        p = seq.params
        sampler = self.model.sampler(**p.sampling)
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
        budget = seq.params.budget
        forced = budget.forced() if budget is not None else None
        if forced is not None:  # the thinking budget is spent: its end marker is written
            token = forced
            seq.sampler.accept(token)
            if mask is not None and seq.gate is None and not matcher.consume_token(token):
                raise ConstraintError(f"structured output refused the end of the thought: "
                                      f"{matcher.get_error()}")
        elif mask is None:
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
        events.append((seq.id, "error", error_event(code, describe(exc))))

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
        if seq.params.budget is not None:
            seq.params.budget.feed(token, piece)
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


def _finite(logprob: float) -> float:
    """A logprob JSON can carry: a token the model rules out (a -inf logit) gets -9999.0, the
    value OpenAI reports for such tokens (NaN and infinities are not JSON)."""
    return logprob if logprob > -9999.0 else -9999.0
