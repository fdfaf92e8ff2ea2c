"""llmrun/structured/numbers.py: every number a schema admits, bounded so that what a client
parses obeys the schema and no number runs on."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from llmrun.structured.numbers import ANY_DEF, CAP, PLACES, bound_numbers
from llmrun.structured.prepare import prepare_schema

ANY_REF = {"$ref": f"#/$defs/{ANY_DEF}"}


def bounded(schema: dict[str, Any]) -> dict[str, Any]:
    return bound_numbers(prepare_schema(schema))


def test_an_unbounded_number_gets_a_cap_and_places() -> None:
    assert bounded({"type": "number"}) == {"type": "number", "minimum": -CAP, "maximum": CAP,
                                           "multipleOf": 10.0 ** -PLACES}
    assert bounded({"type": "integer"}) == {"type": "integer", "minimum": -CAP,
                                            "maximum": CAP}


def test_exclusive_bounds_become_inclusive_ones_a_double_parse_obeys() -> None:
    assert bounded({"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10.5}) == \
        {"type": "integer", "minimum": 1, "maximum": 10}
    node = bounded({"type": "number", "exclusiveMaximum": 1, "exclusiveMinimum": 0})
    assert node["minimum"] > 0 and node["maximum"] < 1
    for bound in (node["minimum"], node["maximum"]):
        text = repr(bound)
        assert float(text) == bound and len(Decimal(text).as_tuple().digits) <= 15
    # a draft-4 flag on the inclusive keyword reads the same
    assert bounded({"type": "integer", "maximum": 5, "exclusiveMaximum": True})["maximum"] == 4


def test_bounds_that_leave_no_number_are_a_value_error_naming_the_place() -> None:
    with pytest.raises(ValueError, match="at /properties/a: no number between its bounds"):
        bounded({"type": "object", "properties": {
            "a": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}})


def test_open_places_take_the_bounded_any_value() -> None:
    root = bounded({"type": "object", "properties": {"list": {"type": "array"}}})
    assert root["additionalProperties"] == ANY_REF
    assert root["properties"]["list"]["items"] == ANY_REF
    any_json = root["$defs"][ANY_DEF]
    assert any_json["minimum"] == -CAP and any_json["maximum"] == CAP
    assert any_json["items"] == ANY_REF and any_json["additionalProperties"] == ANY_REF
    assert bound_numbers(True)["$defs"][ANY_DEF] == any_json


def test_merged_branches_keep_their_own_open_places() -> None:
    root = bounded({"allOf": [{"type": "object"}, {"type": "number"}],
                    "$defs": {"d": {"type": "array"}}})
    first, second = root["allOf"]
    assert "additionalProperties" not in first  # intersecting the recursive one never ends
    assert second["maximum"] == CAP  # numbers are still bounded there
    assert "items" not in root["$defs"]["d"]
    assert ANY_DEF not in root.get("$defs", {})


def test_draft_4_tuples_are_bounded() -> None:
    root = bounded({"type": "array", "items": [{"type": "number", "maximum": 2}]})
    assert root["items"][0]["maximum"] == 2 and root["items"][0]["minimum"] == -CAP
