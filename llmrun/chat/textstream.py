"""Turns generated token bytes into text safe to stream: whole UTF-8 characters only, and
never a piece of a stop string (the text is held back while it could still become one)."""

from __future__ import annotations

import codecs
from collections.abc import Iterable


def partial_match(text: str, markers: Iterable[str]) -> int:
    """Length of the longest end of `text` that begins one of `markers` (without being
    all of it): what must be held back while it could still become a marker."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class TextStream:
    def __init__(self, stops: list[str]) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text, once one did

    def push(self, data: bytes) -> str:
        """Add a token's bytes; return the text that can be released now."""
        self._held += self._decoder.decode(data)
        if not self._stops:
            out, self._held = self._held, ""
            return out
        first, matched = -1, None
        for stop in self._stops:
            i = self._held.find(stop)
            if i != -1 and (first == -1 or i < first):
                first, matched = i, stop
        if first != -1:
            out, self._held = self._held[:first], ""
            self.stopped = True
            self.matched = matched
            return out
        keep = partial_match(self._held, self._stops)
        cut = len(self._held) - keep
        out, self._held = self._held[:cut], self._held[cut:]
        return out

    def flush(self) -> str:
        """The end of generation: release what was held (it never became a stop string)."""
        out = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return out
