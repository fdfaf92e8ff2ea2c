"""What a chat format is: the object that reads a family's output (calls, thought, content),
steers and forces its calls, and writes its past calls, and the pieces the families share.

The runner (engine/host.py, engine/outputs.py) holds one `Format` per request, picked from
the template text (formats.detect), and asks it for everything family-specific; the engine
below sees only the grammar, triggers and think markers it hands over.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from llmrun.chat import thinking, tools
from llmrun.chat.textstream import partial_match
from llmrun.chat.thinking import Splitter
from llmrun.chat.toolcalls import (
    CallReader,
    Finished,
    ToolCheck,
    ToolStream,
    new_call_id,
    parse_calls,
)
from llmrun.chat.toolcalls.jsontext import balanced, loads, whole_object
from llmrun.chat.toolcalls.stream import distinct, release
from llmrun.chat.tools import Steering, ToolPlan
from llmrun.request import PartialCall, ToolCall


class Format:
    """A family's format. This base is the default: the tolerant reader of toolcalls/ and
    the grammars of tools.py (Hermes, Llama 3, Mistral, plain JSON, by the template's
    family), thoughts between the think pair the template shows. A family overrides what it
    does its own way."""

    name = "default"
    # Markers that are special tokens in the family's vocabulary: rendered as text, so the
    # reader sees them (engine/prompt.py's control pieces).
    markers: tuple[str, ...] = ()
    # The thought is a message of the output's own grammar (harmony's analysis channel): a
    # grammar, forced call or the request's, applies from the first token, and the runner
    # does not wait for the thought's end marker before constraining.
    grammar_thinks = False

    def matches(self, template: str) -> bool:
        """Whether `template` is this family's (by markers only it writes)."""
        return False

    def think_pair(self, template: str | None) -> tuple[str, str] | None:
        """The markers a thought lies between (None: the template does not think): also what
        the lazy grammar ignores triggers inside."""
        return thinking.markers(template)

    def splitter(self, pair: tuple[str, str], inside: bool, keep: bool) -> Splitter:
        return thinking.ThinkStream(pair, inside=inside, keep=keep)

    def think_end(self, pair: tuple[str, str]) -> str:
        """What the runner writes to end a thought whose budget is spent (the answer then
        follows)."""
        return pair[1]
    def answer_splitter(self) -> Splitter | None:
        """For a template that does not think: what the output goes through all the same
        (markup of the family's that is never the answer's); None: nothing."""
        return None

    def reader(self, plan: ToolPlan) -> CallReader:
        return plan.stream()

    def grammar(self, plan: ToolPlan, special: dict[str, int] | None = None) -> str | None:
        return plan.grammar(special)

    def steering(self, plan: ToolPlan, special: dict[str, int] | None = None) -> Steering | None:
        return plan.steering(special)

    def write_calls(self, calls: list[ToolCall], info: tools.TemplateInfo) -> str:
        """Past calls as the family writes them (for a template that cannot render them)."""
        return tools.format_calls(calls, info)


DEFAULT = Format()


# -- what the families share ----------------------------------------------------------------


def lit(text: str) -> str:
    """A Lark string literal."""
    return json.dumps(text)


def marker_writer(special: dict[str, int] | None) -> Any:
    """A marker in a grammar: its special token where it is one, else its characters."""
    special = special or {}
    return lambda text: f"<[{special[text]}]>" if text in special else lit(text)


def text_writer(special: dict[str, int] | None) -> Any:
    """Text in a grammar: the special tokens within it (a tag built of several, Kimi K3's
    `<|open|>tools<|sep|>`) as those tokens, the rest as its characters."""
    special = special or {}
    keys = sorted(special, key=len, reverse=True)
    pattern = re.compile("(" + "|".join(re.escape(k) for k in keys) + ")") if keys else None

    def write(text: str) -> str:
        if pattern is None:
            return lit(text)
        parts = [p for p in pattern.split(text) if p]
        return " ".join(f"<[{special[p]}]>" if p in special else lit(p) for p in parts) \
            or '""'

    return write


def args_rule(name: str, tool: Any, strict: bool) -> str:
    """Lark rule `name`: a tool's JSON arguments, by its schema (as tools.py writes them)."""
    return f"{name}: %json {tools._arguments_schema(tool, strict)}"


def lark(start: str, rules: list[str]) -> str:
    """A Lark grammar: its start rule (`start`: the rule's body) and `rules`."""
    return "\n".join([f"start: {start}", *rules]) + "\n"


def json_calls(rule: str, chosen: list[Any], strict: bool,
               body: Callable[[int, Any], str]) -> list[str]:
    """The rules of calls whose arguments are JSON: `{rule}{i}` a tool (`body(i, tool)`,
    which names `args{i}`), `args{i}` its arguments by its schema, and `{rule}` any one."""
    rules = []
    for i, tool in enumerate(chosen):
        rules.append(f"{rule}{i}: {body(i, tool)}")
        rules.append(args_rule(f"args{i}", tool, strict))
    rules.append(one_of(rule, len(chosen)))
    return rules


def one_of(rule: str, n: int) -> str:
    """Lark rule `rule`: any one of `rule0` .. `rule{n-1}` (a rule a tool)."""
    return f"{rule}: " + " | ".join(f"{rule}{i}" for i in range(n))


def choice(plan: ToolPlan) -> list[Any] | None:
    """The tools a forced grammar may call (None: "auto", nothing forced)."""
    if isinstance(plan.choice, tools.NamedTool):
        return [t for t in plan.tools if t.name == plan.choice.name]
    if plan.choice == "required":
        return list(plan.tools)
    return None


def only_tool(plan: ToolPlan) -> str | None:
    """The one tool a forced call can name (ToolStream's `only`)."""
    if isinstance(plan.choice, tools.NamedTool):
        return plan.choice.name
    return plan.tools[0].name if len(plan.tools) == 1 else None


def object_at(text: str, pos: int) -> tuple[int, dict[str, Any]] | None:
    """The JSON object at `text[pos]` (blanks before it aside) and where it ends; None if
    none closes there."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    end = balanced(text, pos) if text.startswith("{", pos) else None
    if end is None:
        return None
    try:
        value = loads(text[pos:end])
    except (ValueError, RecursionError):
        return None
    return (end, value) if isinstance(value, dict) else None


def past(text: str, pos: int, marker: str) -> int:
    """Where the text after `pos` resumes: past `marker` if it follows (blanks before it
    aside), else `pos`."""
    at = pos
    while at < len(text) and text[at].isspace():
        at += 1
    return at + len(marker) if marker and text.startswith(marker, at) else pos


@dataclass
class Gathered:
    """What a family's `parse` gathers from a text: the calls, and the text around them
    (the pieces between the calls, stripped, joined by a space), the content."""

    text: str
    calls: list[ToolCall] = field(default_factory=list)
    pos: int = 0  # where the text after the last call resumes
    _around: list[str] = field(default_factory=list)

    def add(self, start: int, end: int, *calls: ToolCall) -> None:
        """Calls written from `start` to `end` (the text before them is kept)."""
        self._around.append(self.text[self.pos:start])
        self.calls += calls
        self.pos = end

    def call(self, start: int, end: int, name: str, args: dict[str, Any]) -> None:
        self.add(start, end, ToolCall(id=new_call_id(), name=name, arguments=args))

    def result(self, whole: bool = True) -> tuple[list[ToolCall], str] | None:
        """(calls, the text around them), None without calls; not `whole`: what follows
        the last call is dropped (a further call the token limit cut)."""
        if not self.calls:
            return None
        around = [*self._around, self.text[self.pos:]] if whole else self._around
        return self.calls, " ".join(r.strip() for r in around if r.strip())


class Family(Format):
    """A family whose calls open with markers of its own: the reader holds the text from the
    first marker to the end and parses it whole there (`parse`), so a stream reads what the
    whole output would; a call the token limit cut is reported by `cut`."""

    starts: tuple[str, ...] = ()  # what opens a call

    def parse(self, text: str, check: ToolCheck,
              truncated: bool) -> tuple[list[ToolCall], str] | None:
        """(calls, the text around them) from text holding a call's start, or None."""
        raise NotImplementedError

    def cut(self, text: str, names: set[str]) -> tuple[str, str] | None:
        """(name, the arguments' text so far) of a call cut off in `text`, or None."""
        return None

    def reader(self, plan: ToolPlan) -> CallReader:
        return MarkedReader(self, ToolCheck.of(plan.tools), plan.parallel,
                            forced=plan.choice != "auto", only=only_tool(plan))


@dataclass
class MarkedReader:
    """`Family.reader`: text released as it comes until a call's start marker (held while
    it may still become one), held from there to the end, then parsed whole; what no
    family form reads is tried by the tolerant reader (a model that wrote Hermes JSON)."""

    family: Family
    check: ToolCheck
    parallel: bool = True
    forced: bool = False
    only: str | None = None
    _pieces: list[tuple[str, list[Any]]] = field(default_factory=list)
    _capturing: bool = False

    def push(self, text: str, logprobs: list[Any] | None = None) -> tuple[str, list[Any]]:
        self._pieces.append((text, list(logprobs or ())))
        if self._capturing:
            return "", []
        held = "".join(t for t, _ in self._pieces)
        found = [i for i in (held.find(s) for s in self.family.starts) if i != -1]
        if found:
            self._capturing = True
            return self._release(min(found))
        return self._release(len(held) - partial_match(held, self.family.starts))

    def _release(self, n: int) -> tuple[str, list[Any]]:
        text, lps, self._pieces = release(self._pieces, n)
        return text, lps

    def finish(self, truncated: bool = False) -> Finished:
        held = "".join(t for t, _ in self._pieces)
        lps = [e for _, entries in self._pieces for e in entries]
        self._pieces = []
        if self._capturing:
            parsed = self.family.parse(held, self.check, truncated) \
                or parse_calls(held, "hermes", self.check, truncated)
            if parsed is not None:
                calls, rest = parsed
                return Finished(rest, lps, distinct(calls) if self.parallel else calls[:1])
        if truncated and (self._capturing or self.forced):
            cut = self.family.cut(held, self.check.names)
            if cut is None and self.forced and self.only is not None and held.strip():
                cut = self.only, ""
            if cut is not None:
                name, args = cut
                whole = whole_object(args)
                if whole is not None and self.check.accepts(name, whole):
                    return Finished("", lps, [ToolCall(id=new_call_id(), name=name,
                                                       arguments=whole)])
                return Finished("", lps, [], PartialCall(id=new_call_id(), name=name,
                                                         arguments=args))
            if self.forced:
                return Finished("", lps, [])
        return Finished(held, lps, [])


__all__ = ["DEFAULT", "CallReader", "Family", "Format", "Gathered", "MarkedReader", "Splitter",
           "ToolStream", "args_rule", "choice", "distinct", "json_calls", "lark", "lit",
           "marker_writer", "object_at", "one_of", "only_tool", "past", "text_writer"]
