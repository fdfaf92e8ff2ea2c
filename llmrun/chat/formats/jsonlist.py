"""Families whose calls are a JSON list of call objects after a marker of their own:

    Command R7B   <|START_ACTION|>[{"tool_call_id": "0", "tool_name": NAME,
                  "parameters": {...}}]<|END_ACTION|>      thought <|START_THINKING|>...
                  <|END_THINKING|>, answer <|START_RESPONSE|>...<|END_RESPONSE|>
    Cohere2 MoE   the same actions; answer <|START_TEXT|>...<|END_TEXT|>
    Command R+    Action:\\n```json\\n[{"tool_name": NAME, "parameters": {...}}]\\n```
    Granite 3.3   <|tool_call|>[{"name": NAME, "arguments": {...}}]
                  thought <think>...</think>, answer <response>...</response>
    Apriel        <tool_calls>[{"name": NAME, "arguments": {...}}]</tool_calls>
                  thought before [BEGIN FINAL RESPONSE] (the prompt opens it), the
                  answer maybe closed by [END FINAL RESPONSE]
    Firefunction  functools[{"name": NAME, "arguments": {...}}]  (no closing marker)

The reader takes either key of a pair (`name`/`tool_name`, `arguments`/`parameters`): the
models mix them up less than they mix up the list's layout. The markers that wrap the
answer are taken out of the content (`Unwrapped`): they are the family's, never the
answer's.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from typing import Any

from llmrun.chat.formats.base import Family, args_rule, choice, marker_writer
from llmrun.chat.textstream import partial_match
from llmrun.chat.thinking import Splitter
from llmrun.chat.toolcalls import MAX_TRIES, ToolCheck, new_call_id
from llmrun.chat.toolcalls.jsontext import (
    MAX_DEPTH,
    arguments,
    balanced,
    json_values,
    loads,
    nesting,
)
from llmrun.chat.tools import Steering, TemplateInfo, ToolPlan
from llmrun.request import Tool, ToolCall

_FENCE = re.compile(r"\s*```[\w-]{0,20}[ \t]*\n?")
_FENCE_END = re.compile(r"\s*```")
# the head of the last call object begun: its name, and where its arguments start
_HEAD = re.compile(r'"(?:tool_name|name)"\s*:\s*"((?:[^"\\\n]|\\.){1,256})"'
                   r'(\s*,\s*"(?:parameters|arguments)"\s*:\s*)?')


@dataclass
class Unwrapped:
    """A splitter whose content has the family's answer markers taken out (held while the
    streamed text may still become one, so pieces give what the whole gives)."""

    inner: Splitter
    drop: tuple[str, ...]
    _held: str = ""

    def push(self, text: str) -> tuple[str, str]:
        thought, content = self.inner.push(text)
        return thought, self._strip(content, final=False)

    def finish(self) -> tuple[str, str]:
        thought, content = self.inner.finish()
        return thought, self._strip(content, final=True)

    def _strip(self, text: str, final: bool) -> str:
        held = self._held + text
        out: list[str] = []
        pos = 0
        for _ in range(len(held) + 1):  # each turn moves past a marker
            hits = [(i, m) for m in self.drop if (i := held.find(m, pos)) != -1]
            if not hits:
                break
            at = min(i for i, _ in hits)
            out.append(held[pos:at])
            if not final and any(len(held) - at < len(m) and m.startswith(held[at:])
                                 for m in self.drop):
                self._held = held[at:]  # a longer marker may still be written here
                return "".join(out)
            pos = at + max((len(m) for i, m in hits if i == at))
        rest = held[pos:]
        keep = 0 if final else partial_match(rest, self.drop)
        self._held = rest[len(rest) - keep:]
        out.append(rest[:len(rest) - keep])
        return "".join(out)


def _call(obj: Any, check: ToolCheck) -> ToolCall | None:
    if not isinstance(obj, dict):
        return None
    name = obj.get("tool_name", obj.get("name"))
    args = arguments(obj.get("parameters", obj.get("arguments")))
    if not isinstance(name, str) or args is None or not check.accepts(name, args):
        return None
    return ToolCall(id=new_call_id(), name=name, arguments=args)


class JsonList(Family):
    open = ""  # the marker the list follows
    close = ""  # what ends it ("": nothing)
    fenced = False  # the list is in a ```json fence (Command R+)
    name_key = "name"
    args_key = "arguments"
    id_key: str | None = None  # Command R7B numbers its calls
    # the list's layout as the family writes it: its opening, between calls, its end
    layout = ("[", ", ", "]")
    wrappers: tuple[str, ...] = ()  # the answer's markers, dropped from the content
    detect: tuple[str, ...] = ()  # what only this family's template holds, all of it

    def __init__(self) -> None:
        self.starts = (self.open,)
        self.markers = tuple(m for m in (self.open, self.close, *self.wrappers) if m)

    def matches(self, template: str) -> bool:
        return all(d in template for d in self.detect)

    def splitter(self, pair: tuple[str, str], inside: bool, keep: bool) -> Splitter:
        inner = super().splitter(pair, inside, keep)
        return Unwrapped(inner, self.wrappers) if self.wrappers else inner

    # -- reading ---------------------------------------------------------------------------

    def _block(self, text: str, pos: int, check: ToolCheck,
               truncated: bool) -> tuple[int, list[ToolCall]] | None:
        """The calls of the list that starts at `pos` (after the marker) and where it ends;
        a list the token limit cut gives its calls written whole."""
        fence = _FENCE.match(text, pos)
        if fence is not None and "```" in fence.group():
            pos = fence.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if text[pos:pos + 1] not in ("[", "{"):
            return None
        end = balanced(text, pos)
        if end is None:
            if not truncated:
                return None
            values = json_values(text[pos:], truncated=True)
            calls = [_call(v, check) for v in values or []]
            if not calls or any(c is None for c in calls):
                return None
            return len(text), [c for c in calls if c is not None]
        try:
            value = loads(text[pos:end])
        except ValueError:
            return None
        found = [_call(v, check) for v in (value if isinstance(value, list) else [value])]
        if not found or any(c is None for c in found):
            return None
        fence_end = _FENCE_END.match(text, end)
        if fence_end is not None:
            end = fence_end.end()
        closing = text[end:].lstrip()
        if self.close and closing.startswith(self.close):
            end = len(text) - len(closing) + len(self.close)
        return end, [c for c in found if c is not None]

    def parse(self, text: str, check: ToolCheck,
              truncated: bool) -> tuple[list[ToolCall], str] | None:
        if nesting(text) > MAX_DEPTH:
            return None
        calls: list[ToolCall] = []
        rest: list[str] = []
        pos = 0
        for _ in range(MAX_TRIES):
            at = text.find(self.open, pos)
            if at == -1:
                break
            found = self._block(text, at + len(self.open), check, truncated)
            if found is None:
                if truncated and calls:
                    return calls, " ".join(r.strip() for r in rest if r.strip())
                return None
            end, got = found
            rest.append(text[pos:at])
            calls += got
            pos = end
        if not calls:
            return None
        rest.append(text[pos:])
        return calls, " ".join(r.strip() for r in rest if r.strip())

    def cut(self, text: str, names: set[str]) -> tuple[str, str] | None:
        at = text.rfind(self.open)
        if at == -1:
            return None
        heads = list(_HEAD.finditer(text, at))[-MAX_TRIES:]
        if not heads:
            return None
        m = heads[-1]
        try:
            name = json.loads(f'"{m.group(1)}"')
        except ValueError:
            return None
        if name not in names:
            return None
        return name, text[m.end():].rstrip() if m.group(2) is not None else ""

    # -- forcing, steering, writing -------------------------------------------------------

    def _head(self, i: int) -> str:
        return (f'{{"{self.id_key}": "{i}", ' if self.id_key else "{") \
            + f'"{self.name_key}": '

    def _rules(self, plan: ToolPlan, chosen: list[Tool],
               special: dict[str, int] | None) -> list[str]:
        """`calls`: the list after the marker, up to and with the closing marker."""
        mark = marker_writer(special)
        first, sep, last = (json.dumps(p) for p in self.layout)
        rules = []
        for i, tool in enumerate(chosen):
            head = json.dumps(f'"{self.name_key}": ' + json.dumps(tool.name, ensure_ascii=False)
                              + f', "{self.args_key}": ')
            opener = '"{"' if not self.id_key else \
                f'"{{\\"{self.id_key}\\": \\"" /[0-9]{{1,3}}/ "\\", "'
            rules.append(f'call{i}: {opener} {head} args{i} "}}"')
            rules.append(args_rule(f"args{i}", tool, plan.strict))
        rules.append("call: " + " | ".join(f"call{i}" for i in range(len(chosen))))
        more = f" ({sep} call)*" if plan.parallel else ""
        fence = ('"```json\\n" ', ' "\\n```"') if self.fenced else ("", "")
        close = f" {mark(self.close)}" if self.close else ""
        rules.insert(0, f"calls: {fence[0]}{first} call{more} {last}{fence[1]}{close}")
        return rules

    def grammar(self, plan: ToolPlan, special: dict[str, int] | None = None) -> str | None:
        chosen = choice(plan)
        if chosen is None:
            return None
        mark = marker_writer(special)
        return "\n".join([f"start: {mark(self.open)} calls",
                          *self._rules(plan, list(chosen), special)]) + "\n"

    def steering(self, plan: ToolPlan, special: dict[str, int] | None = None) -> Steering | None:
        """The family's marker starts the grammar: the list of calls and its end."""
        if plan.choice != "auto":
            return None
        grammar = "\n".join(["start: calls",
                             *self._rules(plan, list(plan.tools), special)]) + "\n"
        return Steering([re.escape(self.open)], grammar)

    def write_calls(self, calls: list[ToolCall], info: TemplateInfo) -> str:
        first, sep, last = self.layout
        items = []
        for i, c in enumerate(calls):
            obj: dict[str, Any] = {self.id_key: str(i)} if self.id_key else {}
            obj[self.name_key] = c.name
            obj[self.args_key] = c.arguments
            items.append(json.dumps(obj, ensure_ascii=False))
        body = first + sep.join(items) + last
        if self.fenced:
            body = "```json\n" + body + "\n```"
        return self.open + body + self.close


class CommandR7B(JsonList):
    name = "command-r7b"
    open, close = "<|START_ACTION|>", "<|END_ACTION|>"
    name_key, args_key, id_key = "tool_name", "parameters", "tool_call_id"
    layout = ("[\n    ", ",\n    ", "\n]")
    wrappers = ("<|START_RESPONSE|>", "<|END_RESPONSE|>", "<|START_TEXT|>", "<|END_TEXT|>")
    # Cohere2 MoE's template writes the same actions (and <|START_TEXT|> answers)
    detect = ("<|START_ACTION|>", "<|END_ACTION|>")
    PAIR = ("<|START_THINKING|>", "<|END_THINKING|>")

    def __init__(self) -> None:
        super().__init__()
        self.markers = (*self.markers, *self.PAIR)

    def think_pair(self, template: str | None) -> tuple[str, str] | None:
        return self.PAIR


class CommandRPlus(JsonList):
    name = "command-r-plus"
    open = "Action:"
    fenced = True
    name_key, args_key = "tool_name", "parameters"
    layout = ("[", ", ", "]")
    detect = ("Action:\\n```json", '"tool_name": "')


class Granite(JsonList):
    name = "granite"
    open = "<|tool_call|>"
    wrappers = ("<response>", "</response>")
    detect = ("<|tool_call|>", "<|start_of_role|>")


class Apriel(JsonList):
    name = "apriel"
    open, close = "<tool_calls>", "</tool_calls>"
    END = "[BEGIN FINAL RESPONSE]"
    wrappers = ("[END FINAL RESPONSE]",)
    detect = ("<tool_calls>[", END)

    def think_pair(self, template: str | None) -> tuple[str, str] | None:
        # Apriel reasons before its answer, always: 1.6's prompt opens the thought with
        # its words, 1.5's ends with the assistant's header (and its system prompt asks
        # for the reasoning first); the thought ends at the answer's marker either way.
        if template and "Here are my reasoning steps:" in template:
            return "Here are my reasoning steps:", self.END
        return "<|assistant|>", self.END


class Firefunction(JsonList):
    name = "firefunction"
    open = "functools"
    detect = ("functools[",)

    def template_vars(self, extra: dict[str, Any]) -> dict[str, Any]:
        """Its template takes the tools as `functions`, a JSON text, and the date as
        `datetime`, both always (it fails without them): as llama.cpp gives them."""
        offered = extra.get("tools")
        return {"functions": json.dumps(offered, indent=2, ensure_ascii=False) if offered
                else "",
                "datetime": time.strftime("%b %d %Y %H:%M:%S GMT", time.gmtime())}


__all__ = ["Apriel", "CommandR7B", "CommandRPlus", "Firefunction", "Granite", "JsonList",
           "Unwrapped"]
