"""Families that write calls as `invoke` elements with named `parameter`s, in one block:

    MiniMax M2     <minimax:tool_call>\\n<invoke name="NAME">\\n<parameter name="KEY">value
                   </parameter>\\n</invoke>\\n...</minimax:tool_call>     thoughts in <think>
    DeepSeek V3.2  <｜DSML｜function_calls>\\n<｜DSML｜invoke name="NAME">\\n
                   <｜DSML｜parameter name="KEY" string="true|false">value</｜DSML｜parameter>
                   \\n</｜DSML｜invoke>\\n</｜DSML｜function_calls>        thoughts in <think>
    DeepSeek V4    the same, its block named `tool_calls`
    Kimi K3        <|open|>tools<|sep|><|open|>call tool="NAME" index="1"<|sep|>
                   <|open|>argument key="KEY" type="string"<|sep|>value<|close|>argument<|sep|>
                   <|close|>call<|sep|><|close|>tools<|sep|>    after its response section

Several calls share one block. A value is text converted by the tool's schema (xml.convert),
as the other tagged families' are; DeepSeek's `string="true|false"` says the same thing the
schema does (its templates write "true" for a string, "false" and JSON for anything else),
so it is written that way and read by the schema.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from llmrun.chat.formats.base import choice, lark, lit, one_of, text_writer
from llmrun.chat.formats.xml import EndedByCall, Tagged, _types, param_rules
from llmrun.chat.textstream import partial_match
from llmrun.chat.thinking import Splitter, ThinkStream
from llmrun.chat.tools import Steering, TemplateInfo, ToolPlan
from llmrun.request import Tool, ToolCall


class Invoke(Tagged):
    """A block of calls, each an opening tag naming the tool, its parameters each between
    an opening tag naming it and a closing tag, then the call's closing tag."""

    block = ("", "")  # the calls' block: its opening and closing tags
    lead = "\n"  # after the block's opening tag
    # a call's opening tag up to the tool's name, and what follows the name (a pattern,
    # after its closing quote); the call's closing tag
    call_open = '<invoke name="'
    _name_end = r">\n?"
    call_close = "</invoke>\n"
    # a parameter's opening tag up to its key, and its attributes after the key (a
    # pattern); its closing tag, and what a value's free text ends at (all of it, or its
    # first special token)
    param_open = '<parameter name="'
    _param_attrs = r">"
    param_close = "</parameter>\n"
    value_close: str | None = None
    typed = False  # parameters carry `string="true|false"`

    def __init__(self) -> None:
        self.markers = (*self.block,)
        self.starts = (self.block[0], self.call_open)
        b0, b1 = (re.escape(b) for b in self.block)
        call, param = re.escape(self.call_open), re.escape(self.param_open)
        # each call, with the block's opening tag before the first and its end after the last
        self._CALL = re.compile(
            rf"(?:{b0}\s*)?{call}([^\"<>\s]{{1,256}})\"{self._name_end}(.*?)"
            rf"(?:({re.escape(self.call_close.strip())})\s*(?:{b1})?|(?={call}|{b0})|$)",
            re.S)
        self._pair = re.compile(
            rf"\s*{param}([^\"<>]{{1,256}})\"{self._param_attrs}(.*?)"
            rf"(?:({re.escape(self.param_close.strip())})|(?={param})|$)", re.S)

    def _value_close(self, special: dict[str, int] | None) -> str:
        return self.value_close or self.param_close

    def _text(self, text: str, special: dict[str, int] | None) -> str:
        return str(text_writer(special)(text))

    def _name_end_rule(self, special: dict[str, int] | None) -> str:
        return self._text('">\n', special)

    def _attrs(self, value: Any) -> str:
        """What follows a parameter's key in its opening tag, for a value of the JSON
        type `value` says (a schema's type name, or a value itself)."""
        if not self.typed:
            return '">'
        return f'" string="{"true" if value == "string" else "false"}">'

    def _pairs(self, body: str, whole_only: bool = False) -> list[tuple[str, str]] | None:
        out: list[tuple[str, str]] = []
        pos = 0
        while pos < len(body.rstrip()):
            m = self._pair.match(body, pos)
            if m is None:
                return out if whole_only else None  # something else between them
            if m.group(3) is None and whole_only:
                break
            out.append((m.group(1), m.group(2)))
            pos = m.end()
        return out

    def _schema_type(self, schema: Any) -> str:
        """The JSON type a parameter is written as: "string" for bare text (any schema
        allowing a string, or none), else its first type."""
        types = _types(schema)
        return "string" if not types or "string" in types else types[0]

    def _rules(self, chosen: list[Tool], strict: bool,
               special: dict[str, int] | None) -> list[str]:
        rules: list[str] = []
        t = self._text
        close = self._value_close(special)
        rest = self.param_close[len(close):]
        after = f" {t(rest, special)}" if rest else ""

        def param(key: str, schema: Any, value: str) -> str:
            opener = self.param_open + key + self._attrs(self._schema_type(schema))
            return f"{t(opener, special)} {value}{after}"

        for i, tool in enumerate(chosen):
            params, parts = param_rules(i, tool, strict, close, special, param)
            rules += params
            rules.append(f"tail{i}: {lit(tool.name)} {self._name_end_rule(special)} {parts} "
                         f"{t(self.call_close, special)}")
        rules.append(one_of("tail", len(chosen)))
        rules.append(f"call: {t(self.call_open, special)} tail")
        return rules

    def grammar(self, plan: ToolPlan, special: dict[str, int] | None = None) -> str | None:
        chosen = choice(plan)
        if chosen is None:
            return None
        t = self._text
        calls = "call+" if plan.parallel else "call"
        lead = f" {lit(self.lead)}" if self.lead else ""
        return lark(f"{self._before(special)}{t(self.block[0], special)}{lead} {calls} "
                    f"{t(self.block[1], special)}", self._rules(chosen, plan.strict, special))

    def _before(self, special: dict[str, int] | None) -> str:
        """What a forced call's grammar lets come before the block (with a space after)."""
        return ""

    def steering(self, plan: ToolPlan, special: dict[str, int] | None = None) -> Steering | None:
        """The block's opening tag starts the grammar: the calls and the block's end."""
        if plan.choice != "auto":
            return None
        calls = "call+" if plan.parallel else "call"
        lead = f"{lit(self.lead)} " if self.lead else ""
        grammar = lark(f"{lead}{calls} {self._text(self.block[1], special)}",
                       self._rules(list(plan.tools), plan.strict, special))
        return Steering([re.escape(self.block[0])], grammar)

    def _name_end_text(self, index: int) -> str:
        return '">\n'

    def write_calls(self, calls: list[ToolCall], info: TemplateInfo) -> str:
        def param(k: str, v: Any) -> str:
            text = isinstance(v, str)
            return (self.param_open + k + self._attrs(_json_type(v))
                    + (v if text else json.dumps(v, ensure_ascii=False)) + self.param_close)

        return (self.block[0] + self.lead + "".join(
            self.call_open + c.name + self._name_end_text(n)
            + "".join(param(k, v) for k, v in c.arguments.items()) + self.call_close
            for n, c in enumerate(calls, 1)) + self.block[1])


def _json_type(value: Any) -> str:
    """The JSON type of a value, by the names JSON Schema (and Kimi K3's `type=`) use."""
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    return "object" if isinstance(value, dict) else "array"


class MiniMaxM2(Invoke):
    name = "minimax-m2"
    block = ("<minimax:tool_call>", "</minimax:tool_call>")

    def matches(self, template: str) -> bool:
        return "<minimax:tool_call>" in template and "<invoke name=" in template


class DeepSeekV32(Invoke):
    """DeepSeek V3.2's DSML (its template builds the tags from `dsml_token`)."""

    name = "deepseek-v3.2"
    block = ("<｜DSML｜function_calls>", "</｜DSML｜function_calls>")
    call_open = '<｜DSML｜invoke name="'
    call_close = "</｜DSML｜invoke>\n"
    param_open = '<｜DSML｜parameter name="'
    _param_attrs = r'(?: string="(?:true|false)")?>'
    param_close = "</｜DSML｜parameter>\n"
    typed = True
    # `｜DSML｜` is the vocabulary's special token (llama.cpp's parser preserves it alone),
    # and a thought ends at the calls' block too, as that parser ends it
    dsml = "｜DSML｜"

    def __init__(self) -> None:
        super().__init__()
        self.markers = (self.dsml,)

    def splitter(self, pair: tuple[str, str], inside: bool, keep: bool) -> Splitter:
        return EndedByCall(ThinkStream(pair, inside=inside, keep=keep), self.block[0])

    def _value_close(self, special: dict[str, int] | None) -> str:
        # a value's text ends before the token: at `</` (no text holds the token after it)
        return "</" if special and self.dsml in special else self.param_close

    def matches(self, template: str) -> bool:
        return "dsml_token" in template and "'function_calls>" in template


class DeepSeekV4(DeepSeekV32):
    name = "deepseek-v4"
    block = ("<｜DSML｜tool_calls>", "</｜DSML｜tool_calls>")

    def matches(self, template: str) -> bool:
        return "dsml_token" in template and "'tool_calls>" in template


class KimiK3(Invoke):
    """Kimi K3's XTML: tags `<|open|>NAME attrs<|sep|>` ... `<|close|>NAME<|sep|>` (its
    template's open_tag/close_tag), the answer in a `response` section, calls in a `tools`
    section after it (`call tool=".." index="N"`, `argument key=".." type=".."`), the
    thought in `think`, which the generation prompt opens (llama.cpp's Kimi K3 parser and
    tests). Only `<|open|>`, `<|close|>`, `<|sep|>` are special tokens."""

    name = "kimi-k3"
    block = ("<|open|>tools<|sep|>", "<|close|>tools<|sep|>")
    lead = ""
    think = ("<|open|>think<|sep|>", "<|close|>think<|sep|>")
    # the answer's wrapping, dropped from the content
    wrapping = ("<|open|>response<|sep|>", "<|close|>response<|sep|>",
                "<|close|>message<|sep|>")
    call_open = '<|open|>call tool="'
    _name_end = r'(?: index="\d{1,4}")?<\|sep\|>'
    call_close = "<|close|>call<|sep|>"
    param_open = '<|open|>argument key="'
    _param_attrs = r'(?: type="[a-z]{1,16}")?<\|sep\|>'
    param_close = "<|close|>argument<|sep|>"
    value_close = "<|close|>"

    def __init__(self) -> None:
        super().__init__()
        self.markers = ("<|open|>", "<|close|>", "<|sep|>")

    def matches(self, template: str) -> bool:
        return "<|open|>" in template and "<|close|>" in template \
            and "<|end_of_msg|>" in template

    def think_pair(self, template: str | None) -> tuple[str, str] | None:
        return self.think

    def splitter(self, pair: tuple[str, str], inside: bool, keep: bool) -> Splitter:
        return Unwrapped(super().splitter(pair, inside, keep), self.wrapping)

    def _attrs(self, value: Any) -> str:
        return f'" type="{"number" if value == "integer" else value}"<|sep|>'

    def _name_end_rule(self, special: dict[str, int] | None) -> str:
        return f'{lit(chr(34) + " index=" + chr(34))} /[1-9][0-9]{{0,2}}/ ' \
            + self._text('"<|sep|>', special)

    def _name_end_text(self, index: int) -> str:
        return f'" index="{index}"<|sep|>'

    def _before(self, special: dict[str, int] | None) -> str:
        # the response section the template always writes, empty before a forced call (or
        # its end alone, where the generation prompt opened it)
        t = self._text
        return f"(({t(self.wrapping[0], special)})? {t(self.wrapping[1], special)})? "


@dataclass
class Unwrapped:
    """A splitter whose content has the family's wrapping tags taken out (held while the
    end of the text may still become one)."""

    inner: Splitter
    drop: tuple[str, ...]
    _held: str = ""

    def _content(self, text: str, final: bool = False) -> str:
        out = self._held + text
        for _ in range(4):  # (taking one out could join the halves of another)
            before = out
            for tag in self.drop:
                out = out.replace(tag, "")
            if out == before:
                break
        n = 0 if final else partial_match(out, self.drop)
        self._held = out[len(out) - n:] if n else ""
        return out[:len(out) - n] if n else out

    def push(self, text: str) -> tuple[str, str]:
        thought, content = self.inner.push(text)
        return thought, self._content(content)

    def finish(self) -> tuple[str, str]:
        thought, content = self.inner.finish()
        return thought, self._content(content, final=True)
