"""Turns generated token bytes into text safe to stream: whole UTF-8 characters only, and
never a piece of a stop string (the text is held back while it could still become one)."""

from __future__ import annotations

import codecs


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
        keep = self._partial_stop_len()
        cut = len(self._held) - keep
        out, self._held = self._held[:cut], self._held[cut:]
        return out

    def flush(self) -> str:
        """The end of generation: release what was held (it never became a stop string)."""
        out = self._held + self._decoder.decode(b"", final=True)
        self._held = ""
        return out

    def _partial_stop_len(self) -> int:
        """Length of the longest suffix of the held text that begins some stop string."""
        best = 0
        held = self._held
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(held)), best, -1):
                if held.endswith(stop[:n]):
                    best = n
                    break
        return best
