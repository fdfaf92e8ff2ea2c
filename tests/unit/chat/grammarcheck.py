"""What a grammar lets a model write, checked without a model: llguidance's matcher over a
vocabulary of the 256 bytes (every text is some sequence of them)."""

from __future__ import annotations

import functools
from typing import Any


@functools.lru_cache(maxsize=1)
def _byte_tokenizer() -> Any:
    import llguidance

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTok()))


def accepts(grammar: str, text: str) -> bool:
    """Whether llguidance's matcher (byte-level, no vocabulary needed) takes `text` whole."""
    import llguidance

    from llmrun.engine import constraint

    tok = _byte_tokenizer()
    matcher = llguidance.LLMatcher(tok, constraint.from_grammar(grammar))
    assert not matcher.is_error(), matcher.get_error()
    ids = list(text.encode())
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) \
        and matcher.is_accepting()


class _ByteTok:
    """A vocabulary of the 256 bytes and an end token: enough to check what a grammar
    lets a model write, character by character."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = (256,)

    def __call__(self, s: Any) -> list[int]:
        return list(s.encode() if isinstance(s, str) else s)
