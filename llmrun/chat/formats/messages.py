"""Streamed output written as headed messages (harmony, Muse Glimmer): each message a header
up to the family's message marker, then a body up to an end marker, or up to the next
header's opening marker (a model that skipped the end); text before any header is plain
content. The thought is the bodies of some messages, the rest content: the family says
which (`_open` reads a header, `_emit` places a body's text)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmrun.chat.textstream import partial_match

HEADER_LIMIT = 256  # a header is short: longer text without the message marker is content


@dataclass
class MessageSplitter:
    """(thinking, content) of streamed messages; what may still become a marker is held,
    so pieces give what the whole gives."""

    keep: bool = True
    _held: str = ""
    _state: str = "head"  # head: reading a header; body: a message's body; text: no headers

    message: ClassVar[str]  # ends a header
    ends: ClassVar[tuple[str, ...]]  # end a body (taken)
    opens: ClassVar[tuple[str, ...]]  # end a body, left to open the next header
    header_starts: ClassVar[tuple[str, ...]]  # what a header starts with

    def _open(self, header: str) -> str:
        """Read a message's header; what the content gets for it."""
        raise NotImplementedError

    def _emit(self, text: str, thinking: list[str], content: list[str]) -> None:
        """A body's text, to the thought or the content."""
        raise NotImplementedError

    def _close(self) -> str:
        """A message ended: what the content gets for it."""
        return ""

    def push(self, text: str) -> tuple[str, str]:
        self._held += text
        thinking: list[str] = []
        content: list[str] = []
        stops = (*self.ends, *self.opens)
        while self._held:
            if self._state == "head":
                at = self._held.find(self.message)
                if at == -1:
                    if len(self._held) > HEADER_LIMIT or not self._maybe_header():
                        self._state = "text"  # no messages here: plain text
                        continue
                    break
                content.append(self._open(self._held[:at]))
                self._held = self._held[at + len(self.message):]
                self._state = "body"
            elif self._state == "body":
                found = [(i, m) for m in stops if (i := self._held.find(m)) != -1]
                if not found:
                    keep = partial_match(self._held, stops)
                    self._emit(self._held[:len(self._held) - keep], thinking, content)
                    self._held = self._held[len(self._held) - keep:]
                    break
                at, marker = min(found)
                self._emit(self._held[:at], thinking, content)
                content.append(self._close())
                self._held = self._held[at + (len(marker) if marker in self.ends else 0):]
                self._state = "head"
            else:
                content.append(self._held)
                self._held = ""
        return "".join(thinking) if self.keep else "", "".join(content)

    def _maybe_header(self) -> bool:
        """Whether the held text may still be a header (it starts with a header's marker,
        blanks aside)."""
        head = self._held.lstrip()
        return any(head.startswith(m) or m.startswith(head) for m in self.header_starts)

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if self._state == "body":
            thinking: list[str] = []
            content: list[str] = []
            self._emit(held, thinking, content)
            return ("".join(thinking) if self.keep else ""), "".join(content)
        if self._state == "head" and self._maybe_header():
            return "", ""  # a header cut off: no text of it is the answer
        return "", held


__all__ = ["HEADER_LIMIT", "MessageSplitter"]
