"""What a prompt token costs in a step that also decodes for others: how the batcher sizes a
prompt's chunk to fit the step budget (stall-free batching).

A prompt token's time is modelled as s x (1 + r x span): `span` is how many cells its
attention reads (its position, or the sliding window where that is shorter), r is what
attention over one cell costs beside the token's share of the weights, and s is measured
online. Without the span term the cost per token is an average over recent chunks, which
lags behind a prompt whose later chunks attend over ever more cells: on SmolLM2, 2.1 ms a
token at position 100 and 4.1 ms at 3,000, so steps overran a 250 ms budget by 10-20% late in
a 3,000-token prompt. r comes from the model's shape (multiply-adds per cell over those of the
weights a prompt token goes through) rather than from a fit: a slope fitted over a few noisy
steps a few hundred cells apart is noisier than the shape, which predicts SmolLM2's measured
slope (3.3e-4 a cell) to within a few percent. Whatever r misses the fast average of s takes.
"""

from __future__ import annotations

from typing import Protocol


class Shape(Protocol):
    n_params: int
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_swa: int

    def head_dims(self) -> tuple[int, int]: ...


def attention_per_cell(model: Shape) -> float:
    """r: a prompt token's attention work per KV cell over its work in the weights. The
    token embedding table is left out: a prompt token only looks its row up (the output
    head, which may share it, runs for the rows that are sampled)."""
    dk, dv = model.head_dims()
    per_cell = model.n_layer * model.n_head * (dk + dv)
    weights = model.n_params - model.n_vocab * model.n_embd
    return per_cell / weights if weights > 0 and per_cell > 0 else 0.0


class PromptCost:
    WEIGHT = 0.3  # of the latest step in s: host load changes within seconds

    def __init__(self, per_cell: float, window: int = 0) -> None:
        self.per_cell = per_cell  # r
        # a sliding window caps the span (in Gemma 3 one layer in six still attends to all,
        # a growth the average of s follows)
        self.window = window
        self.scale: float | None = None  # s, seconds; None until a step was measured

    def _work(self, base: int, n: int) -> float:
        """The tokens base+1..base+n in units of s (a token attends to its own cell too)."""
        mid = base + (n + 1) / 2
        span = min(mid, self.window) if self.window else mid
        return n * (1.0 + self.per_cell * span)

    def observe(self, pieces: list[tuple[int, int]], seconds: float) -> None:
        """A step read these (cells already in the sequence, tokens read) pieces in
        `seconds` (the decode rows beside them taken out)."""
        work = sum(self._work(base, n) for base, n in pieces)
        if work <= 0 or seconds <= 0:
            return
        s = seconds / work
        self.scale = s if self.scale is None else \
            (1 - self.WEIGHT) * self.scale + self.WEIGHT * s

    def seconds(self, base: int, n: int) -> float:
        assert self.scale is not None
        return self.scale * self._work(base, n)

    def fit(self, base: int, seconds: float, limit: int) -> int | None:
        """The most tokens (up to `limit`) a sequence holding `base` cells can read in
        `seconds`; None until measured."""
        if self.scale is None:
            return None
        lo, hi = 0, limit  # the cost grows with n: the largest n that fits
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.seconds(base, mid) <= seconds:
                lo = mid
            else:
                hi = mid - 1
        return lo
