"""Upstage's Solar Open: every part of a message is marked (special tokens of its vocabulary),

    <|think|>the thought<|end|><|begin|>assistant<|content|>the answer<|end|>
    <|tool_calls|><|tool_call:begin|>ID<|tool_call:name|>NAME<|tool_call:args|>{...}
        <|tool_call:end|>...<|calls|>

(the prompt ends with `<|begin|>assistant`): the calls are a section of JSON arguments, as
sections.py reads them, each with an id before its name; the answer's markers never reach
the content.
"""

from __future__ import annotations

import hashlib
import json
import re

from llmrun.chat.formats.base import json_calls, lit, marker_writer
from llmrun.chat.formats.jsonlist import Unwrapped
from llmrun.chat.formats.sections import Sections
from llmrun.chat.thinking import Splitter, ThinkStream
from llmrun.chat.tools import TemplateInfo, ToolPlan
from llmrun.request import ToolCall

NAME = "<|tool_call:name|>"
THINK = ("<|think|>", "<|end|>")
_ID = re.compile(r"[A-Za-z0-9_-]{1,40}")


class SolarOpen(Sections):
    name = "solar-open"
    section_begin = "<|tool_calls|>"
    section_end = "<|calls|>"
    call_begin = "<|tool_call:begin|>"
    sep = "<|tool_call:args|>"
    call_end = "<|tool_call:end|>"
    detect_marker = "<|tool_call:begin|>"
    WRAPPERS = ("<|begin|>assistant", "<|content|>", "<|end|>")

    def __init__(self) -> None:
        super().__init__()
        self.markers = (*self.markers, NAME, *THINK, "<|content|>", "<|begin|>")
        self._head = re.compile(
            r"\s*" + re.escape(self.call_begin) + r"\s*[^\s<>]{0,64}?\s*" + re.escape(NAME)
            + r"\s*([^\s<>{}]{1,256}?)\s*" + re.escape(self.sep) + r"\s*")

    def think_pair(self, template: str | None) -> tuple[str, str] | None:
        return THINK

    def splitter(self, pair: tuple[str, str], inside: bool, keep: bool) -> Splitter:
        return Unwrapped(ThinkStream(pair, inside=inside, keep=keep), self.WRAPPERS)

    def _calls(self, plan: ToolPlan, chosen: list[object], special: dict[str, int] | None,
               ) -> list[str]:
        mark = marker_writer(special)
        return json_calls("call", chosen, plan.strict,
                          lambda i, tool: f"{mark(self.call_begin)} /[A-Za-z0-9_-]{{1,40}}/ "
                                          f"{mark(NAME)} {lit(tool.name)} {mark(self.sep)} "
                                          f"args{i} {mark(self.call_end)}")

    def write_calls(self, calls: list[ToolCall], info: TemplateInfo) -> str:
        return self.section_begin + "".join(
            self.call_begin + _call_id(c.id) + NAME + c.name + self.sep
            + json.dumps(c.arguments, ensure_ascii=False) + self.call_end
            for c in calls) + self.section_end


def _call_id(call_id: str | None) -> str:
    """An id as the grammar lets the model write one (the client's where it is one)."""
    if call_id and _ID.fullmatch(call_id):
        return call_id
    return hashlib.sha256((call_id or "").encode()).hexdigest()[:12]


__all__ = ["SolarOpen"]
