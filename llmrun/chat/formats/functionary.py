"""MeetKai's Functionary, on Llama 3.1's template:

    v3.1  <function=NAME>{...}</function>, one after another; the `python` tool's code after
          <|python_tag|> (as Llama 3.1 writes it)
    v3.2  every message opens with `>>>` and its recipient on a line of its own:
          `>>>all\\n` the answer, `>>>NAME\\n{...}` a call. The prompt ends with `>>>`, so
          the output starts with the recipient: `all\\nHello` or `get_weather\\n{...}`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from llmrun.chat.formats.base import (
    Family,
    Format,
    Gathered,
    choice,
    json_calls,
    lark,
    lit,
    object_at,
    only_tool,
    past,
)
from llmrun.chat.textstream import partial_match
from llmrun.chat.thinking import Splitter
from llmrun.chat.toolcalls import (
    MAX_TRIES,
    CallReader,
    Finished,
    ToolCheck,
    new_call_id,
    parse_calls,
)
from llmrun.chat.toolcalls.jsontext import MAX_DEPTH, nesting, whole_object
from llmrun.chat.toolcalls.stream import distinct, release
from llmrun.chat.tools import Steering, TemplateInfo, ToolPlan
from llmrun.request import PartialCall, Tool, ToolCall

PYTHON_TAG = "<|python_tag|>"


def _names(chosen: list[Tool]) -> str:
    return "|".join(re.escape(t.name) for t in chosen)


class FunctionaryV31(Family):
    name = "functionary-v3.1"
    markers = (PYTHON_TAG,)
    starts = ("<function=", PYTHON_TAG)
    _TAG = re.compile(r"<function=([^\s<>]{1,256})>")

    def matches(self, template: str) -> bool:
        return "'<function=' + tool_call" in template and PYTHON_TAG in template

    def parse(self, text: str, check: ToolCheck,
              truncated: bool) -> tuple[list[ToolCall], str] | None:
        if nesting(text) > MAX_DEPTH:
            return None
        got = Gathered(text)
        for _ in range(MAX_TRIES):
            tag = self._TAG.search(text, got.pos)
            python = text.find(PYTHON_TAG, got.pos)
            if python != -1 and (tag is None or python < tag.start()):
                # the code runs to the end: Llama 3.1's `python` tool, whose argument it is
                code = text[python + len(PYTHON_TAG):].strip()
                if not code or not check.accepts("python", {"code": code}):
                    return None
                got.call(python, len(text), "python", {"code": code})
                break
            if tag is None:
                break
            found = object_at(text, tag.end())
            if found is None or not check.accepts(tag.group(1), found[1]):
                return got.result(whole=False) if truncated else None
            got.call(tag.start(), past(text, found[0], "</function>"), tag.group(1), found[1])
        return got.result()

    def cut(self, text: str, names: set[str]) -> tuple[str, str] | None:
        found = list(self._TAG.finditer(text))[-1:]
        if not found or found[0].group(1) not in names:
            return None
        return found[0].group(1), text[found[0].end():].strip()

    def _rules(self, chosen: list[Tool], strict: bool) -> list[str]:
        return [*json_calls("tail", chosen, strict, lambda i, tool: f"{lit(tool.name + '>')} "
                                                                 f'args{i} "</function>"'),
                'call: "<function=" tail']

    def grammar(self, plan: ToolPlan, special: dict[str, int] | None = None) -> str | None:
        chosen = choice(plan)
        if chosen is None:
            return None
        return lark("call+" if plan.parallel else "call", self._rules(list(chosen), plan.strict))

    def steering(self, plan: ToolPlan, special: dict[str, int] | None = None) -> Steering | None:
        """A call has begun at `<function=` and a tool's name: the grammar starts there."""
        if plan.choice != "auto":
            return None
        grammar = lark("tail call*" if plan.parallel else "tail",
                       self._rules(list(plan.tools), plan.strict))
        return Steering([f"<function=(?=(?:{_names(plan.tools)})>)"], grammar)

    def write_calls(self, calls: list[ToolCall], info: TemplateInfo) -> str:
        return "".join(
            PYTHON_TAG + c.arguments["code"] if c.name == "python"
            and list(c.arguments) == ["code"] and isinstance(c.arguments["code"], str)
            else f"<function={c.name}>" + json.dumps(c.arguments, ensure_ascii=False)
            + "</function>" for c in calls)


ALL, SEP = "all", ">>>"
_RECIPIENT = re.compile(r"\s*([^\s<>]{1,256})\n")
_RECIPIENT_LIMIT = 256


@dataclass
class RecipientReader:
    """`FunctionaryV32.reader`: the output's first recipient is read from its first line;
    an answer (`all`) is released as it comes, up to the next `>>>`; from a call's
    recipient on, the text is held to the end and parsed whole there."""

    check: ToolCheck
    parallel: bool = True
    forced: bool = False
    only: str | None = None
    _pieces: list[tuple[str, list[Any]]] = field(default_factory=list)
    _state: str = "head"  # head -> text (an answer) | calls (held) | plain (no recipient)

    def push(self, text: str, logprobs: list[Any] | None = None) -> tuple[str, list[Any]]:
        self._pieces.append((text, list(logprobs or ())))
        out: list[str] = []
        lps: list[Any] = []
        while True:
            held = "".join(t for t, _ in self._pieces)
            if self._state == "head":
                m = _RECIPIENT.match(held)
                if m is None:
                    if len(held) > _RECIPIENT_LIMIT or re.search(r"\s", held.lstrip()):
                        self._state = "plain"  # no recipient line: the text as it is
                        continue
                    break
                if m.group(1) == ALL:
                    _, dropped, self._pieces = release(self._pieces, m.end())
                    lps += dropped
                    self._state = "text"
                elif m.group(1) in self.check.names:
                    self._state = "calls"
                else:
                    self._state = "plain"
                continue
            if self._state in ("text", "plain"):
                # (an answer whose recipient the splitter took, or none was written: a
                # call may still follow its `>>>`)
                at = held.find(SEP)
                if at != -1:
                    self._state = "calls"
                n = at if at != -1 else len(held) - partial_match(held, (SEP,))
                text_out, entries, self._pieces = release(self._pieces, n)
                out.append(text_out)
                lps += entries
                break
            break
        return "".join(out), lps

    def finish(self, truncated: bool = False) -> Finished:
        held = "".join(t for t, _ in self._pieces)
        lps = [e for _, entries in self._pieces for e in entries]
        self._pieces = []
        if self._state == "calls":
            parsed = self._parse(held, truncated)
            if parsed is None:
                parsed = parse_calls(held, "hermes", self.check, truncated)
            if parsed is not None:
                calls, rest = parsed
                return Finished(rest, lps, distinct(calls) if self.parallel else calls[:1])
            if truncated:
                return self._cut(held, lps)
        if self._state == "head":
            name = held.strip()
            if name == ALL:
                return Finished("", lps, [])
            if truncated and self.forced and name in self.check.names:
                return Finished("", lps, [], PartialCall(id=new_call_id(), name=name,
                                                         arguments=""))
        return Finished(held, lps, [])

    def _parse(self, text: str, truncated: bool) -> tuple[list[ToolCall], str] | None:
        if nesting(text) > MAX_DEPTH:
            return None
        calls: list[ToolCall] = []
        rest: list[str] = []
        pos = 0
        for _ in range(MAX_TRIES):
            if text.startswith(SEP, pos):
                pos += len(SEP)
            m = _RECIPIENT.match(text, pos)
            if m is None:
                break
            if m.group(1) == ALL:
                at = text.find(SEP, m.end())
                rest.append(text[m.end():at if at != -1 else len(text)])
                if at == -1:
                    pos = len(text)
                    break
                pos = at
                continue
            found = object_at(text, m.end())
            if found is None or not self.check.accepts(m.group(1), found[1]):
                if truncated and calls:
                    pos = len(text)
                    break
                return None
            calls.append(ToolCall(id=new_call_id(), name=m.group(1), arguments=found[1]))
            pos = found[0]
            while pos < len(text) and text[pos].isspace():
                pos += 1
        if not calls or text[pos:].strip():
            return None
        return calls, " ".join(r.strip() for r in rest if r.strip())

    def _cut(self, text: str, lps: list[Any]) -> Finished:
        """The last call of `text`, which the token limit cut off."""
        heads = [m for m in re.finditer(r"(?:^|>>>)\s*([^\s<>]{1,256})\n", text)][-1:]
        if not heads or heads[0].group(1) not in self.check.names:
            return Finished(text if not self.forced else "", lps, [])
        name, args = heads[0].group(1), text[heads[0].end():].strip()
        whole = whole_object(args)
        if whole is not None and self.check.accepts(name, whole):
            return Finished("", lps, [ToolCall(id=new_call_id(), name=name, arguments=whole)])
        return Finished("", lps, [], PartialCall(id=new_call_id(), name=name, arguments=args))


@dataclass
class FirstRecipient:
    """`FunctionaryV32.answer_splitter`: the output's leading `all\n` (the answer's
    recipient, its `>>>` the prompt's) taken off, whether tools are offered or not."""

    _held: str = ""
    _done: bool = False

    def push(self, text: str) -> tuple[str, str]:
        if self._done:
            return "", text
        self._held += text
        m = re.match(r"\s{0,8}all\n", self._held)
        if m is None and (ALL + "\n").startswith(self._held.lstrip(" \n")) \
                and len(self._held) <= 12:
            return "", ""  # may still become it
        self._done = True
        out, self._held = self._held[m.end():] if m else self._held, ""
        return "", out

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        return "", "" if held.strip() == ALL else held


class FunctionaryV32(Format):
    name = "functionary-v3.2"
    markers = (">>>all",)

    def answer_splitter(self) -> Splitter:
        return FirstRecipient()

    def matches(self, template: str) -> bool:
        return ">>>all" in template and "'>>>' + tool_call" in template

    def reader(self, plan: ToolPlan) -> CallReader:
        return RecipientReader(ToolCheck.of(plan.tools), plan.parallel,
                               forced=plan.choice != "auto", only=only_tool(plan))

    def _rules(self, chosen: list[Tool], strict: bool) -> list[str]:
        return json_calls("call", chosen, strict,
                          lambda i, tool: f"{lit(tool.name + chr(10))} args{i}")

    def grammar(self, plan: ToolPlan, special: dict[str, int] | None = None) -> str | None:
        """The calls the output starts with (the prompt wrote the first `>>>`)."""
        chosen = choice(plan)
        if chosen is None:
            return None
        root = 'call (">>>" call)*' if plan.parallel else "call"
        return lark(root, self._rules(list(chosen), plan.strict))

    def steering(self, plan: ToolPlan, special: dict[str, int] | None = None) -> Steering | None:
        """A call has begun at a recipient that is a tool: the output's first line (the
        lazy grammar's text starts with a newline) or after `>>>`; the grammar starts at
        the name."""
        if plan.choice != "auto":
            return None
        root = 'call (">>>" call)*' if plan.parallel else "call"
        names = _names(plan.tools)
        grammar = lark(root, self._rules(list(plan.tools), plan.strict))
        return Steering([f"\\A\\n(?=(?:{names})\\n)", f">>>(?=(?:{names})\\n)"], grammar)

    def write_calls(self, calls: list[ToolCall], info: TemplateInfo) -> str:
        """As the output writes them: the first recipient's `>>>` is the prompt's."""
        return SEP.join(c.name + "\n" + json.dumps(c.arguments, ensure_ascii=False)
                        for c in calls)


__all__ = ["FunctionaryV31", "FunctionaryV32", "RecipientReader"]
