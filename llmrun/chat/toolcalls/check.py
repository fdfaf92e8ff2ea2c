"""Checking a call against the request's tools: a known name, and arguments that its
parameters schema accepts (the patterns and formats left to the grammar).

One checker, two callers: the runner reads calls out of the model's text with it
(toolcalls/reader.py, stream.py), and the daemon checks every call a runner reports with it
again (server/runnerguard.check_calls), since a runner's code may be an attacker's. Both
must reach the same verdict on an honest call, so it judges the arguments as they cross the
IPC: JSON data (`is_json_data`), whose JSON round trip gives them back unchanged.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any

log = logging.getLogger(__name__)

# JSON Schema keywords not checked: regular expressions run by Python's backtracking `re` on
# text a model wrote could take exponential time (ReDoS), and `uniqueItems` can take
# quadratic time; the grammar, where it steers a call, enforces them in linear time.
_UNCHECKED = ("pattern", "patternProperties", "uniqueItems", "format")
# Deepest nesting of arguments (jsontext.MAX_DEPTH: the reader refuses text nested deeper;
# a Python-style call, read by `ast`, could otherwise nest to its parser's 200 levels).
MAX_ARGUMENT_DEPTH = 100


def is_json_data(value: Any, depth: int = MAX_ARGUMENT_DEPTH) -> bool:
    """Whether `value` is what JSON carries unchanged: objects with string keys, lists,
    strings, finite numbers, booleans and null, nested at most `depth` deep. What Python's
    readers also give (NaN and Infinity, which the IPC writes as null, a Python-style call's
    tuples, sets and bytes) would change or fail on the way, so a call holding it is none:
    the daemon, reading the call from the IPC, could not check what the runner checked.
    Iterative: no recursion, whatever the nesting."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        v, level = stack.pop()
        t = type(v)
        if t is float:
            if not math.isfinite(v):
                return False
        elif t is dict:
            if level >= depth or any(type(k) is not str for k in v):
                return False
            stack.extend((x, level + 1) for x in v.values())
        elif t is list:
            if level >= depth:
                return False
            stack.extend((x, level + 1) for x in v)
        elif t not in (str, int, bool) and v is not None:
            return False
    return True


@lru_cache(maxsize=8)


def _safe_validator(base: type) -> type:
    from jsonschema import validators

    return validators.extend(base, {k: lambda *_: None for k in _UNCHECKED})


class ToolCheck:
    """The request's tools as the reader checks calls against them: a known name, and
    arguments valid under that tool's parameters schema (None: any object)."""

    def __init__(self, schemas: Mapping[str, dict[str, Any] | None]) -> None:
        self.schemas = dict(schemas)
        self._validators: dict[str, Any] = {}

    @classmethod
    def of(cls, tools: Iterable[Any]) -> ToolCheck:
        """From `request.Tool`s."""
        return cls({t.name: t.parameters for t in tools})

    @property
    def names(self) -> set[str]:
        return set(self.schemas)

    def accepts(self, name: str, arguments: Any) -> bool:
        """Whether a call of `name` with `arguments` is one: a tool of the request's, an
        object of JSON data (`is_json_data`), valid under the tool's schema."""
        if name not in self.schemas or type(arguments) is not dict \
                or not is_json_data(arguments):
            return False
        schema = self.schemas[name]
        if not schema:
            return True
        try:
            if name not in self._validators:
                self._validators[name] = self._validator(schema)
            return bool(self._validators[name].is_valid(arguments))
        except Exception as exc:  # a schema jsonschema cannot use: the name decides
            log.debug("tool %r: its schema cannot be checked (%s)", name, exc)
            return True

    @staticmethod
    def _validator(schema: dict[str, Any]) -> Any:
        from jsonschema import validators

        from llmrun.structured.prepare import prepare_schema

        base = validators.validator_for(schema, default=validators.Draft202012Validator)
        return _safe_validator(base)(prepare_schema(schema))
