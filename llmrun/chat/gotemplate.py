"""Go text/template chat templates: the syntax of Ollama's Modelfile TEMPLATE instruction.

Ollama renders prompts with Go's text/template over its own data model (`.System`, `.Messages`,
`.Tools`, ...), so templates written for it cannot go through Jinja. This is a small interpreter
for that language, built for untrusted input: templates only reach fields of the plain values
built here (never Python attributes), output, running time and nesting are bounded, and every
failure is a `TemplateError`. `render` reproduces Ollama's `template.Execute`
(template/template.go), including its fallback for templates that predate `.Messages`.
"""

from __future__ import annotations

import bisect
import json
import re
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from datetime import date, timedelta
from decimal import Decimal
from functools import lru_cache
from typing import Any

from llmrun.chat import templates as limits  # MAX_*: the limits of both template languages
from llmrun.chat.templates import TemplateError

# -- values: what templates see -------------------------------------------------------------


class _Struct:
    """A Go struct: named fields (the only thing a template can reach) and its encoding/json
    form. `stringer` types print as that JSON, like Ollama's types with a String() method."""

    __slots__ = ("fields", "json", "stringer", "type_name")

    def __init__(self, type_name: str, fields: dict[str, Any], json_form: dict | None = None,
                 stringer: bool = False) -> None:
        self.type_name, self.fields, self.stringer = type_name, fields, stringer
        self.json = _Ordered(fields) if json_form is None else json_form


class _Ordered(dict):
    """A JSON object that keeps its key order (a struct, an ordered map); plain dicts are Go
    maps, whose keys encoding/json sorts."""


class _JSONMap(dict):
    """A Go map type whose String() is its JSON (Ollama's templateArgs, templateProperties)."""


class _JSONList(list):
    """Ollama's templateTools: a slice whose String() is its JSON (`null` when nil)."""

    nil = False


class _PropertyType(list):
    """api.PropertyType: a JSON schema type, one name or several."""


def _text(value: Any) -> str:
    if isinstance(value, list):  # content parts
        return "".join(p.get("text", "") for p in value if isinstance(p, dict))
    return "" if value is None else str(value)


def _go_value(v: Any) -> Any:
    """JSON data as Go decodes it into `any`: every number a float64."""
    if isinstance(v, bool) or v is None or isinstance(v, str | float):
        return v
    if isinstance(v, int):
        return float(v)
    if isinstance(v, dict):
        return {str(k): _go_value(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_go_value(x) for x in v]
    return str(v)


def _list(v: Any) -> list:
    return v if isinstance(v, list) else []


def _property(schema: Any) -> _Struct:
    """api.ToolProperty: only the schema keys Ollama keeps, with its JSON field order."""
    s = schema if isinstance(schema, dict) else {}
    t = s.get("type")
    ptype = _PropertyType([t] if isinstance(t, str) else [str(x) for x in _list(t)])
    props = s.get("properties")
    f = {"AnyOf": [_property(x) for x in _list(s.get("anyOf"))], "Type": ptype,
         "Items": _go_value(s.get("items")), "Description": _text(s.get("description")),
         "Enum": [_go_value(x) for x in _list(s.get("enum"))],
         "Properties": _Ordered((str(k), _property(v)) for k, v in props.items())
         if isinstance(props, dict) else None,
         "Required": [str(x) for x in _list(s.get("required"))]}
    j = _Ordered()
    for key, name, empty in (("anyOf", "AnyOf", []), ("type", "Type", []), ("items", "Items", None),
                             ("description", "Description", ""), ("enum", "Enum", []),
                             ("properties", "Properties", None), ("required", "Required", [])):
        if f[name] is not None and f[name] != empty:  # omitempty
            j[key] = f[name]
    return _Struct("api.ToolProperty", f, j)


def _tool(tool: dict[str, Any]) -> _Struct:
    """Ollama's templateTool. Its function and parameters print as JSON too: they did before
    Ollama 0.14, and templates such as qwen2.5's (`{{ .Function }}`) rely on it."""
    fn = tool.get("function") or {}
    params = fn.get("parameters") or {}
    props = params.get("properties")
    properties = _JSONMap((str(k), _property(v)) for k, v in props.items()) \
        if isinstance(props, dict) else _JSONMap()
    pf = {"Type": _text(params.get("type")), "Defs": _go_value(params.get("$defs")),
          "Items": _go_value(params.get("items")),
          "Required": [str(x) for x in _list(params.get("required"))], "Properties": properties}
    pj = _Ordered(type=pf["Type"])
    for key, name in (("$defs", "Defs"), ("items", "Items"), ("required", "Required")):
        if pf[name] is not None and pf[name] != []:
            pj[key] = pf[name]
    pj["properties"] = properties if isinstance(props, dict) else None
    parameters = _Struct("template.templateToolFunctionParameters", pf, pj, stringer=True)
    name, description = _text(fn.get("name")), _text(fn.get("description"))
    function = _Struct("template.templateToolFunction",
                       {"Name": name, "Description": description, "Parameters": parameters},
                       _Ordered(name=name, description=description, parameters=parameters),
                       stringer=True)
    tf = {"Type": _text(tool.get("type")), "Items": _go_value(tool.get("items")),
          "Function": function}
    tj = _Ordered(type=tf["Type"])
    if tf["Items"] is not None:
        tj["items"] = tf["Items"]
    tj["function"] = function
    return _Struct("template.templateTool", tf, tj, stringer=True)


def _tool_call(call: dict[str, Any]) -> _Struct:
    fn = call.get("function") or {}
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise TemplateError("tool call arguments are not valid JSON") from None
    if not isinstance(args, dict | None):
        raise TemplateError("tool call arguments must be a JSON object")
    function = _Struct("template.templateToolCallFunction", {
        "Index": fn["index"] if isinstance(fn.get("index"), int) else 0,
        "Name": _text(fn.get("name")),
        "Arguments": _JSONMap((str(k), _go_value(v)) for k, v in (args or {}).items())})
    return _Struct("template.templateToolCall", {"ID": _text(call.get("id")), "Function": function})


def _message(m: dict[str, Any]) -> _Struct:
    calls = [_tool_call(c) for c in _list(m.get("tool_calls"))]
    # the thought arrives as `reasoning_content` (the Hugging Face name) from llmrun's history
    thought = m.get("thinking") or m.get("reasoning_content")
    f = {"Role": m["role"], "Content": m["content"], "Thinking": _text(thought),
         "Images": [], "ToolCalls": calls, "ToolName": _text(m.get("tool_name") or m.get("name")),
         "ToolCallID": _text(m.get("tool_call_id"))}
    json_form = _Ordered(f, Images=None, ToolCalls=calls or None)
    return _Struct("*template.templateMessage", f, json_form)


def _collate(messages: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """Ollama's collate: every system text joined (for `.System`), and consecutive messages of
    one role merged, except tool results."""
    system: list[str] = []
    out: list[dict[str, Any]] = []
    for m in messages:
        m = {**m, "role": _text(m.get("role")).lower(), "content": _text(m.get("content"))}
        if m["role"] == "system":
            system.append(m["content"])
        if out and out[-1]["role"] == m["role"] and m["role"] != "tool":
            out[-1]["content"] += "\n\n" + m["content"]
        else:
            out.append(m)
    return "\n\n".join(system), out


# -- printing: Go's fmt and encoding/json -----------------------------------------------------


def _float(f: float, style: str) -> str:
    """Shortest float64 text: fmt's %v ('v') or encoding/json's ('json')."""
    if f != f or f in (float("inf"), float("-inf")):
        if style == "json":
            raise ValueError("unsupported value")
        return "NaN" if f != f else ("+Inf" if f > 0 else "-Inf")
    if f == 0:
        return "0"
    _, digits, exponent = Decimal(repr(abs(f))).as_tuple()
    point = len(digits) + int(exponent)  # |f| = 0.DIGITS x 10**point
    ds = "".join(map(str, digits)).rstrip("0")
    exp = point - 1
    if (abs(f) < 1e-6 or abs(f) >= 1e21) if style == "json" else (exp < -4 or exp >= 6):
        text = ds[0] + ("." + ds[1:] if len(ds) > 1 else "")
        text += f"e{'-' if exp < 0 else '+'}{abs(exp):{'' if style == 'json' else '02'}}"
    elif point <= 0:
        text = "0." + "0" * -point + ds
    else:
        text = ds[:point] + "0" * (point - len(ds)) + ("." + ds[point:] if len(ds) > point else "")
    return "-" + text if f < 0 else text


def _json_str(s: str) -> str:
    out = json.dumps(s, ensure_ascii=False)
    for c, esc in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"), ("\u2028", "\\u2028"),
                   ("\u2029", "\\u2029")):
        out = out.replace(c, esc)
    return out


def _json(v: Any) -> str:
    """encoding/json's Marshal: compact, map keys sorted, <, > and & escaped."""
    if isinstance(v, _Struct):
        return _json(v.json)
    if v is None or (isinstance(v, _JSONList) and v.nil):
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return str(v) if isinstance(v, int) else _float(v, "json")
    if isinstance(v, str):
        return _json_str(v)
    if isinstance(v, _PropertyType) and len(v) == 1:
        return _json_str(v[0])
    if isinstance(v, list | tuple):
        return "[" + ",".join(map(_json, v)) + "]"
    if isinstance(v, dict):
        keys = list(v) if isinstance(v, _Ordered) else sorted(v, key=str)
        return "{" + ",".join(f"{_json_str(str(k))}:{_json(v[k])}" for k in keys) + "}"
    raise ValueError(f"cannot encode {type(v).__name__}")


def _fmt(v: Any) -> str:
    """fmt's %v, calling String() where Ollama's types have one."""
    if isinstance(v, str):
        return v
    if v is None:
        return "<nil>"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return str(v) if isinstance(v, int) else _float(v, "v")
    if isinstance(v, _PropertyType) and len(v) < 2:
        return v[0] if v else ""
    if isinstance(v, _JSONMap | _JSONList) or (isinstance(v, _Struct) and v.stringer):
        try:
            return _json(v)
        except ValueError:
            return ""
    if isinstance(v, _Struct):
        return "{" + " ".join(map(_fmt, v.fields.values())) + "}"
    if isinstance(v, dict):
        return "map[" + " ".join(f"{_fmt(k)}:{_fmt(v[k])}" for k in sorted(v, key=str)) + "]"
    return "[" + " ".join(map(_fmt, v)) + "]"


def _type_name(v: Any) -> str:
    if isinstance(v, _Struct):
        return v.type_name
    for t, name in ((bool, "bool"), (int, "int"), (float, "float64"), (str, "string"),
                    (dict, "map[string]interface {}"), (list, "[]interface {}")):
        if isinstance(v, t):
            return name
    return "<nil>"


def _sprint(args: Iterable[Any]) -> str:
    """fmt.Sprint: a space between operands when neither is a string."""
    out: list[str] = []
    prev: Any = ""
    for a in args:
        if out and not isinstance(a, str) and not isinstance(prev, str):
            out.append(" ")
        out.append(_fmt(a))
        prev = a
    return "".join(out)


def _go_quote(s: str) -> str:
    """strconv.Quote."""
    named = {"\a": "\\a", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t",
             "\v": "\\v", '"': '\\"', "\\": "\\\\"}
    out = []
    for c in s:
        n = ord(c)
        if c in named:
            out.append(named[c])
        elif c.isprintable():
            out.append(c)
        else:
            out.append(f"\\x{n:02x}" if n < 0x80 else f"\\u{n:04x}" if n < 0x10000
                       else f"\\U{n:08x}")
    return '"' + "".join(out) + '"'


_VERB = re.compile(r"%([-+# 0]*)(\d+)?(?:\.(\d*))?(.?)", re.S)


def _format_arg(verb: str, arg: Any, flags: str, prec: int | None) -> str | None:
    """One printf operand, or None where Go would print %!verb(type=value)."""
    if isinstance(arg, bool):
        return _fmt(arg) if verb in "vt" else None
    if isinstance(arg, int):
        sign = "+" if "+" in flags and arg >= 0 else ""
        if verb in "cq":
            return (chr(arg) if verb == "c" else f"'{chr(arg)}'") if 0 <= arg < 0x110000 else None
        forms = {"v": "d", "d": "d", "b": "b", "o": "o", "x": "x", "X": "X"}
        return sign + format(arg, forms[verb]) if verb in forms else None
    if isinstance(arg, float):
        sign = "+" if "+" in flags and arg >= 0 else ""
        if verb not in "vgGeEfF":
            return None
        if verb in "vgG" and prec is None:
            return sign + _float(arg, "v")
        return sign + format(arg, f".{6 if prec is None else prec}{'g' if verb == 'v' else verb}")
    if isinstance(arg, str):
        text = arg if prec is None else arg[:prec]
        if verb in "xX":
            return text.encode().hex() if verb == "x" else text.encode().hex().upper()
        return {"v": text, "s": text, "q": _go_quote(text)}.get(verb)
    if arg is None:
        return "<nil>" if verb == "v" else None
    return _fmt(arg) if verb in "vsd" else None


def _sprintf(fmt: str, args: list[Any]) -> str:
    """fmt.Sprintf for the verbs chat templates use (v s d q t x f e g c ...)."""
    out: list[str] = []
    pos = n = size = 0
    for m in _VERB.finditer(fmt):
        out.append(fmt[pos:m.start()])
        pos = m.end()
        flags, width, prec, verb = m.groups()
        if verb == "%" or not verb:
            out.append("%" if verb else "%!(NOVERB)")
            continue
        if n >= len(args):
            out.append(f"%!{verb}(MISSING)")
            continue
        arg, n = args[n], n + 1
        w = int(width or 0)
        if w > 1_000_000 or (prec and int(prec) > 1_000_000):
            out.append("%!(BADWIDTH)")
            continue
        text = _format_arg(verb, arg, flags, None if prec is None else int(prec or 0))
        if text is None:
            text = f"%!{verb}(<nil>)" if arg is None else f"%!{verb}({_type_name(arg)}={_fmt(arg)})"
        if "-" in flags:
            text = text.ljust(w)
        elif "0" in flags and isinstance(arg, int | float) and not isinstance(arg, bool):
            sign = text[0] if text[:1] in "+-" else ""
            text = sign + text[len(sign):].rjust(w - len(sign), "0")
        else:
            text = text.rjust(w)
        size += len(text)  # many wide verbs: stop before joining them all
        if size > limits.MAX_OUTPUT:
            raise _Fail(f"printf makes a string over its limit of {limits.MAX_OUTPUT} characters")
        out.append(text)
    out.append(fmt[pos:])
    if n < len(args):
        out.append("%!(EXTRA " + ", ".join(f"{_type_name(a)}={_fmt(a)}" for a in args[n:]) + ")")
    return "".join(out)


# -- built-in functions -----------------------------------------------------------------------


class _Fail(Exception):
    """An execution error; the caller adds the line."""


def _truth(v: Any) -> bool:
    """Go's truth: false, 0, nil and empty strings, slices and maps are false; structs true."""
    return True if isinstance(v, _Struct) else bool(v)


def _kind(v: Any) -> str:
    for t, name in ((bool, "bool"), (int, "int"), (float, "float"), (str, "string")):
        if isinstance(v, t):
            return name
    return "nil" if v is None else "other"


def _eq(a: Any, *others: Any) -> bool:
    ka = _kind(a)
    for b in others:
        kb = _kind(b)
        if ka == kb == "other":
            if not (isinstance(a, _Struct) and isinstance(b, _Struct)):
                raise _Fail(f"non-comparable types {_type_name(a)} and {_type_name(b)}")
            same = a is b
        elif ka != kb:
            if "nil" not in (ka, kb):
                raise _Fail(f"incompatible types for comparison: {_type_name(a)} and "
                            f"{_type_name(b)}")
            same = False
        else:
            same = a == b
        if same:
            return True
    return False


def _lt(a: Any, b: Any) -> bool:
    ka, kb = _kind(a), _kind(b)
    if ka not in ("int", "float", "string") or kb not in ("int", "float", "string"):
        raise _Fail(f"invalid type for comparison: {_type_name(a)} and {_type_name(b)}")
    if ka != kb:
        raise _Fail(f"incompatible types for comparison: {_type_name(a)} and {_type_name(b)}")
    return a < b


def _int(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise _Fail(f"cannot index slice/array with type {_type_name(v)}")
    return v


def _index(item: Any, *keys: Any) -> Any:
    for key in keys:
        if isinstance(item, dict):
            if not isinstance(key, str):
                raise _Fail(f"value has type {_type_name(key)}; should be string")
            item = item.get(key)
        elif isinstance(item, list | tuple | str):
            seq = item.encode() if isinstance(item, str) else item
            i = _int(key)
            if not 0 <= i < len(seq):
                raise _Fail(f"index out of range: {i}")
            item = seq[i]
        else:
            raise _Fail("index of untyped nil" if item is None
                        else f"can't index item of type {_type_name(item)}")
    return item


def _slice(item: Any, *bounds: Any) -> Any:
    if not isinstance(item, list | tuple | str):
        raise _Fail("slice of untyped nil" if item is None
                    else f"can't slice item of type {_type_name(item)}")
    seq = item.encode() if isinstance(item, str) else item
    idx = [_int(b) for b in bounds]
    lo, hi = (idx[0] if idx else 0), (idx[1] if len(idx) > 1 else len(seq))
    for i in (lo, hi):
        if not 0 <= i <= len(seq):
            raise _Fail(f"index out of range: {i}")
    if lo > hi:
        raise _Fail(f"invalid slice index: {lo} > {hi}")
    return seq[lo:hi].decode(errors="replace") if isinstance(item, str) else list(seq[lo:hi])


def _len(v: Any) -> int:
    if isinstance(v, str):
        return len(v.encode())
    if isinstance(v, list | tuple | dict):
        return len(v)
    raise _Fail("len of nil pointer" if v is None else f"len of type {_type_name(v)}")


def _printf(fmt: Any, *args: Any) -> str:
    if not isinstance(fmt, str):
        raise _Fail(f"wrong type for value; expected string; got {_type_name(fmt)}")
    return _sprintf(fmt, list(args))


def _escaper(fn: Callable[[str], str]) -> Callable[..., str]:
    """html/js/urlquery: escape the one string argument, or the Sprint of them all."""
    return lambda *a: fn(a[0] if len(a) == 1 and isinstance(a[0], str) else _sprint(a))


def _html(s: str) -> str:
    for c, esc in (("&", "&amp;"), ("'", "&#39;"), ('"', "&#34;"), ("<", "&lt;"), (">", "&gt;"),
                   ("\0", "\ufffd")):
        s = s.replace(c, esc)
    return s


def _js(s: str) -> str:
    named = {"\\": "\\\\", "'": "\\'", '"': '\\"', "<": "\\u003C", ">": "\\u003E",
             "&": "\\u0026", "=": "\\u003D"}
    return "".join(named.get(c) or (f"\\u{ord(c):04X}" if c < " " or (c >= "\x80" and
                                                                     not c.isprintable()) else c)
                   for c in s)


def _json_func(v: Any) -> str:
    try:
        return _json(v)
    except ValueError:
        return ""  # Ollama ignores the marshalling error


# name: (function, fewest arguments, most arguments or None); `and`/`or` are evaluated lazily.
_FUNCS: dict[str, tuple[Callable[..., Any] | None, int, int | None]] = {
    "and": (None, 1, None), "or": (None, 1, None),
    "not": (lambda v: not _truth(v), 1, 1),
    "eq": (_eq, 2, None), "ne": (lambda a, b: not _eq(a, b), 2, 2),
    "lt": (_lt, 2, 2), "le": (lambda a, b: _lt(a, b) or _eq(a, b), 2, 2),
    "gt": (lambda a, b: not (_lt(a, b) or _eq(a, b)), 2, 2),
    "ge": (lambda a, b: not _lt(a, b), 2, 2),
    "len": (_len, 1, 1), "index": (_index, 1, None), "slice": (_slice, 1, 3),
    "print": (lambda *a: _sprint(a), 0, None), "printf": (_printf, 1, None),
    "println": (lambda *a: " ".join(map(_fmt, a)) + "\n", 0, None),
    "html": (_escaper(_html), 0, None), "js": (_escaper(_js), 0, None),
    "urlquery": (_escaper(lambda s: urllib.parse.quote_plus(s, safe="")), 0, None),
    "json": (_json_func, 1, 1),
    "currentDate": (lambda *_: date.today().isoformat(), 0, None),
    "yesterdayDate": (lambda *_: (date.today() - timedelta(days=1)).isoformat(), 0, None),
}

_PRINTERS = frozenset({"print", "printf", "println", "html", "js", "urlquery"})

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
        if self.depth > limits.MAX_NESTING:
            raise self.error(act.pos, "control structures nest deeper than the limit of "
                                      f"{limits.MAX_NESTING}")
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
            if self.depth > limits.MAX_NESTING:
                raise self.error(tok.pos, "parentheses nest deeper than the limit of "
                                          f"{limits.MAX_NESTING}")
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


# -- execution --------------------------------------------------------------------------------


class _Break(Exception):
    pass


class _Continue(Exception):
    pass


_MISSING = object()  # no value piped into a command


def _field(value: Any, name: str) -> Any:
    """`.name` of a value: struct fields and map keys only (a missing key is nil, as with
    Ollama's missingkey=zero)."""
    if isinstance(value, _Struct):
        if name not in value.fields:
            raise _Fail(f"can't evaluate field {name} in type {value.type_name}")
        return value.fields[name]
    if isinstance(value, dict):
        return value.get(name)
    if value is None:
        raise _Fail(f"nil pointer evaluating interface {{}}.{name}")
    raise _Fail(f"can't evaluate field {name} in type {_type_name(value)}")


def _iterate(value: Any) -> Iterable[tuple[Any, Any]]:
    if value is None:
        return ()
    if isinstance(value, list | tuple):
        return enumerate(value)
    if isinstance(value, dict):
        return ((k, value[k]) for k in sorted(value, key=str))
    if isinstance(value, int) and not isinstance(value, bool):
        return ((i, i) for i in range(value))
    raise _Fail(f"range can't iterate over {_fmt(value)}")


class _State:
    """One render: the variable stack, the output and the budgets."""

    def __init__(self) -> None:
        self.vars: list[list[Any]] = []
        self.out: list[str] = []
        self.size = self.steps = 0
        self.line = 1
        self.deadline = time.monotonic() + limits.MAX_SECONDS

    def run(self, nodes: tuple[Any, ...], data: dict[str, Any]) -> None:
        self.vars = [["$", data]]
        try:
            self.walk(data, nodes)
        except _Fail as exc:
            raise TemplateError(f"template: line {self.line}: {exc}") from None

    def write(self, text: str) -> None:
        self.size += len(text)
        if self.size > limits.MAX_OUTPUT:
            raise _Fail(f"output exceeds its limit of {limits.MAX_OUTPUT} characters")
        self.out.append(text)

    def tick(self) -> None:
        self.steps += 1
        if self.steps > limits.MAX_STEPS:
            raise _Fail(f"exceeds its limit of {limits.MAX_STEPS} steps")
        if not self.steps & 63 and time.monotonic() > self.deadline:  # the clock costs more
            raise _Fail(f"exceeds its time limit of {limits.MAX_SECONDS:g} seconds")

    def walk(self, dot: Any, nodes: tuple[Any, ...]) -> None:
        for node in nodes:
            self.tick()
            if isinstance(node, _Text):
                self.write(node.text)
                continue
            self.line = node.line
            if isinstance(node, _Action):
                value = self.pipe(dot, node.pipe)
                if not node.pipe.decl:
                    self.write("<no value>" if value is None else _fmt(value))
            elif isinstance(node, _Loop):
                raise _Break() if node.kind == "break" else _Continue()
            elif node.kind == "range":
                self.range(dot, node)
            else:
                self.branch(dot, node)

    def branch(self, dot: Any, node: _Branch) -> None:
        mark = len(self.vars)
        try:
            value = self.pipe(dot, node.pipe)
            if _truth(value):
                self.walk(value if node.kind == "with" else dot, node.body)
            else:
                self.walk(dot, node.orelse)
        finally:
            del self.vars[mark:]

    def range(self, dot: Any, node: _Branch) -> None:
        mark = len(self.vars)
        try:
            ran = False
            for key, elem in _iterate(self.pipe(dot, node.pipe)):
                self.tick()
                ran = True
                values = [elem] if len(node.pipe.decl) == 1 else [key, elem]
                for k, (name, value) in enumerate(zip(node.pipe.decl, values, strict=False)):
                    if node.pipe.assign:
                        self.set_var(name, value)
                    else:
                        self.vars[mark + k][1] = value
                inner = len(self.vars)
                try:
                    self.walk(elem, node.body)
                except _Continue:
                    pass
                except _Break:
                    break
                finally:
                    del self.vars[inner:]
            if not ran:
                self.walk(dot, node.orelse)
        finally:
            del self.vars[mark:]

    def lookup(self, name: str) -> list[Any]:
        for entry in reversed(self.vars):
            if entry[0] == name:
                return entry
        raise _Fail(f"undefined variable {name!r}")

    def set_var(self, name: str, value: Any) -> None:
        self.lookup(name)[1] = value

    def pipe(self, dot: Any, pipe: _Pipe) -> Any:
        value: Any = _MISSING
        for cmd in pipe.cmds:
            value = self.command(dot, cmd, value)
        for name in pipe.decl:
            if pipe.assign:
                self.set_var(name, value)
            else:
                self.vars.append([name, value])
        return value

    def command(self, dot: Any, cmd: tuple[Any, ...], final: Any) -> Any:
        head, args = cmd[0], cmd[1:]
        if isinstance(head, _Func):
            return self.call(dot, head.name, args, final)
        if args or final is not _MISSING:
            raise _Fail(f"can't give argument to non-function {_describe(head)}")
        return self.eval(dot, head)

    def eval(self, dot: Any, node: Any) -> Any:
        if isinstance(node, _Field):
            return self.fields(dot, node.names)
        if isinstance(node, _Var):
            return self.fields(self.lookup(node.name)[1], node.names)
        if isinstance(node, _Dot):
            return dot
        if isinstance(node, _Lit):
            return node.value
        if isinstance(node, _Func):
            return self.call(dot, node.name, (), _MISSING)
        if isinstance(node, _Chain):
            return self.fields(self.eval(dot, node.node), node.names)
        return self.pipe(dot, node)

    def fields(self, value: Any, names: tuple[str, ...]) -> Any:
        for name in names:
            value = _field(value, name)
        return value

    def call(self, dot: Any, name: str, args: tuple[Any, ...], final: Any) -> Any:
        fn, fewest, most = _FUNCS[name]
        n = len(args) + (final is not _MISSING)
        if n < fewest or (most is not None and n > most):
            want = f"at least {fewest}" if most is None else f"{fewest}" if fewest == most \
                else f"{fewest} to {most}"
            raise _Fail(f"wrong number of args for {name}: want {want} got {n}")
        if fn is None:  # and/or: stop at the first false/true value, which is the result
            value = None
            for arg in args:
                value = self.eval(dot, arg)
                if _truth(value) == (name == "or"):
                    return value
            return value if final is _MISSING else final
        values = [self.eval(dot, arg) for arg in args]
        if name in _PRINTERS and sum(len(v) for v in values if isinstance(v, str)) \
                > limits.MAX_OUTPUT:  # `print $s $s $s ...`: refused before it is built
            raise _Fail(f"{name} makes a string over its limit of {limits.MAX_OUTPUT} characters")
        try:
            result = fn(*values, *(() if final is _MISSING else (final,)))
        except (ValueError, TypeError, OverflowError) as exc:
            raise _Fail(f"error calling {name}: {exc}") from None
        if isinstance(result, str) and len(result) > limits.MAX_OUTPUT:
            raise _Fail(f"{name} makes a string over its limit of {limits.MAX_OUTPUT} characters")
        return result


def _describe(node: Any) -> str:
    if isinstance(node, _Field | _Var):
        head = "" if isinstance(node, _Field) else node.name
        return head + "".join("." + n for n in node.names)
    return repr(node.value) if isinstance(node, _Lit) else "value"


# -- Ollama's execution -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Template:
    nodes: tuple[Any, ...]
    uses_messages: bool
    through_response: tuple[Any, ...]  # legacy mode's last turn: cut after the first .Response


def _identifiers(nodes: tuple[Any, ...]) -> set[str]:
    """Lower-cased field and variable names, as Ollama's Vars() collects them to pick a mode."""
    names: set[str] = set()

    def pipe(p: _Pipe) -> None:
        for cmd in p.cmds:
            for arg in cmd:
                if isinstance(arg, _Field | _Var):
                    names.update(n.lower() for n in arg.names)
                    names.update([arg.name.lower()] if isinstance(arg, _Var) else [])
                elif isinstance(arg, _Pipe):
                    pipe(arg)

    def walk(ns: tuple[Any, ...]) -> None:
        for n in ns:
            if isinstance(n, _Action | _Branch):
                pipe(n.pipe)
            if isinstance(n, _Branch):
                walk(n.body)
                walk(n.orelse)

    walk(nodes)
    return names


def _through_response(nodes: tuple[Any, ...]) -> tuple[Any, ...]:
    """Ollama's deleteNode: drop everything after the first `.Response` field in a depth-first
    walk (conditions of if/range/with are not searched), so the reply continues from there."""
    cut = False

    def pipe(p: _Pipe) -> _Pipe | None:
        nonlocal cut
        cmds = []
        for cmd in p.cmds:
            args = []
            for arg in cmd:
                if isinstance(arg, _Field) and "Response" in arg.names:
                    cut = True
                    args.append(arg)
                elif not cut:
                    sub = pipe(arg) if isinstance(arg, _Pipe) else arg
                    args += [sub] if sub is not None else []
            if not args:
                return None
            cmds.append(tuple(args))
        return replace(p, cmds=tuple(cmds))

    def walk(ns: tuple[Any, ...]) -> tuple[Any, ...]:
        out: list[Any] = []
        for n in ns:
            if cut:
                break
            if isinstance(n, _Action):
                p = pipe(n.pipe)
                out += [replace(n, pipe=p)] if p is not None else []
            elif isinstance(n, _Branch):
                out.append(replace(n, body=walk(n.body), orelse=walk(n.orelse)))
            else:
                out.append(n)
        return tuple(out)

    return walk(nodes)


@lru_cache(maxsize=32)
def _parse(source: str) -> tuple[Any, ...]:
    return _Parser(source).parse()


@lru_cache(maxsize=32)
def _compile(source: str) -> _Template:
    nodes = _parse(source)
    names = _identifiers(nodes)
    if "messages" not in names and "response" not in names:  # Ollama appends {{ .Response }}
        response = _Pipe((), False, ((_Field(("Response",)),),))
        nodes += (_Action(response, source.count("\n") + 1),)
    return _Template(nodes, "messages" in names, _through_response(nodes))


def _render_legacy(template: _Template, messages: list[dict[str, Any]], extra: dict[str, Any],
                   add_generation_prompt: bool, state: _State) -> None:
    """Templates without .Messages render one exchange (.System, .Prompt, .Response) at a
    time; the last one stops after .Response, so the model writes (or continues) the reply."""
    turn = {"System": "", "Prompt": "", "Response": ""}

    def flush() -> None:
        state.run(template.nodes, {**turn, **extra})
        turn.update(System="", Prompt="", Response="")

    for m in messages:
        if m["role"] == "system":
            if turn["Prompt"] or turn["Response"]:
                flush()
            turn["System"] = m["content"]
        elif m["role"] == "user":
            if turn["Response"]:
                flush()
            turn["Prompt"] = m["content"]
        elif m["role"] == "assistant":
            turn["Response"] = m["content"]
    last = template.through_response if add_generation_prompt else template.nodes
    state.run(last, {**turn, **extra})


def render(source: str, messages: list[dict[str, Any]], *,
           tools: list[dict[str, Any]] | None = None, add_generation_prompt: bool = True,
           think: bool | str | None = None) -> str:
    """Render an Ollama chat template over OpenAI/Hugging Face style messages and tools, as
    Ollama's template.Execute does. `add_generation_prompt=False` only matters to templates
    without .Messages: the last exchange is then rendered whole instead of cut after
    .Response (with .Messages the template alone decides, as in Ollama)."""
    limits.check_size(source)
    template = _compile(source)
    levels = ("high", "medium", "low", "max")
    extra = {"Think": think is True or think in levels,
             "ThinkLevel": "medium" if think is True else think if think in levels else "",
             "IsThinkSet": think is not None}
    state = _State()
    try:
        system, msgs = _collate(messages)
        if template.uses_messages:
            state.run(template.nodes, {
                "System": system, "Messages": [_message(m) for m in msgs], "Tools": _tools(tools),
                "Response": "", **extra})
        else:
            _render_legacy(template, msgs, extra, add_generation_prompt, state)
    except TemplateError:
        raise
    except Exception as exc:  # e.g. RecursionError on absurdly nested data: a request error
        raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
    return "".join(state.out)


def check(source: str) -> None:
    """Raise TemplateError if `source` is too big or does not parse."""
    limits.check_size(source)
    _compile(source)


def execute(source: str, data: dict[str, Any]) -> str:
    """Run a Go template over plain data (dict keys are its fields), with none of Ollama's
    conventions: for tests, and for text other than chat prompts."""
    limits.check_size(source)
    state = _State()
    try:
        state.run(_parse(source), data)
    except TemplateError:
        raise
    except Exception as exc:
        raise TemplateError(f"template failed: {type(exc).__name__}: {exc}") from None
    return "".join(state.out)


def _tools(tools: list[dict[str, Any]] | None) -> _JSONList:
    out = _JSONList(_tool(t) for t in tools or [])
    out.nil = tools is None
    return out


_GO_ACTION = re.compile(r"\{\{-?\s*(?:[.$]|/\*|(?:if|range|with|else|end|template|define|block"
                        r"|break|continue)\b(?!\s*\())")


def looks_like_go(source: str) -> bool:
    """Whether a template is Go text/template (Ollama) rather than Jinja (Hugging Face): Go
    actions such as `{{ .X }}`, `{{ if .X }}`, `{{ end }}`, and no Jinja `{% %}` blocks."""
    return "{%" not in source and _GO_ACTION.search(source) is not None
