"""Families whose calls are JSON objects after a marker of their own, in a list or one
after another:

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
    Nemotron Nano 2  <TOOLCALL>[{"name": "NAME", "arguments": {...}}, ...]</TOOLCALL>
                  thoughts in <think>
    Apertus       <|tools_prefix|>[{"NAME": {...}}, ...]<|tools_suffix|>
                  thoughts in <|inner_prefix|>...<|inner_suffix|>
    MiniMax M1    <tool_calls>\\n{"name": "NAME", "arguments": {...}}\\n...</tool_calls>
    GigaChat 3    <|message_sep|>\\n\\nfunction call<|role_sep|>\\n
                  {"name": ..., "arguments": ...}
    GigaChat 3.1  <|function_call|>{"name": ..., "arguments": ...}     (one call each)

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

from llmrun.chat.formats.base import (
    Family,
    Gathered,
    choice,
    json_calls,
    lark,
    lit,
    past,
    text_writer,
)
from llmrun.chat.textstream import partial_match
from llmrun.chat.thinking import Splitter
from llmrun.chat.toolcalls import MAX_TRIES, ToolCheck, new_call_id
from llmrun.chat.toolcalls.jsontext import MAX_DEPTH, arguments, balanced, loads, nesting
from llmrun.chat.tools import Steering, TemplateInfo, ToolPlan
from llmrun.request import Tool, ToolCall

_FENCE = re.compile(r"\s*```[\w-]{0,20}[ \t]*\n?")
_FENCE_END = re.compile(r"\s*```")
# the head of a call object, up to its arguments: its name (group 1), and (group 2) the
# arguments' key where it is written; either key of a pair, a few short fields before the
# name (Command R7B's `tool_call_id`)
_HEAD = re.compile(r'\{\s*(?:"[\w-]{1,32}"\s*:\s*(?:"[^"\\\n]{0,32}"|\d{1,6})\s*,\s*){0,3}'
                   r'"(?:tool_name|name)"\s*:\s*"((?:[^"\\\n]|\\.){1,256})"'
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


class JsonList(Family):
    """Calls as JSON objects after the family's marker: in a list (`listed`; a lone object
    is read too, the models drop the brackets) or one after another, maybe in a ```json
    fence, maybe closed by a marker. The objects are read one by one (jsontext: linear, no
    recursion past MAX_DEPTH); calls the token limit cut keep their whole objects, the one
    it cut becomes the partial call."""

    open = ""  # the marker the calls follow
    close = ""  # what ends them ("": the calls end the message)
    listed = True  # the objects in a JSON list, else one after another
    single = False  # one call only (the template writes the first)
    name_key = "name"
    args_key = "arguments"
    id_key: str | None = None  # Command R7B numbers its calls
    # the calls' layout as the family writes them: the opening, between calls, the end
    lead, sep, end = "[", ", ", "]"
    wrappers: tuple[str, ...] = ()  # the answer's markers, dropped from the content
    detect: tuple[str, ...] = ()  # what only this family's template holds ((): its markers)
    # the start of an object up to its arguments (what a cut call is read by): group 1 its
    # name, inside a JSON string; a group 2 matched where the arguments' key is written
    _item: re.Pattern[str] = _HEAD

    def __init__(self) -> None:
        self.starts = (self.open,)
        self.markers = tuple(m for m in (self.open, self.close, *self.wrappers) if m)

    def matches(self, template: str) -> bool:
        return all(d in template for d in self.detect or (self.open, self.close))

    def splitter(self, pair: tuple[str, str], inside: bool, keep: bool) -> Splitter:
        inner = super().splitter(pair, inside, keep)
        return Unwrapped(inner, self.wrappers) if self.wrappers else inner

    # -- reading ---------------------------------------------------------------------------

    def _call(self, item: Any) -> tuple[str, Any] | None:
        """(name, arguments) of a decoded object, or None. Either key of a pair: the models
        mix them up less than they mix up the list's layout."""
        if not isinstance(item, dict):
            return None
        name = item.get("tool_name", item.get("name"))
        args = arguments(item.get("parameters", item.get("arguments")))
        return (name, args) if isinstance(name, str) and args is not None else None

    def _items(self, text: str, pos: int) -> tuple[list[Any], int | None, int] | None:
        """The whole objects of the calls after a marker (`pos` just past it): (objects,
        where they end, or None when the token limit may have cut them, where the first
        object that does not close begins); None where no calls' JSON starts."""
        fence = _FENCE.match(text, pos)
        if fence is not None and "```" in fence.group():
            pos = fence.end()
        while pos < len(text) and text[pos].isspace():
            pos += 1
        listed = self.listed and text.startswith("[", pos)
        if self.listed and not listed and not text.startswith("{", pos):
            return None
        items: list[Any] = []
        i = pos + 1 if listed else pos
        for _ in range(10_000):  # each turn reads an object, or ends
            while i < len(text) and (text[i].isspace() or (text[i] == "," and listed)):
                i += 1
            if i >= len(text):
                return items, None if listed or not items else i, i
            if listed and text[i] == "]":
                return items, i + 1, i
            if not listed and (text[i] != "{" or (items and (self.single or self.listed))):
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
        got = Gathered(text)
        for _ in range(MAX_TRIES):
            at = text.find(self.open, got.pos)
            if at == -1:
                break
            read = self._items(text, at + len(self.open))
            found = [self._call(item) for item in read[0]] if read is not None else [None]
            if read is None or any(f is None or not check.accepts(*f) for f in found) \
                    or (read[1] is None and not truncated):
                return got.result(whole=False) if truncated else None
            end = read[1]
            if end is not None:  # past the fence's end and the closing marker
                fence = _FENCE_END.match(text, end)
                end = past(text, fence.end() if fence else end, self.close)
            got.add(at, len(text) if end is None else end,
                    *(ToolCall(id=new_call_id(), name=f[0], arguments=f[1])
                      for f in found if f is not None))
            if end is None:  # cut by the token limit: a further call was dropped
                return got.result(whole=False)
        return got.result()

    def cut(self, text: str, names: set[str]) -> tuple[str, str] | None:
        at = text.rfind(self.open)
        read = self._items(text, at + len(self.open)) if at != -1 else None
        if read is None or read[1] is not None:
            return None
        m = self._item.match(text, read[2])
        if m is None:
            return None
        try:
            name = json.loads(f'"{m.group(1)}"')
        except ValueError:
            return None
        if name not in names:
            return None
        written = self._item.groups < 2 or m.group(2) is not None
        return name, text[m.end():].rstrip() if written else ""

    # -- forcing, steering, writing -------------------------------------------------------

    def _head(self, name: str, i: int = 0) -> str:
        """An object's JSON up to its arguments (`i`: the call's number, if it has one)."""
        number = f'"{self.id_key}": "{i}", ' if self.id_key else ""
        return "{" + number + f'"{self.name_key}": ' + json.dumps(name, ensure_ascii=False) \
            + f', "{self.args_key}": '

    def _head_rule(self, name: str) -> str:
        """`_head` in a grammar: any number of a few digits where the family numbers."""
        head = self._head(name)
        if not self.id_key:
            return lit(head)
        at = head.index(f'"{self.id_key}": "') + len(self.id_key) + 5
        return f"{lit(head[:at])} /[0-9]{{1,3}}/ {lit(head[at + 1:])}"

    def _rules(self, chosen: list[Tool], plan: ToolPlan,
               special: dict[str, int] | None) -> list[str]:
        """Rule `calls` (the objects, the layout's end and the closing marker) and theirs."""
        rules = json_calls("call", chosen, plan.strict,
                           lambda i, tool: f'{self._head_rule(tool.name)} args{i} "}}"')
        more = f" ({lit(self.sep)} call)*" if plan.parallel and not self.single else ""
        end = " " + lit(self.end) if self.end else ""
        close = " " + text_writer(special)(self.close) if self.close else ""
        rules.append(f"calls: call{more}{end}{close}")
        return rules

    def _lead(self) -> str:
        return lit(self.lead) + " " if self.lead else ""

    def grammar(self, plan: ToolPlan, special: dict[str, int] | None = None) -> str | None:
        chosen = choice(plan)
        if chosen is None:
            return None
        return lark(f"{text_writer(special)(self.open)} {self._lead()}calls",
                    self._rules(list(chosen), plan, special))

    def steering(self, plan: ToolPlan, special: dict[str, int] | None = None) -> Steering | None:
        """The family's marker starts the grammar: the calls and their end."""
        if plan.choice != "auto":
            return None
        grammar = lark(f"{self._lead()}calls", self._rules(list(plan.tools), plan, special))
        return Steering([re.escape(self.open)], grammar)

    def write_calls(self, calls: list[ToolCall], info: TemplateInfo) -> str:
        return self.open + self.lead + self.sep.join(
            self._head(c.name, i) + json.dumps(c.arguments, ensure_ascii=False) + "}"
            for i, c in enumerate(calls[:1] if self.single else calls)) \
            + self.end + self.close


class CommandR7B(JsonList):
    name = "command-r7b"
    open, close = "<|START_ACTION|>", "<|END_ACTION|>"
    name_key, args_key, id_key = "tool_name", "parameters", "tool_call_id"
    lead, sep, end = "[\n    ", ",\n    ", "\n]"
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
    name_key, args_key = "tool_name", "parameters"
    lead, end = "```json\n[", "]\n```"
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


class Nemotron(JsonList):
    name = "nemotron"
    open = "<TOOLCALL>"
    close = "</TOOLCALL>"


class MiniMaxM1(JsonList):
    """MiniMax M1: one object a line in `<tool_calls>` (its template's own instructions)."""

    name = "minimax-m1"
    open = "<tool_calls>"
    close = "</tool_calls>"
    listed = False
    lead, sep, end = "\n", "\n", "\n"

    def matches(self, template: str) -> bool:
        return "<tool_calls>\\n{\"name\"" in template or "<tool_calls>\n{\"name\"" in template


class GigaChat3(JsonList):
    """GigaChat 3: the call is a message of the role `function call` (its template renders
    the first call only)."""

    name = "gigachat3"
    open = "<|message_sep|>\n\nfunction call<|role_sep|>\n"
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

    def _head(self, name: str, i: int = 0) -> str:
        return "{" + json.dumps(name) + ": "


__all__ = ["Apertus", "Apriel", "CommandR7B", "CommandRPlus", "Firefunction", "GigaChat3",
           "GigaChat31", "Granite", "JsonList", "MiniMaxM1", "Nemotron", "Unwrapped"]
