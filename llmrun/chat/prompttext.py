"""A chat request as its template's variables and the text they render to: the one path the
runner (engine/prompt.py) and the corpus tests (tests/unit/chat/test_corpus.py) take."""

from __future__ import annotations

from typing import Any

from llmrun.chat import formats, templates, thinking, tools
from llmrun.request import ChatRequest, Message


def variables(req: ChatRequest, source: str, plan: tools.ToolPlan | None,
              messages: list[Message] | None = None,
              ) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra variables) for rendering `req` with `source` (`plan`: tools.plan of
    them; `messages`: `req.messages` as the caller marked them, e.g. with image markers)."""
    # past calls the template cannot render are written as its family writes them
    out, extra = tools.chat_inputs(req.messages if messages is None else messages,
                                   req.system, source, plan, formats.detect(source).write_calls)
    # thinking switched as this template reads it (thinking.py), then the request's own
    # variables (llama-server's chat_template_kwargs), which win
    out = thinking.switch_messages(source, out, req.think)
    extra.update(thinking.template_vars(req.think, source, req.think_budget))
    extra.update(template_kwargs(req))
    return out, extra


def template_kwargs(req: ChatRequest) -> dict[str, Any]:
    """The request's own template variables (llama-server's `chat_template_kwargs`); one
    that names what the renderer itself passes (the messages, the tools) is refused."""
    taken = sorted(set(req.template_kwargs) & thinking.RESERVED)
    if taken:
        raise ValueError(f"chat_template_kwargs cannot set {', '.join(taken)}: the request's "
                         f"own fields give those")
    return req.template_kwargs


def render(req: ChatRequest, source: str, plan: tools.ToolPlan | None, *, bos_token: str,
           eos_token: str, messages: list[Message] | None = None) -> str:
    """The prompt text of `req` (see `variables`): with thinking off, a thought the
    template's generation prompt always opens is closed (as llama.cpp does)."""
    out, extra = variables(req, source, plan, messages)
    text = templates.render(source, out, bos_token=bos_token, eos_token=eos_token, **extra)
    pair = formats.detect(source).think_pair(source)
    if req.think is False and pair is not None:
        text = thinking.closed(text, pair)
    return text
