"""Speculative decoding by prompt lookup: guess a sequence's next tokens from its own history.

A sequence that is copying (an edited file, a quoted passage, a tool call repeating its
arguments) has already seen what comes next: the tokens that followed the last occurrence of
its current tail. The engine feeds such a guess (a draft) after the sequence's next token in
the same batched decode as every other sequence, then samples each row in order and keeps the
drafted tokens the sampler itself produced, up to the first one it did not. Every token the
client gets is still sampled by the sequence's own chain from the model's logits given the
tokens before it, so greedy output is the same as without drafts (as far as llama.cpp
computes a row of a batch exactly as it computes that row alone: probe_exact_rows, and
DRAFT_DEFAULT for where that falls short) and sampled output has the same distribution
(the acceptance rule for a draft that is a single token, not a distribution: sample,
compare). With the same seed it is the same text too: the chain draws
once per emitted token, as it does without drafts.

Drafting pays only where an extra row of a batch costs less than the tokens it is expected
to win, and that depends on the machine and the model: on a GPU or an Apple chip a few more
rows cost almost nothing; on a small CPU running a small model, decode is compute bound and
each row costs nearly a whole token (measured in docs/benchmarks.md). So the engine learns
both sides as it runs: `StepCost` fits the time of a decode against its number of rows, and
each sequence keeps `Acceptance`, how often its guesses came true, updated by every guess,
also by those it made but did not send (they are checked against the token that came next,
for free). A sequence drafts k tokens when the k-th is still expected to pay for its row.
"""

from __future__ import annotations

import math
import time

import numpy as np

from llmrun.engine import backend
from llmrun.engine.llama import Batch, Context, LlamaError, Model

# Most tokens drafted for one sequence in one step.
DRAFT_MAX = 16
# Options.num_draft when unset: off. Drafting is opt-in because its output is the plain
# output only as far as llama.cpp computes a row of a batch exactly as that row alone, and
# probe_exact_rows checks that at one place, not everywhere: with flash attention off, rows
# it passed still came out a few last bits apart (tests/integration/test_draft.py has the
# cases where the text and every log-probability are the same). And on a small CPU it rarely pays
# (docs/benchmarks.md): each row of a decode costs most of a token there.
DRAFT_DEFAULT = 0
# ... and with a draft model, which a Modelfile names on purpose: on, as llama-server's `-md`
# (its guesses are paid for: draft_length keeps only those worth their cost).
DRAFT_MODEL_DEFAULT = 8
# The shortest tail that must recur before its continuation is proposed: single tokens
# recur everywhere in text, their continuations rarely.
MIN_NGRAM = 2
MAX_NGRAM = 4
# Most rows of one decode whose logits probe_exact_rows compares with decoding them one by one.
PROBE_ROWS = 16
# Steps of more rows than this read prompts (a different regime of llama.cpp's kernels):
# they say nothing about what a few more rows of decode cost.
COST_MAX_ROWS = 64


class History:
    """A sequence's tokens (prompt, then output) in a growing array, to search its tail."""

    def __init__(self, prompt: list[int]) -> None:
        self._tokens = np.zeros(max(64, 2 * len(prompt)), dtype=np.int32)
        self._tokens[: len(prompt)] = prompt
        self.n = len(prompt)

    def append(self, token: int) -> None:
        if self.n == len(self._tokens):
            self._tokens = np.concatenate([self._tokens, np.zeros_like(self._tokens)])
        self._tokens[self.n] = token
        self.n += 1

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest
        recurring tail (MIN_NGRAM to MAX_NGRAM tokens); none when no such tail recurs."""
        n = self.n
        if k <= 0 or n <= MIN_NGRAM:
            return []
        h = self._tokens[:n]
        # where the last token occurred before, then narrowed to where the tokens before it
        # match too: each step one vectorised comparison over the survivors
        found = np.flatnonzero(h[: n - 1] == h[n - 1])
        best, length = found, 1
        while best.size and length < MAX_NGRAM:
            found = best[best >= length]
            found = found[h[found - length] == h[n - 1 - length]]
            if not found.size:
                break
            best, length = found, length + 1
        if length < MIN_NGRAM or not best.size:
            return []
        start = int(best[-1]) + 1
        return h[start: min(start + k, n)].tolist()


class Acceptance:
    """How likely a sequence's next guessed token is to come true: a moving average over
    its recent guesses (about the last twenty), starting hopeful enough to try."""

    RATE = 0.05
    PRIOR = 0.5

    def __init__(self) -> None:
        self.p = self.PRIOR

    def update(self, hits: int, missed: bool) -> None:
        """`hits` guessed tokens came true in a row, then one did not (`missed`), or the
        guess ran out."""
        keep = 1.0 - self.RATE
        self.p = self.p * keep ** hits + (1.0 - keep ** hits)
        if missed:
            self.p *= keep


class StepCost:
    """The time of a decode as a line in its number of rows, fitted over the engine's recent
    steps (least squares, older steps weighing less). Until steps of different sizes have
    been seen, a row is assumed to cost PRIOR_SHARE of a row's average share of the step."""

    DECAY = 0.97  # each new step's weight over the one before: about the last 30 count
    PRIOR_SHARE = 0.5
    PRIOR_WEIGHT = 8.0  # in rows squared: a few drafted steps outweigh it

    def __init__(self) -> None:
        self.w = self.x = self.y = self.xx = self.xy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        if rows > COST_MAX_ROWS or seconds <= 0:
            return
        d = self.DECAY
        self.w = self.w * d + 1.0
        self.x = self.x * d + rows
        self.y = self.y * d + seconds
        self.xx = self.xx * d + rows * rows
        self.xy = self.xy * d + rows * seconds

    def row_share(self, rows: int, tokens: int) -> float:
        """What one more row costs, over what each of the `tokens` a step of `rows` rows
        yields costs; inf before any step was seen."""
        if self.w == 0:
            return math.inf
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        cov = self.xy / self.w - mx * my
        prior = self.PRIOR_SHARE * my / mx
        slope = (cov * self.w + self.PRIOR_WEIGHT * prior) / (var * self.w + self.PRIOR_WEIGHT)
        slope = max(slope, 0.0)
        step = my + slope * (rows - mx)
        return math.inf if step <= 0 else slope * tokens / step


def draft_length(accept: float, row_share: float, limit: int) -> int:
    """How many tokens to draft: the k-th drafted token comes true with probability about
    accept**k and its row costs `row_share` of a token, so draft while the one pays for the
    other (at most `limit`)."""
    if limit <= 0 or accept <= row_share:
        return 0
    if accept >= 1.0 or row_share <= 0.0:
        return limit
    return min(limit, int(math.log(row_share) / math.log(accept)))


def probe_exact_rows(ctx: backend.Context, seq: int, pos: int, tokens: list[int]) -> int:
    """The most rows (up to PROBE_ROWS) a decode may hold while every row's logits are
    bit-identical to decoding the same tokens one at a time, measured on this machine in
    sequence `seq` from position `pos` (its cells from `pos` on are dropped afterwards).

    Whether they are depends on the model's tensor types and the CPU: llama.cpp switches
    kernels with the number of rows (matrix-vector against repacked matrix-matrix code,
    flash attention's tiled path), and a different kernel sums in a different order.
    Drafted rows must stay in the identical regime for a draft to change nothing."""
    tokens = (tokens * PROBE_ROWS)[:PROBE_ROWS]
    batch = Batch(PROBE_ROWS)
    try:
        alone = []
        for i, tok in enumerate(tokens):
            batch.clear()
            batch.add(tok, pos + i, seq, True)
            if ctx.decode(batch) != 0:
                return 1
            alone.append(ctx.logits(0).copy())
        for n in (PROBE_ROWS, 8, 4, 3, 2):
            ctx.seq_rm(seq, pos, -1)
            batch.clear()
            for i in range(n):
                batch.add(tokens[i], pos + i, seq, True)
            if ctx.decode(batch) != 0:
                return 1
            if all(np.array_equal(ctx.logits(i), alone[i]) for i in range(n)):
                return n
        return 1
    finally:
        ctx.seq_rm(seq, pos, -1)
        batch.close()


class DraftModel:
    """A second, smaller model with the same vocabulary that guesses each sequence's next
    tokens greedily (speculative decoding with a draft model, as llama-server's `-md`).

    It keeps one KV sequence per slot of the main engine (the same ids), each holding a
    prefix of that slot's tokens: before guessing it reads what it lacks (a whole prompt the
    first time, then the tokens kept since), then decodes its guesses one step at a time, all
    sequences in one batch per step. Its guesses are checked by the main model exactly as
    prompt lookup's are, so what they change is speed only."""

    def __init__(self, model: Model, ctx: Context, n_slots: int) -> None:
        self.model = model
        self.ctx = ctx
        self.held: list[list[int]] = [[] for _ in range(n_slots)]  # each sequence's tokens
        # of `held`, how many are known to equal the slot's tokens, for the request `owner`:
        # the next comparison starts there (a slot's tokens only grow while one request has it)
        self.sure = [0] * n_slots
        self.owner: list[object] = [None] * n_slots
        self.batch = Batch(ctx.n_batch)
        self.token_s: float | None = None  # seconds per drafted token (moving average)

    def check_vocabulary(self, main: Model) -> None:
        """LlamaError unless this model tokenizes as `main` does: same size, same special
        tokens, the same text for a sample of tokens."""
        n = main.n_vocab
        same = self.model.n_vocab == n and (self.model.bos, self.model.eos) == (main.bos,
                                                                                 main.eos)
        sample = range(0, n, max(1, n // 512)) if same else range(0)
        if not same or any(self.model.piece(t) != main.piece(t) or
                           self.model.token_text(t) != main.token_text(t) for t in sample):
            raise LlamaError("the draft model's vocabulary is not the model's: its guesses "
                             "would be other tokens (use a model of the same family)")

    def propose(self, wants: list[tuple[int, object, list[int], int, int]]
                ) -> dict[int, list[int]]:
        """Guesses for each (slot, owner, the slot's tokens, the token about to be decoded
        after them, most tokens to guess): up to that many tokens each, by slot; a guess
        ends early at an end-of-generation token. `owner` names what the slot's tokens
        belong to (a request, and how often its context was shifted): while it is the same,
        they only grow."""
        t0 = time.perf_counter()
        rest: dict[int, list[int]] = {}
        for slot, owner, tokens, last, _ in wants:
            held = self.held[slot]
            start = self.sure[slot] if self.owner[slot] == owner else 0
            n = start + common_prefix(held[start:], tokens[start:])
            n = min(n, len(tokens))  # `last` is read (again): its logits give the first guess
            if n < len(held):
                if not self.ctx.seq_rm(slot, n, -1):
                    self.ctx.seq_rm(slot, -1, -1)
                    n = 0
                del held[n:]
            self.owner[slot], self.sure[slot] = owner, n
            rest[slot] = [*tokens[n:], last]
        guesses: dict[int, list[int]] = {slot: [] for slot, *_ in wants}
        # read what each sequence lacks, in batches; the last token's logits give the first
        # guess (taken at once: a row's logits last until the next decode)
        while any(rest.values()):
            batch = self.batch
            batch.clear()
            ends: list[tuple[int, int]] = []
            for slot, todo in rest.items():
                room = batch.capacity - batch.n
                if not todo or room <= 0:
                    continue
                take = todo[:room]
                held = self.held[slot]
                for i, tok in enumerate(take):
                    idx = batch.add(tok, len(held) + i, slot, i == len(todo) - 1)
                held.extend(take)
                del todo[: len(take)]
                if not todo:
                    ends.append((slot, idx))
            self._decode()
            for slot, idx in ends:
                guesses[slot].append(self._greedy(idx))
        limits = {slot: k for slot, *_, k in wants}
        while True:  # then one guess after another (held takes them; `sure` does not)
            going = [slot for slot, g in guesses.items() if 0 < len(g) < limits[slot]
                     and not self.model.is_eog(g[-1])]
            if not going:
                break
            batch = self.batch
            batch.clear()
            rows = []
            for slot in going:
                held = self.held[slot]
                rows.append((slot, batch.add(guesses[slot][-1], len(held), slot, True)))
                held.append(guesses[slot][-1])
            self._decode()
            for slot, idx in rows:
                guesses[slot].append(self._greedy(idx))
        out = {slot: g[: limits[slot]] for slot, g in guesses.items()}
        for g in out.values():  # (an end-of-generation guess ends it)
            eog = next((i for i, t in enumerate(g) if self.model.is_eog(t)), None)
            if eog is not None:
                del g[eog:]
        made = sum(len(g) for g in out.values())
        if made:
            per = (time.perf_counter() - t0) / made
            self.token_s = per if self.token_s is None else 0.8 * self.token_s + 0.2 * per
        return out

    def _decode(self) -> None:
        rc = self.ctx.decode(self.batch)
        if rc != 0:
            for held in self.held:  # what the cells hold is unknown now: start over
                held.clear()
            self.ctx.seq_rm(-1, -1, -1)
            self.sure = [0] * len(self.sure)
            raise LlamaError(f"the draft model's decode failed ({rc})")

    def _greedy(self, idx: int) -> int:
        return int(np.argmax(self.ctx.logits(idx)))

    def close(self) -> None:
        self.batch.close()
        self.ctx.close()
        self.model.close()


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many tokens `a` and `b` share from the start (a slot's and a prompt's)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
