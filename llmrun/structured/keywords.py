"""The JSON Schema keywords structured output knows: those llguidance enforces, those that
constrain nothing, the `format` values it enforces, and the keywords whose values are
subschemas, walked the same way by the daemon's checks (limits.py) and the rewrite before
compiling (numbers.py).

tests/integration/test_bounds.py compiles each listed keyword and format with llguidance, and
each refused one, so a change of the constraint engine that moves one shows there.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# Schema keywords llguidance enforces.
SUPPORTED = frozenset({
    "type", "enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "multipleOf", "minLength", "maxLength", "pattern", "format", "minItems", "maxItems",
    "prefixItems", "items", "required", "additionalProperties", "properties",
    "patternProperties", "minProperties", "maxProperties", "anyOf", "oneOf", "allOf",
    "$ref", "$defs", "definitions",
    "nullable",  # OpenAPI's; prepare.py rewrites it as a type union
})
# Keywords that describe and constrain nothing.
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment",
    "deprecated", "readOnly", "writeOnly",
})
# `format` values llguidance enforces (it refuses the others).
FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "hostname", "ipv4",
                     "ipv6", "uuid", "uri"})

# Keywords whose value is one subschema (`items` also a list of them: draft 4's tuples),
# a list of subschemas, or a map of names to subschemas. Every keyword of any draft that
# holds schemas is here, the unsupported ones included, so that a keyword nested inside
# one is found wherever it sits.
SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
             "propertyNames", "unevaluatedProperties", "unevaluatedItems", "additionalItems")
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                  "dependentSchemas")


def subschemas(node: dict[str, Any]) -> Iterator[tuple[str, Any, Any, str]]:
    """Every place in the schema `node` that holds a subschema, as (keyword, container,
    slot, path): `container[slot]` is the subschema (so a walk may replace it), `path` its
    place under `node` ("items", "anyOf/0", "properties/a"). A subschema keyword holding a
    list is read as a list of subschemas (draft 4's `items`; elsewhere the list is
    malformed, and the engine reports it). Places come in the order of the tables above,
    whatever the order of `node`'s keys."""
    for key in SUBSCHEMA:
        if key not in node:
            continue
        value = node[key]
        if isinstance(value, list):
            yield from ((key, value, i, f"{key}/{i}") for i in range(len(value)))
        else:
            yield key, node, key, key
    for key in SUBSCHEMA_LISTS:
        value = node.get(key)
        if isinstance(value, list):
            yield from ((key, value, i, f"{key}/{i}") for i in range(len(value)))
    for key in SUBSCHEMA_MAPS:
        value = node.get(key)
        if isinstance(value, dict):
            yield from ((key, value, name, f"{key}/{name}") for name in list(value))
