"""Families that write calls as a Python list of keyword calls between markers:

    LFM2, LFM2.5   <|tool_call_start|>[NAME(key="v", n=3), OTHER(flag=True)]<|tool_call_end|>
                   thoughts (LFM2.5 8B) in <think>

A call is read with Python's `ast` on a bounded text and its values taken as literals only,
never evaluated: Python's (True, None, tuples) and JSON's (true, false, null), which LFM2
models write too (llama.cpp's LFM2 parser accepts both). Positional arguments, calls within
values, names and operators are not a call.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from llmrun.chat.formats.base import Family, choice, lark, lit, marker_writer, one_of
from llmrun.chat.toolcalls import ToolCheck, new_call_id
from llmrun.chat.toolcalls.jsontext import MAX_DEPTH, nesting
from llmrun.chat.tools import Steering, TemplateInfo, ToolPlan
from llmrun.request import Tool, ToolCall
from llmrun.structured.prepare import JSON_OPTIONS, prepare_schema

# Longest call list given to the parser: `ast` builds a tree of the whole text, so what
# reaches it is bounded (real calls are a few kilobytes; a longer one stays text).
MAX_TEXT = 200_000
_NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False,
          "null": None}
_NAME = re.compile(r"[A-Za-z_][\w.\-]{0,255}")
_HEAD = re.compile(r"\s*,?\s*([A-Za-z_][\w.\-]{0,255})\(")
_CUT_TRIES = 4


class NotLiteral(ValueError):
    pass


def literal(node: ast.AST) -> Any:
    """A literal's value as JSON data (tuples as lists); NotLiteral for anything else.
    Depth is bounded by the caller (the text's nesting)."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(
            node.value, (str, int, float, bool))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) \
            and isinstance(node.operand, ast.Constant):
        number = node.operand.value
        if isinstance(number, (int, float)) and not isinstance(number, bool):
            return -number if isinstance(node.op, ast.USub) else number
    if isinstance(node, (ast.List, ast.Tuple)):
        return [literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values, strict=True):
            key = literal(k) if k is not None else None
            if not isinstance(key, str):
                raise NotLiteral("a key that is not a string")
            out[key] = literal(v)
        return out
    raise NotLiteral(type(node).__name__)


def _call(node: ast.AST) -> tuple[str, dict[str, Any]] | None:
    if not isinstance(node, ast.Call) or node.args:
        return None
    name = ast.unparse(node.func) if isinstance(node.func, (ast.Name, ast.Attribute)) else ""
    if not _NAME.fullmatch(name) or any(kw.arg is None for kw in node.keywords):
        return None
    try:
        return name, {kw.arg: literal(kw.value) for kw in node.keywords if kw.arg}
    except (NotLiteral, RecursionError):
        return None


def read_list(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    """The calls of `[f(a=1), g(b="x")]` (or one call without the list), or None."""
    if len(text) > MAX_TEXT or nesting(text) > MAX_DEPTH:
        return None
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    items = tree.body.elts if isinstance(tree.body, ast.List) else [tree.body]
    calls = [_call(item) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def call_ends(text: str, start: int) -> tuple[list[int], list[int]]:
    """(where each call of the list opening at `text[start]` ends, after its `)`; where
    each of the last call's top-level arguments ends, at its `,`), strings aside: one
    linear pass, what a cut list's whole calls and arguments are read from."""
    ends: list[int] = []
    args: list[int] = []
    depth = 0
    quote = ""
    i = start
    while i < len(text):
        ch = text[i]
        if quote:
            if ch == "\\":
                i += 1
            elif text.startswith(quote, i):
                i += len(quote) - 1
                quote = ""
        elif ch in "\"'":
            quote = ch * 3 if text.startswith(ch * 3, i) else ch
            i += len(quote) - 1
        elif ch in "([{":
            depth += 1
            if depth == 2:
                args = []
        elif ch in ")]}":
            depth -= 1
            if depth == 1 and ch == ")":
                ends.append(i + 1)
            if depth <= 0:
                break
        elif ch == "," and depth == 2:
            args.append(i)
        i += 1
    return ends, args


class LFM2(Family):
    name = "lfm2"
    open = "<|tool_call_start|>"
    close = "<|tool_call_end|>"
    markers = (open, close)
    starts = (open,)

    def matches(self, template: str) -> bool:
        # LFM2 lists the tools between `<|tool_list_start|>` tokens; LFM2.5's templates
        # write a plain "List of tools: [" (llama.cpp tells them apart the same way), and
        # both call in `<|tool_call_start|>` lists.
        return "<|tool_list_start|>" in template or "List of tools: [" in template

    def parse(self, text: str, check: ToolCheck,
              truncated: bool) -> tuple[list[ToolCall], str] | None:
        start = text.find(self.open)
        if start == -1:
            return None
        body_at = start + len(self.open)
        end = text.find(self.close, body_at)
        body = text[body_at:] if end == -1 else text[body_at:end]
        tail = "" if end == -1 else text[end + len(self.close):]
        found = read_list(body)
        if found is None and truncated and end == -1 and body.lstrip().startswith("["):
            # cut by the token limit: the whole calls, a further one dropped
            lead = body_at + body.index("[")
            whole, _ = call_ends(text, lead)
            found = read_list(text[lead:whole[-1]] + "]") if whole else None
        if found is None or not all(check.accepts(n, a) for n, a in found):
            return None
        calls = [ToolCall(id=new_call_id(), name=n, arguments=a) for n, a in found]
        return calls, (text[:start].strip() + " " + tail.strip()).strip()

    def cut(self, text: str, names: set[str]) -> tuple[str, str] | None:
        start = text.rfind(self.open)
        lead = text.find("[", start) if start != -1 else -1
        if lead == -1 or text[start + len(self.open):lead].strip():
            return None
        whole, commas = call_ends(text, lead)
        at = whole[-1] if whole else lead + 1
        m = _HEAD.match(text, at)
        if m is None or m.group(1) not in names:
            return None
        args: dict[str, Any] = {}
        # the arguments written whole, longest first (a few tries: each parses the call)
        for comma in list(reversed(commas))[:_CUT_TRIES]:
            parsed = read_list(text[m.start(1):comma] + ")")
            if parsed:
                args = parsed[0][1]
                break
        written = json.dumps(args, ensure_ascii=False)
        return m.group(1), written[:-1] if args else "{"

    def _rules(self, tools: list[Tool], parallel: bool, strict: bool,
               special: dict[str, int] | None) -> list[str]:
        """Rule `calls`: the list's calls, `]` and the closing marker. Values are JSON
        (by each parameter's schema): a Python literal too, but for true/false/null, which
        the reader takes."""
        rules: list[str] = []
        for i, tool in enumerate(tools):
            props = list(((tool.parameters or {}).get("properties") or {}).items())
            required = set((tool.parameters or {}).get("required") or [])
            for k, (key, schema) in enumerate(props):
                rules.append(f"v{i}_{k}: %json {_value_schema(schema, strict)}")
                rules.append(f"p{i}_{k}: {lit(key + '=')} v{i}_{k}")
            # any in-order run of the parameters, the required ones among it, joined by
            # ", ": `first` before one is written, `more` after
            n = len(props)
            for k in range(n + 1):
                if k == n:
                    rules += [f"first{i}_{k}: \"\"", f"more{i}_{k}: \"\""]
                    continue
                skip = props[k][0] not in required
                rules.append(f"first{i}_{k}: p{i}_{k} more{i}_{k + 1}"
                             + (f" | first{i}_{k + 1}" if skip else ""))
                rules.append(f'more{i}_{k}: ", " p{i}_{k} more{i}_{k + 1}'
                             + (f" | more{i}_{k + 1}" if skip else ""))
            rules.append(f"call{i}: {lit(tool.name + '(')} first{i}_0 \")\"")
        rules.append(one_of("call", len(tools)))
        more = ' (", " call)*' if parallel else ""
        rules.append(f'calls: call{more} "]" {marker_writer(special)(self.close)}')
        return rules

    def grammar(self, plan: ToolPlan, special: dict[str, int] | None = None) -> str | None:
        chosen = choice(plan)
        if chosen is None:
            return None
        return lark(f'{marker_writer(special)(self.open)} "[" calls',
                    self._rules(chosen, plan.parallel, plan.strict, special))

    def steering(self, plan: ToolPlan, special: dict[str, int] | None = None) -> Steering | None:
        """The opening marker starts the grammar: the list and the closing marker."""
        if plan.choice != "auto":
            return None
        grammar = lark('"[" calls', self._rules(list(plan.tools), plan.parallel, plan.strict,
                                                special))
        return Steering([re.escape(self.open)], grammar)

    def write_calls(self, calls: list[ToolCall], info: TemplateInfo) -> str:
        return self.open + "[" + ", ".join(
            c.name + "(" + ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}"
                                     for k, v in c.arguments.items()) + ")"
            for c in calls) + "]" + self.close


def _value_schema(schema: Any, strict: bool) -> str:
    """A parameter's JSON schema for `%json` (any JSON where it refers elsewhere)."""
    if not isinstance(schema, dict) or "$ref" in json.dumps(schema):
        schema = {}
    body = {**prepare_schema(schema), "x-guidance": {**JSON_OPTIONS, "lenient": not strict}}
    return json.dumps(body, allow_nan=False)
