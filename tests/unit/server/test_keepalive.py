"""Parsing of keep-alive durations (where a request enters, and LLMRUN_KEEP_ALIVE) and of
LLMRUN_HOST addresses (config)."""

from __future__ import annotations

import math

import pydantic
import pytest

from llmrun.api.anthropic.wire import MessagesBody
from llmrun.api.ollama.wire import ChatBody
from llmrun.api.openai.wire import ChatCompletionBody
from llmrun.config import parse_host
from llmrun.request import duration_seconds as parse_keep_alive
from llmrun.server import keepalive


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("5m", 300.0),
        ("1h30m", 5400.0),
        ("1h", 3600.0),
        ("30s", 30.0),
        ("1.5s", 1.5),
        ("1m30s", 90.0),
        ("250ms", 0.25),
        ("2h0m5s", 7205.0),
        (" 10M ", 600.0),
        ("+5s", 5.0),
        ("90", 90.0),
        ("2.5", 2.5),
        ("0", 0.0),
        ("0s", 0.0),
        (0, 0.0),
        (600, 600.0),
        (12.5, 12.5),
        (10**400, math.inf),  # an integer past a float's range: no OverflowError
    ],
)
def test_durations(value: str | float, seconds: float) -> None:
    result = parse_keep_alive(value)
    assert result == seconds
    assert isinstance(result, float)


@pytest.mark.parametrize("value", [-1, -0.5, "-1", "-1m", "-5m30s", "-0.1s", -10**400])
def test_negative_means_forever(value: str | float) -> None:
    assert parse_keep_alive(value) == math.inf


@pytest.mark.parametrize("value", ["5x", "abc", "5m3", "", "m", "5 m", "1h-30m", "s5", "-", "5m-"])
def test_invalid_durations(value: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_keep_alive(value)
    assert str(exc.value) == f"invalid keep_alive duration {value!r}"


def test_none_uses_the_configured_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMRUN_KEEP_ALIVE", "2m")
    assert keepalive.seconds(None) == 120.0
    assert keepalive.seconds(7.0) == 7.0
    monkeypatch.setenv("LLMRUN_KEEP_ALIVE", "-1")
    assert keepalive.seconds(None) == math.inf


def test_a_body_carries_its_keep_alive_parsed() -> None:
    """Parsed once, where the request enters: the internal request holds seconds."""
    msgs = [{"role": "user", "content": "hi"}]
    assert ChatBody(model="m", messages=msgs, keep_alive="1m30s").to_request().keep_alive \
        == 90.0
    assert ChatBody(model="m", messages=msgs, keep_alive="-1").to_request().keep_alive \
        == math.inf
    assert ChatBody(model="m", messages=msgs, keep_alive="0ms").to_request().keep_alive == 0
    assert ChatBody(model="m", messages=msgs).to_request().keep_alive is None
    body = ChatCompletionBody.model_validate({"model": "m", "messages": msgs,
                                              "keep_alive": 5})
    assert body.keep_alive == 5.0
    for bad in ("5x", True, [1], "nan"):
        with pytest.raises(pydantic.ValidationError, match="keep_alive"):
            ChatBody.model_validate({"model": "m", "messages": msgs, "keep_alive": bad})
    assert "keep_alive" not in MessagesBody.model_fields  # (Anthropic's body has none)


@pytest.mark.parametrize("value", ["nan", "NaN"])
def test_nan_is_refused(value: str) -> None:
    with pytest.raises(ValueError):
        parse_keep_alive(value)


@pytest.mark.parametrize("value", ["--5m", "+-5m", "-+1h"])
def test_repeated_signs_are_refused(value: str) -> None:
    with pytest.raises(ValueError):
        parse_keep_alive(value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("127.0.0.1:8080", ("127.0.0.1", 8080)),
        (":9000", ("127.0.0.1", 9000)),
        ("localhost", ("localhost", 11434)),
        ("localhost:", ("localhost", 11434)),
        ("[::1]:1234", ("::1", 1234)),
        ("[::1]", ("::1", 11434)),
        ("::1", ("::1", 11434)),
        ("http://0.0.0.0:11434/", ("0.0.0.0", 11434)),
        ("https://example.com", ("example.com", 11434)),
        ("  0.0.0.0:1  ", ("0.0.0.0", 1)),
        ("host:65535", ("host", 65535)),
    ],
)
def test_parse_host(value: str, expected: tuple[str, int]) -> None:
    assert parse_host(value) == expected


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("host:0", "port out of range: 0"),
        ("host:65536", "port out of range: 65536"),
        ("host:-1", "port out of range: -1"),
        ("[::1]:99999", "port out of range: 99999"),
        ("", "empty host"),
        ("http://", "empty host"),
    ],
)
def test_parse_host_refusals(value: str, message: str) -> None:
    with pytest.raises(ValueError) as exc:
        parse_host(value)
    assert str(exc.value) == message


@pytest.mark.parametrize("value", ["host:abc", "host:80x", "[::1]:port"])
def test_parse_host_non_numeric_port(value: str) -> None:
    with pytest.raises(ValueError, match="invalid literal for int"):
        parse_host(value)
