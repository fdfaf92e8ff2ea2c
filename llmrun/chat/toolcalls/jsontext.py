"""The JSON in a model's text, read without trusting it: bracket nesting and where an object
ends (linear, no recursion), light repairs (trailing commas, arguments given as a string),
and the run of JSON values a call may be written as."""

from __future__ import annotations

import json
import re
from typing import Any

# Deepest bracket nesting a call's JSON may have. Real arguments are a few levels deep; text
# nested deeper is not taken for a call, and never reaches a recursive decoder (Python's json
# raises RecursionError near 1000 levels, which must not escape into the engine thread).
MAX_DEPTH = 100

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_BRACKET = re.compile(r"[\[\]{}]")
# a string, a lone quote (a string left open), or a bracket
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|"|[\[\]{}]', re.S)
_TRAILING_COMMA = re.compile(r'("(?:[^"\\]|\\.)*")|,(\s*[}\]])', re.S)


def nesting(text: str) -> int:
    """The deepest bracket nesting in `text`, brackets inside strings aside (those of a string
    left unclosed count: erring on the deep side is safe). Linear time, no recursion."""
    depth = deepest = 0
    for m in _BRACKET.finditer(_STRING.sub("", text)):
        if m.group() in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif depth:
            depth -= 1
    return deepest


def balanced(text: str, i: int) -> int | None:
    """The end of the JSON object or list that opens at `text[i]` (brackets in strings
    aside), or None when it does not close. Linear, no recursion."""
    depth = 0
    for m in _JSON_TOKEN.finditer(text, i):
        t = m.group()
        if t[0] == '"':
            if len(t) == 1:
                return None  # a string left open
            continue
        depth += 1 if t in "[{" else -1
        if depth == 0:
            return m.end()
        if depth < 0:
            return None
    return None


def loads(text: str) -> Any:
    """JSON, or with trailing commas removed (a light repair); raises ValueError."""
    try:
        return json.loads(text)
    except ValueError:
        fixed = _TRAILING_COMMA.sub(lambda m: m.group(1) or m.group(2), text)
        if fixed == text:
            raise
        return json.loads(fixed)


def arguments(value: Any) -> dict[str, Any] | None:
    if value is None or value == "":
        return {}
    if isinstance(value, str):  # arguments given as a JSON string (OpenAI's wire form)
        if nesting(value) > MAX_DEPTH:
            return None
        try:
            value = loads(value)
        except (ValueError, RecursionError):
            return None
    return value if isinstance(value, dict) else None


def json_values(text: str, truncated: bool = False) -> list[Any] | None:
    """The JSON values in `text` (inside a fence or not), separated by whitespace, commas or
    semicolons; lists are flattened. None if anything else is there (`truncated`: except a
    broken tail after at least one whole value, where generation was cut off)."""
    m = re.fullmatch(r"\s*```[\w-]*\s*(.*?)\s*(?:```\s*)?", text, re.S)
    s = (m.group(1) if m else text).strip()
    out: list[Any] = []
    i = 0
    while True:
        while i < len(s) and s[i] in " \t\r\n,;":
            i += 1
        if i >= len(s):
            break
        end = balanced(s, i) if s[i] in "[{" else None
        try:
            if end is None:
                raise ValueError("not an object or list, or not closed")
            value = loads(s[i:end])
        except ValueError:
            if truncated and out:
                break
            if truncated and s[i] == "[":  # a list cut short: its whole items
                return json_values(s[i + 1:], truncated=True)
            return None
        i = end
        out.extend(value if isinstance(value, list) else [value])
    return out or None


def whole_object(text: str) -> dict[str, Any] | None:
    """The JSON object `text` opens with, if it closes (what follows it aside)."""
    s = text.lstrip()
    end = balanced(s, 0) if s.startswith("{") else None
    if end is None or nesting(s[:end]) > MAX_DEPTH:
        return None
    try:
        value = loads(s[:end])
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None
