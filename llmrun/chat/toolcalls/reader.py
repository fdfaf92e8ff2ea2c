"""Reading tool calls out of a model's whole output, in every form models write (the
package's docstring lists them): calls of the request's tools with valid arguments, and the
text around them."""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
from collections.abc import Iterable
from typing import Any

from llmrun.chat.toolcalls.check import ToolCheck
from llmrun.chat.toolcalls.jsontext import (
    MAX_DEPTH,
    arguments,
    balanced,
    json_values,
    loads,
    nesting,
)
from llmrun.request import ToolCall

# Most call-shaped places in one output the reader tries: each try may scan to the end of
# the text, so this bounds the reader's work to a multiple of the output's length.
MAX_TRIES = 64
# Markers that start a call whatever the model's family: a model that writes one means it.
MARKERS = ("<tool_call>", "<|tool_call|>", "<function=", "[TOOL_CALLS]", "<|python_tag|>",
           "functools[")

# where a call may begin (JSON keys a call object starts with, or a marker)
_CANDIDATE = re.compile(
    r'<tool_call>|<\|tool_call\|>|<function=|(?:\[\s*)?\{\s*"(?:name|function|type)"\s*:')
_BLOCK_END = {"<tool_call>": "</tool_call>", "<|tool_call|>": "<|/tool_call|>"}
_FUNCTION_TAG = re.compile(r"<function=([\w.\-]+)>\s*")
# what may wrap a call: a fence's first line (or Llama's `functools` prefix) before it...
_OPENER = re.compile(r"(?:```[\w-]*[ \t]*\n?[ \t]*|functools[ \t]*)$")
_OPENER_WINDOW = 40
# ... and a fence's end, a closing tag or a list's end after it
_CLOSER = re.compile(r"\s*(?:```|</tool_call>|</function>|\])")
_ONLY_SEPARATORS = re.compile(r"[\s,;\[\]{}]*")


def new_call_id() -> str:
    alphabet = string.ascii_letters + string.digits
    return "call_" + "".join(secrets.choice(alphabet) for _ in range(24))


def _call(obj: Any, check: ToolCheck) -> ToolCall | None:
    """A call from a decoded JSON object, if it names one of the tools with valid arguments."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):
        obj = obj["function"]  # {"type": "function", "function": {...}}
    name = obj.get("name", obj.get("function"))
    if not isinstance(name, str) or not name:
        return None
    args = arguments(obj.get("arguments", obj.get("parameters")))
    if args is None or not check.accepts(name, args):
        return None
    return ToolCall(id=new_call_id(), name=name, arguments=args)


def _calls(values: list[Any] | None, check: ToolCheck) -> list[ToolCall] | None:
    """Calls from decoded values, or None unless every one of them is a call."""
    if not values:
        return None
    calls = [_call(v, check) for v in values]
    if any(c is None for c in calls):
        return None
    return [c for c in calls if c is not None]


def _pythonic(text: str, check: ToolCheck) -> list[ToolCall] | None:
    """`[f(a=1), g(b="x")]` (Llama 3.2+): parsed, never evaluated."""
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    items = tree.body.elts if isinstance(tree.body, ast.List) else [tree.body]
    calls = []
    for item in items:
        if not isinstance(item, ast.Call) or item.args:
            return None
        try:
            name = ast.unparse(item.func)
            args = {kw.arg: ast.literal_eval(kw.value) for kw in item.keywords if kw.arg}
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
        if not re.fullmatch(r"[\w.]+", name) or not check.accepts(name, args):
            return None
        calls.append(ToolCall(id=new_call_id(), name=name, arguments=args))
    return calls or None


_MISTRAL_ARGS = re.compile(r"\s*([^\s\[\]{}]+)\s*(?:\[CALL_ID\]\s*([^\s\[]+)\s*)?\[ARGS\]")


def _mistral(text: str, check: ToolCheck, truncated: bool) -> tuple[list[ToolCall], str] | None:
    """`[TOOL_CALLS][{...}, ...]` or `[TOOL_CALLS]name[ARGS]{...}` (Mistral, Devstral)."""
    head, *parts = text.split("[TOOL_CALLS]")
    calls: list[ToolCall] = []
    for n, part in enumerate(parts):
        body = part.strip()
        cut = truncated and n == len(parts) - 1  # this part may end mid-call
        if not body:
            continue
        if body[0] in "[{":
            found = _calls(json_values(body, cut), check)
            if found is None:
                return None
            calls += found
            continue
        pos = 0  # name[ARGS]{...}, maybe several in a row
        while pos < len(body):
            m = _MISTRAL_ARGS.match(body, pos)
            start = m.end() if m else 0
            while m and start < len(body) and body[start].isspace():
                start += 1
            end = balanced(body, start) if m and body[start:start + 1] == "{" else None
            try:
                args = loads(body[start:end]) if end is not None else None
            except ValueError:
                args = None
            if m is None or not isinstance(args, dict) or end is None:
                if cut and calls:
                    break
                return None
            if not check.accepts(m.group(1), args):
                return None
            calls.append(ToolCall(id=new_call_id(), name=m.group(1), arguments=args))
            pos = end
            while pos < len(body) and body[pos].isspace():
                pos += 1
    return (calls, head.strip()) if calls else None


def _at(text: str, m: re.Match[str], check: ToolCheck) -> tuple[int, list[ToolCall]] | None:
    """The calls of the call-shaped place `m` found, and where it ends; None if not calls."""
    start, token = m.start(), m.group()
    end: int | None  # None: no balanced end (_balanced)
    if token in _BLOCK_END:  # <tool_call> ... </tool_call>, the end tag may be missing
        close = text.find(_BLOCK_END[token], m.end())
        end = len(text) if close == -1 else close + len(_BLOCK_END[token])
        calls = _calls(json_values(text[m.end():len(text) if close == -1 else close]), check)
        return (end, calls) if calls else None
    if token == "<function=":  # <function=name>{...}</function>
        tag = _FUNCTION_TAG.match(text, start)
        if tag is None or text[tag.end():tag.end() + 1] != "{":
            return None
        end = balanced(text, tag.end())
        if end is None:
            return None
        try:
            args = loads(text[tag.end():end])
        except ValueError:
            return None
        if not isinstance(args, dict) or not check.accepts(tag.group(1), args):
            return None
        return end, [ToolCall(id=new_call_id(), name=tag.group(1), arguments=args)]
    end = balanced(text, start)  # a JSON object, or a list of them
    if end is None:
        return None
    try:
        value = loads(text[start:end])
    except ValueError:
        return None
    calls = _calls(value if isinstance(value, list) else [value], check)
    return (end, calls) if calls else None


def _scan(text: str, check: ToolCheck, truncated: bool) -> tuple[list[ToolCall], str] | None:
    """Every call-shaped place in `text` that holds calls, and the text around them (fences
    and tags that wrapped a call removed)."""
    calls: list[ToolCall] = []
    rest: list[str] = []
    pos = 0  # the text before this is taken (into calls or rest)
    search = 0
    failed = -1  # the first place since the last call that held none
    for _ in range(MAX_TRIES):
        m = _CANDIDATE.search(text, search)
        if m is None:
            break
        found = _at(text, m, check)
        if found is None:
            failed = m.start() if failed < pos else failed
            search = m.start() + 1
            continue
        end, got = found
        opener = _OPENER.search(text, max(pos, m.start() - _OPENER_WINDOW), m.start())
        start = opener.start() if opener else m.start()
        closer = _CLOSER.match(text, end)
        rest.append(text[pos:start])
        calls += got
        pos = search = closer.end() if closer else end
    if not calls:
        return None
    tail = text[pos:]
    if truncated and failed >= pos:  # generation was cut off in a further call: drop it
        tail = text[pos:failed]
    rest.append(tail)
    content = "".join(rest).strip()
    return calls, "" if _ONLY_SEPARATORS.fullmatch(content) else content


def parse_calls(text: str, family: str, check: ToolCheck,
                truncated: bool = False) -> tuple[list[ToolCall], str] | None:
    """(calls, other text) from a model's output, or None if it holds no call of one of the
    tools with valid arguments. `family`: the template's (tools.TemplateInfo), which adds
    its own forms (Mistral's, Llama's pythonic lists). `truncated`: the output was cut off
    (length): a broken last call after whole ones is dropped. Text nested deeper than
    MAX_DEPTH holds no call."""
    if nesting(text) > MAX_DEPTH:
        return None
    try:
        if "[TOOL_CALLS]" in text:
            found = _mistral(text, check, truncated)
            if found is not None:
                return found
        if family == "llama3":
            body = text.replace("<|python_tag|>", " ").strip()
            if body.startswith("["):
                calls = _pythonic(body, check)
                if calls:
                    return calls, ""
            text = body
        return _scan(text, check, truncated)
    except RecursionError:  # bounded above; this is the last line of defence
        return None


# The head of a call whose name is written whole, in the reader's forms: a JSON object's
# name (the arguments' key maybe after it), `<function=name>`, Mistral's `name[ARGS]`. A
# name is a short string: bounded, so a quote left open costs no scan to the end per try.
_CALL_HEAD = re.compile(
    r'\{\s*"(?:name|function)"\s*:\s*("(?:[^"\\\n]|\\.){1,256}")'
    r'(\s*,\s*"(?:arguments|parameters)"\s*:\s*)?'
    r'|<function=([\w.\-]+)>\s*'
    r'|\[TOOL_CALLS\]\s*([^\s\[\]{}"]+)\s*(?:\[CALL_ID\]\s*[^\s\[]+\s*)?\[ARGS\]\s*')


def cut_call(text: str, names: Iterable[str], begun: bool = True) -> tuple[str, str] | None:
    """(name, the arguments' text so far) of the last call begun in `text`, an output the
    token limit cut off; None when no call of one of `names` has its name written whole.
    `begun`: only a call whose arguments had begun (a name alone is also what a model
    echoing the tool list writes); False where a grammar forced the call, so a name is
    one."""
    names = set(names)
    found: tuple[str, str] | None = None
    for n, m in enumerate(_CALL_HEAD.finditer(text)):
        if n >= MAX_TRIES:
            break
        if m.group(1) is not None:
            try:
                name = json.loads(m.group(1))
            except ValueError:
                continue
            if m.group(2) is None and begun:
                continue
            args = text[m.end():] if m.group(2) is not None else ""
        else:
            name = m.group(3) or m.group(4)
            args = text[m.end():]
        if name in names:
            found = name, args.rstrip()
    return found
