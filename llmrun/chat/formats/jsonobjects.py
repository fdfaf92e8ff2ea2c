"""Families that write their calls as JSON objects after a marker of their own:

    Nemotron Nano 2  <TOOLCALL>[{"name": "NAME", "arguments": {...}}, ...]</TOOLCALL>
                     thoughts in <think>
    Apertus          <|tools_prefix|>[{"NAME": {...}}, ...]<|tools_suffix|>
                     thoughts in <|inner_prefix|>...<|inner_suffix|>
    MiniMax M1       <tool_calls>\\n{"name": "NAME", "arguments": {...}}\\n...</tool_calls>
    GigaChat 3       <|message_sep|>\\n\\nfunction call<|role_sep|>\\n
                     {"name": ..., "arguments": ...}
    GigaChat 3.1     <|function_call|>{"name": ..., "arguments": ...}     (one call each)

The objects are read one by one (jsontext: linear, no recursion past MAX_DEPTH); calls the
token limit cut keep their whole objects, the one it cut becomes the partial call.
"""

from __future__ import annotations

import json
import re
from typing import Any

from llmrun.chat.formats.base import Family, args_rule, choice, lit, text_writer
from llmrun.chat.toolcalls import MAX_TRIES, ToolCheck, new_call_id
from llmrun.chat.toolcalls.jsontext import MAX_DEPTH, arguments, balanced, loads, nesting
from llmrun.chat.tools import Steering, TemplateInfo, ToolPlan
from llmrun.request import ToolCall


class JsonList(Family):
    open = ""
    close = ""  # ("": the calls end the message)
    listed = True  # the objects in a JSON list, else one after another
    lead, sep, end = "[", ", ", "]"  # written around and between the objects
    single = False  # one call only (the template writes the first)
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
        """The whole objects from `pos` (a list's `[`, or the first object): (objects, where
        they end, or None when the token limit may have cut them, where the first object
        that does not close begins)."""
        items: list[Any] = []
        i = pos + 1 if self.listed else pos
        for _ in range(10_000):
            while i < len(text) and (text[i].isspace() or (text[i] == "," and self.listed)):
                i += 1
            if i >= len(text):
                return items, None if self.listed or not items else i, i
            if self.listed and text[i] == "]":
                return items, i + 1, i
            if not self.listed and (text[i] != "{" or (items and self.single)):
                return items, i, i
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
            if self.listed and text[i:i + 1] != "[":
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
        if start == -1:
            return None
        i = start + len(self.open)
        while i < len(text) and text[i].isspace():
            i += 1
        if self.listed and text[i:i + 1] != "[":
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
        more = f" ({lit(self.sep)} call)*" if parallel and not self.single else ""
        close = " " + text_writer(special)(self.close) if self.close else ""
        end = " " + lit(self.end) if self.end else ""
        rules.append(f"calls: call{more}{end}{close}")
        return rules

    def grammar(self, plan: ToolPlan, special: dict[str, int] | None = None) -> str | None:
        chosen = choice(plan)
        if chosen is None:
            return None
        lead = " " + lit(self.lead) if self.lead else ""
        return "\n".join([f"start: {text_writer(special)(self.open)}{lead} calls",
                          *self._list(chosen, plan.parallel, plan.strict, special)]) + "\n"

    def steering(self, plan: ToolPlan, special: dict[str, int] | None = None) -> Steering | None:
        """The opening marker starts the grammar: the calls and the closing marker."""
        if plan.choice != "auto":
            return None
        lead = lit(self.lead) + " " if self.lead else ""
        grammar = "\n".join([f"start: {lead}calls", *self._list(
            list(plan.tools), plan.parallel, plan.strict, special)]) + "\n"
        return Steering([re.escape(self.open)], grammar)

    def write_calls(self, calls: list[ToolCall], info: TemplateInfo) -> str:
        return self.open + self.lead + self.sep.join(
            self._item_json(c.name) + json.dumps(c.arguments, ensure_ascii=False) + "}"
            for c in (calls[:1] if self.single else calls)) + self.end + self.close


class NameArguments(JsonList):
    """Objects `{"name": ..., "arguments": ...}`."""

    _item = re.compile(r'\{\s*"name"\s*:\s*"([^"\\]{1,256})"\s*,\s*"arguments"\s*:\s*')

    def _call(self, item: Any) -> tuple[str, Any] | None:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = arguments(item.get("arguments"))  # (a JSON string, as the templates allow)
        return None if args is None else (item["name"], args)

    def _item_json(self, name: str) -> str:
        return '{"name": ' + json.dumps(name) + ', "arguments": '


class Nemotron(NameArguments):
    name = "nemotron"
    open = "<TOOLCALL>"
    close = "</TOOLCALL>"


class MiniMaxM1(NameArguments):
    """MiniMax M1: one object a line in `<tool_calls>` (its template's own instructions)."""

    name = "minimax-m1"
    open = "<tool_calls>"
    close = "</tool_calls>"
    listed = False
    lead, sep, end = "\n", "\n", "\n"

    def matches(self, template: str) -> bool:
        return "<tool_calls>\\n{\"name\"" in template or "<tool_calls>\n{\"name\"" in template


class GigaChat3(NameArguments):
    """GigaChat 3: the call is a message of the role `function call` (its template renders
    the first call only)."""

    name = "gigachat3"
    open = "<|message_sep|>\n\nfunction call<|role_sep|>\n"
    close = ""
    listed = False
    lead, sep, end = "", "", ""
    single = True

    def __init__(self) -> None:
        super().__init__()
        self.markers = ("<|message_sep|>", "<|role_sep|>")

    def matches(self, template: str) -> bool:
        # (llama.cpp tells 3 from 3.1 the same way: 3.1 has a token of its own for calls)
        return "'function call'" in template and "<|role_sep|>" in template \
            and "<|function_call|>" not in template


class GigaChat31(GigaChat3):
    name = "gigachat3.1"
    open = "<|function_call|>"

    def __init__(self) -> None:
        super().__init__()
        self.markers = (self.open,)

    def matches(self, template: str) -> bool:
        return "<|function_call|>" in template and "<|role_sep|>" in template


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
