"""The JSON body's shape, counted over raw bytes before any parser sees it."""

from __future__ import annotations

import json

import pytest

from llmrun.daemon import jsonshape
from llmrun.daemon.jsonshape import refusal


def test_values_and_depth_are_bounded() -> None:
    assert refusal(b"[1,2]", max_values=2) is None
    assert refusal(b"[1,2,3]", max_values=2) == (413, "the JSON body has more than 2 values "
                                                      "(array items and object members)")
    assert refusal(b"[[]]", max_depth=2) is None
    status, message = refusal(b"[[[]]]", max_depth=2) or (0, "")
    assert status == 400 and "nested more than 2 levels" in message


def test_what_strings_hold_is_not_counted() -> None:
    text = json.dumps({"content": "[[[[,,,,{{{{" * 1000 + '"\\'})
    assert refusal(text.encode(), max_values=4, max_depth=2) is None


def test_not_json_ends_the_count_or_passes_the_bound() -> None:
    assert refusal(b'["abc', max_values=1) is None  # unterminated: the parser refuses it
    assert refusal(b'["abc\\"]', max_values=1) is None  # the last quote is escaped
    assert refusal(b'""' * 100, max_values=4) is not None  # tokens past 5N + 3


@pytest.mark.parametrize("size", [10, 11, 12, 13])
def test_strings_across_windows(monkeypatch: pytest.MonkeyPatch, size: int) -> None:
    monkeypatch.setattr(jsonshape, "WINDOW", size)
    body = json.dumps(["a\\b\"c" * 7, [1, 2], {"k": "x" * 30}]).encode()
    assert refusal(body, max_values=6, max_depth=2) is None
    assert refusal(body, max_values=5) is not None
