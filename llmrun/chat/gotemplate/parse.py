"""Go text/template's lexer and parser: source text to a tree of frozen nodes, checking what
Go checks at parse time (functions exist, variables are declared, break/continue sit inside
range) and bounding how deep control structures and parentheses nest."""

from __future__ import annotations

import bisect
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from llmrun.chat import templatelimits
from llmrun.chat.gotemplate.funcs import _FUNCS
from llmrun.chat.templatelimits import TemplateError

# -- lexing -----------------------------------------------------------------------------------

_SPACE = " \t\r\n"
_KEYWORDS = {"if", "else", "end", "range", "with", "break", "continue", "define", "template",
             "block", "nil", "true", "false"}
_TOKEN = re.compile(r"""
    (?P<str>"(?:[^"\\\n]|\\.)*") | (?P<raw>`[^`]*`) | (?P<char>'(?:[^'\\\n]|\\[^'\n]+)')
  | (?P<num>[+-]?(?:0[xX][0-9a-fA-F_]+|0[bB][01_]+|0[oO][0-7_]+
                   |(?:\d[\d_]*\.?[\d_]*|\.\d[\d_]*)(?:[eE][+-]?\d+)?))
  | (?P<field>\.[^\W\d]\w*) | (?P<dot>\.) | (?P<var>\$\w*) | (?P<ident>[^\W\d]\w*)
  | (?P<op>:=|[=|(),])""", re.X)
_ESCAPE = re.compile(r"\\(?:x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|([0-7]{3})|(.))",
                     re.S)
_NAMED_ESCAPES = {"a": "\a", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
                  "\\": "\\", '"': '"', "'": "'"}


@dataclass(frozen=True, slots=True)
class _Tok:
    kind: str  # str num field dot var ident op
    value: Any
    pos: int
    spaced: bool  # white space before it: Go needs some between operands


@dataclass(frozen=True, slots=True)
class _Act:
    toks: tuple[_Tok, ...]
    pos: int


def _error(src: str, pos: int, message: str) -> TemplateError:
    return TemplateError(f"template: line {src.count(chr(10), 0, pos) + 1}: {message}")


def _close_at(src: str, i: int) -> tuple[int, bool] | None:
    """(end, trim) if a closing `}}` or ` -}}` starts at i."""
    if i < len(src) and src[i] in _SPACE and src.startswith("-}}", i + 1):
        return i + 4, True
    return (i + 2, False) if src.startswith("}}", i) else None


def _unquote(src: str, pos: int, body: str) -> str:
    def one(m: re.Match[str]) -> str:
        x, u, big_u, octal, c = m.groups()
        if c is not None:
            if c not in _NAMED_ESCAPES:
                raise _error(src, pos, f"unknown escape sequence \\{c}")
            return _NAMED_ESCAPES[c]
        code = int(octal, 8) if octal else int(x or u or big_u, 16)
        if code > 0x10FFFF:
            raise _error(src, pos, "invalid escape sequence")
        return chr(code)
    return _ESCAPE.sub(one, body)


def _token(src: str, m: re.Match[str], spaced: bool) -> _Tok:
    kind, text, pos = m.lastgroup or "", m.group(), m.start()
    value: Any = text
    if kind == "str":
        value = _unquote(src, pos, text[1:-1])
    elif kind == "raw":
        kind, value = "str", text[1:-1]
    elif kind == "char":
        char = _unquote(src, pos, text[1:-1])
        if len(char) != 1:
            raise _error(src, pos, f"malformed character constant {text}")
        kind, value = "num", ord(char)
    elif kind == "num":
        digits = text.replace("_", "")
        if re.search(r"[.eE]", digits) and not re.match(r"[+-]?0[xX]", digits):
            value = float(digits)
        else:
            try:
                value = int(digits, 8 if re.fullmatch(r"[+-]?0\d+", digits) else 0)
            except ValueError:
                raise _error(src, pos, f"bad number syntax: {text!r}") from None
    elif kind == "field":
        value = text[1:]
    return _Tok(kind, value, pos, spaced)


def _lex_action(src: str, i: int, start: int) -> tuple[tuple[_Tok, ...], int, bool]:
    toks: list[_Tok] = []
    spaced = False
    while (close := _close_at(src, i)) is None:
        if i >= len(src):
            raise _error(src, start, "unclosed action")
        if src[i] in _SPACE:
            i, spaced = i + 1, True
            continue
        m = _TOKEN.match(src, i)
        if m is None:
            what = "unterminated quoted string" if src[i] in "\"`'" else f"unexpected {src[i]!r}"
            raise _error(src, i, f"{what} in action")
        toks.append(_token(src, m, spaced))
        i, spaced = m.end(), False
    return tuple(toks), *close


def _scan(src: str) -> list[str | _Act]:
    """Split a template into texts (trim markers applied) and the tokens of its actions."""
    items: list[str | _Act] = []
    pos, trim = 0, False
    while True:
        start = src.find("{{", pos)
        text = src[pos:] if start < 0 else src[pos:start]
        text = text.lstrip(_SPACE) if trim else text
        if start < 0:
            return [*items, text]
        i = start + 2
        if src.startswith("-", i) and i + 1 < len(src) and src[i + 1] in _SPACE:
            text, i = text.rstrip(_SPACE), i + 2
        items.append(text)
        if src.startswith("/*", i):
            end = src.find("*/", i + 2)
            close = _close_at(src, end + 2) if end >= 0 else None
            if close is None:
                raise _error(src, start, "unclosed comment" if end < 0
                             else "comment ends before closing delimiter")
            pos, trim = close
            continue
        toks, pos, trim = _lex_action(src, i, start)
        items.append(_Act(toks, start))


# -- parsing ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Field:
    names: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class _Var:
    name: str
    names: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class _Dot:
    pass


@dataclass(frozen=True, slots=True)
class _Lit:
    value: Any  # None is nil


@dataclass(frozen=True, slots=True)
class _Func:
    name: str


@dataclass(frozen=True, slots=True)
class _Chain:
    node: Any
    names: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class _Pipe:
    decl: tuple[str, ...]
    assign: bool  # `=` rather than `:=`
    cmds: tuple[tuple[Any, ...], ...]


@dataclass(frozen=True, slots=True)
class _Text:
    text: str


@dataclass(frozen=True, slots=True)
class _Action:
    pipe: _Pipe
    line: int


@dataclass(frozen=True, slots=True)
class _Branch:
    kind: str  # if, range, with
    pipe: _Pipe
    body: tuple[Any, ...]
    orelse: tuple[Any, ...]
    line: int


@dataclass(frozen=True, slots=True)
class _Loop:
    kind: str  # break, continue
    line: int


def _is_op(tok: _Tok, ops: str) -> bool:
    return tok.kind == "op" and tok.value in ops.split()


class _Scope:
    """The variables declared at a point of the parse: a stack (scopes end by truncating it)
    with counts beside it, so that looking a name up does not scan every declaration."""

    def __init__(self) -> None:
        self.names, self.counts = ["$"], Counter(["$"])

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: str) -> bool:
        return self.counts[name] > 0

    def append(self, name: str) -> None:
        self.names.append(name)
        self.counts[name] += 1

    def truncate(self, mark: int) -> None:
        for name in self.names[mark:]:
            self.counts[name] -= 1
        del self.names[mark:]


class _Parser:
    """Recursive descent over the scanned items, checking what Go checks at parse time
    (functions exist, variables are declared, break/continue sit inside range)."""

    def __init__(self, src: str) -> None:
        self.src, self.items, self.i = src, _scan(src), 0
        self.vars, self.depth, self.loops = _Scope(), 0, 0
        # where each line starts, found once: an action's line is then a binary search, not a
        # count from the start of the template (which made parsing quadratic in its size)
        self.newlines = [m.start() for m in re.finditer("\n", src)]

    def line(self, pos: int) -> int:
        return bisect.bisect_left(self.newlines, pos) + 1

    def parse(self) -> tuple[Any, ...]:
        nodes, stop = self.block()
        if stop is not None:
            raise self.error(stop.pos, f"unexpected {{{{{stop.toks[0].value}}}}}")
        return nodes

    def error(self, pos: int, message: str) -> TemplateError:
        return _error(self.src, pos, message)

    def block(self) -> tuple[tuple[Any, ...], _Act | None]:
        """Nodes up to the {{else}} or {{end}} that stops them (returned; None at the end)."""
        nodes: list[Any] = []
        while self.i < len(self.items):
            item = self.items[self.i]
            self.i += 1
            if isinstance(item, str):
                nodes += [_Text(item)] if item else []
                continue
            head = item.toks[0] if item.toks else None
            word = head.value if head is not None and head.kind == "ident" else None
            if word in ("else", "end"):
                return tuple(nodes), item
            nodes.append(self.action(item, word))
        return tuple(nodes), None

    def action(self, act: _Act, word: str | None) -> Any:
        line = self.line(act.pos)
        if word in ("if", "range", "with"):
            return self.control(word, act.toks[1:], act)
        if word in ("break", "continue"):
            if len(act.toks) > 1:
                raise self.error(act.pos, f"unexpected {act.toks[1].value!r} in {word}")
            if not self.loops:
                raise self.error(act.pos, f"{{{{{word}}}}} outside {{{{range}}}}")
            return _Loop(word, line)
        if word in ("define", "template", "block"):
            raise self.error(act.pos, f"{{{{{word}}}}} is not supported")
        return _Action(self.pipeline(act.toks, act.pos, "command"), line)

    def control(self, kind: str, toks: tuple[_Tok, ...], act: _Act) -> _Branch:
        self.depth += 1
        if self.depth > templatelimits.MAX_NESTING:
            raise self.error(act.pos, "control structures nest deeper than the limit of "
                                      f"{templatelimits.MAX_NESTING}")
        mark = len(self.vars)
        pipe = self.pipeline(toks, act.pos, kind)
        self.loops += kind == "range"
        body, stop = self.block()
        self.loops -= kind == "range"
        if stop is None:
            raise self.error(act.pos, f"unexpected EOF: {{{{{kind}}}}} has no {{{{end}}}}")
        orelse: tuple[Any, ...] = ()
        rest = stop.toks[1:]
        if stop.toks[0].value == "else":
            if rest and rest[0].kind == "ident" and rest[0].value == kind != "range":
                orelse = (self.control(kind, rest[1:], stop),)  # else if: one {{end}} for both
                rest = ()
            else:
                if rest:
                    raise self.error(stop.pos, f"unexpected {rest[0].value!r} in else")
                orelse, stop = self.block()
                if stop is None or stop.toks[0].value != "end":
                    raise self.error(act.pos, f"expected {{{{end}}}} to close {{{{{kind}}}}}")
                rest = stop.toks[1:]
        if rest:
            raise self.error(stop.pos, f"unexpected {rest[0].value!r} in end")
        self.vars.truncate(mark)
        self.depth -= 1
        return _Branch(kind, pipe, body, orelse, self.line(act.pos))

    def pipeline(self, toks: tuple[_Tok, ...], pos: int, context: str) -> _Pipe:
        decl: list[str] = []
        assign, k = False, 0
        if len(toks) > 1 and toks[0].kind == "var" and _is_op(toks[1], ":= ="):
            decl, assign, k = [toks[0].value], toks[1].value == "=", 2
        elif (context == "range" and len(toks) > 3 and toks[0].kind == toks[2].kind == "var"
              and _is_op(toks[1], ",") and _is_op(toks[3], ":= =")):
            decl, assign, k = [toks[0].value, toks[2].value], toks[3].value == "=", 4
        if not toks[k:]:
            raise self.error(pos, f"missing value for {context}")
        cmds, end = self.commands(toks, k, pos, context)
        if end < len(toks):
            raise self.error(toks[end].pos, f"unexpected {toks[end].value!r} in {context}")
        for name in decl:
            if not assign:
                self.vars.append(name)
            elif name not in self.vars:
                raise self.error(pos, f"undefined variable {name!r}")
        return _Pipe(tuple(decl), assign, cmds)

    def commands(self, toks: tuple[_Tok, ...], i: int, pos: int,
                 context: str) -> tuple[tuple[tuple[Any, ...], ...], int]:
        """Commands joined by `|`, up to the end of the tokens or an unmatched `)`."""
        cmds: list[tuple[Any, ...]] = []
        while True:
            cmd: list[Any] = []
            while i < len(toks) and not _is_op(toks[i], "| )"):
                if cmd and not toks[i].spaced:
                    raise self.error(toks[i].pos, f"unexpected {toks[i].value!r} in operand")
                node, i = self.operand(toks, i)
                cmd.append(node)
            if not cmd:
                raise self.error(pos, f"missing value for {context}")
            if cmd[0] == _Lit(None):
                raise self.error(pos, "nil is not a command")
            if cmds and isinstance(cmd[0], _Lit | _Dot):
                raise self.error(pos, f"non executable command in pipeline stage {len(cmds) + 1}")
            cmds.append(tuple(cmd))
            if i < len(toks) and _is_op(toks[i], "|"):
                i += 1
                continue
            return tuple(cmds), i

    def operand(self, toks: tuple[_Tok, ...], i: int) -> tuple[Any, int]:
        tok = toks[i]
        i += 1
        node: Any
        if tok.kind == "field":
            node = _Field((tok.value,))
        elif tok.kind == "var":
            if tok.value not in self.vars:
                raise self.error(tok.pos, f"undefined variable {tok.value!r}")
            node = _Var(tok.value)
        elif tok.kind == "dot":
            node = _Dot()
        elif tok.kind in ("str", "num"):
            node = _Lit(tok.value)
        elif tok.kind == "ident" and tok.value in ("true", "false", "nil"):
            node = _Lit({"true": True, "false": False}.get(tok.value))
        elif tok.kind == "ident" and tok.value not in _KEYWORDS:
            if tok.value not in _FUNCS:
                raise self.error(tok.pos, f"function {tok.value!r} not defined")
            node = _Func(tok.value)
        elif _is_op(tok, "("):
            self.depth += 1
            if self.depth > templatelimits.MAX_NESTING:
                raise self.error(tok.pos, "parentheses nest deeper than the limit of "
                                          f"{templatelimits.MAX_NESTING}")
            cmds, i = self.commands(toks, i, tok.pos, "parenthesized pipeline")
            if i >= len(toks) or not _is_op(toks[i], ")"):
                raise self.error(tok.pos, "unclosed left paren")
            self.depth -= 1
            node, i = _Pipe((), False, cmds), i + 1
        else:
            raise self.error(tok.pos, f"unexpected {tok.value!r} in operand")
        names: list[str] = []
        while i < len(toks) and toks[i].kind == "field" and not toks[i].spaced:
            names.append(toks[i].value)
            i += 1
        if names:
            if isinstance(node, _Lit | _Dot):
                raise self.error(tok.pos, f"unexpected . after term {tok.value!r}")
            node = (_Field(node.names + tuple(names)) if isinstance(node, _Field)
                    else _Var(node.name, tuple(names)) if isinstance(node, _Var)
                    else _Chain(node, tuple(names)))
        return node, i
