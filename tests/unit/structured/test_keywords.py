"""llmrun/structured/keywords.py: the keyword tables, and where a schema's subschemas sit."""

from __future__ import annotations

from typing import Any

from llmrun.structured import keywords


def test_a_keyword_is_enforced_or_an_annotation_never_both() -> None:
    assert not keywords.SUPPORTED & keywords.ANNOTATIONS
    # the schema-holding keywords llguidance enforces are walked, and so are the others
    holding = {*keywords.SUBSCHEMA, *keywords.SUBSCHEMA_LISTS, *keywords.SUBSCHEMA_MAPS}
    assert {"items", "additionalProperties", "anyOf", "oneOf", "allOf", "prefixItems",
            "properties", "patternProperties", "$defs", "definitions"} <= holding
    assert {"not", "if", "then", "else", "contains", "dependentSchemas"} <= \
        holding - keywords.SUPPORTED


def test_subschemas_name_every_place_in_table_order() -> None:
    node: dict[str, Any] = {
        "properties": {"a": {"type": "string"}, "b": True},
        "anyOf": [{"type": "null"}, {"const": 1}],
        "items": {"type": "integer"},
        "not": {},
        "enum": [{"type": "object"}],  # a value, not a schema
        "default": {"items": {}},
        "$defs": {"x": {"type": "number"}},
    }
    found = [(key, path) for key, _, _, path in keywords.subschemas(node)]
    assert found == [("items", "items"), ("not", "not"), ("anyOf", "anyOf/0"),
                     ("anyOf", "anyOf/1"), ("properties", "properties/a"),
                     ("properties", "properties/b"), ("$defs", "$defs/x")]
    for _, container, slot, path in keywords.subschemas(node):
        target: Any = node
        for part in path.split("/"):
            target = target[int(part)] if isinstance(target, list) else target[part]
        assert container[slot] is target


def test_a_list_under_a_one_schema_keyword_is_a_list_of_schemas() -> None:
    node: dict[str, Any] = {"items": [{"type": "string"}, {"type": "integer"}],
                            "prefixItems": "not a list", "properties": ["not", "a", "map"]}
    assert [path for *_, path in keywords.subschemas(node)] == ["items/0", "items/1"]


def test_a_walk_may_replace_what_it_is_given() -> None:
    node: dict[str, Any] = {"items": True, "allOf": [True], "properties": {"p": True}}
    for _, container, slot, _ in keywords.subschemas(node):
        container[slot] = {"replaced": True}
    assert node == {"items": {"replaced": True}, "allOf": [{"replaced": True}],
                    "properties": {"p": {"replaced": True}}}
