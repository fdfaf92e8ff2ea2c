"""What a chat template can render, found by rendering it (as llama.cpp's renderer probes a
template, common/jinja/caps.cpp), and the variables some templates read that no chat
request carries. tools.inspect_template turns these facts into its TemplateInfo.

Reading the text alone is not enough: Functionary 3.2's template concatenates a call's
`arguments` to a string (object arguments fail to render), Gemma 2's raises "System role not
supported", and DeepSeek's templates render calls and results without ever naming `tools`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any

from llmrun.chat import templates
from llmrun.chat.templatelimits import BudgetError

# Markers no template writes by itself: a probe looks for them in what it rendered.
_SYSTEM = "LLMRUN_PROBE_SYSTEM"
_USER = "LLMRUN_PROBE_USER"
_DESCRIPTION = "LLMRUN_PROBE_DESCRIPTION"
_ARGUMENT = "LLMRUN_PROBE_ARGUMENT"
_RESULT = "LLMRUN_PROBE_RESULT"
# Nine alphanumerics: Mistral's templates refuse any other call id (llama.cpp probes so too).
_CALL_ID = "call00001"

_TOOLS = [{"type": "function", "function": {
    "name": "probe_tool", "description": _DESCRIPTION,
    "parameters": {"type": "object", "properties": {"arg": {"type": "string"}},
                   "required": ["arg"]}}}]


def _conversation(arguments: Any) -> list[dict[str, Any]]:
    call = {"id": _CALL_ID, "type": "function",
            "function": {"name": "probe_tool", "arguments": arguments}}
    return [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": _RESULT, "tool_call_id": _CALL_ID, "name": "probe_tool"},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Thanks"},
    ]


@dataclass(frozen=True)
class Capabilities:
    system_role: bool = True  # renders a system message's text
    tools: bool = False  # renders the `tools` offered
    calls: bool = False  # renders an assistant message's `tool_calls`
    results: bool = False  # renders `tool` messages
    object_arguments: bool = True  # reads a call's `arguments` as an object, not a JSON string
    rendered: bool = False  # a tool conversation rendered at all (else the calls facts are
    # unknown, and the caller keeps what the text says)


def _render(source: str, messages: list[dict[str, Any]],
            tools: list[dict[str, Any]] | None = None) -> str | None:
    extra: dict[str, Any] = context(source, tools or [])
    if tools is not None:
        extra["tools"] = tools
    try:
        return templates.render(source, messages, **extra)
    except BudgetError:  # no more probes: see `capabilities`
        raise
    except Exception:  # a probe that fails says the template cannot do that
        return None


@lru_cache(maxsize=32)
def capabilities(source: str) -> Capabilities:
    """What `source` renders, from a few conversations rendered through it (cached: each
    costs a render, about a millisecond). A template that runs out of its render's budget
    (templatelimits) in one is not probed further: it is taken to render a system turn and
    to say nothing of calls, and the request's own render reports it."""
    try:
        return _probed(source)
    except BudgetError:
        return Capabilities()


def _probed(source: str) -> Capabilities:
    plain = _render(source, [{"role": "user", "content": _USER}])
    system = _render(source, [{"role": "system", "content": _SYSTEM},
                              {"role": "user", "content": _USER}])
    # No system role: the template renders a user's turn, but not a system turn before it.
    # (One that fails or drops even a lone user turn teaches nothing: the turn stays.)
    system_role = plain is None or _USER not in plain or (
        system is not None and _SYSTEM in system)
    as_object = _render(source, _conversation({"arg": _ARGUMENT}), _TOOLS)
    # A dict printed as Python prints it is not the object reading the template wants
    reads_object = as_object is not None and _ARGUMENT in as_object \
        and f"'{_ARGUMENT}'" not in as_object
    out = as_object
    if not reads_object:
        as_text = _render(source, _conversation(json.dumps({"arg": _ARGUMENT})), _TOOLS)
        if as_text is not None and _ARGUMENT in as_text:
            out = as_text
    if out is None:
        return Capabilities(system_role=system_role)
    return Capabilities(system_role=system_role, tools=_DESCRIPTION in out,
                        calls=_ARGUMENT in out, results=_RESULT in out,
                        object_arguments=out is as_object, rendered=True)


# Variables llama.cpp's server gives every template (common/chat.cpp, extra context), and
# `functions`, which Fireworks' FireFunction v2 template reads for the tools (as a JSON text)
# and which nothing else supplies: without them these templates fail to render at all.
_SUPPLIED = ("datetime", "date_string", "functions")


def context(source: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The variables of _SUPPLIED that `source` reads without setting them itself."""
    wanted = templates.free_names(source).intersection(_SUPPLIED)
    if not wanted:
        return {}
    now = datetime.now()
    values = {"datetime": now.strftime("%b %d %Y"), "date_string": now.strftime("%d %b %Y"),
              "functions": json.dumps(tools, ensure_ascii=False, indent=4)}
    return {k: v for k, v in values.items() if k in wanted}
