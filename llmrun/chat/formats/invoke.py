"""Families that write calls as `invoke` elements with named `parameter`s, in one block:

    MiniMax M2     <minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="KEY">value
                   </parameter>\\n</invoke>\\n...</minimax:tool_call>     thoughts in <think>
    DeepSeek V3.2  <｜DSML｜function_calls>\\n<｜DSML｜invoke name="NAME">\\n
                   <｜DSML｜parameter name="KEY" string="true|false">value</｜DSML｜parameter>
                   \\n</｜DSML｜invoke>\\n</｜DSML｜function_calls>        thoughts in <think>
    DeepSeek V4    the same, its block named `tool_calls`

Several calls share one block. A value is text converted by the tool's schema (xml.convert),
as the other tagged families' are; DeepSeek's `string="true|false"` says the same thing the
schema does (its templates write "true" for a string, "false" and JSON for anything else),
so it is written that way and read by the schema.
"""

from __future__ import annotations

import json
import re
from typing import Any

from llmrun.chat.formats.base import choice, lit, marker_writer
from llmrun.chat.formats.xml import Tagged, _properties, _types, _value_rule
from llmrun.chat.tools import Steering, TemplateInfo, ToolPlan
from llmrun.request import Tool, ToolCall


class Invoke(Tagged):
    block = ("", "")  # the calls' block: its opening and closing tags
    tag = ""  # written before `invoke` and `parameter` (DeepSeek's `｜DSML｜`)
    typed = False  # parameters carry `string="true|false"`

    def __init__(self) -> None:
        t, (b0, b1) = re.escape(self.tag), (re.escape(b) for b in self.block)
        self.invoke = f"<{self.tag}invoke name=\""
        self.close_param = f"</{self.tag}parameter>"
        self.close_invoke = f"</{self.tag}invoke>"
        self.markers = (*self.block,)
        self.starts = (self.block[0], self.invoke)
        # each call, with the block's opening tag before the first and its end after the last
        self._call = re.compile(
            rf"(?:{b0}\s*)?<{t}invoke name=\"([^\"<>\s]{{1,256}})\">(.*?)"
            rf"(?:(</{t}invoke>)\s*(?:{b1})?|(?=<{t}invoke |{b0})|$)", re.S)
        self._pair = re.compile(
            rf"\s*<{t}parameter name=\"([^\"<>]{{1,256}})\"(?: string=\"(?:true|false)\")?>"
            rf"(.*?)(?:(</{t}parameter>)|(?=<{t}parameter )|$)", re.S)

    def _calls_at(self, text: str) -> list[tuple[int, int, str, str, bool]]:
        return [(m.start(), m.end(), m.group(1), m.group(2), m.group(3) is not None)
                for m in self._call.finditer(text)]

    def _pairs(self, body: str, whole_only: bool = False) -> list[tuple[str, str]] | None:
        out: list[tuple[str, str]] = []
        pos = 0
        while pos < len(body.rstrip()):
            m = self._pair.match(body, pos)
            if m is None:
                return out if whole_only else None  # something else between them
            if m.group(3) is None and whole_only:
                break
            out.append((m.group(1), m.group(2)))
            pos = m.end()
        return out

    def _is_text(self, schema: Any) -> bool:
        """Whether a parameter is written as bare text (DeepSeek's string="true")."""
        types = _types(schema)
        return not types or "string" in types

    def _open_param(self, key: str, text: bool) -> str:
        flag = f' string="{"true" if text else "false"}"' if self.typed else ""
        return f'<{self.tag}parameter name="{key}"{flag}>'

    def _rules(self, chosen: list[Tool], strict: bool,
               special: dict[str, int] | None) -> list[str]:
        rules: list[str] = []
        for i, tool in enumerate(chosen):
            required = set((tool.parameters or {}).get("required") or [])
            parts = []
            for k, (key, schema) in enumerate(_properties(tool).items()):
                value = f"v{i}_{k}"
                rules += _value_rule(value, schema, strict, self.close_param + "\n", special)
                rules.append(f"p{i}_{k}: {lit(self._open_param(key, self._is_text(schema)))} "
                             f"{value}")
                parts.append(f"p{i}_{k}" + ("" if key in required else "?"))
            rules.append(f"tail{i}: {lit(tool.name + chr(34) + '>' + chr(10))} "
                         + " ".join(parts) + f" {lit(self.close_invoke + chr(10))}")
        rules.append("tail: " + " | ".join(f"tail{i}" for i in range(len(chosen))))
        rules.append(f"call: {lit(self.invoke)} tail")
        return rules

    def grammar(self, plan: ToolPlan, special: dict[str, int] | None = None) -> str | None:
        chosen = choice(plan)
        if chosen is None:
            return None
        mark = marker_writer(special)
        calls = "call+" if plan.parallel else "call"
        return "\n".join([f'start: {mark(self.block[0])} "\\n" {calls} {mark(self.block[1])}',
                          *self._rules(chosen, plan.strict, special)]) + "\n"

    def steering(self, plan: ToolPlan, special: dict[str, int] | None = None) -> Steering | None:
        """The block's opening tag starts the grammar: the calls and the block's end."""
        if plan.choice != "auto":
            return None
        mark = marker_writer(special)
        calls = "call+" if plan.parallel else "call"
        grammar = "\n".join([f'start: "\\n" {calls} {mark(self.block[1])}',
                             *self._rules(list(plan.tools), plan.strict, special)]) + "\n"
        return Steering([re.escape(self.block[0])], grammar)

    def write_calls(self, calls: list[ToolCall], info: TemplateInfo) -> str:
        def param(k: str, v: Any) -> str:
            text = isinstance(v, str)
            return (self._open_param(k, text) + (v if text else json.dumps(v, ensure_ascii=False))
                    + self.close_param + "\n")

        return (self.block[0] + "\n" + "".join(
            f'{self.invoke}{c.name}">\n' + "".join(param(k, v) for k, v in c.arguments.items())
            + self.close_invoke + "\n" for c in calls) + self.block[1])


class MiniMaxM2(Invoke):
    name = "minimax-m2"
    block = ("<minimax:tool_call>", "</minimax:tool_call>")

    def matches(self, template: str) -> bool:
        return "<minimax:tool_call>" in template and "<invoke name=" in template


class DeepSeekV32(Invoke):
    """DeepSeek V3.2's DSML (its template builds the tags from `dsml_token`)."""

    name = "deepseek-v3.2"
    tag = "｜DSML｜"
    block = ("<｜DSML｜function_calls>", "</｜DSML｜function_calls>")
    typed = True

    def matches(self, template: str) -> bool:
        return "dsml_token" in template and "'function_calls>" in template


class DeepSeekV4(DeepSeekV32):
    name = "deepseek-v4"
    block = ("<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>")

    def matches(self, template: str) -> bool:
        return "dsml_token" in template and "'tool_calls>" in template
