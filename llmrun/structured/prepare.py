"""A client's JSON schema as the constraint engine should read it: the layout of generated
JSON (JSON_OPTIONS, compiler overrides), `format: "json"` as a schema, and prepare_schema's
copy with OpenAPI's `nullable` rewritten and a client's `x-guidance` options dropped.

The tool-call grammars (llmrun/chat/) and the runner's compiler (llmrun/engine/constraint.py)
both prepare schemas here, so a response format and a forced call's arguments read alike.
"""

from __future__ import annotations

import copy
from typing import Any

# How generated JSON is laid out: as the model likes, within bounds. Between tokens, one
# space or one newline with up to 20 spaces or tabs of indentation (llama.cpp's JSON grammar
# bounds it the same way): a small model given unbounded whitespace may emit newlines forever
# inside a valid document, and one forced compact layout (tried first) made SmolLM2 write
# keys like `", "` where it wanted a newline (measured: 1 of 4 seeds ran to the token limit,
# 2 of 4 wrote a wrong key; with this pattern 4 of 4 wrote the object asked for). These are
# *overrides*: a client's own `x-guidance` options are dropped (see prepare_schema).
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": True,
    "whitespace_pattern": r"(?: |\n[ \t]{0,20})?",
}

# `format: "json"` (Ollama) and `response_format: json_object` (OpenAI): a JSON object, as
# Ollama's and llama.cpp's JSON grammars (`root ::= object`) have it.
ANY_OBJECT: dict[str, Any] = {"type": "object"}


def _nullable(node: dict[str, Any]) -> None:
    """OpenAPI's `nullable: true` (which llguidance does not read) as JSON Schema: null joins
    the node's types, enum or alternatives in place, so `$ref` paths into it stay valid."""
    if node.pop("nullable", False) is not True:
        return
    kind = node.get("type")
    if isinstance(kind, str):
        node["type"] = [kind, "null"]
    elif isinstance(kind, list) and "null" not in kind:
        node["type"] = [*kind, "null"]
    if isinstance(node.get("enum"), list) and None not in node["enum"]:
        node["enum"] = [*node["enum"], None]
    if "const" in node:
        node["enum"] = [node.pop("const"), None]
    for key in ("anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            node[key] = [*node[key], {"type": "null"}]


def prepare_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """A copy of a client's schema as llguidance should read it: `nullable` rewritten and
    `x-guidance` (compiler options: ours, not the client's) removed, at every level."""
    schema = copy.deepcopy(schema)
    stack: list[Any] = [schema]
    while stack:  # iterative: limits.py has bounded the depth, not the breadth
        value = stack.pop()
        if isinstance(value, dict):
            value.pop("x-guidance", None)
            _nullable(value)
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return schema
