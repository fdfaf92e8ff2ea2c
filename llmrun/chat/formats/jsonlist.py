"""Families that write their calls as one JSON list between markers of their own:

    Nemotron Nano 2  <TOOLCALL>[{"name": "NAME", "arguments": {...}}, ...]</TOOLCALL>
                     thoughts in <think>
    Apertus          <|tools_prefix|>[{"NAME": {...}}, ...]<|tools_suffix|>
                     thoughts in <|inner_prefix|>...<|inner_suffix|>

The list is read item by item (jsontext: linear, no recursion past MAX_DEPTH); a list the
token limit cut keeps its whole items, the item it cut becomes the partial call.
"""

from __future__ import annotations

import json
import re
from typing import Any

from llmrun.chat.formats.base import Family, args_rule, choice, lit, marker_writer
from llmrun.chat.toolcalls import MAX_TRIES, ToolCheck, new_call_id
from llmrun.chat.toolcalls.jsontext import MAX_DEPTH, arguments, balanced, loads, nesting
from llmrun.chat.tools import Steering, TemplateInfo, ToolPlan
from llmrun.request import ToolCall


class JsonList(Family):
    open = ""
    close = ""
    # the start of a list item, up to its arguments: group 1 is the name
    _item: re.Pattern[str]

    def __init__(self) -> None:
        self.markers = (self.open, self.close)
        self.starts = (self.open,)

    def matches(self, template: str) -> bool:
        return self.open in template and self.close in template

    def _call(self, item: Any) -> tuple[str, Any] | None:
        """(name, arguments) of a decoded list item, or None."""
        raise NotImplementedError

    def _item_json(self, name: str) -> str:
        """A list item's JSON up to its arguments (what `_item` reads)."""
        raise NotImplementedError

    def _items(self, text: str, pos: int) -> tuple[list[Any], int | None, int]:
        """The whole items of the list whose `[` is at `pos`: (items, the end of the list or
        None when it does not close, where the first item that does not close begins)."""
        items: list[Any] = []
        i = pos + 1
        for _ in range(10_000):
            while i < len(text) and (text[i].isspace() or text[i] == ","):
                i += 1
            if i >= len(text):
                return items, None, i
            if text[i] == "]":
                return items, i + 1, i
            end = balanced(text, i) if text[i] == "{" else None
            if end is None:
                return items, None, i
            try:
                items.append(loads(text[i:end]))
            except (ValueError, RecursionError):
                return items, None, i
            i = end
        return items, None, i

    def parse(self, text: str, check: ToolCheck,
              truncated: bool) -> tuple[list[ToolCall], str] | None:
        if nesting(text) > MAX_DEPTH:
            return None
        calls: list[ToolCall] = []
        rest: list[str] = []
        pos = 0
        for _ in range(MAX_TRIES):
            start = text.find(self.open, pos)
            if start == -1:
                break
            rest.append(text[pos:start])
            i = start + len(self.open)
            while i < len(text) and text[i].isspace():
                i += 1
            if text[i:i + 1] != "[":
                return None
            items, end, _ = self._items(text, i)
            if end is None and not (truncated and (items or calls)):
                return None
            for item in items:
                found = self._call(item)
                if found is None or not check.accepts(*found):
                    return None
                calls.append(ToolCall(id=new_call_id(), name=found[0], arguments=found[1]))
            if end is None:  # cut by the token limit: a further call was dropped
                return (calls, " ".join(r.strip() for r in rest if r.strip())) \
                    if calls else None
            pos = end
            while pos < len(text) and text[pos].isspace():
                pos += 1
            if text.startswith(self.close, pos):
                pos += len(self.close)
        rest.append(text[pos:])
        if not calls:
            return None
        return calls, " ".join(r.strip() for r in rest if r.strip())

    def cut(self, text: str, names: set[str]) -> tuple[str, str] | None:
        start = text.rfind(self.open)
        i = text.find("[", start) if start != -1 else -1
        if i == -1 or text[start + len(self.open):i].strip():
            return None
        _, end, at = self._items(text, i)
        m = self._item.match(text, at) if end is None else None
        if m is None or m.group(1) not in names:
            return None
        return m.group(1), text[m.end():].rstrip()

    def _list(self, tools: list[Any], parallel: bool, strict: bool,
              special: dict[str, int] | None) -> list[str]:
        """Rules `calls` (the list's items, `]` and the closing marker) and their calls."""
        rules = []
        for i, tool in enumerate(tools):
            rules.append(f"call{i}: {lit(self._item_json(tool.name))} args{i} \"}}\"")
            rules.append(args_rule(f"args{i}", tool, strict))
        rules.append("call: " + " | ".join(f"call{i}" for i in range(len(tools))))
        more = ' (", " call)*' if parallel else ""
        rules.append(f'calls: call{more} "]" {marker_writer(special)(self.close)}')
        return rules

    def grammar(self, plan: ToolPlan, special: dict[str, int] | None = None) -> str | None:
        chosen = choice(plan)
        if chosen is None:
            return None
        return "\n".join([f'start: {marker_writer(special)(self.open)} "[" calls',
                          *self._list(chosen, plan.parallel, plan.strict, special)]) + "\n"

    def steering(self, plan: ToolPlan, special: dict[str, int] | None = None) -> Steering | None:
        """The opening marker starts the grammar: the list and the closing marker."""
        if plan.choice != "auto":
            return None
        grammar = "\n".join(['start: "[" calls', *self._list(
            list(plan.tools), plan.parallel, plan.strict, special)]) + "\n"
        return Steering([re.escape(self.open)], grammar)

    def write_calls(self, calls: list[ToolCall], info: TemplateInfo) -> str:
        return self.open + "[" + ", ".join(
            self._item_json(c.name) + json.dumps(c.arguments, ensure_ascii=False) + "}"
            for c in calls) + "]" + self.close


class Nemotron(JsonList):
    """NVIDIA Nemotron Nano 2: its template writes `{"name": ..., "arguments": ...}` items."""

    name = "nemotron"
    open = "<TOOLCALL>"
    close = "</TOOLCALL>"
    _item = re.compile(r'\{\s*"name"\s*:\s*"([^"\\]{1,256})"\s*,\s*"arguments"\s*:\s*')

    def _call(self, item: Any) -> tuple[str, Any] | None:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = arguments(item.get("arguments"))  # (a JSON string, as the template allows)
        return None if args is None else (item["name"], args)

    def _item_json(self, name: str) -> str:
        return '{"name": ' + json.dumps(name) + ', "arguments": '


class Apertus(JsonList):
    """Swiss AI Apertus: each item an object of one key, the tool's name, whose value is
    the arguments; thoughts between its inner markers (its template's `inner_token`)."""

    name = "apertus"
    open = "<|tools_prefix|>"
    close = "<|tools_suffix|>"
    think = ("<|inner_prefix|>", "<|inner_suffix|>")
    _item = re.compile(r'\{\s*"([^"\\]{1,256})"\s*:\s*')

    def __init__(self) -> None:
        super().__init__()
        self.markers = (self.open, self.close, *self.think)

    def think_pair(self, template: str | None) -> tuple[str, str] | None:
        return self.think

    def _call(self, item: Any) -> tuple[str, Any] | None:
        if not isinstance(item, dict) or len(item) != 1:
            return None
        [(name, args)] = item.items()
        return (name, args) if isinstance(args, dict) else None

    def _item_json(self, name: str) -> str:
        return "{" + json.dumps(name) + ": "
