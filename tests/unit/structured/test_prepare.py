"""llmrun/structured/prepare.py: a client's schema as llguidance should read it."""

from __future__ import annotations

import copy
from typing import Any

from llmrun.structured.prepare import prepare_schema


def test_nullable_becomes_a_null_alternative_at_every_level() -> None:
    schema: dict[str, Any] = {"type": "object", "properties": {
        "s": {"type": "string", "nullable": True},
        "t": {"type": ["integer", "null"], "nullable": True},
        "e": {"enum": ["a", "b"], "nullable": True},
        "c": {"const": 3, "nullable": True},
        "u": {"anyOf": [{"type": "string"}], "nullable": True},
        "n": {"type": "string", "nullable": False}}}
    before = copy.deepcopy(schema)
    props = prepare_schema(schema)["properties"]
    assert props["s"] == {"type": ["string", "null"]}
    assert props["t"] == {"type": ["integer", "null"]}
    assert props["e"] == {"enum": ["a", "b", None]}
    assert props["c"] == {"enum": [3, None]}
    assert props["u"] == {"anyOf": [{"type": "string"}, {"type": "null"}]}
    assert props["n"] == {"type": "string"}  # false: dropped, nothing else changed
    assert schema == before  # a copy: the client's schema is left as it came


def test_a_clients_compiler_options_are_dropped() -> None:
    schema = {"x-guidance": {"whitespace_flexible": False}, "type": "array",
              "items": [{"x-guidance": {"lenient": True}, "type": "string"}]}
    assert prepare_schema(schema) == {"type": "array", "items": [{"type": "string"}]}
