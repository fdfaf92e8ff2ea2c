"""Checking a call against the request's tools: a known name, and arguments that its
parameters schema accepts (the patterns and formats left to the grammar)."""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from functools import lru_cache
from typing import Any

log = logging.getLogger(__name__)

# JSON Schema keywords not checked: regular expressions run by Python's backtracking `re` on
# text a model wrote could take exponential time (ReDoS), and `uniqueItems` can take
# quadratic time; the grammar, where it steers a call, enforces them in linear time.
_UNCHECKED = ("pattern", "patternProperties", "uniqueItems", "format")


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

    def accepts(self, name: str, arguments: dict[str, Any]) -> bool:
        if name not in self.schemas:
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

        from llmrun.chat.schema import prepare_schema

        base = validators.validator_for(schema, default=validators.Draft202012Validator)
        return _safe_validator(base)(prepare_schema(schema))
