"""A thinking budget: after so many tokens of thought the runner ends the thought itself, by
forcing the tokens of the family's end marker (`</think>`, harmony's switch to its final
channel), and the answer follows, as llama-server's --reasoning-budget does.

One `ThoughtBudget` per budgeted sequence, fed every token the sequence generates; while it
forces, the sampler's choice is replaced by its next token (engine/sampling.py) for that
sequence alone: the batch, and every other sequence's logits and tokens, are untouched.

    before  the output may open a thought (its opener not yet written, or partly)
    inside  thought tokens are counted; the model's own end marker ends it
    closing the budget is spent: the end marker's tokens are being forced
    after   nothing more to do (the thought ended, or the output began without one)
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ThoughtBudget:
    limit: int  # the most tokens a thought takes (>= 1: 0 is thinking off, see request.py)
    close: list[int]  # the tokens that end a thought, forced once `limit` is spent
    closer: bytes  # the end marker as text (the model may write it first)
    opener: bytes | None = None  # None: the prompt opened the thought
    used: int = 0
    state: str = "before"
    _seen: bytes = b""  # the head so far (before), or the last bytes (inside: marker search)
    _forcing: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.opener is None:
            self.state = "inside"

    @property
    def active(self) -> bool:
        """Whether it may still force tokens (a sequence does not draft meanwhile: drafts
        are checked against what the sampler picks, which a forced token overrides)."""
        return self.state != "after"

    def forced(self) -> int | None:
        """The token the sequence writes next in place of sampling, if any."""
        return self._forcing[0] if self._forcing else None

    def feed(self, token: int, piece: bytes) -> None:
        """After each token the sequence generated (`piece`: its text)."""
        if self._forcing:
            self._forcing.pop(0)
            if not self._forcing:
                self.state = "after"
            return
        if self.state == "before":
            self._opening(piece)
        elif self.state == "inside":
            self.used += 1
            self._inside(piece)

    def _opening(self, piece: bytes) -> None:
        opener = self.opener or b""
        head = (self._seen + piece).lstrip()
        if head.startswith(opener):
            self.state = "inside"
            self._seen = b""
            rest = head[len(opener):]
            self.used += bool(rest)  # a token that opens the thought and goes on is of it
            self._inside(rest)
        elif opener.startswith(head):
            self._seen = head  # blank, or the opener not yet whole (bounded by its length)
        else:
            self.state = "after"  # the answer began without a thought
            self._seen = b""

    def _inside(self, text: bytes) -> None:
        tail = self._seen + text
        if self.closer in tail:
            self.state = "after"
            self._seen = b""
            return
        self._seen = tail[-(len(self.closer) - 1):] if len(self.closer) > 1 else b""
        if self.used >= self.limit:
            self._forcing = list(self.close)
            self.state = "closing" if self._forcing else "after"
