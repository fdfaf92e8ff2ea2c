"""Muse Glimmer: the output is messages, each a recipient and a body, as harmony's are,

    to=self<|message|>the thought<|eom|>
    <|start|>assistant to=user<|message|>the answer<|eot|>
    <|start|>assistant to=NAME<|message|><atem:function_calls>
    <atem:invoke name="NAME">
    <atem:parameter name="KEY">value</atem:parameter>
    </atem:invoke>
    </atem:function_calls><|eom|>

(the prompt ends with `<|start|>assistant`, so the output starts at its first recipient).
`self` is the thought, `user` (or no recipient) the answer, any other recipient a call in
ATEM's tags, each value converted by the tool's schema as xml.py converts them.

The splitter turns the messages into (thinking, content), a call's message written into
the content with its header, `<|start|>assistant to=NAME<|message|>`, which the reader reads
calls after: ATEM markup the model quotes in its answer has no such header and stays text
(llama.cpp's parser keeps it so too).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from llmrun.chat.formats.base import choice, lark, lit, marker_writer, one_of
from llmrun.chat.formats.messages import MessageSplitter
from llmrun.chat.formats.xml import Tagged, free_text, param_rules
from llmrun.chat.thinking import Splitter
from llmrun.chat.tools import Steering, TemplateInfo, ToolPlan
from llmrun.request import Tool, ToolCall

START, MESSAGE, EOM, EOT = "<|start|>", "<|message|>", "<|eom|>", "<|eot|>"
CANON = START + "assistant to="
CALLS_OPEN, CALLS_CLOSE = "<atem:function_calls>", "</atem:function_calls>"
PARAM_CLOSE = "</atem:parameter>"
_ENDS = (EOM, EOT)
_RECIPIENT = re.compile(r"to=([^\s<>]{1,256}?)(?=\s|<\||$)")
_SELF, _USER = "self", "user"


@dataclass
class MuseSplitter(MessageSplitter):
    """(thinking, content) of streamed Muse Glimmer messages (the module's doc)."""

    _recipient: str = _USER

    message = MESSAGE
    ends = _ENDS
    opens = (START,)
    header_starts = ("to=", START, MESSAGE)

    def _open(self, header: str) -> str:
        found = _RECIPIENT.search(header)
        self._recipient = found.group(1) if found else _USER
        return "" if self._recipient in (_SELF, _USER) else CANON + self._recipient + MESSAGE

    def _emit(self, text: str, thinking: list[str], content: list[str]) -> None:
        (thinking if self._recipient == _SELF else content).append(text)


class MuseGlimmer(Tagged):
    name = "muse-glimmer"
    # special tokens of its vocabulary (llama.cpp preserves them)
    markers = (START, MESSAGE, EOM, EOT, CALLS_OPEN, CALLS_CLOSE, "<atem:invoke",
               "</atem:invoke>", "<atem:parameter", PARAM_CLOSE)
    starts = (CANON,)
    grammar_thinks = True  # the thought is a message: a grammar takes it in its stride
    _CALL = re.compile(
        re.escape(CANON) + r"([^\s<>]{1,256})" + re.escape(MESSAGE) + r"\s*"
        + re.escape(CALLS_OPEN) + r'\s*<atem:invoke name="([^"<>]{1,256})">(.*?)'
        r"(?:(</atem:invoke>)\s*(?:" + re.escape(CALLS_CLOSE) + r")?|(?="
        + re.escape(CANON) + r")|$)", re.S)
    _PARAM = re.compile(r'\s*<atem:parameter name="([^"<>]{1,256})">(.*?)(?:('
                        + re.escape(PARAM_CLOSE) + r")|$)", re.S)

    def matches(self, template: str) -> bool:
        return CALLS_OPEN in template and EOM in template

    def think_pair(self, template: str | None) -> tuple[str, str] | None:
        # what the lazy grammar ignores triggers between; the splitter is Muse's own
        return " to=self" + MESSAGE, EOM

    def splitter(self, pair: tuple[str, str], inside: bool, keep: bool) -> Splitter:
        return MuseSplitter(keep=keep)

    def _calls_at(self, text: str) -> list[tuple[int, int, str, str, bool]]:
        # the recipient and the invoked name say the same: a call whose differ is no call
        return [(m.start(), m.end(), m.group(2) if m.group(1) == m.group(2) else "",
                 m.group(3), m.group(4) is not None) for m in self._CALL.finditer(text)]

    def _pairs(self, body: str, whole_only: bool = False) -> list[tuple[str, str]] | None:
        out: list[tuple[str, str]] = []
        pos = 0
        while body[pos:].strip():
            m = self._PARAM.match(body, pos)
            if m is None or m.group(3) is None:
                return out if whole_only else None
            out.append((m.group(1), m.group(2)))
            pos = m.end()
        return out

    def _rules(self, chosen: list[Tool], strict: bool,
               special: dict[str, int] | None) -> list[str]:
        """`tail`: a call from its recipient's name on, as the template writes it."""
        mark = marker_writer(special)
        rules: list[str] = []
        for i, tool in enumerate(chosen):
            params, parts = param_rules(
                i, tool, strict, PARAM_CLOSE, special,
                lambda key, _, value: f"{mark('<atem:parameter')} "
                                      f'{lit(f" name={json.dumps(key)}>")} {value} "\\n"')
            rules += params
            rules.append(f"tail{i}: {lit(tool.name)} {mark(MESSAGE)} {mark(CALLS_OPEN)} "
                         f'"\\n" {mark("<atem:invoke")} '
                         f"{lit(f' name={json.dumps(tool.name)}>' + chr(10))} {parts}"
                         f' {mark("</atem:invoke>")} "\\n" {mark(CALLS_CLOSE)}')
        rules.append(one_of("tail", len(chosen)))
        rules.append(f'next: {mark(EOM)} {mark(START)} "assistant to=" tail')
        return rules

    def grammar(self, plan: ToolPlan, special: dict[str, int] | None = None) -> str | None:
        """The calls, maybe after a thought (free text), from the output's first recipient
        on (the prompt wrote `<|start|>assistant`)."""
        chosen = choice(plan)
        if chosen is None:
            return None
        mark = marker_writer(special)
        more = " next*" if plan.parallel else ""
        # (" to=" once, before both: a literal that is a prefix of another ends a lexeme
        # too soon, so " to=" and " to=self" would refuse a tool named "se...")
        return lark(f'" to=" (thought | tail{more})', [
            f'thought: "self" {mark(MESSAGE)} thought_body {mark(START)} "assistant to=" '
            f"tail{more}",
            free_text("thought_body", EOM, special),
            *self._rules(list(chosen), plan.strict, special)])

    def steering(self, plan: ToolPlan, special: dict[str, int] | None = None) -> Steering | None:
        """A call has begun at a recipient that is a tool, the output's first or one after
        `<|start|>assistant`: the grammar starts at the name."""
        if plan.choice != "auto":
            return None
        names = "|".join(re.escape(t.name) for t in plan.tools)
        more = " next*" if plan.parallel else ""
        grammar = lark(f"tail{more}", self._rules(list(plan.tools), plan.strict, special))
        return Steering([r"(?:\A\n|<\|start\|>assistant) to=(?=(?:" + names + r")<\|message\|>)"],
                        grammar)

    def write_calls(self, calls: list[ToolCall], info: TemplateInfo) -> str:
        return EOM.join(
            f"{CANON}{c.name}{MESSAGE}{CALLS_OPEN}\n<atem:invoke name=\"{c.name}\">\n" + "".join(
                f'<atem:parameter name="{k}">'
                f"{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
                f"{PARAM_CLOSE}\n" for k, v in c.arguments.items())
            + f"</atem:invoke>\n{CALLS_CLOSE}" for c in calls)


__all__ = ["MuseGlimmer", "MuseSplitter"]
