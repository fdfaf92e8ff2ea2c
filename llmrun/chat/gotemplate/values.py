"""Go values as templates see them (structs, ordered and stringer maps and slices) and how Go
prints them: fmt's %v and Sprint, strconv.Quote, encoding/json's Marshal."""

from __future__ import annotations

import json
from collections.abc import Iterable
from decimal import Decimal
from typing import Any

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
