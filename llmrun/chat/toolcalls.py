"""Reading tool calls out of a model's output: the tolerant reader and the stream filter.

Small models do not keep to the format their template asks for (a 0.5B Hermes model wrote
its calls as bare or fenced JSON five times out of five), so one reader, for every family,
accepts what models actually write:

    <tool_call>{"name": ..., "arguments": {...}}</tool_call>   the closing tag may be missing
    [TOOL_CALLS]... / <|python_tag|>... / [f(a=1)]              Mistral, Llama 3 (their families)
    {"name": ..., "arguments": {...}}  or a list of them       bare, or in a ```json, ```tool_call
    {"function": ..., "parameters": ...}                       or ``` fence, text around it
    {"type": "function", "function": {"name": ..., ...}}
    <function=name>{...}</function>

A shape is a call only when its name is one of the request's tools and its arguments
validate against that tool's schema (`ToolCheck`); light repairs are made first (arguments
given as a JSON string, trailing commas). Anything else stays content: an unknown name,
arguments that fail the schema, the JSON a user asked for.

`ToolStream` filters one request's streamed text: what may be the start of a call is held
back until it is plainly not one (released at once) or plainly one (held to the end, then
parsed). What it holds while undecided is a few dozen characters at most.
"""

from __future__ import annotations

import ast
import json
import logging
import re
import secrets
import string
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from llmrun.chat.textstream import partial_match
from llmrun.request import PartialCall, ToolCall

log = logging.getLogger(__name__)

# Deepest bracket nesting a call's JSON may have. Real arguments are a few levels deep; text
# nested deeper is not taken for a call, and never reaches a recursive decoder (Python's json
# raises RecursionError near 1000 levels, which must not escape into the engine thread).
MAX_DEPTH = 100
# Most call-shaped places in one output the reader tries: each try may scan to the end of
# the text, so this bounds the reader's work to a multiple of the output's length.
MAX_TRIES = 64
# Markers that start a call whatever the model's family: a model that writes one means it.
MARKERS = ("<tool_call>", "<|tool_call|>", "<function=", "[TOOL_CALLS]", "<|python_tag|>",
           "functools[")

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.S)
_BRACKET = re.compile(r"[\[\]{}]")
# a string, a lone quote (a string left open), or a bracket
_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|"|[\[\]{}]', re.S)
_TRAILING_COMMA = re.compile(r'("(?:[^"\\]|\\.)*")|,(\s*[}\]])', re.S)
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


def nesting(text: str) -> int:
    """The deepest bracket nesting in `text`, brackets inside strings aside (those of a string
    left unclosed count: erring on the deep side is safe). Linear time, no recursion."""
    depth = deepest = 0
    for m in _BRACKET.finditer(_STRING.sub("", text)):
        if m.group() in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif depth:
            depth -= 1
    return deepest


# -- checking a call against the request's tools ----------------------------------------------

# JSON Schema keywords not checked: regular expressions run by Python's backtracking `re` on
# text a model wrote could take exponential time (ReDoS), and `uniqueItems` can take
# quadratic time; the grammar, where it steers a call, enforces them in linear time.
_UNCHECKED = ("pattern", "patternProperties", "uniqueItems", "format")


@lru_cache(maxsize=8)
def _safe_validator(base: type) -> type:
    from jsonschema import validators

    return validators.extend(base, {k: lambda *_: None for k in _UNCHECKED})


class ToolCheck:
    """The request's tools as the reader checks calls against them: a known name, and
    arguments valid under that tool's parameters schema (None: any object)."""

    def __init__(self, schemas: Mapping[str, dict[str, Any] | None]) -> None:
        self.schemas = dict(schemas)
        self._validators: dict[str, Any] = {}

    @classmethod
    def of(cls, tools: Iterable[Any]) -> ToolCheck:
        """From `request.Tool`s."""
        return cls({t.name: t.parameters for t in tools})

    @property
    def names(self) -> set[str]:
        return set(self.schemas)

    def accepts(self, name: str, arguments: dict[str, Any]) -> bool:
        if name not in self.schemas:
            return False
        schema = self.schemas[name]
        if not schema:
            return True
        try:
            if name not in self._validators:
                self._validators[name] = self._validator(schema)
            return bool(self._validators[name].is_valid(arguments))
        except Exception as exc:  # a schema jsonschema cannot use: the name decides
            log.debug("tool %r: its schema cannot be checked (%s)", name, exc)
            return True

    @staticmethod
    def _validator(schema: dict[str, Any]) -> Any:
        from jsonschema import validators

        from llmrun.chat.schema import prepare_schema

        base = validators.validator_for(schema, default=validators.Draft202012Validator)
        return _safe_validator(base)(prepare_schema(schema))


# -- decoding ---------------------------------------------------------------------------------


def _balanced(text: str, i: int) -> int | None:
    """The end of the JSON object or list that opens at `text[i]` (brackets in strings
    aside), or None when it does not close. Linear, no recursion."""
    depth = 0
    for m in _JSON_TOKEN.finditer(text, i):
        t = m.group()
        if t[0] == '"':
            if len(t) == 1:
                return None  # a string left open
            continue
        depth += 1 if t in "[{" else -1
        if depth == 0:
            return m.end()
        if depth < 0:
            return None
    return None


def _loads(text: str) -> Any:
    """JSON, or with trailing commas removed (a light repair); raises ValueError."""
    try:
        return json.loads(text)
    except ValueError:
        fixed = _TRAILING_COMMA.sub(lambda m: m.group(1) or m.group(2), text)
        if fixed == text:
            raise
        return json.loads(fixed)


def _arguments(value: Any) -> dict[str, Any] | None:
    if value is None or value == "":
        return {}
    if isinstance(value, str):  # arguments given as a JSON string (OpenAI's wire form)
        if nesting(value) > MAX_DEPTH:
            return None
        try:
            value = _loads(value)
        except (ValueError, RecursionError):
            return None
    return value if isinstance(value, dict) else None


def _call(obj: Any, check: ToolCheck) -> ToolCall | None:
    """A call from a decoded JSON object, if it names one of the tools with valid arguments."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):
        obj = obj["function"]  # {"type": "function", "function": {...}}
    name = obj.get("name", obj.get("function"))
    if not isinstance(name, str) or not name:
        return None
    args = _arguments(obj.get("arguments", obj.get("parameters")))
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


def _json_values(text: str, truncated: bool = False) -> list[Any] | None:
    """The JSON values in `text` (inside a fence or not), separated by whitespace, commas or
    semicolons; lists are flattened. None if anything else is there (`truncated`: except a
    broken tail after at least one whole value, where generation was cut off)."""
    m = re.fullmatch(r"\s*```[\w-]*\s*(.*?)\s*(?:```\s*)?", text, re.S)
    s = (m.group(1) if m else text).strip()
    out: list[Any] = []
    i = 0
    while True:
        while i < len(s) and s[i] in " \t\r\n,;":
            i += 1
        if i >= len(s):
            break
        end = _balanced(s, i) if s[i] in "[{" else None
        try:
            if end is None:
                raise ValueError("not an object or list, or not closed")
            value = _loads(s[i:end])
        except ValueError:
            if truncated and out:
                break
            if truncated and s[i] == "[":  # a list cut short: its whole items
                return _json_values(s[i + 1:], truncated=True)
            return None
        i = end
        out.extend(value if isinstance(value, list) else [value])
    return out or None


# -- the reader ------------------------------------------------------------------------------


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
            found = _calls(_json_values(body, cut), check)
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
            end = _balanced(body, start) if m and body[start:start + 1] == "{" else None
            try:
                args = _loads(body[start:end]) if end is not None else None
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
        calls = _calls(_json_values(text[m.end():len(text) if close == -1 else close]), check)
        return (end, calls) if calls else None
    if token == "<function=":  # <function=name>{...}</function>
        tag = _FUNCTION_TAG.match(text, start)
        if tag is None or text[tag.end():tag.end() + 1] != "{":
            return None
        end = _balanced(text, tag.end())
        if end is None:
            return None
        try:
            args = _loads(text[tag.end():end])
        except ValueError:
            return None
        if not isinstance(args, dict) or not check.accepts(tag.group(1), args):
            return None
        return end, [ToolCall(id=new_call_id(), name=tag.group(1), arguments=args)]
    end = _balanced(text, start)  # a JSON object, or a list of them
    if end is None:
        return None
    try:
        value = _loads(text[start:end])
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


def _whole_object(text: str) -> dict[str, Any] | None:
    """The JSON object `text` opens with, if it closes (what follows it aside)."""
    s = text.lstrip()
    end = _balanced(s, 0) if s.startswith("{") else None
    if end is None or nesting(s[:end]) > MAX_DEPTH:
        return None
    try:
        value = _loads(s[:end])
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


# -- streaming --------------------------------------------------------------------------------

NO, MAYBE, YES = 0, 1, 2
# What may begin a call in streamed text: held back from here while undecided.
_STARTS = re.compile(r"[{\[`<]|functools\[")
# a fence a call may come in: ```json, ```tool_call (or ```tool_code ...), or no language
_FENCE_OPEN = re.compile(r"```(?:json|tool[\w-]{0,16})?[ \t]*\n")
_FENCE_PARTIAL = re.compile(r"`{1,3}|```(?:j|js|jso|json|t|to|too|tool[\w-]{0,16})?[ \t]*")
_SHAPE_WINDOW = 300  # characters of undecided text looked at; longer is not a call's start


@lru_cache(maxsize=64)
def _heads(names: frozenset[str], pythonic: bool) -> tuple[str, ...]:
    """How a call of one of `names` begins, whitespace removed."""
    out = []
    for name in sorted(names):
        n = json.dumps(name, ensure_ascii=False)
        for head in ('{"name":' + n, '{"function":' + n, '{"function":{"name":' + n,
                     '{"type":"function","function":{"name":' + n):
            out += [head, "[" + head]
        if pythonic:
            out.append(f"[{name}(")
    return tuple(out)


def shape(text: str, names: frozenset[str], pythonic: bool = False) -> int:
    """Whether `text` (which starts where a call might) begins a call of one of `names`: YES,
    NO, or MAYBE while too little of it is there to tell."""
    for marker in MARKERS:
        if text.startswith(marker):
            return YES
        if marker.startswith(text):
            return MAYBE
    head = text[:_SHAPE_WINDOW]
    if head.startswith("`"):
        fence = _FENCE_OPEN.match(head)
        if fence is None:
            return MAYBE if _FENCE_PARTIAL.fullmatch(head) else NO
        head = head[fence.end():]
    compact = "".join(head.split())
    if not compact:
        return MAYBE if len(text) < _SHAPE_WINDOW else NO
    undecided = NO
    for call in _heads(names, pythonic):
        if compact.startswith(call):
            return YES
        if call.startswith(compact) and len(text) < _SHAPE_WINDOW:
            undecided = MAYBE
    return undecided


@dataclass
class Finished:
    text: str
    logprobs: list[Any]
    calls: list[ToolCall]
    partial: PartialCall | None = None  # a call the token limit cut off (no whole ones)


def _distinct(calls: list[ToolCall]) -> list[ToolCall]:
    """Calls without exact repeats (same function, same arguments): small models, greedy
    ones especially, tend to repeat a call until the token limit."""
    seen: set[str] = set()
    out = []
    for call in calls:
        key = json.dumps([call.name, call.arguments], sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(call)
    return out


@dataclass
class ToolStream:
    """Filters one request's streamed text: text is released as it comes, except from a
    point where a call may begin (`shape`): held while undecided, released the moment it
    is not a call, held to the end once it is one, then parsed. Text that was not a call
    after all is released then. Logprob entries travel with the text of their tokens.

    A call the token limit cut off is never released as text: it ends as a `PartialCall`
    (or, when its arguments were whole and only the call's closing was cut, as a call).
    `forced`: a grammar made the whole output a call (tool_choice required or named), so
    none of it is text even when the cut came before the tool's name was whole; `only`: the
    one tool such a call can name (a named choice, or a single tool), whose name it then
    is."""

    family: str
    check: ToolCheck
    parallel: bool = True
    forced: bool = False
    only: str | None = None
    _pieces: list[tuple[str, list[Any]]] = field(default_factory=list)
    _capturing: bool = False

    def __post_init__(self) -> None:
        self._names = frozenset(self.check.names)
        self._pythonic = self.family == "llama3"

    def _held(self) -> str:
        return "".join(t for t, _ in self._pieces)

    def push(self, text: str, logprobs: list[Any] | None = None) -> tuple[str, list[Any]]:
        """Add generated text; return (text, logprob entries) that can be released now."""
        self._pieces.append((text, list(logprobs or ())))
        if self._capturing:
            return "", []
        held = self._held()
        i = 0
        while (m := _STARTS.search(held, i)) is not None:
            verdict = shape(held[m.start():], self._names, self._pythonic)
            if verdict == YES:
                self._capturing = True
                return self._release(m.start())
            if verdict == MAYBE:
                return self._release(m.start())
            i = m.start() + 1
        return self._release(len(held) - partial_match(held, MARKERS))

    def _release(self, n: int) -> tuple[str, list[Any]]:
        out: list[str] = []
        lps: list[Any] = []
        keep: list[tuple[str, list[Any]]] = []
        count = 0
        for text, entries in self._pieces:
            if count >= n and (text or keep):
                keep.append((text, entries))
            elif count + len(text) <= n:
                out.append(text)
                lps += entries
                count += len(text)
            else:
                cut = n - count
                out.append(text[:cut])
                lps += entries
                keep.append((text[cut:], []))
                count = n
        self._pieces = keep
        return "".join(out), lps

    def finish(self, truncated: bool = False) -> Finished:
        """The end of generation (`truncated`: by the token limit): the calls, and whatever
        text is still held."""
        held = self._held()
        lps = [e for _, entries in self._pieces for e in entries]
        self._pieces = []
        if self._capturing:
            parsed = parse_calls(held, self.family, self.check, truncated)
            if parsed is not None:
                calls, rest = parsed
                return Finished(rest, lps, _distinct(calls) if self.parallel else calls[:1])
        if truncated and (self._capturing or self.forced):
            cut = cut_call(held, self._names, begun=not self.forced)
            if cut is None and self.forced and self.only is not None and held.strip():
                cut = self.only, ""  # cut before its name was whole (a thought: not begun)
            if cut is not None:
                name, args = cut
                whole = _whole_object(args)
                if whole is not None and self.check.accepts(name, whole):
                    # only the call's own closing (`}`, `</tool_call>`) was cut
                    return Finished("", lps, [ToolCall(id=new_call_id(), name=name,
                                                       arguments=whole)])
                return Finished("", lps, [], PartialCall(id=new_call_id(), name=name,
                                                         arguments=args))
            if self.forced:  # cut before the name of one of several tools was whole
                return Finished("", lps, [])
        return Finished(held, lps, [])


def filter_events(streams: dict[str, ToolStream],
                  events: list[tuple[str, str, Any]]) -> list[tuple[str, str, Any]]:
    """Pass runner events through the `streams` of tool-enabled requests.

    Chunk payloads are `{"text", "logprobs"?}` as the engine makes them (a thought's,
    `{"text": "", "thinking"}`, passes: see thinking.py); the parsed calls leave as one chunk
    whose payload is `{"text", "tool_calls", "logprobs"?}`, and the done event's
    finish_reason becomes "tool_calls"; a call the token limit cut off leaves as
    `{"text": "", "partial_call"}` before a done event whose finish_reason stays "length".
    A finished request leaves `streams`."""
    out: list[tuple[str, str, Any]] = []
    for event in events:
        rid, kind, payload = event
        stream = streams.get(rid)
        if stream is None or (kind == "chunk" and ("thinking" in payload
                                                   or "prompt_logprobs" in payload)):
            out.append(event)
        elif kind == "chunk":
            lps = payload.get("logprobs")
            text, lps = stream.push(payload["text"], lps)
            if "logprobs" in payload and (text or lps):
                out.append((rid, kind, {"text": text, "logprobs": lps}))
            elif text:
                out.append((rid, kind, {"text": text}))
        elif kind == "done":
            streams.pop(rid, None)
            if payload.get("finish_reason") == "cancel":
                out.append(event)
                continue
            end = stream.finish(truncated=payload.get("finish_reason") == "length")
            if end.calls:
                chunk: dict[str, Any] = {"text": end.text,
                                         "tool_calls": [c.model_dump() for c in end.calls]}
                if end.logprobs:
                    chunk["logprobs"] = end.logprobs
                out.append((rid, "chunk", chunk))
                # "length" too: what was cut off was a further call, dropped; these are whole
                if payload.get("finish_reason") in ("stop", "length"):
                    payload = {**payload, "finish_reason": "tool_calls"}
            elif end.partial is not None:  # finish_reason stays "length"
                chunk = {"text": "", "partial_call": end.partial.model_dump()}
                if end.logprobs:
                    chunk["logprobs"] = end.logprobs
                out.append((rid, "chunk", chunk))
            elif end.text or end.logprobs:
                out.append((rid, "chunk", {"text": end.text, "logprobs": end.logprobs}
                            if end.logprobs else {"text": end.text}))
            out.append((rid, kind, payload))
        else:
            if kind == "error":
                streams.pop(rid, None)
            out.append(event)
    return out
