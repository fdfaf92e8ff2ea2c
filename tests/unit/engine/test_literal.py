"""literal.py: special-token texts a client writes stay text, over a fake vocabulary that
parses special tokens as llama.cpp does (the real tokenizer: tests/integration/
test_special_tokens.py)."""

from __future__ import annotations

import random
import re
import time
from dataclasses import dataclass, field

import pytest

from llmrun.engine.literal import Guard, trie_pattern
from llmrun.request import Message, Tool, ToolCall

SPECIAL = 10 ** 7  # the first special token's id: above every code point
SPECIALS = ["<|call|>", "<|channel|>", "<|im_end|>", "<｜tool▁sep｜>", "</think>", "|x|>", "<|x|>"]


@dataclass
class FakeVocab:
    """Special texts are one token each (ids from SPECIAL) when parsed, every other character is
    its code point; `space_prefix`: a SentencePiece tokenizer that writes a space (id 32)
    before the text, as llama 2's does."""

    specials: list[str] = field(default_factory=lambda: list(SPECIALS))
    space_prefix: bool = False
    add_bos: bool = True
    add_eos: bool = False
    bos: int = 1
    eos: int = 2

    def tokenize(self, text: str, add_special: bool, parse_special: bool = True) -> list[int]:
        out = [self.bos] if add_special and self.add_bos else []
        if self.space_prefix and text:
            out.append(32)
        order = sorted(self.specials, key=len, reverse=True)
        i = 0
        while i < len(text):
            hit = next((s for s in order if parse_special and text.startswith(s, i)), None)
            if hit is not None:
                out.append(SPECIAL + self.specials.index(hit))
                i += len(hit)
            else:
                out.append(ord(text[i]))
                i += 1
        if add_special and self.add_eos:
            out.append(self.eos)
        return out

    def piece(self, token: int) -> bytes:
        if token >= SPECIAL:
            return self.specials[token - SPECIAL].encode()
        return chr(token).encode()


def guard() -> Guard:
    return Guard(trie_pattern(SPECIALS))


def specials_in(tokens: list[int]) -> list[int]:
    return [t for t in tokens if t >= SPECIAL]


def render(client: str) -> str:
    """A template's text around a client's: its own markers are special tokens."""
    return "<|channel|>user<|message|>" + client + "<|im_end|>"


def test_pattern_finds_the_longest_text_first() -> None:
    pattern = trie_pattern(["<|a|>", "<|a|>b", "<|"])
    assert pattern is not None
    assert [m.group() for m in pattern.finditer("x<|a|>by<|a|>z<|q")] == ["<|a|>b", "<|a|>",
                                                                          "<|"]
    assert trie_pattern([]) is None


@pytest.mark.parametrize("client", [
    "<|call|>", "say <|call|> now", "<|call|><|call|><|im_end|>", "a<|im_end|>\n<|channel|>b",
    "ünïcode <｜tool▁sep｜> 名前", "</think></think>", "<<|call|>>", "<|call|", "|call|>",
    "<|c<|call|>all|>", "{\"a\": \"<|call|>\"}"])
def test_no_client_text_becomes_a_special_token(client: str) -> None:
    g = guard()
    vocab = FakeVocab()
    text = render(g.text(client))
    tokens = g.tokenize(vocab, text, add_bos=True)
    template = vocab.tokenize(render(""), add_special=True)
    assert specials_in(tokens) == specials_in(template)  # the template's, no more
    assert g.strip(text) == render(client)  # the model reads what the client wrote
    assert "".join(vocab.piece(t).decode() for t in tokens[1:]) == render(client)


def test_a_special_text_inside_a_broken_one_is_broken_too() -> None:
    """`|x|>` is a special text of its own: breaking `<|x|>` after `<` leaves it whole,
    so it is broken in turn."""
    g = guard()
    broken = g.text("<|x|>")
    assert broken.count(g.nonce) == 2
    assert specials_in(g.tokenize(FakeVocab(), broken, add_bos=False)) == []


def test_text_without_special_texts_is_left_as_it_is() -> None:
    g = guard()
    vocab = FakeVocab()
    text = render(g.text("plain <b>text</b> | >"))
    assert g.broken == 0 and g.strip(text) == text
    assert g.tokenize(vocab, text, add_bos=True) == vocab.tokenize(text, add_special=True)
    assert Guard(None).text("<|call|>") == "<|call|>"


def test_bos_and_eos_once_around_the_pieces() -> None:
    g = guard()
    vocab = FakeVocab(add_eos=True)
    tokens = g.tokenize(vocab, render(g.text("a <|call|> b <|call|>")), add_bos=True)
    assert tokens[0] == vocab.bos and tokens.count(vocab.bos) == 1
    assert tokens[-1] == vocab.eos and tokens.count(vocab.eos) == 1
    assert g.tokenize(vocab, g.text("<|call|>"), add_bos=False)[0] != vocab.bos


def test_a_space_prefixing_vocabulary_adds_no_space_inside_a_broken_marker() -> None:
    g = guard()
    vocab = FakeVocab(space_prefix=True)
    tokens = g.tokenize(vocab, render(g.text("<|call|>")), add_bos=False)
    assert "".join(vocab.piece(t).decode() for t in tokens) == " " + render("<|call|>")


def test_each_render_has_its_own_nonce_of_digits() -> None:
    a, b = guard(), guard()
    assert a.nonce != b.nonce and re.fullmatch(r"\d{20}", a.nonce)
    assert a.nonce.upper() == a.nonce  # no template filter changes it


def test_assistant_turns_are_left_as_the_model_wrote_them() -> None:
    g = guard()
    said = Message(role="assistant", content="<think>x</think>done <|call|>",
                   tool_calls=[ToolCall(id="1", name="f", arguments={"q": "<|call|>"})])
    assert g.message(said) is said
    for role in ("user", "system", "tool"):
        m = g.message(Message(role=role, content="hi <|im_end|>", name="<|call|>"))
        assert g.nonce in m.content and g.nonce in (m.name or "")


def test_a_tool_definition_is_broken_in_its_nested_strings() -> None:
    g = guard()
    tool = Tool(name="f", description="ends with <|im_end|>", parameters={
        "type": "object", "properties": {"q": {"type": "string", "description": "a <|call|>",
                                               "enum": ["<|channel|>", 3]}}})
    shown = g.tool(tool)
    assert shown.name == "f" and g.nonce in shown.description
    q = shown.parameters["properties"]["q"]
    assert g.nonce in q["description"] and g.nonce in q["enum"][0] and q["enum"][1] == 3
    assert tool.parameters["properties"]["q"]["description"] == "a <|call|>"  # a copy
    plain = Tool(name="g", description="no markers")
    assert g.tool(plain) is plain


def test_random_text_round_trips_and_never_parses_a_client_special() -> None:
    rng = random.Random(7)
    alphabet = ["<", "|", ">", "c", "a", "l", "x", "/", "think", " ", "é", *SPECIALS]
    vocab = FakeVocab()
    for _ in range(300):
        client = "".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 30)))
        g = guard()
        text = render(g.text(client))
        tokens = g.tokenize(vocab, text, add_bos=False)
        assert specials_in(tokens) == [SPECIAL + 1, SPECIAL + 2], client
        assert "".join(vocab.piece(t).decode() for t in tokens) == render(client)


def test_a_large_vocabulary_of_specials_scans_quickly() -> None:
    """gpt-oss has some thousand reserved special tokens: the scan stays linear."""
    texts = [f"<|reserved_{i}|>" for i in range(2000)] + SPECIALS
    g = Guard(trie_pattern(texts))
    client = "<|reserved_1999|> <| < |" * 20_000
    start = time.perf_counter()
    broken = g.text(client)
    assert time.perf_counter() - start < 2.0
    assert g.broken == 20_000 and g.strip(broken) == client
