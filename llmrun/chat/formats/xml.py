"""Families that write each argument as text between tags, converted by the tool's schema:

    Qwen3-Coder  <tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nvalue\\n</parameter>\\n
                 </function>\\n</tool_call>                      (Qwen 3.5 writes the same)
    GLM 4.6/4.7  <tool_call>NAME\\n<arg_key>KEY</arg_key>\\n<arg_value>value</arg_value>\\n
                 </tool_call>                                       thoughts in <think>
    Seed-OSS     Qwen3-Coder's calls in <seed:tool_call>, values against their tags;
                 thoughts in <seed:think>
    Tencent Hy3  GLM's, every tag `:opensource`, a separator after the name, in one
                 <tool_calls:opensource> block; thoughts in <think:opensource>
    Ling 3.0     GLM's; a call also ends the thought the prompt opened

A value arrives as text; the tool's schema for that parameter says what it is, as the
models' own parsers read it: integer, number, boolean and null by their JSON spelling, an
object or array parsed as JSON, anything else (and a value that does not parse as its
type) kept as the string.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from llmrun.chat.formats.base import (
    Family,
    Gathered,
    choice,
    lark,
    lit,
    marker_writer,
    one_of,
)
from llmrun.chat.textstream import partial_match
from llmrun.chat.thinking import Splitter, ThinkStream
from llmrun.chat.toolcalls import MAX_TRIES, ToolCheck
from llmrun.chat.tools import Steering, TemplateInfo, ToolPlan
from llmrun.request import Tool, ToolCall
from llmrun.structured.prepare import JSON_OPTIONS, prepare_schema

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")


def _types(schema: Any) -> list[str]:
    """The JSON types a parameter's schema allows (its `anyOf`/`oneOf` members' too)."""
    if not isinstance(schema, dict):
        return []
    t = schema.get("type")
    out = [t] if isinstance(t, str) else [x for x in t if isinstance(x, str)] \
        if isinstance(t, list) else []
    for key in ("anyOf", "oneOf"):
        for sub in schema.get(key) or []:
            out += _types(sub)
    if not out and "enum" in schema:
        out = ["string"] if all(isinstance(v, str) for v in schema["enum"]) else []
    return out


def convert(value: str, schema: Any) -> Any:
    """A parameter's text as the value its schema's type says (see the module's doc)."""
    types = _types(schema)
    text = value.strip()
    for t in types:
        if t == "integer" and re.fullmatch(r"-?\d{1,300}", text):
            return int(text)
        if t == "number" and _NUMBER.fullmatch(text) and len(text) <= 300:
            number = float(text)
            return int(number) if number.is_integer() and "." not in text and "e" not in \
                text.lower() else number
        if t == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if t == "null" and text == "null":
            return None
        if t in ("object", "array") and text[:1] in "{[":
            try:
                parsed = json.loads(text)
            except (ValueError, RecursionError):
                continue
            if isinstance(parsed, dict if t == "object" else list):
                return parsed
    return value


def _properties(tool: Tool) -> dict[str, Any]:
    props = (tool.parameters or {}).get("properties")
    return props if isinstance(props, dict) else {}


class Tagged(Family):
    """What Qwen3-Coder's and GLM's forms share: a call is a name and (key, value) pairs."""

    def _pairs(self, body: str, whole_only: bool = False) -> list[tuple[str, str]] | None:
        """The (key, value) pairs of a call's body; None if it holds anything else.
        `whole_only`: those written whole, of a body the token limit cut."""
        raise NotImplementedError

    # a call: its name (group 1), its body (group 2), its closing tag (group 3, where
    # written); a family whose pattern reads otherwise overrides `_calls_at`
    _CALL: re.Pattern[str]

    def _calls_at(self, text: str) -> list[tuple[int, int, str, str, bool]]:
        """(start, end, name, body, closed) of each call in `text`."""
        return [(m.start(), m.end(), m.group(1), m.group(2), m.group(3) is not None)
                for m in self._CALL.finditer(text)]

    # the steering trigger, a pattern with `{names}` for the tools' names (escaped, joined)
    trigger = ""

    def _rules(self, chosen: list[Tool], strict: bool,
               special: dict[str, int] | None) -> list[str]:
        """The grammar's rules for calls to `chosen`: `call`, and `tail` (what follows the
        trigger)."""
        raise NotImplementedError

    def grammar(self, plan: ToolPlan, special: dict[str, int] | None = None) -> str | None:
        chosen = choice(plan)
        if chosen is None:
            return None
        root = 'call ("\\n" call)*' if plan.parallel else "call"
        return lark(root, self._rules(chosen, plan.strict, special))

    def steering(self, plan: ToolPlan, special: dict[str, int] | None = None) -> Steering | None:
        if plan.choice != "auto":
            return None
        names = "|".join(re.escape(t.name) for t in plan.tools)
        root = 'tail ("\\n" call)*' if plan.parallel else "tail"
        grammar = lark(root, self._rules(list(plan.tools), plan.strict, special))
        return Steering([self.trigger.format(names=names)], grammar)

    def parse(self, text: str, check: ToolCheck,
              truncated: bool) -> tuple[list[ToolCall], str] | None:
        got = Gathered(text)
        for start, end, name, body, closed in self._calls_at(text)[:MAX_TRIES]:
            pairs = self._pairs(body)
            if pairs is None or (not closed and truncated):
                # (a further call cut off: dropped)
                return got.result(whole=False) if truncated else None
            schemas = _properties_of(check, name)
            args = {k: convert(v, schemas.get(k)) for k, v in pairs}
            if not check.accepts(name, args):
                return None
            got.call(start, end, name, args)
        return got.result()

    def cut(self, text: str, names: set[str]) -> tuple[str, str] | None:
        found = self._calls_at(text)
        if not found or found[-1][2] not in names:
            return None
        _, _, name, body, _ = found[-1]
        pairs = self._pairs(body, whole_only=True) or []
        args = json.dumps(dict(pairs), ensure_ascii=False)
        # the members written whole, the object left open: more may have followed
        return name, args[:-1] if pairs else "{"


def _properties_of(check: ToolCheck, name: str) -> dict[str, Any]:
    schema = check.schemas.get(name) or {}
    props = schema.get("properties") if isinstance(schema, dict) else None
    return props if isinstance(props, dict) else {}


def free_text(name: str, close: str, special: dict[str, int] | None) -> str:
    """Lark rule `name`: free text and the `close` marker after it. Written out, the
    marker ends a lazy lexeme (its first occurrence ends the text: a lexeme that stops
    where the next one could start would stop at once); a special token cannot be part of
    text, so the text runs until the model writes it."""
    if special and close in special:
        return f"{name}: /(?s:.*)/ <[{special[close]}]>"
    pattern = re.escape(close).replace("\\\n", "\\n").replace("/", "\\/")
    return f"{name}[lazy]: /(?s:.*){pattern}/"


def _value_rule(name: str, schema: Any, strict: bool, close: str,
                special: dict[str, int] | None) -> list[str]:
    """Lark rules `name`: one parameter's value as the model writes it, and `close`."""
    if isinstance(schema, dict) and "$ref" not in json.dumps(schema):
        if "const" in schema and isinstance(schema["const"], str):
            return [f"{name}: {lit(schema['const'])} {marker_writer(special)(close)}"]
        enum = schema.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            return [f"{name}: (" + " | ".join(lit(v) for v in enum) + ") "
                    + marker_writer(special)(close)]
        types = _types(schema)
        if types and "string" not in types:
            body = {**prepare_schema(schema), "x-guidance": {**JSON_OPTIONS,
                                                              "lenient": not strict}}
            return [f"{name}: json_{name} {marker_writer(special)(close)}",
                    f"json_{name}: %json {json.dumps(body, allow_nan=False)}"]
    return [free_text(name, close, special)]


def param_rules(i: int, tool: Tool, strict: bool, close: str, special: dict[str, int] | None,
                write: Callable[[str, Any, str], str]) -> tuple[list[str], str]:
    """The rules `p{i}_{k}` of tool `i`'s parameters, each as the family writes it
    (`write(key, schema, value)`: the rule's body, `value` the name of the rule of the
    value, which ends at `close`), and the sequence a call holds: the schema's order, its
    required parameters, the others optional."""
    required = set((tool.parameters or {}).get("required") or [])
    rules: list[str] = []
    parts: list[str] = []
    for k, (key, schema) in enumerate(_properties(tool).items()):
        value = f"v{i}_{k}"
        rules += _value_rule(value, schema, strict, close, special)
        rules.append(f"p{i}_{k}: {write(key, schema, value)}")
        parts.append(f"p{i}_{k}" + ("" if key in required else "?"))
    return rules, " ".join(parts)


def _function_call(open_: str, close: str) -> re.Pattern[str]:
    """A `<function=NAME>...</function>` call, in its `open_`/`close` block or not."""
    o, c = re.escape(open_), re.escape(close)
    return re.compile(rf"(?:{o}\s*)?<function=([^\s<>]{{1,256}})>(.*?)"
                      rf"(?:(</function>)\s*(?:{c})?|(?={o}|<function=)|$)", re.S)


class QwenCoder(Tagged):
    name = "qwen3-coder"
    block = ("<tool_call>", "</tool_call>")
    markers: tuple[str, ...] = block
    starts: tuple[str, ...] = ("<tool_call>", "<function=")
    # what lies between `<parameter=KEY>` and the value, and the value and `</parameter>`
    value_gap = "\n"
    _CALL = _function_call(*block)
    _PARAM = re.compile(r"<parameter=([^\s<>]{1,256})>\n?(.*?)(?:\n?</parameter>|"
                        r"(?=<parameter=)|$)", re.S)

    def matches(self, template: str) -> bool:
        # (Seed-OSS wraps the same calls in `<seed:tool_call>`: not this family's reader)
        return "<function=" in template and "<parameter=" in template \
            and "<seed:" not in template

    def _pairs(self, body: str, whole_only: bool = False) -> list[tuple[str, str]] | None:
        out = []
        pos = 0
        for m in self._PARAM.finditer(body):
            if body[pos:m.start()].strip():
                return None  # something else between the parameters
            if whole_only and not m.group(0).endswith("</parameter>"):
                break
            out.append((m.group(1), m.group(2)))
            pos = m.end()
        if body[pos:].strip() and not whole_only:
            return None
        return out

    def _tool_rules(self, i: int, tool: Tool, strict: bool,
                    special: dict[str, int] | None) -> list[str]:
        mark = marker_writer(special)
        gap = self.value_gap
        rules, parts = param_rules(i, tool, strict, gap + "</parameter>\n", special,
                                   lambda key, _, value: f"{lit(f'<parameter={key}>' + gap)} "
                                                         f"{value}")
        rules.append(f"params{i}: " + (parts or '""'))
        rules.append(f"tail{i}: {lit(tool.name + '>' + chr(10))} params{i} "
                     f'"</function>\\n" {mark(self.block[1])}')
        return rules

    def _rules(self, chosen: list[Tool], strict: bool,
               special: dict[str, int] | None) -> list[str]:
        mark = marker_writer(special)
        rules: list[str] = []
        for i, tool in enumerate(chosen):
            rules += self._tool_rules(i, tool, strict, special)
        rules.append(one_of("tail", len(chosen)))
        rules.append(f'call: {mark(self.block[0])} "\\n<function=" tail')
        return rules

    # A call has begun when `<function=` is followed by a tool's name and `>`: the grammar
    # starts at the name.
    trigger = "<function=(?=(?:{names})>)"

    def write_calls(self, calls: list[ToolCall], info: TemplateInfo) -> str:
        gap = self.value_gap
        return "\n".join(
            f"{self.block[0]}\n<function={c.name}>\n" + "".join(
                f"<parameter={k}>{gap}"
                f"{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
                f"{gap}</parameter>\n" for k, v in c.arguments.items())
            + f"</function>\n{self.block[1]}" for c in calls)


class SeedOSS(QwenCoder):
    """ByteDance Seed-OSS: Qwen3-Coder's calls in `<seed:tool_call>` blocks, each value
    written right against its tags (`<parameter=KEY>value</parameter>`), thoughts in
    `<seed:think>` (its template's tokens; test-chat.cpp's Seed-OSS outputs)."""

    name = "seed-oss"
    block = ("<seed:tool_call>", "</seed:tool_call>")
    think = ("<seed:think>", "</seed:think>")
    markers = (*block, *think)
    starts = ("<seed:tool_call>", "<function=")
    value_gap = ""
    _CALL = _function_call(*block)
    # (a value is all between its tags: one that ends in a newline keeps it, as llama.cpp's
    # Seed-OSS parser reads it)
    _PARAM = re.compile(r"<parameter=([^\s<>]{1,256})>(.*?)(?:</parameter>|(?=<parameter=)|$)",
                        re.S)

    def matches(self, template: str) -> bool:
        return "<seed:tool_call>" in template and "<function=" in template

    def think_pair(self, template: str | None) -> tuple[str, str] | None:
        return self.think


class GLM(Tagged):
    name = "glm"
    suffix = ""  # in every tag's name (Hunyuan's `:opensource`)
    sep = ""  # between the name and the arguments (Hunyuan's `<tool_sep:opensource>`)
    block: tuple[str, str] | None = None  # what the calls are written in (Hunyuan)
    # after each value, and before the call's closing tag (Ling: nothing, and a newline)
    pair_end, call_end = "\n", ""

    def __init__(self) -> None:
        t = self._tag
        self.markers = tuple(t(n) for n in ("tool_call", "/tool_call", "arg_key", "/arg_key",
                                            "arg_value", "/arg_value")) \
            + ((self.sep,) if self.sep else ()) + (self.block or ())
        self.starts = (t("tool_call"), *(self.block or ())[:1])
        e = {n: re.escape(t(n)) for n in ("tool_call", "/tool_call", "arg_key", "/arg_key",
                                          "arg_value", "/arg_value")}
        sep = rf"(?:{re.escape(self.sep)})?\s*" if self.sep else ""
        opens = rf"(?:{re.escape(self.block[0])}\s*)?" if self.block else ""
        closes = rf"(?:\s*{re.escape(self.block[1])})?" if self.block else ""
        # (a call's body ends at its closing tag, or where another call begins: the tag,
        # a name and its first key, so that a value holding the tag's text stays whole)
        following = rf"(?={e['tool_call']}\s*[^\s<>]{{1,256}}\s*{sep}" \
            rf"(?:{e['arg_key']}|{e['/tool_call']}|$))"
        self._CALL = re.compile(
            rf"{opens}{e['tool_call']}\s*([^\s<>]{{1,256}})\s*{sep}(.*?)"
            rf"(?:({e['/tool_call']}){closes}|{following}|$)", re.S)
        self._PAIR = re.compile(rf"\s*{e['arg_key']}(.*?){e['/arg_key']}\s*{e['arg_value']}"
                                rf"(.*?)(?:({e['/arg_value']})|$)", re.S)
        # A call has begun when its tag is followed by a tool's name (and a newline, or
        # the separator; or the first key straight after the name: Spark 2.5's and Laguna
        # S 2.1's templates write no newlines in a call, and the grammar takes either).
        after = re.escape(self.sep) if self.sep else "(?:\\n|" + e["arg_key"] + ")"
        self.trigger = re.escape(t("tool_call")).replace("{", "{{").replace("}", "}}") \
            + "(?=(?:{names})" + after.replace("{", "{{").replace("}", "}}") + ")"

    def _tag(self, name: str) -> str:
        return f"<{name}{self.suffix}>"

    def matches(self, template: str) -> bool:
        return "<arg_key>" in template and "<arg_value>" in template

    def _pairs(self, body: str, whole_only: bool = False) -> list[tuple[str, str]] | None:
        out: list[tuple[str, str]] = []
        pos = 0
        while pos < len(body.rstrip()):
            m = self._PAIR.match(body, pos)
            if m is None:
                return out if whole_only else None
            if m.group(3) is None and whole_only:
                break
            out.append((m.group(1).strip(), m.group(2)))
            pos = m.end()
        return out

    def _rules(self, chosen: list[Tool], strict: bool,
               special: dict[str, int] | None) -> list[str]:
        mark = marker_writer(special)
        t = self._tag
        rules: list[str] = []
        pair_end = f" {lit(self.pair_end)}?" if self.pair_end else ""
        for i, tool in enumerate(chosen):
            params, parts = param_rules(
                i, tool, strict, t("/arg_value"), special,
                lambda key, _, value: f"{mark(t('arg_key'))} {lit(key)} "
                                      f"{mark(t('/arg_key'))} "
                                      f'"\\n"? {mark(t("arg_value"))} {value}{pair_end}')
            rules += params
            name = lit(tool.name) + (f" {mark(self.sep)} " if self.sep else " ") + '"\\n"?'
            end = f"{lit(self.call_end)} " if self.call_end else ""
            rules.append(f"tail{i}: {name} {parts} {end}{mark(t('/tool_call'))}")
        rules.append(one_of("tail", len(chosen)))
        rules.append(f"call: {mark(t('tool_call'))} tail")
        return rules

    def grammar(self, plan: ToolPlan, special: dict[str, int] | None = None) -> str | None:
        if self.block is None:
            return super().grammar(plan, special)
        chosen = choice(plan)
        if chosen is None:
            return None
        mark = marker_writer(special)
        calls = '(call "\\n")+' if plan.parallel else 'call "\\n"'
        return lark(f'{mark(self.block[0])} "\\n" {calls} {mark(self.block[1])}',
                    self._rules(chosen, plan.strict, special))

    def steering(self, plan: ToolPlan, special: dict[str, int] | None = None) -> Steering | None:
        if self.block is None:
            return super().steering(plan, special)
        if plan.choice != "auto":
            return None
        names = "|".join(re.escape(t.name) for t in plan.tools)
        more = ' (call "\\n")*' if plan.parallel else ""
        grammar = lark(f'tail "\\n"{more} {marker_writer(special)(self.block[1])}',
                       self._rules(list(plan.tools), plan.strict, special))
        return Steering([self.trigger.format(names=names)], grammar)

    def write_calls(self, calls: list[ToolCall], info: TemplateInfo) -> str:
        t = self._tag
        body = [t("tool_call") + c.name + self.sep + "\n" + "".join(
            f"{t('arg_key')}{k}{t('/arg_key')}\n{t('arg_value')}"
            f"{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
            f"{t('/arg_value')}{self.pair_end}" for k, v in c.arguments.items())
            + self.call_end + t("/tool_call")
            for c in calls]
        if self.block is None:  # (GLM's template opens each call on a line of its own)
            return "\n".join(body)
        return self.block[0] + "\n" + "".join(b + "\n" for b in body) + self.block[1]


class Hunyuan(GLM):
    """Tencent Hy3: GLM's key/value calls with every tag named `...:opensource`, a separator
    after the name, all calls in one `<tool_calls:opensource>` block; thoughts in
    `<think:opensource>` (its template's special-token variables)."""

    name = "hunyuan"
    suffix = ":opensource"
    sep = "<tool_sep:opensource>"
    block = ("<tool_calls:opensource>", "</tool_calls:opensource>")
    think = ("<think:opensource>", "</think:opensource>")

    def __init__(self) -> None:
        super().__init__()
        self.markers = (*self.markers, *self.think)

    def matches(self, template: str) -> bool:
        return "'<tool_calls{}>'.format(HYTK)" in template and "<arg_key{}>" in template

    def think_pair(self, template: str | None) -> tuple[str, str] | None:
        return self.think


class Ling(GLM):
    """Ling 3.0 (Bailing V3): GLM's calls in `<role>` turns. Its generation prompt opens a
    thought, and the model may call before closing it: a call's start ends the thought
    too (llama.cpp's Ling 3.0 parser ends it at `</think>` or `<tool_call>`)."""

    name = "ling"
    pair_end, call_end = "", "\n"

    def matches(self, template: str) -> bool:
        return "<role>ASSISTANT</role>" in template and "<arg_key>" in template

    def splitter(self, pair: tuple[str, str], inside: bool, keep: bool) -> Splitter:
        return EndedByCall(ThinkStream(pair, inside=inside, keep=keep), "<tool_call>")


@dataclass
class EndedByCall:
    """A think stream whose thought also ends where `call` (a call's start marker) comes:
    the thought's end marker is given to it there, the call goes on as content."""

    inner: ThinkStream
    call: str
    _held: str = ""

    def push(self, text: str) -> tuple[str, str]:
        rest, self._held = self._held + text, ""
        if not self.inner.thinking:
            return self.inner.push(rest)
        close = self.inner.pair[1]
        at, end = rest.find(self.call), rest.find(close)
        if at != -1 and (end == -1 or at < end):  # the call comes first: the thought ends
            t, c = self.inner.push(rest[:at] + close)
            t2, c2 = self.inner.push(rest[at:])
            return t + t2, c + c2
        if end != -1:
            return self.inner.push(rest)
        # what may still become either marker is held here (so the inner stream never
        # holds half of its end marker when a call comes)
        keep = partial_match(rest, (self.call, close))
        self._held = rest[len(rest) - keep:] if keep else ""
        return self.inner.push(rest[:len(rest) - keep] if keep else rest)

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        t, c = self.inner.push(held)
        t2, c2 = self.inner.finish()
        return t + t2, c + c2
