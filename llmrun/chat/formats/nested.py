"""MiniMax M3: calls whose arguments are XML trees, every tag behind a namespace token:

    NS<tool_call>\\nNS<invoke name="NAME">NS<KEY>value NS</KEY>...NS</invoke>\\n...NS</tool_call>

with NS = `]<]minimax[>[` (a special token of its vocabulary). An object's members are tags
named by their keys, a list's items are `item` tags, a scalar is its text (booleans in JSON's
spelling): its template's `to_xml`. Thoughts are `<mm:think>` pairs.

A value is read by the tool's schema (xml.convert for a scalar's text): an element holding
elements is an object, or a list where they are all `item`s. The tags are read in one pass
with a stack no deeper than MAX_DEPTH.
"""

from __future__ import annotations

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
    text_writer,
)
from llmrun.chat.formats.xml import _types, convert
from llmrun.chat.toolcalls import MAX_TRIES, ToolCheck
from llmrun.chat.toolcalls.jsontext import MAX_DEPTH
from llmrun.chat.tools import Steering, TemplateInfo, ToolPlan
from llmrun.request import Tool, ToolCall
from llmrun.structured.prepare import JSON_OPTIONS, prepare_schema

NS = "]<]minimax[>["
_NS = re.escape(NS)
_TAG = re.compile(_NS + r"<(/?)([^<>\s/\"]{1,256})>")
_INVOKE = re.compile(_NS + r'<invoke name="([^"<>\s]{1,256})">')
# Deepest schema the grammar follows; below it a value is free text (read by the schema).
_GRAMMAR_DEPTH = 8


class Element:
    __slots__ = ("children", "closed", "tag", "text")

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.text: list[str] = []
        self.children: list[Element] = []
        self.closed = False


def elements(body: str) -> Element | None:
    """The tree of the tags in `body` under a root, or None when they do not nest; tags
    the text ends inside stay open (`closed` False)."""
    root = Element("")
    stack = [root]
    pos = 0
    for m in _TAG.finditer(body):
        stack[-1].text.append(body[pos:m.start()])
        pos = m.end()
        closing, tag = m.group(1), m.group(2)
        if closing:
            if len(stack) == 1 or stack[-1].tag != tag:
                return None
            stack.pop().closed = True
        else:
            if len(stack) > MAX_DEPTH:
                return None
            child = Element(tag)
            stack[-1].children.append(child)
            stack.append(child)
    stack[-1].text.append(body[pos:])
    root.closed = len(stack) == 1
    return root


class NotAValue(ValueError):
    pass


def value(node: Element, schema: Any, whole_only: bool = False) -> Any:
    """An element's value by its schema (see the module's doc). NotAValue where it is
    none: text beside elements, a key twice. `whole_only`: an object's members written
    whole, of a tree the token limit cut."""
    types = _types(schema)
    if not node.children:
        text = "".join(node.text)
        if not text.strip() and ("array" in types or "object" in types) \
                and "string" not in types:
            return [] if "array" in types and "object" not in types else {}
        return convert(text, schema)
    if any(t.strip() for t in node.text):
        raise NotAValue("text beside elements")
    sub = schema if isinstance(schema, dict) else {}
    if all(c.tag == "item" for c in node.children) and ("array" in types or not types):
        return [value(c, sub.get("items"), whole_only) for c in node.children
                if c.closed or not whole_only]
    props = sub.get("properties") if isinstance(sub.get("properties"), dict) else {}
    out: dict[str, Any] = {}
    for c in node.children:
        if whole_only and not c.closed:
            break
        if c.tag in out:
            raise NotAValue(f"{c.tag} twice")
        out[c.tag] = value(c, (props or {}).get(c.tag), whole_only)
    return out


def to_xml(v: Any) -> str:
    """A value as the template's `to_xml` writes it (None members left out, as it does)."""
    if isinstance(v, dict):
        return "".join(f"{NS}<{k}>{to_xml(x)}{NS}</{k}>" for k, x in v.items() if x is not None)
    if isinstance(v, list):
        return "".join(f"{NS}<item>{to_xml(x)}{NS}</item>" for x in v)
    if isinstance(v, bool) or v is None:
        return json.dumps(v)
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


class MiniMaxM3(Family):
    name = "minimax-m3"
    block = (NS + "<tool_call>", NS + "</tool_call>")
    think = ("<mm:think>", "</mm:think>")
    # (llama.cpp's parser preserves the namespace, `<tool_call>` and the think tags: each
    # a token of its own)
    markers = (NS, "<tool_call>", "</tool_call>", *think)
    starts = (NS + "<tool_call>", NS + "<invoke name=")

    def matches(self, template: str) -> bool:
        return NS in template and "<invoke name=" in template

    def think_pair(self, template: str | None) -> tuple[str, str] | None:
        return self.think

    def _calls_at(self, text: str) -> list[tuple[int, int, str, str, bool]]:
        """(start, end, name, body, closed) of each call in `text`: the block's opening
        tag before the first, its end after the last."""
        out = []
        pos = 0
        for _ in range(MAX_TRIES):
            m = _INVOKE.search(text, pos)
            if m is None:
                break
            start = m.start()
            opening = text.rfind(self.block[0], pos, start)
            if opening != -1 and not text[opening + len(self.block[0]):start].strip():
                start = opening
            close = text.find(NS + "</invoke>", m.end())
            following = _INVOKE.search(text, m.end())
            if close == -1 or (following and following.start() < close):
                end = following.start() if following else len(text)
                out.append((start, end, m.group(1), text[m.end():end], False))
                pos = end
                continue
            end = close + len(NS + "</invoke>")
            body = text[m.end():close]
            rest = text[end:]
            if rest.lstrip().startswith(self.block[1]):
                end = len(text) - len(rest.lstrip()) + len(self.block[1])
            out.append((start, end, m.group(1), body, True))
            pos = end
        return out

    def _arguments(self, body: str, schema: Any, whole_only: bool = False) -> Any:
        tree = elements(body)
        if tree is None or (not tree.closed and not whole_only):
            return None
        if not tree.children:  # no arguments, or text that is none
            return None if "".join(tree.text).strip() else {}
        try:
            args = value(tree, schema or {"type": "object"}, whole_only)
        except (NotAValue, RecursionError):
            return None
        return args if isinstance(args, dict) else None

    def parse(self, text: str, check: ToolCheck,
              truncated: bool) -> tuple[list[ToolCall], str] | None:
        got = Gathered(text)
        for start, end, name, body, closed in self._calls_at(text):
            args = self._arguments(body, check.schemas.get(name)) if closed else None
            if args is None or not check.accepts(name, args):
                # (a further call cut off: dropped)
                return got.result(whole=False) if truncated and not closed else None
            got.call(start, end, name, args)
        return got.result()

    def cut(self, text: str, names: set[str]) -> tuple[str, str] | None:
        found = self._calls_at(text)
        if not found or found[-1][2] not in names:
            return None
        _, _, name, body, _ = found[-1]
        args = self._arguments(body, None, whole_only=True) or {}
        written = json.dumps(args, ensure_ascii=False)
        # the members written whole, the object left open: more may have followed
        return name, written[:-1] if args else "{"

    # -- grammar --------------------------------------------------------------------------

    def _value_rules(self, name: str, schema: Any, close: str, strict: bool,
                     special: dict[str, int] | None, depth: int, rules: list[str]) -> None:
        """Rule `name`: a value by its schema, then the `close` tag (NS and `</KEY>`)."""
        ns = marker_writer(special)(NS)
        end = f"{ns} {lit(close)}"
        s = schema if isinstance(schema, dict) else {}
        types = _types(s)
        if depth < _GRAMMAR_DEPTH and "$ref" not in json.dumps(s) and len(set(types)) == 1:
            if types == ["object"] and isinstance(s.get("properties"), dict):
                required = set(s.get("required") or [])
                parts = []
                for k, (key, sub) in enumerate(s["properties"].items()):
                    member = f"{name}_{k}"
                    self._value_rules(member + "v", sub, f"</{key}>", strict, special,
                                      depth + 1, rules)
                    rules.append(f"{member}: {ns} {lit(f'<{key}>')} {member}v")
                    parts.append(member + ("" if key in required else "?"))
                members = " ".join(parts) or '""'
                rules.append(f"{name}: {members} {end}")
                return
            if types == ["array"] and isinstance(s.get("items"), dict):
                self._value_rules(f"{name}_i", s["items"], "</item>", strict, special,
                                  depth + 1, rules)
                rules.append(f"{name}: ({ns} {lit('<item>')} {name}_i)* {end}")
                return
            if types[0] in ("integer", "number", "boolean", "null"):
                body = {**prepare_schema(s), "x-guidance": {**JSON_OPTIONS,
                                                            "lenient": not strict}}
                rules.append(f"{name}: {name}_j {end}")
                rules.append(f"{name}_j: %json {json.dumps(body, allow_nan=False)}")
                return
        enum = s.get("enum")
        if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
            rules.append(f"{name}: (" + " | ".join(lit(v) for v in enum) + f") {end}")
            return
        # free text, which ends where the namespace token does; where that is a special
        # token, no text holds it, so the elements a value of no set shape may hold are
        # the grammar's (`tree`)
        if special and NS in special:
            rules.append(f"{name}: tree {end}")
        else:
            pattern = re.escape(NS + close).replace("/", "\\/")
            rules.append(f"{name}[lazy]: /(?s:.*){pattern}/")

    def _rules(self, chosen: list[Tool], strict: bool,
               special: dict[str, int] | None) -> list[str]:
        ns = marker_writer(special)(NS)
        rules: list[str] = []
        for i, tool in enumerate(chosen):
            schema = tool.parameters or {"type": "object", "properties": {}}
            self._value_rules(f"args{i}", schema, "</invoke>", strict, special, 0, rules)
            rules.append(f"tail{i}: {lit(tool.name + chr(34) + '>')} args{i} \"\\n\"")
        rules.append(one_of("tail", len(chosen)))
        rules.append(f"call: {ns} {lit('<invoke name=' + chr(34))} tail")
        if any(" tree " in r for r in rules):
            rules.append(f'tree: /(?s:.*)/ ({ns} "<" TAG ">" tree {ns} "</" TAG ">" '
                         "/(?s:.*)/)*")
            rules.append('TAG: /[^<>\\s\\/"]{1,256}/')
        return rules

    def grammar(self, plan: ToolPlan, special: dict[str, int] | None = None) -> str | None:
        chosen = choice(plan)
        if chosen is None:
            return None
        ns = marker_writer(special)(NS)
        calls = "call+" if plan.parallel else "call"
        t = text_writer(special)
        # (the namespace a lexeme of its own: a call and the block's end both begin with it)
        return lark(f"{ns} {t('<tool_call>' + chr(10))} {calls} {ns} {t('</tool_call>')}",
                    self._rules(chosen, plan.strict, special))

    def steering(self, plan: ToolPlan, special: dict[str, int] | None = None) -> Steering | None:
        """The block's opening tag starts the grammar: the calls and the block's end."""
        if plan.choice != "auto":
            return None
        ns = marker_writer(special)(NS)
        calls = "call+" if plan.parallel else "call"
        grammar = lark(f"{lit(chr(10))} {calls} {ns} {text_writer(special)('</tool_call>')}",
                       self._rules(list(plan.tools), plan.strict, special))
        return Steering([re.escape(self.block[0])], grammar)

    def write_calls(self, calls: list[ToolCall], info: TemplateInfo) -> str:
        return self.block[0] + "\n" + "".join(
            f'{NS}<invoke name="{c.name}">{to_xml(c.arguments)}{NS}</invoke>\n'
            for c in calls) + self.block[1]
