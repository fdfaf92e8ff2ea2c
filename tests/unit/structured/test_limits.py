"""llmrun/structured/limits.py: the schema and grammar ceilings as plain ValueErrors
(Refused), the same messages llmrun/bounds.py makes a request's 400."""

from __future__ import annotations

import logging

import pytest

from llmrun import bounds
from llmrun.request import EngineError
from llmrun.structured import limits


def refused(schema: object, **kwargs: object) -> str:
    with pytest.raises(limits.Refused) as info:
        limits.check_schema(schema, **kwargs)  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    return str(info.value)


def test_a_fault_names_the_field_the_place_and_the_limit() -> None:
    message = refused({"properties": {"a": {"type": "array", "uniqueItems": True}}},
                      where="tool 't' parameters")
    assert message == ("tool 't' parameters: the keyword 'uniqueItems' is not supported (at "
                       "/properties/a/uniqueItems); structured output cannot enforce this "
                       "schema")
    assert "over 10000 alternatives" in refused({"enum": list(range(10_001))})
    deep: dict[str, object] = {}
    for _ in range(40):  # two JSON levels an object level: `properties`, then the name
        deep = {"type": "object", "properties": {"a": deep}}
    assert f"nested over {limits.MAX_SCHEMA_DEPTH} levels" in refused(deep)


def test_what_is_not_a_schema_passes() -> None:
    limits.check_schema("json")
    limits.check_schema(None)
    limits.check_schema({"type": "object", "properties": {"not": {"const": {"if": 1}}}})


def test_draft_4_tuples_are_walked_for_keywords() -> None:
    assert "(at /items/1/uniqueItems)" in refused(
        {"type": "array", "items": [{"type": "string"}, {"uniqueItems": True}]})


def test_one_budget_spans_the_schemas_of_a_request() -> None:
    budget = limits.Budget()
    limits.check_schema({"enum": list(range(6000))}, budget=budget)
    assert budget.alternatives == 6000 and budget.nodes == 6002
    assert "alternatives" in refused({"enum": list(range(6000))}, budget=budget)


def test_non_strict_output_logs_what_is_not_enforced(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="llmrun.structured.limits"):
        limits.check_schema({"type": "string", "format": "regex"}, strict=False)
    assert "'format' 'regex' is not supported" in caplog.text
    assert "not enforced (the client asked for non-strict output)" in caplog.text


def test_grammar_ceilings() -> None:
    limits.check_grammar(None)
    limits.check_grammar('root ::= "((((" [(((] # ((((\n')  # literals, classes, comments
    with pytest.raises(limits.Refused, match="groups nested over 1000 deep"):
        limits.check_grammar("root ::= " + "(" * 1001 + '"a"' + ")" * 1001)
    with pytest.raises(limits.Refused, match=f"over the limit of {limits.MAX_GRAMMAR_BYTES}"):
        limits.check_grammar("x" * (limits.MAX_GRAMMAR_BYTES + 1))


def test_bounds_makes_a_refusal_the_requests_400() -> None:
    schema = {"$ref": "https://example.com/s.json"}
    with pytest.raises(EngineError) as info:
        bounds.check_schema(schema)
    assert info.value.code == "invalid_request"
    assert info.value.message == refused(schema)
    with pytest.raises(EngineError) as info:
        bounds.check_grammar("(" * 1001)
    assert info.value.code == "invalid_request" and "nested over" in info.value.message
