"""Gemma 4: a call is its name and its arguments in Gemma's own notation, not JSON,

    <|tool_call>call:NAME{city:<|"|>Paris<|"|>,days:3,tags:[<|"|>a<|"|>],opts:{x:true}}<tool_call|>

(keys bare, strings between `<|"|>` marks, numbers, true/false/null, lists and dicts as in
JSON), several calls one after another; the thought is `<|channel>thought\\n...<channel|>`
(the prompt writes an empty one when thinking is off). The template writes arguments with
their keys sorted (Jinja's dictsort), so the forced grammar writes them in that order; the
markers are special tokens of Gemma 4's vocabulary.
"""

from __future__ import annotations

import contextlib
import json
import re
from typing import Any

from llmrun.chat.formats.base import (
    Family,
    Gathered,
    choice,
    lark,
    lit,
    marker_writer,
    one_of,
    past,
)
from llmrun.chat.formats.jsonlist import Unwrapped
from llmrun.chat.formats.xml import _types, free_text
from llmrun.chat.thinking import Splitter, ThinkStream
from llmrun.chat.toolcalls import MAX_TRIES, ToolCheck
from llmrun.chat.toolcalls.jsontext import MAX_DEPTH, nesting
from llmrun.chat.tools import Steering, TemplateInfo, ToolPlan
from llmrun.request import Tool, ToolCall

OPEN, CLOSE, QUOTE = "<|tool_call>", "<tool_call|>", '<|"|>'
THINK = ("<|channel>thought", "<channel|>")
_HEAD = re.compile(re.escape(OPEN) + r"\s*call:([^\s{}<>:]{1,256})\s*(?=\{)")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d{0,300})(?:\.\d{1,300})?(?:[eE][+-]?\d{1,5})?")
_KEY = re.compile(r"\s*([^\s:{}\[\],<>\"]{1,256})\s*:")
_WORDS = {"true": True, "false": False, "null": None, "None": None}


class _Cut(Exception):
    """The text ended (or went wrong) inside a value."""


class _Reader:
    """Gemma's notation read into Python values: a recursive descent bounded by MAX_DEPTH
    (the text's nesting is checked before), each step moving forward, so linear."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def _blank(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos].isspace():
            self.pos += 1

    def value(self, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise _Cut
        self._blank()
        text, pos = self.text, self.pos
        if text.startswith(QUOTE, pos):
            end = text.find(QUOTE, pos + len(QUOTE))
            if end == -1:
                raise _Cut
            self.pos = end + len(QUOTE)
            return text[pos + len(QUOTE):end]
        if text.startswith('"', pos):  # a JSON string, as a model may write one
            m = re.compile(r'"(?:[^"\\]|\\.)*"', re.S).match(text, pos)
            if m is None:
                raise _Cut
            self.pos = m.end()
            try:
                return json.loads(m.group())
            except ValueError:
                raise _Cut from None
        if text.startswith("{", pos):
            return self.members(depth)
        if text.startswith("[", pos):
            self.pos += 1
            items: list[Any] = []
            self._blank()
            if text.startswith("]", self.pos):
                self.pos += 1
                return items
            while True:
                items.append(self.value(depth + 1))
                self._blank()
                if text.startswith(",", self.pos):
                    self.pos += 1
                elif text.startswith("]", self.pos):
                    self.pos += 1
                    return items
                else:
                    raise _Cut
        for word, meaning in _WORDS.items():
            if text.startswith(word, pos):
                self.pos += len(word)
                return meaning
        m = _NUMBER.match(text, pos)
        if m is None:
            raise _Cut
        self.pos = m.end()
        number = m.group()
        return int(number) if re.fullmatch(r"-?\d+", number) else float(number)

    def members(self, depth: int = 0, done: dict[str, Any] | None = None) -> dict[str, Any]:
        """The dict at `pos` (`done` gathers its members as they are read)."""
        out: dict[str, Any] = {} if done is None else done
        self.pos += 1  # the "{"
        self._blank()
        if self.text.startswith("}", self.pos):
            self.pos += 1
            return out
        while True:
            self._blank()
            if self.text.startswith(QUOTE, self.pos):  # a key written as a string
                key = self.value(depth + 1)
                self._blank()
                if not isinstance(key, str) or not self.text.startswith(":", self.pos):
                    raise _Cut
                self.pos += 1
            else:
                m = _KEY.match(self.text, self.pos)
                if m is None:
                    raise _Cut
                key, self.pos = m.group(1), m.end()
            out[key] = self.value(depth + 1)
            self._blank()
            if self.text.startswith(",", self.pos):
                self.pos += 1
            elif self.text.startswith("}", self.pos):
                self.pos += 1
                return out
            else:
                raise _Cut


def write_value(value: Any) -> str:
    """A value in Gemma's notation, as its template's format_argument writes it."""
    if isinstance(value, str):
        return QUOTE + value + QUOTE
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{write_value(v)}" for k, v in sorted(value.items())) + "}"
    if isinstance(value, list):
        return "[" + ",".join(write_value(v) for v in value) + "]"
    return json.dumps(value)


def _value_rule(name: str, schema: Any, quote: str) -> str:
    """Lark rule `name`: one argument's value by the JSON types its schema allows (nested
    values are Gemma's notation of any JSON value; the reader checks the whole schema)."""
    if isinstance(schema, dict):
        enum = schema.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            return f"{name}: {quote} (" + " | ".join(lit(v) for v in enum) + f") {quote}"
    types = _types(schema)
    forms = {"string": "gstring", "integer": "gint", "number": "gnumber",
             "boolean": '"true" | "false"', "null": '"null"', "object": "gdict",
             "array": "garray"}
    alts = [forms[t] for t in dict.fromkeys(types) if t in forms]
    return f"{name}: " + (" | ".join(alts) if alts else "gvalue")


def _notation_rules(special: dict[str, int] | None) -> list[str]:
    """Gemma's notation of any JSON value."""
    quote = marker_writer(special)(QUOTE)
    return [
        f"gstring: {quote} gtext",
        free_text("gtext", QUOTE, special),
        "gint: /-?(0|[1-9][0-9]{0,18})/",
        "gnumber: /-?(0|[1-9][0-9]{0,18})(\\.[0-9]{1,18})?([eE][+-]?[0-9]{1,3})?/",
        'gvalue: gstring | gnumber | "true" | "false" | "null" | gdict | garray',
        'gdict: "{" (gkey ":" gvalue ("," gkey ":" gvalue)*)? "}"',
        "gkey: /[A-Za-z_][A-Za-z0-9_]{0,63}/",
        'garray: "[" (gvalue ("," gvalue)*)? "]"',
    ]


def _members_rules(i: int, tool: Tool, quote: str) -> list[str]:
    """Lark rules `members{i}`: the tool's declared arguments, sorted by key as the template
    writes them, each required one present, commas between (None-able: see `_nullable`)."""
    params = tool.parameters or {}
    found = params.get("properties")
    props: dict[str, Any] = found if isinstance(found, dict) else {}
    required = set(params.get("required") or [])
    keys = sorted(props)
    n = len(keys)
    rules = []
    for j, key in enumerate(keys):
        rules.append(f"p{i}_{j}: {lit(key + ':')} v{i}_{j}")
        rules.append(_value_rule(f"v{i}_{j}", props[key], quote))

    def optional(j: int) -> bool:  # whether the members from j on may all be left out
        return all(keys[k] not in required for k in range(j, n))

    def ref(prefix: str, j: int) -> str:
        return "" if j >= n else f" {prefix}{i}_{j}" + ("?" if optional(j) else "")

    for j, key in enumerate(keys):
        first = [f"p{i}_{j}{ref('m', j + 1)}"]
        more = [f'"," p{i}_{j}{ref("m", j + 1)}']
        if key not in required and j + 1 < n:
            first.append(f"f{i}_{j + 1}")
            more.append(f"m{i}_{j + 1}")
        rules.append(f"f{i}_{j}: " + " | ".join(first))
        rules.append(f"m{i}_{j}: " + " | ".join(more))
    body = "" if n == 0 else f"f{i}_0" + ("?" if optional(0) else "")
    rules.append(f'members{i}: "{{" {body} "}}"' if body else f'members{i}: "{{}}"')
    return rules


class Gemma4(Family):
    name = "gemma4"
    markers = (OPEN, CLOSE, QUOTE, *THINK[1:], "<|channel>")
    starts = (OPEN,)
    # what the answer must not hold: an empty thought the model adds after its answer, or
    # a lone end of one (llama.cpp's tests show both), longest first
    _STRAY = ("<|channel>thought\n<channel|>", "<|channel>thought<channel|>", "<channel|>",
              "<|channel>")

    def matches(self, template: str) -> bool:
        return "'<|tool_call>call:'" in template

    def think_pair(self, template: str | None) -> tuple[str, str] | None:
        return THINK

    def splitter(self, pair: tuple[str, str], inside: bool, keep: bool) -> Splitter:
        return Unwrapped(_Trimmed(ThinkStream(pair, inside=inside, keep=keep)), self._STRAY)

    def parse(self, text: str, check: ToolCheck,
              truncated: bool) -> tuple[list[ToolCall], str] | None:
        if nesting(text) > MAX_DEPTH:
            return None
        got = Gathered(text)
        for _ in range(MAX_TRIES):
            m = _HEAD.search(text, got.pos)
            if m is None:
                break
            reader = _Reader(text)
            reader.pos = m.end()
            try:
                args = reader.members()
            except _Cut:
                return got.result(whole=False) if truncated else None
            if not check.accepts(m.group(1), args):
                return None
            got.call(m.start(), past(text, reader.pos, CLOSE), m.group(1), args)
        return got.result()

    def cut(self, text: str, names: set[str]) -> tuple[str, str] | None:
        found = list(_HEAD.finditer(text))[-1:]
        if not found or found[0].group(1) not in names or nesting(text) > MAX_DEPTH:
            return None
        reader = _Reader(text)
        reader.pos = found[0].end()
        done: dict[str, Any] = {}
        with contextlib.suppress(_Cut):
            reader.members(done=done)
        # the members read whole as JSON, the object left open: more may have followed
        # (the last one read may itself be cut: a string's end mark is its end)
        args = json.dumps(done, ensure_ascii=False)
        return found[0].group(1), args[:-1] if done else "{"

    def _rules(self, chosen: list[Tool], special: dict[str, int] | None) -> list[str]:
        mark = marker_writer(special)
        rules = _notation_rules(special)
        for i, tool in enumerate(chosen):
            rules.append(f"tail{i}: {lit(tool.name)} members{i} {mark(CLOSE)}")
            rules += _members_rules(i, tool, mark(QUOTE))
        rules.append(one_of("tail", len(chosen)))
        rules.append(f'call: {mark(OPEN)} "call:" tail')
        return rules

    def grammar(self, plan: ToolPlan, special: dict[str, int] | None = None) -> str | None:
        chosen = choice(plan)
        if chosen is None:
            return None
        return lark("call+" if plan.parallel else "call", self._rules(list(chosen), special))

    def steering(self, plan: ToolPlan, special: dict[str, int] | None = None) -> Steering | None:
        """A call has begun at `<|tool_call>call:` and a tool's name: the grammar starts at
        the name."""
        if plan.choice != "auto":
            return None
        names = "|".join(re.escape(t.name) for t in plan.tools)
        grammar = lark("tail call*" if plan.parallel else "tail",
                       self._rules(list(plan.tools), special))
        return Steering([re.escape(OPEN) + f"call:(?=(?:{names})\\{{)"], grammar)

    def write_calls(self, calls: list[ToolCall], info: TemplateInfo) -> str:
        return "".join(f"{OPEN}call:{c.name}{write_value(c.arguments)}{CLOSE}" for c in calls)


class _Trimmed:
    """A splitter whose thought has the blank after `<|channel>thought` taken off (the
    template writes `<|channel>thought\\n`; llama.cpp's parser skips it too)."""

    def __init__(self, inner: ThinkStream) -> None:
        self.inner = inner
        self._begun = False

    def push(self, text: str) -> tuple[str, str]:
        thought, content = self.inner.push(text)
        return self._trim(thought), content

    def finish(self) -> tuple[str, str]:
        thought, content = self.inner.finish()
        return self._trim(thought), content

    def _trim(self, thought: str) -> str:
        if not self._begun:
            thought = thought.lstrip()
            self._begun = bool(thought)
        return thought


__all__ = ["Gemma4", "write_value"]
