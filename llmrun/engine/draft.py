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

import numpy as np

from llmrun.engine.llama import Batch, Context

# Most tokens drafted for one sequence in one step.
DRAFT_MAX = 16
# Options.num_draft when unset: off. Drafting is opt-in because its output is the plain
# output only as far as llama.cpp computes a row of a batch exactly as that row alone, and
# probe_exact_rows checks that at one place, not everywhere: with flash attention off, rows
# it passed still came out a few last bits apart (tests/test_draft.py has the cases where
# the text and every log-probability are the same). And on a small CPU it rarely pays
# (docs/benchmarks.md): each row of a decode costs most of a token there.
DRAFT_DEFAULT = 0
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


def probe_exact_rows(ctx: Context, seq: int, pos: int, tokens: list[int]) -> int:
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
