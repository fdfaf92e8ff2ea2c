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
    if formats.detect(source).think_pair(source):
        extra.update(thinking.template_vars(req.think))
    return out, extra


def render(req: ChatRequest, source: str, plan: tools.ToolPlan | None, *, bos_token: str,
           eos_token: str, messages: list[Message] | None = None) -> str:
    """The prompt text of `req` (see `variables`)."""
    out, extra = variables(req, source, plan, messages)
    return templates.render(source, out, bos_token=bos_token, eos_token=eos_token, **extra)
