"""llama-server's token utilities (`/tokenize`, `/detokenize`, `/apply-template`) on the
real daemon and SmolLM2: they agree with each other and with what a chat request reads."""

from __future__ import annotations

import httpx
import pytest

MODEL = "smollm2"


def test_tokenize_and_detokenize_round_trip(api: httpx.Client) -> None:
    text = "Hello world, ça va? <|im_start|>"
    r = api.post("/tokenize", json={"model": MODEL, "content": text})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    assert ids and all(isinstance(t, int) for t in ids)
    pieces = api.post("/tokenize", json={"model": MODEL, "content": text,
                                         "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    # a piece is text, or bytes where a token holds part of a character; the special token
    # written in the text is one token, shown as nothing when generated
    raw = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"])
                   for p in pieces)
    assert raw.decode() == "Hello world, ça va? "
    back = api.post("/detokenize", json={"model": MODEL, "tokens": ids[:-1]})
    assert back.status_code == 200 and back.json() == {"content": "Hello world, ça va? "}


@pytest.mark.parametrize("tokens", [[-1], [10**9], [1, 2, 49152]])
def test_detokenize_refuses_what_is_not_a_token(api: httpx.Client, tokens: list[int]) -> None:
    r = api.post("/detokenize", json={"model": MODEL, "tokens": tokens})
    assert r.status_code == 400 and "not a token" in r.json()["error"]


def test_utilities_errors(api: httpx.Client) -> None:
    r = api.post("/tokenize", json={"model": "no-such-model", "content": "x"})
    assert r.status_code == 404 and "error" in r.json()
    r = api.post("/tokenize", json={"content": "x"})  # which model?
    assert r.status_code == 400 and "model" in r.json()["error"]
    r = api.post("/detokenize", json={"model": MODEL, "tokens": ["a"]})
    assert r.status_code == 400


def test_apply_template_is_what_a_chat_request_reads(api: httpx.Client) -> None:
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "What is 2+2?"}]
    r = api.post("/apply-template", json={"model": MODEL, "messages": messages})
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt"]
    assert "Be brief." in prompt and "What is 2+2?" in prompt
    assert prompt.rstrip().endswith("assistant")  # the generation prompt is there
    chat = api.post("/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                  "max_tokens": 1})
    assert chat.json()["usage"]["prompt_tokens"] == r.json()["prompt_tokens"]
    counted = api.post("/tokenize", json={"model": MODEL, "content": prompt}).json()["tokens"]
    assert len(counted) == r.json()["prompt_tokens"]
