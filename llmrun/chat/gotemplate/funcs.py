"""Go text/template's built-in functions (and Ollama's `json`, `currentDate`,
`yesterdayDate`), with fmt.Sprintf for `printf`; each refuses to build an oversized string."""

from __future__ import annotations

import re
import urllib.parse
from collections.abc import Callable
from datetime import date, timedelta
from typing import Any

from llmrun.chat import templatelimits
from llmrun.chat.gotemplate.values import (
    _float,
    _fmt,
    _go_quote,
    _json,
    _sprint,
    _Struct,
    _type_name,
)

# -- built-in functions -----------------------------------------------------------------------


class _Fail(Exception):
    """An execution error; the caller adds the line."""


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
        if size > templatelimits.MAX_OUTPUT:
            raise _Fail(f"printf makes a string over its limit of "
                        f"{templatelimits.MAX_OUTPUT} characters")
        out.append(text)
    out.append(fmt[pos:])
    if n < len(args):
        out.append("%!(EXTRA " + ", ".join(f"{_type_name(a)}={_fmt(a)}" for a in args[n:]) + ")")
    return "".join(out)


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
    return seq[lo:hi].decode(errors="replace") if isinstance(seq, bytes) else list(seq[lo:hi])


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
