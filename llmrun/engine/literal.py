"""What a client writes stays text: a special token's text in a user's, system's or tool's
message (`<|call|>`, `<|im_end|>`, `</think>`) is tokenized as its characters, never as the
special token, so no client can close its own turn and write one of the model's.

The rendered prompt must be tokenized with special tokens parsed (the template writes its
markers as text), and llama.cpp parses a user-defined token even without that (gpt-oss's
`<|channel|>`, `<|message|>`, `<|start|>`, `<|end|>` are user-defined once loaded), so the
client's occurrences are broken before rendering instead: a random run of digits, which no
filter of a template changes, goes after each one's first character; the rendered text is
cut there and each piece tokenized alone. The model sees the characters it would have seen,
in tokens no longer than the pieces. llama.cpp (llama-server's chat) and Ollama (its issue
15931) parse every special token of the rendered prompt, the client's included.

Assistant turns are left as they are: a client writes them whole through every API anyway,
and a replayed answer may hold the model's own markers, which templates read (DeepSeek's
drops the thought before `</think>`)."""

from __future__ import annotations

import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from llmrun.request import Message, Tool

GUARDED_ROLES = frozenset({"system", "user", "tool"})
_SPACE = b" "


class Vocabulary(Protocol):
    """What tokenizing in pieces needs of the model (engine/llama Model)."""

    add_bos: bool
    add_eos: bool

    @property
    def bos(self) -> int: ...

    @property
    def eos(self) -> int: ...

    def tokenize(self, text: str, add_special: bool, parse_special: bool = True
                 ) -> list[int]: ...

    def piece(self, token: int) -> bytes: ...


def trie_pattern(texts: Iterable[str]) -> re.Pattern[str] | None:
    """One regex finding any of `texts`, longest first where several start at one place:
    a trie of alternatives, so a vocabulary of a thousand special tokens costs a few steps
    per character (an alternation of them all would try each in turn). None: no texts."""
    trie: dict[str, Any] = {}
    for text in texts:
        node = trie
        for ch in text:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict[str, Any]) -> str:
        alts = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        if "" in node:  # a text ends here: the longer ones first, then this one
            return f"(?:{body})?"
        return body

    return re.compile(build(trie)) if trie else None


@dataclass
class Guard:
    """Breaks the special texts in what a client wrote, for one render (`nonce`: fresh each
    time, so no client can write it)."""

    pattern: re.Pattern[str] | None
    nonce: str = field(default_factory=lambda: f"{secrets.randbelow(10 ** 20):020d}")
    broken: int = 0  # how many occurrences were broken

    def text(self, text: str) -> str:
        """`text` with the nonce after the first character of each special text in it (and of
        any such text a broken one still holds, found by scanning on from that character)."""
        if self.pattern is None or not text:
            return text
        out: list[str] = []
        last = pos = 0
        while (m := self.pattern.search(text, pos)) is not None:
            cut = m.start() + 1
            out += (text[last:cut], self.nonce)
            last = pos = cut
            self.broken += 1
        if not out:
            return text
        out.append(text[last:])
        return "".join(out)

    def value(self, value: Any) -> Any:
        """A JSON value with its strings (keys included) broken."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {self.text(k) if isinstance(k, str) else k: self.value(v)
                    for k, v in value.items()}
        if isinstance(value, list):
            return [self.value(v) for v in value]
        return value

    def message(self, m: Message) -> Message:
        if m.role not in GUARDED_ROLES:
            return m
        content = self.text(m.content)
        name = self.text(m.name) if m.name else m.name
        if content == m.content and name == m.name:
            return m
        return m.model_copy(update={"content": content, "name": name})

    def tool(self, t: Tool) -> Tool:
        """A tool's definition as the template renders it (the grammar keeps the real one)."""
        update = {"description": self.text(t.description) if t.description else t.description,
                  "parameters": self.value(t.parameters)}
        return t if update == {"description": t.description, "parameters": t.parameters} \
            else t.model_copy(update=update)

    def strip(self, text: str) -> str:
        """The rendered text as the model reads it."""
        return text.replace(self.nonce, "") if self.broken else text

    def tokenize(self, vocab: Vocabulary, text: str, add_bos: bool) -> list[int]:
        """The rendered `text`'s tokens, special tokens parsed, cut where the nonce is."""
        if not self.broken or self.nonce not in text:
            return vocab.tokenize(self.strip(text), add_special=add_bos, parse_special=True)
        tokens = [vocab.bos] if add_bos and vocab.bos >= 0 else []
        for i, part in enumerate(text.split(self.nonce)):
            ids = vocab.tokenize(part, add_special=False, parse_special=True)
            if i and ids and not part.startswith(" ") and vocab.piece(ids[0]) == _SPACE:
                # a SentencePiece vocabulary that puts a space before the text (llama 2's)
                # puts it before each piece: not in the text, so not in the tokens
                ids = ids[1:]
            tokens += ids
        if add_bos and vocab.add_eos and vocab.eos >= 0:
            tokens.append(vocab.eos)
        return tokens
