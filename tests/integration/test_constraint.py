"""Structured output inside the batching engine (engine/constraint.py, llguidance), on the
real SmolLM2 vocabulary and model: grammars compile or are refused with the keyword named,
constrained sequences obey their schema whatever the sampler draws, and they batch with free
ones without changing anyone's tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import llguidance as lg
import numpy as np
import pytest

from llmrun.engine import constraint
from llmrun.engine.batcher import SeqParams
from llmrun.engine.llama import LlamaError, Model, Sampler
from llmrun.request import ChatRequest, Options
from tests.integration.test_engine import GREEDY, Harness

AGE = {"type": "object", "properties": {"age": {"type": "integer", "minimum": 0,
                                                 "maximum": 150}},
       "required": ["age"], "additionalProperties": False}
PERSON = {"type": "object", "required": ["name", "tags"], "additionalProperties": False,
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "tags": {"type": "array", "items": {"enum": ["a", "b"]},
                                  "maxItems": 2}}}


@pytest.fixture(scope="module")
def model(smollm2_path: Path) -> Iterator[Model]:
    m = Model(smollm2_path)
    yield m
    m.close()


@pytest.fixture(scope="module")
def tok(model: Model) -> lg.LLTokenizer:
    return constraint.tokenizer(model)


@pytest.fixture(scope="module")
def harness(model: Model) -> Iterator[Harness]:
    h = Harness(model, slots=3)
    yield h
    h.close()


def job(**fields: Any) -> ChatRequest:
    return ChatRequest(model="test", messages=[], options=Options(), **fields)


def submit(h: Harness, question: str, matcher: Any = None, max_tokens: int = 40,
           **sampling: Any) -> str:
    h._n += 1
    rid = f"c{h._n}"
    params = SeqParams(sampling={**GREEDY, **sampling}, max_tokens=max_tokens, matcher=matcher)
    h.engine.submit(rid, h.tokens([{"role": "user", "content": question}]), params)
    return rid


def matcher_for(tok: lg.LLTokenizer, schema: dict[str, Any]) -> lg.LLMatcher:
    grammar = constraint.compile(job(format=schema), tok)
    assert grammar is not None
    return constraint.matcher(tok, grammar)


# -- compiling ---------------------------------------------------------------------------------


def test_unsupported_keyword_is_refused_unless_not_strict(tok: lg.LLTokenizer) -> None:
    schema = {"type": "integer", "not": {"const": 3}}
    with pytest.raises(ValueError, match='"not"'):
        constraint.compile(job(format=schema), tok)
    assert constraint.compile(job(format=schema, format_strict=False), tok)  # a warning
    with pytest.raises(ValueError, match="Unknown format: regex"):
        constraint.compile(job(format={"type": "string", "format": "regex"}), tok)


def test_huge_bounds_compile_and_hold(tok: lg.LLTokenizer) -> None:
    """What llama.cpp's GBNF path crashed on (SIGSEGV) is an ordinary grammar here."""
    m = matcher_for(tok, {"type": "string", "maxLength": 200000})
    assert m.consume_tokens(tok.tokenize_str('"' + "ab" * 50))
    m = matcher_for(tok, {"type": "string", "maxLength": 3})
    assert not m.consume_tokens(tok.tokenize_str('"abcd"'))


def test_grammar_kinds(tok: lg.LLTokenizer) -> None:
    m = constraint.matcher(tok, constraint.compile(job(format="json"), tok) or "")
    assert not m.consume_tokens(tok.tokenize_str("[1]"))  # "json": an object, as Ollama
    gbnf = 'root ::= "yes" | "no"'
    m = constraint.matcher(tok, constraint.compile(job(grammar=gbnf), tok) or "")
    assert m.consume_tokens(tok.tokenize_str("no")) and m.is_accepting()
    lark = 'start: "x=" %json {"type": "integer", "maximum": 5}'
    m = constraint.matcher(tok, constraint.compile(job(grammar=lark), tok) or "")
    assert not m.consume_tokens(tok.tokenize_str("x=7"))
    with pytest.raises(ValueError, match="structured output"):
        constraint.compile(job(grammar="start: undefined_rule"), tok)
    assert constraint.compile(job(), tok) is None


def test_nullable_and_client_options(tok: lg.LLTokenizer) -> None:
    m = matcher_for(tok, {"type": "string", "nullable": True})
    assert m.consume_tokens(tok.tokenize_str("null")) and m.is_accepting()
    # a client's x-guidance (compiler options) is ours to set: whitespace stays bounded
    m = matcher_for(tok, {"type": "object", "x-guidance": {"whitespace_pattern": "[\n]*"}})
    assert not m.consume_tokens(tok.tokenize_str("{\n\n"))
    m = matcher_for(tok, {"type": "object"})
    assert m.consume_tokens(tok.tokenize_str('{\n  "a": 1\n}')) and m.is_accepting()


# -- sampling ----------------------------------------------------------------------------------


def test_masked_sampling_never_writes_llama_cpp_logits(model: Model, tok: lg.LLTokenizer) -> None:
    m = matcher_for(tok, AGE)
    mask = np.zeros((1, (model.n_vocab + 31) // 32), dtype=np.int32)
    lg.numpy.fill_next_token_bitmask(m, mask)  # type: ignore[attr-defined]
    logits = np.random.default_rng(0).normal(size=model.n_vocab).astype(np.float32)
    logits.flags.writeable = False  # as llama.cpp's buffer: a write would raise
    sampler = Sampler(model, **{**GREEDY, "temperature": 1.0})
    try:
        token = sampler.sample_masked(logits, mask[0])
        assert (mask[0][token >> 5] >> (token & 31)) & 1
        with pytest.raises(LlamaError, match="allows no token"):
            sampler.sample_masked(logits, np.zeros_like(mask[0]))
    finally:
        sampler.close()


def test_integer_bounds_hold_whatever_is_sampled(harness: Harness, tok: lg.LLTokenizer) -> None:
    """Through the old GBNF converter, `{"minimum": 0, "maximum": 150}` came back as
    987654321987. Hot sampling, a prompt that asks for a huge number: every answer is still in
    range."""
    rids = [submit(harness, "Reply in JSON: an age of 987654321987 years.",
                   matcher_for(tok, AGE), temperature=1.5, top_k=0, seed=seed)
            for seed in range(6)]
    for text in harness.wait(*rids):
        jsonschema.validate(json.loads(text), AGE)
    assert all(harness.final[r][1]["finish_reason"] == "stop" for r in rids)


def test_constrained_and_free_batch_as_alone(model: Model, tok: lg.LLTokenizer) -> None:
    """Two constrained sequences and a free one decoded together give each the tokens it
    gets alone (greedy)."""
    cases = [("Describe a person as JSON.", PERSON), ("How old is the sun, as JSON?", AGE),
             ("Why is the sky blue?", None)]

    def run(h: Harness, together: bool) -> list[str]:
        out = []
        rids = []
        for question, schema in cases:
            rid = submit(h, question, schema and matcher_for(tok, schema))
            if together:
                rids.append(rid)
            else:
                out += h.wait(rid)
        return h.wait(*rids) if together else out

    h = Harness(model, slots=3)
    try:
        alone = run(h, together=False)
        together = run(h, together=True)
    finally:
        h.close()
    assert together == alone
    jsonschema.validate(json.loads(alone[0]), PERSON)
    jsonschema.validate(json.loads(alone[1]), AGE)
    assert len(alone[2]) > 40


def test_a_dead_end_grammar_ends_its_sequence_alone(harness: Harness,
                                                   tok: lg.LLTokenizer) -> None:
    # a schema that refers only to itself: the matcher fails at its first mask
    loop = lg.LLMatcher(tok, lg.LLMatcher.grammar_from_json_schema(
        {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}), log_level=0)
    free = submit(harness, "Why is the sky blue?", max_tokens=16)
    bad = submit(harness, "Say something.", loop)
    ok = submit(harness, "Give an age as JSON.", matcher_for(tok, AGE))
    with harness.cond:
        assert harness.cond.wait_for(lambda: all(r in harness.final for r in (free, bad, ok)),
                                     timeout=120)
    kind, payload = harness.final[bad]
    assert kind == "error" and payload["code"] == "invalid_request"
    assert "structured output" in payload["message"]
    assert harness.final[free][0] == "done" and harness.final[ok][0] == "done"
    jsonschema.validate(json.loads(harness.text[ok]), AGE)


def test_control_characters_in_names_are_written_escaped(tok: lg.LLTokenizer) -> None:
    """A property named "\x04" aborted llama.cpp's GBNF matcher (found by the fuzz test);
    llguidance takes it, and only as JSON writes it: escaped."""
    schema = {"type": "object", "properties": {"\x04p": {"enum": ["x\ny"]}},
              "required": ["\x04p"]}
    good = matcher_for(tok, schema)
    assert good.consume_tokens(tok.tokenize_str(json.dumps({"\x04p": "x\ny"})))
    assert good.is_accepting()
    raw = matcher_for(tok, schema)
    assert not raw.consume_tokens(tok.tokenize_str('{"\x04p": '))


# -- numbers as a client parses them -----------------------------------------------------------


def number(**node: Any) -> dict[str, Any]:
    return {"type": "object", "properties": {"p": {"type": "number", **node}},
            "required": ["p"], "additionalProperties": False}


def admitted(tok: lg.LLTokenizer, schema: dict[str, Any], text: str) -> bool:
    """Whether the matcher for `schema` lets the model write `text` whole, one character's
    token at a time (the slowest way a model can spell it; a single refusal is final)."""
    m = matcher_for(tok, schema)
    for ch in text:
        ids = tok.tokenize_str(ch)
        if m.validate_tokens(ids) < len(ids):
            return False
        assert m.consume_tokens(ids)
    return m.is_accepting()


def client_accepts(schema: dict[str, Any], text: str) -> bool:
    """What a client does: parse (numbers become doubles, or ints), then validate."""
    return jsonschema.Draft202012Validator(schema).is_valid(json.loads(text))


# (schema, value text, whether the matcher must let it through): every refusal below is text
# a client parses to a value outside the bound (or to inf, or to 0), or a digit run past the
# cap; every admission sits at the edge of a bound and validates.
EDGES = [
    (number(exclusiveMinimum=0, exclusiveMaximum=1), "0.5", True),
    (number(exclusiveMinimum=0, exclusiveMaximum=1), "0.9999999999", True),
    (number(exclusiveMinimum=0, exclusiveMaximum=1), "0.99999999999999999", False),  # 1.0
    (number(exclusiveMinimum=0, exclusiveMaximum=1), "0.9999999999999999999", False),
    (number(exclusiveMinimum=0, exclusiveMaximum=1), "1", False),
    (number(exclusiveMinimum=0, exclusiveMaximum=1), "0.0000000001", True),
    (number(exclusiveMinimum=0, exclusiveMaximum=1), "0." + "0" * 400 + "1", False),  # 0.0
    (number(exclusiveMinimum=0, exclusiveMaximum=1), "1e-400", False),
    (number(exclusiveMinimum=0, exclusiveMaximum=1), "0", False),
    (number(exclusiveMaximum=0.1), "0.1", False),  # parsed, exactly the bound
    (number(exclusiveMaximum=0.1), "0.10", False),
    (number(exclusiveMaximum=0.1), "0.099999999999999999", False),  # parsed: 0.1
    (number(exclusiveMaximum=0.1), "0.0999999999", True),
    (number(maximum=0.1), "0.1", True),
    (number(maximum=0.1), "0.10000000000000001", False),  # parsed: 0.1, but past the places
    (number(minimum=-2.5, maximum=-0.5), "-2.5", True),
    (number(minimum=-2.5, maximum=-0.5), "-0.5", True),
    (number(exclusiveMinimum=-2.5, maximum=-0.5), "-2.4999999999999999999", False),
    (number(exclusiveMinimum=1e15), "1000000000000000.0000000001", False),  # parsed: 1e15
    (number(exclusiveMinimum=1e15), "1000000000000010", True),  # the 15th digit past it
    (number(), "1e400", False),  # inf
    (number(), "1" + "0" * 400, False),  # inf
    (number(), "9007199254740991", True),
    (number(), "90071992547409910", False),  # past the 16 digits of the cap
    (number(), "3.1415926535", True),
    (number(), "3.14159265358979323846", False),  # past the 10 places
    (number(multipleOf=0.25, exclusiveMaximum=1), "0.75", True),
    (number(multipleOf=0.25, exclusiveMaximum=1), "1", False),
    ({"type": "integer", "exclusiveMaximum": 3.5}, "3", True),
    ({"type": "integer", "exclusiveMaximum": 3}, "3", False),
    ({"type": "integer", "exclusiveMinimum": -1}, "0", True),
    ({"type": "integer"}, "2.0", False),  # integers stay integers
    ({"type": "integer"}, "1" * 40, False),
    ({"type": "object"}, '{"a": [1e400]}', False),  # format "json": open places too
    ({"type": "object"}, '{"a": {"b": 0.' + "9" * 30 + "}}", False),
    ({"type": "object"}, '{"a": {"b": [0.25, -3]}}', True),
]


@pytest.mark.parametrize(("schema", "text", "admit"), EDGES)
def test_numbers_obey_their_bounds_as_a_client_parses_them(
        tok: lg.LLTokenizer, schema: dict[str, Any], text: str, admit: bool) -> None:
    doc = f'{{"p": {text}}}' if "properties" in schema else text
    assert admitted(tok, schema, doc) is admit
    if admit:
        assert client_accepts(schema, doc)


def test_a_long_digit_run_is_cut_after_the_cap(tok: lg.LLTokenizer) -> None:
    """However the model spells a number, its digits end: after the 10th decimal place, and
    after the 16th digit before the point, only what closes the number is allowed."""
    m = matcher_for(tok, number())
    assert m.consume_tokens(tok.tokenize_str('{"p": 0.'))
    fed = 0
    while m.validate_tokens(tok.tokenize_str("9")) == 1:
        assert m.consume_tokens(tok.tokenize_str("9"))
        fed += 1
        assert fed <= 10
    assert fed == 10
    m = matcher_for(tok, number())
    digits = tok.tokenize_str('{"p": ' + "9" * 40)
    assert m.validate_tokens(digits) < len(digits)


def test_what_is_admitted_near_a_bound_always_validates(tok: lg.LLTokenizer) -> None:
    """Texts at and around each bound, spelled out to 25 digits: whatever a matcher lets
    through, the client's parse of it validates."""
    bounds = [0, 0.1, 0.3, 1, -0.5, 2.675, 1e-5, 123456.789, 1e15]
    for b in bounds:
        for node in ({"exclusiveMaximum": b}, {"exclusiveMinimum": b}, {"maximum": b},
                     {"minimum": b}):
            schema = number(**node)
            m = matcher_for(tok, schema)
            for text in _around(b):
                ids = tok.tokenize_str(f'{{"p": {text}}}')
                probe = m.deep_copy()
                if probe.validate_tokens(ids) == len(ids):
                    probe.consume_tokens(ids)
                    if probe.is_accepting():
                        assert client_accepts(schema, f'{{"p": {text}}}'), (node, text)


def _around(b: float) -> list[str]:
    from decimal import Decimal
    exact = Decimal(b)
    out = {repr(float(b)), format(exact, "f")}
    for e in range(8, 26):
        step = Decimal(1).scaleb(-e)
        out.update(format(exact - step, "f"), format(exact + step, "f"))
    return sorted(t for t in out if "e" not in t)


def test_tool_arguments_bound_their_numbers() -> None:
    from llmrun.chat.tools import _arguments_schema
    from llmrun.request import Tool

    tool = Tool(name="f", parameters=number(exclusiveMaximum=1))
    p = json.loads(_arguments_schema(tool, True))["properties"]["p"]
    assert p == {"type": "number", "minimum": -9007199254740991, "maximum": 0.9999999999,
                 "multipleOf": 1e-10}
