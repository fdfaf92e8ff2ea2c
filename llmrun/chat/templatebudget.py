"""The budget of one Jinja render and the sizes of what it builds: steps and time
(`Budget`, the current one in `BUDGET`), and the checks that refuse a string, list or integer
over templatelimits.py's limits, for string operations and operators before Python builds
their result (a `%` format, `*` on a string, `str.center`), for everything else after.

A chat template runs in the runner's engine thread, which every request on the model shares,
so whatever a template can make grow is counted here: jinjaenv.py calls these from every hook
of its sandbox."""

from __future__ import annotations

import re
import time
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

from jinja2.runtime import Namespace

from llmrun.chat import templatelimits
from llmrun.chat.templatelimits import TemplateError

# -- the budget of one render -------------------------------------------------------------------


class Budget:
    """Steps and time of one render (or one compile: Jinja folds constants by calling filters).
    A failure is sticky: whatever swallows the first exception, the next step raises again."""

    __slots__ = ("deadline", "depth", "failure", "next_check", "steps")

    def __init__(self) -> None:
        self.steps = self.depth = 0
        self.next_check = 0
        self.deadline = time.monotonic() + templatelimits.MAX_SECONDS
        self.failure: str | None = None

    def tick(self, n: int = 1) -> None:
        self.steps += n
        if self.steps >= self.next_check:  # the clock is read every 64 steps: it costs more
            self.check()

    def check(self) -> None:
        if self.failure is None:
            if self.steps > templatelimits.MAX_STEPS:
                self.failure = (f"chat template exceeds its limit of "
                                f"{templatelimits.MAX_STEPS} steps")
            elif time.monotonic() > self.deadline:
                self.failure = ("chat template exceeds its time limit of "
                                f"{templatelimits.MAX_SECONDS:g} seconds")
        if self.failure is not None:
            self.next_check = 0
            raise templatelimits.BudgetError(self.failure)
        self.next_check = self.steps + 64


BUDGET: ContextVar[Budget | None] = ContextVar("llmrun_template_budget", default=None)


def tick(n: int = 1) -> None:
    budget = BUDGET.get()
    if budget is not None:
        budget.tick(n)


def limit_text(size: int) -> None:
    if size > templatelimits.MAX_OUTPUT:
        raise TemplateError("chat template builds a string over its limit of "
                            f"{templatelimits.MAX_OUTPUT} characters")


def limit_items(count: int) -> None:
    if count > templatelimits.MAX_ITEMS:
        raise TemplateError("chat template builds a list over its limit of "
                            f"{templatelimits.MAX_ITEMS} items")


def limit_int(bits: int) -> None:
    if bits > templatelimits.MAX_INT_BITS:
        raise TemplateError(f"chat template computes an integer over its limit of "
                            f"{templatelimits.MAX_INT_BITS} bits")


def checked(value: Any) -> Any:
    """A value a call or filter returned, refused if it is too big to keep."""
    if isinstance(value, str | bytes):
        limit_text(len(value))
    elif isinstance(value, list | tuple):
        limit_items(len(value))
    elif isinstance(value, int):
        limit_int(value.bit_length())
    return value


def weight(value: Any, limit: int = templatelimits.MAX_OUTPUT) -> int:
    """About how many characters str(value) prints, counted no further than just past `limit`.
    Lengths alone do not bound it: a list holding one long string n times prints it n times."""
    if isinstance(value, str | bytes):
        return len(value)
    total, stack = 0, [value]
    while stack and total <= limit:
        v = stack.pop()
        if isinstance(v, str | bytes):
            total += len(v) + 2  # quoted (escapes can add more; the result is checked again)
        elif isinstance(v, int):
            total += v.bit_length() // 3 + 2
        elif isinstance(v, Namespace):
            stack.append(v._Namespace__attrs)
            total += 14
        elif isinstance(v, Mapping):
            tick(len(v))
            stack += v.keys()
            stack += v.values()
            total += 2 + 4 * len(v)
        elif isinstance(v, list | tuple | set | frozenset):
            tick(len(v))
            stack += v
            total += 2 + 2 * len(v)
        else:  # None, floats, ranges, views, generators, macros: short reprs
            total += 40
    return total


def as_text(value: Any) -> str:
    """str(value), once it is known to fit."""
    if isinstance(value, str):
        return value
    limit_text(weight(value))
    return checked(str(value))


# -- sizes of string operations, known before they run -----------------------------------------

_PRINTF = re.compile(r"%(?:\([^)]*\))?[#0 +\-]*(\*|\d+)?(?:\.(\*|\d+))?")
_FIELD = re.compile(r"\{([^{}]*(?:\{[^{}]*\}[^{}]*)*)\}")


def _number(digits: str) -> int:
    return int(digits[:18])  # wider than any limit already, and clear of int()'s digit cap


def _format_size(fmt: str, values: list[Any], widths: list[int], stars: bool,
                 fields: int) -> int:
    """Most characters `fmt` formatted with `values` can print: each field at its widest."""
    if stars:  # `%*d` or `{:{w}}`: widths come from the values
        widths += [abs(v) for v in values if isinstance(v, int)]
    widest = max((weight(v) for v in values), default=0)
    return len(fmt) + fields * (max(widths, default=0) + widest)


def _values(args: Any) -> list[Any]:
    if isinstance(args, tuple):
        return list(args)
    return list(args.values()) if isinstance(args, Mapping) else [args]


def printf_size(fmt: str, values: list[Any]) -> int:
    specs = _PRINTF.findall(fmt)
    widths = [_number(x) for spec in specs for x in spec if x.isdigit()]
    stars = any("*" in spec for spec in specs)
    return _format_size(fmt, values, widths, stars, len(specs))


def _str_format_size(fmt: str, values: list[Any]) -> int:
    fields = _FIELD.findall(fmt)
    specs = [f.partition(":")[2] for f in fields]
    widths = [_number(x) for spec in specs for x in re.findall(r"\d+", spec)]
    return _format_size(fmt, values, widths, any("{" in spec for spec in specs), len(fields))


def int_arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str,
             default: int) -> int:
    value = args[i] if len(args) > i else kwargs.get(name, default)
    return value if isinstance(value, int) else default


def replace_size(s: str, old: Any, new: Any, count: Any) -> int:
    if not isinstance(old, str) or not isinstance(new, str):
        return len(s)
    hits = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(0, len(new) - len(old))


def method_size(s: str | bytes, name: str, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> int | None:
    """Most characters a str (or bytes) method can return, for those whose arguments can make
    it grow without bound; None for the others (their results are checked after)."""
    if name in ("center", "ljust", "rjust", "zfill"):
        return max(len(s), int_arg(args, kwargs, 0, "width", 0))
    if name == "expandtabs":
        tabs = s.count(b"\t") if isinstance(s, bytes) else s.count("\t")
        return len(s) + tabs * max(0, int_arg(args, kwargs, 0, "tabsize", 8))
    if name == "replace" and isinstance(s, str) and len(args) >= 2:
        return replace_size(s, args[0], args[1], args[2] if len(args) > 2 else -1)
    if name == "join" and args:
        items = args[0] if isinstance(args[0], list | tuple) else ()
        limit_items(len(items))
        return len(s) * len(items) + sum(weight(x) for x in items)
    if name in ("format", "format_map") and isinstance(s, str):
        values = [*args, *kwargs.values()]
        if name == "format_map" and args and isinstance(args[0], Mapping):
            values = list(args[0].values())
        return _str_format_size(s, values)
    if name == "translate" and args:
        table = args[0]
        longest = max((weight(v) for v in table.values()), default=1) \
            if isinstance(table, Mapping) else 1
        return len(s) * max(1, longest)
    return None


def check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse an operation whose result would be too big, before Python builds it."""
    if operator == "*":
        if isinstance(left, int) and isinstance(right, int):
            limit_int(left.bit_length() + right.bit_length())
            return
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(n, int) and isinstance(seq, str | bytes):
            limit_text(len(seq) * n)
        elif isinstance(n, int) and isinstance(seq, list | tuple):
            limit_items(len(seq) * n)
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            limit_int(left.bit_length() * right)
    elif operator == "+":
        if isinstance(left, str | bytes) and isinstance(right, str | bytes):
            limit_text(len(left) + len(right))
        elif isinstance(left, list | tuple) and isinstance(right, list | tuple):
            limit_items(len(left) + len(right))
    elif operator == "%" and isinstance(left, str):
        limit_text(printf_size(left, _values(right)))
