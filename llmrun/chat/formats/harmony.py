"""gpt-oss's harmony format: the output is messages, each a header and a body,

    <|channel|>analysis<|message|>the thought<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>
        {...}<|call|>
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>

(the recipient may also stand before the channel: `<|start|>assistant to=functions.NAME
<|channel|>commentary json<|message|>`, as the template writes past calls). The analysis
channel is the thought, the final channel (and commentary to no one: a preamble) the answer,
a message to `functions.NAME` a call. The markers are special tokens of gpt-oss's
vocabulary; `<|call|>` and `<|return|>` end generation there, so the reader takes a body's
end as its message's end too.

The splitter turns the messages into (thinking, content), a call written into the content
in one canonical form, `<|channel|>commentary to=functions.NAME<|message|>{...}<|call|>`,
which the call reader reads out of it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from llmrun.chat.formats.base import (
    Family,
    Gathered,
    choice,
    json_calls,
    lark,
    lit,
    marker_writer,
    object_at,
    past,
)
from llmrun.chat.formats.messages import MessageSplitter
from llmrun.chat.formats.xml import free_text
from llmrun.chat.toolcalls import MAX_TRIES, ToolCheck
from llmrun.chat.toolcalls.jsontext import MAX_DEPTH, nesting
from llmrun.chat.tools import Steering, TemplateInfo, ToolPlan
from llmrun.request import ToolCall

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN, CONSTRAIN = "<|end|>", "<|call|>", "<|return|>", "<|constrain|>"
_ENDS = (END, CALL, RETURN)
# What ends a body without ending the message first (a model that skipped `<|end|>`)
_OPENS = (START, CHANNEL)
CANON = CHANNEL + "commentary to=functions."
_RECIPIENT = re.compile(r"to=(\S+?)(?=\s|<\||$)")
_CHANNEL_NAME = re.compile(r"<\|channel\|>\s*(\w+)")
_CALL = re.compile(re.escape(CANON) + r"([^\s<>]{1,256})" + re.escape(MESSAGE))


@dataclass
class HarmonySplitter(MessageSplitter):
    """(thinking, content) of streamed harmony messages (the module's doc)."""

    _channel: str = ""
    _recipient: str | None = None

    message = MESSAGE
    ends = _ENDS
    opens = _OPENS
    header_starts = (START, CHANNEL)

    def _open(self, header: str) -> str:
        channel = _CHANNEL_NAME.search(header)
        self._channel = channel.group(1) if channel else "final"
        recipient = _RECIPIENT.search(header)
        name = recipient.group(1) if recipient else None
        self._recipient = name[len("functions."):] if name and name.startswith(
            "functions.") else name
        return "" if self._recipient is None else CANON + self._recipient + MESSAGE

    def _emit(self, text: str, thinking: list[str], content: list[str]) -> None:
        if self._channel == "analysis" and self._recipient is None:
            thinking.append(text)
        else:
            content.append(text)

    def _close(self) -> str:
        ended, self._recipient = self._recipient, None
        return "" if ended is None else CALL


class Harmony(Family):
    name = "harmony"
    markers = (START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN)
    starts = (CANON,)
    grammar_thinks = True

    def matches(self, template: str) -> bool:
        return CHANNEL in template and MESSAGE in template

    def think_pair(self, template: str | None) -> tuple[str, str] | None:
        # what the lazy grammar ignores triggers between; the splitter is harmony's own
        return CHANNEL + "analysis" + MESSAGE, END

    def splitter(self, pair: tuple[str, str], inside: bool, keep: bool) -> HarmonySplitter:
        return HarmonySplitter(keep=keep)

    def think_end(self, pair: tuple[str, str]) -> str:
        # the analysis message ends, and the final channel's opens
        return END + START + "assistant" + CHANNEL + "final" + MESSAGE

    def parse(self, text: str, check: ToolCheck,
              truncated: bool) -> tuple[list[ToolCall], str] | None:
        if nesting(text) > MAX_DEPTH:
            return None
        got = Gathered(text)
        for m in list(_CALL.finditer(text))[:MAX_TRIES]:
            found = object_at(text, m.end())
            if found is None:
                return got.result(whole=False) if truncated else None
            if not check.accepts(m.group(1), found[1]):
                return None
            got.call(m.start(), past(text, found[0], CALL), m.group(1), found[1])
        return got.result()

    def cut(self, text: str, names: set[str]) -> tuple[str, str] | None:
        found = list(_CALL.finditer(text))
        if not found or found[-1].group(1) not in names:
            return None
        return found[-1].group(1), text[found[-1].end():].strip()

    def _rules(self, chosen: list[object], strict: bool, special: dict[str, int] | None,
               ) -> list[str]:
        """`tail`: a call's name on, as gpt-oss writes it; `args{i}`."""
        mark = marker_writer(special)
        # `<|call|>` ends generation where it is a special token (an end-of-generation
        # one, which the grammar's end allows); written out, the grammar writes it
        close = "" if special and CALL in special else f" {mark(CALL)}"
        return json_calls("tail", chosen, strict,
                          lambda i, tool: f'{lit(tool.name)} " " {mark(CONSTRAIN)} "json" '
                                          f"{mark(MESSAGE)} args{i}{close}")

    def grammar(self, plan: ToolPlan, special: dict[str, int] | None = None) -> str | None:
        """One call (gpt-oss makes one per turn: harmony ends the turn at `<|call|>`), maybe
        after a thought, which stays free text."""
        chosen = choice(plan)
        if chosen is None:
            return None
        mark = marker_writer(special)
        return lark("thought? call", [
            f'thought: {mark(CHANNEL)} "analysis" {mark(MESSAGE)} thought_body '
            f'{mark(START)} "assistant"',
            free_text("thought_body", END, special),
            f'call: {mark(CHANNEL)} "commentary to=functions." tail',
            *self._rules(list(chosen), plan.strict, special)])

    def steering(self, plan: ToolPlan, special: dict[str, int] | None = None) -> Steering | None:
        """A call has begun at `to=functions.` in a commentary header: the grammar starts
        at the name."""
        if plan.choice != "auto":
            return None
        grammar = lark("tail", self._rules(list(plan.tools), plan.strict, special))
        return Steering([re.escape(CHANNEL) + r"commentary to=functions\."], grammar)

    def write_calls(self, calls: list[ToolCall], info: TemplateInfo) -> str:
        return "".join(f"{START}assistant{CHANNEL}commentary to=functions.{c.name} "
                       f"{CONSTRAIN}json{MESSAGE}"
                       + json.dumps(c.arguments, ensure_ascii=False) + CALL for c in calls)
