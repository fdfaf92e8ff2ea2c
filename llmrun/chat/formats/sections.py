"""Families whose calls are JSON arguments between markers, in a section of their own:

    DeepSeek V3.1  <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}
                   <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>
    DeepSeek R1    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n
                   ```json\\n{...}\\n```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>   (V3 too)
    Kimi K2        <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0
                   <|tool_call_argument_begin|>{...}<|tool_call_end|>...<|tool_calls_section_end|>

(the markers are special tokens of those vocabularies). Thoughts, where the model has them,
are `<think>` pairs: the default's.
"""

from __future__ import annotations

import json
import re
from typing import Any

from llmrun.chat.formats.base import (
    Family,
    choice,
    json_calls,
    lark,
    lit,
    marker_writer,
    object_at,
    past,
)
from llmrun.chat.toolcalls import MAX_TRIES, ToolCheck, new_call_id
from llmrun.chat.toolcalls.jsontext import MAX_DEPTH, nesting
from llmrun.chat.tools import Steering, TemplateInfo, ToolPlan
from llmrun.request import ToolCall


class Sections(Family):
    section_begin = ""
    section_end = ""
    call_begin = ""
    sep = ""  # between the name and the arguments
    call_end = ""
    name_prefix = ""  # written before the name (Kimi's `functions.`)
    kind = ""  # written before the separator, the name after it (R1's `function`)
    fence = False  # the arguments in a ```json fence (R1)
    indexed = False  # `:N` after the name (Kimi's call index)
    detect_marker = ""

    def __init__(self) -> None:
        self.markers = (self.section_begin, self.section_end, self.call_begin, self.sep,
                        self.call_end)
        self.starts = (self.section_begin, self.call_begin)
        index = r"(?::\d{1,4})?" if self.indexed else ""
        prefix = re.escape(self.name_prefix)
        if self.kind:  # the kind, the separator, then the name (and a fence's opening)
            self._head = re.compile(
                r"\s*" + re.escape(self.call_begin) + r"\s*(?:" + re.escape(self.kind)
                + r")?\s*" + re.escape(self.sep) + r"\s*" + prefix + r"([^\s<>{}`]{1,256})"
                + (r"\s*(?:```[\w-]{0,16}\s*)?" if self.fence else r"\s*"))
        else:
            self._head = re.compile(
                r"\s*" + re.escape(self.call_begin) + r"\s*" + prefix
                + r"([^\s<>{}]{1,256}?)" + index + r"\s*" + re.escape(self.sep) + r"\s*")

    def matches(self, template: str) -> bool:
        return self.detect_marker in template

    def parse(self, text: str, check: ToolCheck,
              truncated: bool) -> tuple[list[ToolCall], str] | None:
        if nesting(text) > MAX_DEPTH:
            return None
        at = [i for i in (text.find(self.section_begin), text.find(self.call_begin))
              if i != -1]
        if not at:
            return None
        start = min(at)
        head = text[:start]
        pos = start + len(self.section_begin) if text.startswith(self.section_begin, start) \
            else start
        calls: list[ToolCall] = []
        for _ in range(MAX_TRIES):
            m = self._head.match(text, pos)
            if m is None:
                break
            found = object_at(text, m.end())
            if found is None:
                if truncated and calls:
                    return calls, head.strip()  # a further call cut off: dropped
                return None
            end, args = found
            if not check.accepts(m.group(1), args):
                return None
            calls.append(ToolCall(id=new_call_id(), name=m.group(1), arguments=args))
            pos = past(text, past(text, end, "```" if self.fence else ""), self.call_end)
        if not calls:
            return None
        tail = text[pos:].lstrip()
        if tail.startswith(self.section_end):
            tail = tail[len(self.section_end):]
        return calls, (head.strip() + " " + tail.strip()).strip()

    def cut(self, text: str, names: set[str]) -> tuple[str, str] | None:
        at = text.rfind(self.call_begin)
        m = self._head.match(text, at) if at != -1 else None
        if m is None or m.group(1) not in names:
            return None
        args = text[m.end():].rstrip()
        return m.group(1), args[:-3].rstrip() if self.fence and args.endswith("```") \
            else args

    def _name(self, name: str, index: int | None = None) -> str:
        suffix = "" if not self.indexed else f":{index}" if index is not None else ""
        return self.name_prefix + name + suffix

    def _calls(self, plan: ToolPlan, chosen: list[object], special: dict[str, int] | None,
               ) -> list[str]:
        mark = marker_writer(special)
        index = ' /:[0-9]{1,3}/' if self.indexed else ""
        fence = ('"\\n```json\\n"', '"\\n```"') if self.fence else ("", "")

        def call(i: int, tool: Any) -> str:
            name = lit(self.name_prefix + tool.name)
            if self.kind:
                return (f"{mark(self.call_begin)} {lit(self.kind)} {mark(self.sep)} {name} "
                        f"{fence[0]} args{i} {fence[1]} {mark(self.call_end)}")
            return f"{mark(self.call_begin)} {name}{index} {mark(self.sep)} args{i} " \
                f"{mark(self.call_end)}"

        return json_calls("call", chosen, plan.strict, call)

    def grammar(self, plan: ToolPlan, special: dict[str, int] | None = None) -> str | None:
        chosen = choice(plan)
        if chosen is None:
            return None
        mark = marker_writer(special)
        calls = "call+" if plan.parallel else "call"
        return lark(f"{mark(self.section_begin)} {calls} {mark(self.section_end)}",
                    self._calls(plan, list(chosen), special))

    def steering(self, plan: ToolPlan, special: dict[str, int] | None = None) -> Steering | None:
        """The section's marker starts the grammar: the calls and the section's end."""
        if plan.choice != "auto":
            return None
        mark = marker_writer(special)
        calls = "call+" if plan.parallel else "call"
        grammar = lark(f"{calls} {mark(self.section_end)}",
                       self._calls(plan, list(plan.tools), special))
        return Steering([re.escape(self.section_begin)], grammar)

    def _call_text(self, call: ToolCall, index: int) -> str:
        args = json.dumps(call.arguments, ensure_ascii=False)
        if self.kind:
            fenced = f"\n```json\n{args}\n```" if self.fence else args
            return (self.call_begin + self.kind + self.sep + self._name(call.name, index)
                    + fenced + self.call_end)
        return self.call_begin + self._name(call.name, index) + self.sep + args \
            + self.call_end

    def write_calls(self, calls: list[ToolCall], info: TemplateInfo) -> str:
        return self.section_begin + "".join(
            self._call_text(c, i) for i, c in enumerate(calls)) + self.section_end


class DeepSeekV31(Sections):
    name = "deepseek-v3.1"
    section_begin = "<｜tool▁calls▁begin｜>"
    section_end = "<｜tool▁calls▁end｜>"
    call_begin = "<｜tool▁call▁begin｜>"
    sep = "<｜tool▁sep｜>"
    call_end = "<｜tool▁call▁end｜>"

    # V3.1 writes the name, then the separator, then the JSON (R1 and V3 write
    # `function<｜tool▁sep｜>NAME` and a fenced JSON: another family)
    _DETECT = re.compile(r"tool▁call▁begin｜>'\s*\+\s*tool\['function'\]\['name'\]")

    def matches(self, template: str) -> bool:
        return bool(self._DETECT.search(template))


class DeepSeekR1(DeepSeekV31):
    """DeepSeek R1 (and V3, its distills): the call's type `function`, the separator, the
    name, then its arguments in a ```json fence (their templates' `tool['type'] +
    '<｜tool▁sep｜>' + name + '\\n```json'`)."""

    name = "deepseek-r1"
    kind = "function"
    fence = True
    _DETECT = re.compile(r"tool▁call▁begin｜>'\s*\+\s*\w{1,16}\['type'\]\s*\+\s*'<｜tool▁sep｜>'")


class KimiK2(Sections):
    name = "kimi-k2"
    section_begin = "<|tool_calls_section_begin|>"
    section_end = "<|tool_calls_section_end|>"
    call_begin = "<|tool_call_begin|>"
    sep = "<|tool_call_argument_begin|>"
    call_end = "<|tool_call_end|>"
    name_prefix = "functions."
    indexed = True
    detect_marker = "<|tool_calls_section_begin|>"
