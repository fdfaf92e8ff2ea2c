"""Word wrapping for answers streamed to a terminal: a line breaks between words, never
inside one (as Ollama's CLI does), at the terminal's width.

The word being written is held back until it ends (a space or a line break), so it is known
whether it still fits the line; a word longer than a whole line is broken where it must be.
"""

from __future__ import annotations

from collections.abc import Callable

from rich.cells import cell_len


class WordWrap:
    def __init__(self, write: Callable[[str], object], width: int) -> None:
        self._write = write
        # one column spare: a terminal that wraps at its last column by itself would
        # otherwise add a blank line when our line break follows
        self.width = max(8, width - 1)
        self.col = 0
        self.word = ""
        self.lines = 0  # line breaks written: how far back an answer's start is

    def newline(self) -> None:
        self._write("\n")
        self.col = 0
        self.lines += 1

    def feed(self, text: str) -> None:
        for ch in text:
            if ch == "\n":
                self._flush_word()
                self.newline()
            elif ch in " \t":
                self._flush_word()
                if self.col + 1 > self.width:  # the space at the line's end is its break
                    self.newline()
                else:
                    self._write(ch)
                    self.col += 1
            else:
                self.word += ch
                if cell_len(self.word) >= self.width:  # longer than a line: it must break
                    if self.col:
                        self.newline()
                    self._write(self.word)
                    self.col, self.word = cell_len(self.word), ""

    def _flush_word(self) -> None:
        if not self.word:
            return
        n = cell_len(self.word)
        if self.col and self.col + n > self.width:
            self.newline()
        self._write(self.word)
        self.col += n
        self.word = ""

    def close(self) -> None:
        """Write the word held back (the answer ended)."""
        self._flush_word()
