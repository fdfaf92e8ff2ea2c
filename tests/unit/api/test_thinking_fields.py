"""Each dialect's thinking fields as the one ChatRequest: the switch, the budget, and the
template's own variables, with a clear error for a value out of bounds."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from llmrun.api.anthropic.wire import MessagesBody
from llmrun.api.openai.wire import ChatCompletionBody
from llmrun.request import MAX_THINK_BUDGET, ChatRequest, EngineError

USER = [{"role": "user", "content": "hi"}]


def openai(**kw: Any) -> ChatRequest:
    [req] = ChatCompletionBody.model_validate({"model": "m", "messages": USER, **kw}) \
        .to_requests()
    return req


def anthropic(**kw: Any) -> ChatRequest:
    return MessagesBody.model_validate({"model": "m", "messages": USER, "max_tokens": 100,
                                        **kw}).to_request()


def test_openai_reasoning_budget_and_template_kwargs() -> None:
    req = openai(reasoning_budget=32, chat_template_kwargs={"enable_thinking": True,
                                                            "custom": [1]})
    assert req.think_budget == 32 and req.think is True
    assert req.template_kwargs == {"enable_thinking": True, "custom": [1]}
    assert openai(reasoning_budget=-1).think_budget is None  # llama-server's "no limit"
    off = openai(reasoning_budget=0)
    assert off.think_budget == 0 and off.think is False  # no thought at all
    assert openai().think_budget is None and openai().template_kwargs == {}
    for bad in (-2, MAX_THINK_BUDGET + 1, "ten", 1.5):
        with pytest.raises(ValidationError, match="reasoning_budget"):
            openai(reasoning_budget=bad)


def test_anthropic_budget_tokens() -> None:
    req = anthropic(thinking={"type": "enabled", "budget_tokens": 40})
    assert req.think is True and req.think_budget == 40
    assert anthropic(thinking={"type": "enabled"}).think_budget is None
    assert anthropic(thinking={"type": "disabled", "budget_tokens": 40}).think_budget is None
    assert anthropic(thinking={"type": "adaptive"}).think_budget is None
    for bad in (0, -5, "40", True, 2.5, None, MAX_THINK_BUDGET + 1):
        with pytest.raises(EngineError, match="budget_tokens"):
            anthropic(thinking={"type": "enabled", "budget_tokens": bad})
    # above max_tokens (Anthropic refuses it; Claude Code and others send 1024 and more):
    # taken, the length then ends the output first
    assert anthropic(thinking={"type": "enabled", "budget_tokens": 1024}).think_budget == 1024


def test_the_budget_is_bounded_where_every_dialect_meets() -> None:
    with pytest.raises(ValidationError, match="think_budget"):
        ChatRequest(model="m", messages=[], think_budget=-1)
    with pytest.raises(ValidationError, match="think_budget"):
        ChatRequest(model="m", messages=[], think_budget=MAX_THINK_BUDGET + 1)


def test_responses_reasoning_budget() -> None:
    from llmrun.api.openai.responses.wire import ResponsesBody

    def responses(**kw: Any) -> ChatRequest:
        body = ResponsesBody.model_validate({"model": "m", "input": "hi", **kw})
        return body.to_request([])[0]

    req = responses(reasoning={"effort": "low"}, reasoning_budget=16)
    assert (req.think, req.think_budget) == ("low", 16)
    assert responses(reasoning_budget=-1).think_budget is None
    assert responses(reasoning_budget=0).think is False
    with pytest.raises(ValidationError, match="reasoning_budget"):
        responses(reasoning_budget=-3)
