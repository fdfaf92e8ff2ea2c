"""MiniCPM 5: each argument as text in a tag of its own, converted by the tool's schema,

    <function name="NAME"><param name="KEY">value</param>...</function>

a value holding `<`, `&` or a newline wrapped in `<![CDATA[...]]>` (as its template writes
it and its system prompt asks), calls one per line; thoughts in `<think>` (the default's).
"""

from __future__ import annotations

import json
import re
from typing import Any

from llmrun.chat.formats.base import lit, marker_writer, one_of
from llmrun.chat.formats.xml import Tagged, param_rules
from llmrun.chat.tools import TemplateInfo
from llmrun.request import Tool, ToolCall

_CDATA_OPEN, _CDATA_CLOSE = "<![CDATA[", "]]>"


class MiniCPM5(Tagged):
    name = "minicpm5"
    # special tokens of MiniCPM 5's vocabulary (llama.cpp preserves them)
    markers = ("<function", "<param", "</function>", "</param>")
    starts = ("<function name=",)
    _CALL = re.compile(r'<function name="([^"<>\s]{1,256})">(.*?)'
                       r'(?:(</function>)|(?=<function name=)|$)', re.S)
    _OPEN = re.compile(r'\s*<param name="([^"<>]{1,256})">')

    def matches(self, template: str) -> bool:
        return '<function name="' in template and '<param name="' in template

    def _pairs(self, body: str, whole_only: bool = False) -> list[tuple[str, str]] | None:
        out: list[tuple[str, str]] = []
        pos = 0
        while body[pos:].strip():
            m = self._OPEN.match(body, pos)
            if m is None:
                return out if whole_only else None
            start = m.end()
            if body.startswith(_CDATA_OPEN, start):
                end = body.find(_CDATA_CLOSE, start)
                close = body.find("</param>", end) if end != -1 else -1
                if end == -1 or close == -1 or body[end + len(_CDATA_CLOSE):close].strip():
                    return out if whole_only else None
                value = body[start + len(_CDATA_OPEN):end]
            else:
                close = body.find("</param>", start)
                if close == -1:
                    return out if whole_only else None
                value = body[start:close]
            out.append((m.group(1), value))
            pos = close + len("</param>")
        return out

    def _rules(self, chosen: list[Tool], strict: bool,
               special: dict[str, int] | None) -> list[str]:
        mark = marker_writer(special)
        rules: list[str] = []
        for i, tool in enumerate(chosen):
            params, parts = param_rules(
                i, tool, strict, "</param>", special,
                lambda key, _, value: f"{mark('<param')} {lit(f' name={json.dumps(key)}>')} "
                                      f"{value}")
            rules += params
            rules.append(f"tail{i}: {lit(json.dumps(tool.name)[1:] + '>')} {parts} "
                         f"{mark('</function>')}")
        rules.append(one_of("tail", len(chosen)))
        rules.append(f"call: {mark('<function')} {lit(' name=' + chr(34))} tail")
        return rules

    # A call has begun when `<function name="` holds a tool's name: the grammar starts there.
    trigger = '<function name="(?=(?:{names})")'

    def write_calls(self, calls: list[ToolCall], info: TemplateInfo) -> str:
        return "\n".join(
            f'<function name="{c.name}">' + "".join(
                f'<param name="{k}">{_text(v)}</param>' for k, v in c.arguments.items())
            + "</function>" for c in calls)


def _text(value: Any) -> str:
    """A value as the template writes it: strings as they are (in CDATA where they hold
    `<`, `&` or a newline), anything else as JSON (what the reader converts back)."""
    if not isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if any(c in value for c in "<&\n") and _CDATA_CLOSE not in value:
        return _CDATA_OPEN + value + _CDATA_CLOSE
    return value


__all__ = ["MiniCPM5"]
