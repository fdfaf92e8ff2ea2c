"""A chat format derived from the template itself, for a template of no named family.

The template is rendered with probe conversations and the renderings compared, as
llama.cpp's chat auto-parser does (common/chat-diff-analyzer.cpp): an assistant turn with
no call, with one call and with two calls gives the text of a call and of the section
around the calls,

    W_open  A  NAME  B  ARGS  D  [SEP  A  NAME  B  ARGS  D]  W_close

(ARGS: the arguments as the template writes them, a JSON object), and an assistant turn
with a thought, against one without, gives the markers a thought lies between. From these
pieces the format reads calls (a pattern per call), steers (the first marker is the
trigger), forces (the pieces as literals around each tool's `%json` arguments) and writes
history (the pieces again).

What derivation cannot tell stays with the named families (formats/__init__.py) and the
default: arguments written as tagged text rather than JSON (their types come from the
schema, a rule per family), call ids the model writes, and calls with no marker before
them (bare JSON, which the default's tolerant reader takes). A template whose first marker
is one the default already reads (`<tool_call>`, `[TOOL_CALLS]`, `<|python_tag|>`,
`<function=`) is left to it: its reader takes more of what small models really write.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from llmrun.chat import templates, thinking
from llmrun.chat.formats.base import Family, choice, json_calls, lark
from llmrun.chat.toolcalls import MAX_TRIES, ToolCheck, new_call_id
from llmrun.chat.toolcalls.jsontext import MAX_DEPTH, balanced, loads, nesting
from llmrun.chat.tools import Steering, TemplateInfo, ToolPlan
from llmrun.request import ToolCall

# Probe values no template writes by itself
_NAMES = ("probe_fn", "probe_two")
_ARGS = ({"probe_arg": "probe_val"}, {"probe_key": "probe_more"})
_ID = "probe0001"
_THOUGHT = "probe thought"
_ANSWER = "probe answer"
_QUESTION = "probe question"
# What the default's reader already takes as a call's start
_DEFAULT_STARTS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<function=")
# A marker inside the pieces: a tag, or a bracketed upper-case word (Mistral's style)
_MARKER = re.compile(r"<[^<>\s]{1,64}>|\[[A-Z_]{2,32}\]")
# the markers' brackets, and what a marker begun and not yet closed looks like (a JSON
# list's `[` is no marker)
_OPENERS = (("<", ">"), ("[", "]"))
_BEGUN = {"<": re.compile(r"<[^<>\s]{0,63}"), "[": re.compile(r"\[[A-Z_]{1,31}")}


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = next((i for i in range(n) if a[i] != b[i]), n)
    return i


def _common_suffix(a: str, b: str) -> int:
    return _common_prefix(a[::-1], b[::-1])


def _snapped(text: str, start: int, end: int) -> tuple[int, int]:
    """`text[start:end]` widened to whole markers: a character diff stops where two texts
    differ, which may be inside a tag both have begun (`<tool_call>` against `<|im_end|>`
    share the `<`)."""
    for opener, closer in _OPENERS:
        before = text[max(0, start - 64):start]
        i = before.rfind(opener)
        if i != -1 and _BEGUN[opener].fullmatch(before[i:]):
            start -= len(before) - i
        after = text[max(start, end - 64):end]
        j = after.rfind(opener)
        if j != -1 and _BEGUN[opener].fullmatch(after[j:]):
            k = text.find(closer, end, end + 64)
            if k != -1:
                end = k + 1
    return start, end


def _diff(a: str, b: str) -> tuple[int, int]:
    """Where `b` differs from `a`: the span of `b` between their common prefix and suffix,
    widened to whole markers."""
    p, _ = _snapped(b, _common_prefix(a, b), len(b))
    s = min(_common_suffix(a, b), len(b) - p, len(a) - p)
    return _snapped(b, p, len(b) - s)


def _render(source: str, assistant: dict[str, Any]) -> str | None:
    messages = [{"role": "user", "content": _QUESTION}, {"role": "assistant", **assistant}]
    tools = [{"type": "function", "function": {
        "name": n, "description": "a probe",
        "parameters": {"type": "object", "properties": {k: {"type": "string"} for k in a}}}}
        for n, a in zip(_NAMES, _ARGS, strict=True)]
    try:
        return templates.render(source, messages, add_generation_prompt=False, tools=tools,
                                enable_thinking=True)
    except templates.TemplateError:
        return None


def _calls(n: int) -> dict[str, Any]:
    return {"content": _ANSWER, "tool_calls": [
        {"id": _ID if i == 0 else _ID[:-1] + "2", "type": "function",
         "function": {"name": _NAMES[i], "arguments": _ARGS[i]}} for i in range(n)]}


def _args_span(text: str, args: dict[str, str], start: int) -> tuple[int, int] | None:
    """Where the arguments object `args` is written in `text`, after `start`."""
    key = text.find(json.dumps(next(iter(args))), start)
    if key == -1:
        return None
    for o in range(key - 1, max(start, key - 8) - 1, -1):
        if text[o] == "{":
            end = balanced(text, o)
            if end is not None:
                try:
                    if loads(text[o:end]) == args:
                        return o, end
                except ValueError:
                    return None
            return None
    return None


@dataclass(frozen=True)
class Envelope:
    """The pieces a template writes calls with (see the module's doc)."""

    open: str  # W_open: before the first call
    head: str  # A: before a call's name
    mid: str  # B: between the name and the arguments
    tail: str  # D: after the arguments
    sep: str  # between calls
    close: str  # W_close: after the last call


def envelope(source: str) -> Envelope | None:
    """The call pieces of `source`, derived from probe renderings; None where the template
    renders no call, renders one in a form this cannot read (see the module's doc), or
    renders two calls other than as the same pieces repeated."""
    # (an answer beside the calls: some templates write nothing for an empty turn)
    plain = _render(source, {"content": _ANSWER})
    one = _render(source, _calls(1))
    two = _render(source, _calls(2))
    if plain is None or one is None or two is None or _NAMES[0] not in plain \
            or _NAMES[1] not in two or _ID in one:
        # (a template that does not show the tools gets llmrun's Hermes preamble, which
        # teaches `<tool_call>`: the default's format, whatever its history looks like)
        return None
    # the calls' text: what they added to the plain turn
    start, end = _diff(plain, one)
    call = one[start:end]
    start2, end2 = _diff(plain, two)
    body2 = two[start2:end2]
    n = call.find(_NAMES[0])
    span = _args_span(call, _ARGS[0], n + len(_NAMES[0])) if n != -1 else None
    if span is None or _ANSWER in call or _ANSWER in body2:
        return None
    a, b, d = call[:n], call[n + len(_NAMES[0]):span[0]], call[span[1]:]
    # the second call: its own head is what A and the gap between the calls share
    n2 = body2.find(_NAMES[1])
    span1 = _args_span(body2, _ARGS[0], 0)
    if n2 == -1 or span1 is None or not body2.startswith(a + _NAMES[0] + b):
        return None
    gap = body2[span1[1]:n2]
    head = len(a) - _snapped(a, len(a) - _common_suffix(a, gap), len(a))[0]
    tail = _whole(d, min(_common_prefix(d, gap), len(gap) - head))
    env = Envelope(open=a[:len(a) - head], head=a[len(a) - head:], mid=b, tail=d[:tail],
                   sep=gap[tail:len(gap) - head], close=d[tail:])
    expected = (env.open + env.head + _NAMES[0] + env.mid + json.dumps(_ARGS[0]) + env.tail
                + env.sep + env.head + _NAMES[1] + env.mid + json.dumps(_ARGS[1]) + env.tail
                + env.close)
    if _squeeze(expected) != _squeeze(body2):
        return None  # not the same pieces repeated (call indexes, ids, ...)
    env = _within_turn(source, env, plain)
    first = (env.open + env.head).strip()
    if not first or first.startswith("{") or first.startswith(_DEFAULT_STARTS):
        return None
    return env


def _whole(text: str, n: int) -> int:
    """`n`, or less so that `text[:n]` does not end inside a marker."""
    for opener, _ in _OPENERS:
        i = text.rfind(opener, 0, n)
        if i != -1 and _BEGUN[opener].fullmatch(text[i:n]):
            n = i
    return n


def _within_turn(source: str, env: Envelope, plain: str) -> Envelope:
    """`env` without what is not the model's to write: the assistant turn's header (a
    template that writes calls as a turn of their own repeats it), what comes before the
    section's own marker (an empty thought Command R7B writes first), and the end of the
    turn after the calls (the end-of-turn token, and what follows it)."""
    opening = env.open
    marks = list(_MARKER.finditer(opening))
    if marks:
        opening = opening[marks[-1].start():]
    ending = plain[plain.rfind(_ANSWER) + len(_ANSWER):].strip()
    close = env.close
    if ending:
        m = _MARKER.search(ending)
        at = close.find(m.group(0)) if m else close.find(ending)
        if at != -1:
            close = close[:at]
    return Envelope(opening, env.head, env.mid, env.tail, env.sep, close.rstrip())


def _squeeze(text: str) -> str:
    """`text` without its whitespace, and JSON's spacing after `:` and `,` with it."""
    return re.sub(r"\s+", "", text)


def think_pair(source: str) -> tuple[str, str] | None:
    """The markers a past thought is rendered between (an assistant turn with a thought
    against one without), else what thinking.markers reads from the text."""
    plain = _render(source, {"content": _ANSWER})
    thought = _render(source, {"content": _ANSWER, "reasoning_content": _THOUGHT})
    if plain is not None and thought is not None and _THOUGHT in thought:
        start, end = _diff(plain, thought)
        added = thought[start:end]
        at = added.find(_THOUGHT)
        opener, closer = added[:at].strip(), added[at + len(_THOUGHT):].strip()
        if at != -1 and _ANSWER not in added and _MARKER.fullmatch(opener) \
                and _MARKER.fullmatch(closer):
            return opener, closer
    return thinking.markers(source)


def _pattern(text: str) -> str:
    """A regex for one of the pieces: its whitespace as any whitespace."""
    return r"\s*".join(re.escape(part) for part in re.split(r"\s+", text.strip())) \
        if text.strip() else ""


class Derived(Family):
    """The format of a template derived by `envelope` (see the module's doc)."""

    name = "derived"

    def __init__(self, env: Envelope, pair: tuple[str, str] | None) -> None:
        self.env = env
        self._pair = pair
        self.markers = tuple(dict.fromkeys(
            m for piece in (env.open, env.head, env.mid, env.tail, env.sep, env.close)
            for m in _MARKER.findall(piece)))
        first = (env.open + env.head).strip()
        self.starts = (_MARKER.match(first).group(0) if _MARKER.match(first)  # type: ignore[union-attr]
                       else first[:32],)
        self._call = re.compile(
            r"\s*" + _pattern(env.head) + r"\s*([^\s<>{}\[\]\"]{1,256}?)\s*" + _pattern(env.mid)
            + r"\s*(?=\{)")
        self._open = re.compile(r"\s*" + _pattern(env.open)) if env.open.strip() else None

    def think_pair(self, template: str | None) -> tuple[str, str] | None:
        return self._pair

    def parse(self, text: str, check: ToolCheck,
              truncated: bool) -> tuple[list[ToolCall], str] | None:
        if nesting(text) > MAX_DEPTH:
            return None
        start = text.find(self.starts[0])
        if start == -1:
            return None
        head, pos = text[:start], start
        if self._open is not None:
            m = self._open.match(text, pos)
            if m is None:
                return None
            pos = m.end()
        calls: list[ToolCall] = []
        tail_re = re.compile(r"\s*" + _pattern(self.env.tail)) if self.env.tail.strip() else None
        sep_re = re.compile(r"\s*" + _pattern(self.env.sep)) if self.env.sep.strip() else None
        for _ in range(MAX_TRIES):
            m = self._call.match(text, pos)
            if m is None:
                break
            end = balanced(text, m.end())
            args: Any = None
            if end is not None:
                try:
                    args = loads(text[m.end():end])
                except ValueError:
                    args = None
            if not isinstance(args, dict):
                if truncated and calls:
                    return calls, head.strip()
                return None
            if not check.accepts(m.group(1), args):
                return None
            calls.append(ToolCall(id=new_call_id(), name=m.group(1), arguments=args))
            pos = end  # type: ignore[assignment]
            for piece in (tail_re, sep_re):
                if piece is not None and (found := piece.match(text, pos)) is not None:
                    pos = found.end()
        if not calls:
            return None
        rest = text[pos:]
        if self.env.close.strip():
            m = re.match(r"\s*" + _pattern(self.env.close), rest)
            if m is not None:
                rest = rest[m.end():]
        return calls, (head.strip() + " " + rest.strip()).strip()

    def cut(self, text: str, names: set[str]) -> tuple[str, str] | None:
        last = None
        for m in self._call.finditer(text):
            last = m
        if last is None or last.group(1) not in names:
            return None
        return last.group(1), text[last.end():].rstrip()

    def _literal(self, text: str, special: dict[str, int] | None) -> str:
        """`text` as Lark: its markers that are special tokens by id, the rest as strings."""
        out: list[str] = []
        pos = 0
        for m in _MARKER.finditer(text):
            if special and m.group(0) in special:
                if text[pos:m.start()]:
                    out.append(json.dumps(text[pos:m.start()]))
                out.append(f"<[{special[m.group(0)]}]>")
                pos = m.end()
        if text[pos:]:
            out.append(json.dumps(text[pos:]))
        return " ".join(out) or '""'

    def _rules(self, plan: ToolPlan, chosen: list[Any],
               special: dict[str, int] | None) -> list[str]:
        env = self.env
        tail = self._literal(env.tail, special)

        def call(i: int, tool: Any) -> str:
            return f"{self._literal(env.head + tool.name + env.mid, special)} args{i} {tail}"

        return json_calls("call", chosen, plan.strict, call)

    def _root(self, plan: ToolPlan, special: dict[str, int] | None) -> str:
        more = f"({self._literal(self.env.sep, special)} call)*" if plan.parallel else ""
        return f"call {more} {self._literal(self.env.close, special)}"

    def grammar(self, plan: ToolPlan, special: dict[str, int] | None = None) -> str | None:
        chosen = choice(plan)
        if chosen is None:
            return None
        return lark(f"{self._literal(self.env.open, special)} {self._root(plan, special)}",
                    self._rules(plan, list(chosen), special))

    def steering(self, plan: ToolPlan, special: dict[str, int] | None = None) -> Steering | None:
        """The first marker starts the grammar: the rest of the section, then its calls."""
        if plan.choice != "auto":
            return None
        opening = self.env.open + self.env.head
        at = opening.find(self.starts[0]) + len(self.starts[0])
        if self.env.open.strip():  # the section's marker: then the calls
            after = self.env.open[at:] if at <= len(self.env.open) else ""
            start = f"start: {self._literal(after, special)} {self._root(plan, special)}"
            return Steering([re.escape(self.starts[0])], "\n".join(
                [start, *self._rules(plan, list(plan.tools), special)]) + "\n")
        # no section: the call's own marker, then the rest of its head
        rules = self._rules(plan, list(plan.tools), special)
        rest = self.env.head[at:]
        firsts = " | ".join(
            f"{self._literal(rest + t.name + self.env.mid, special)} args{i} "
            f"{self._literal(self.env.tail, special)}" for i, t in enumerate(plan.tools))
        more = f"({self._literal(self.env.sep, special)} call)*" if plan.parallel else ""
        return Steering([re.escape(self.starts[0])], "\n".join(
            [f"start: first {more} {self._literal(self.env.close, special)}",
             f"first: {firsts}", *rules]) + "\n")

    def write_calls(self, calls: list[ToolCall], info: TemplateInfo) -> str:
        env = self.env
        return env.open + env.sep.join(
            env.head + c.name + env.mid + json.dumps(c.arguments, ensure_ascii=False)
            + env.tail for c in calls) + env.close


def derive(source: str) -> Derived | None:
    """The derived format of `source` (None: derivation cannot tell; see the module's doc)."""
    env = envelope(source)
    return Derived(env, think_pair(source)) if env is not None else None
