"""The Jinja environment chat templates render in: Jinja's immutable sandbox with what Hugging
Face's renderer adds to it (`raise_exception`, `strftime_now`, its `tojson` and its arguments,
its `{% generation %}` tag), the `append` and `pop` on lists llama.cpp's renderer allows, and
every filter, loop, operator, call and `~` counted against the render's budget or refused past
the limits (templatebudget.py). `ENV` is the one environment every template compiles in."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import datetime
from functools import wraps
from typing import Any

import jinja2
import jinja2.parser
from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.ext import Extension
from jinja2.runtime import LoopContext, Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment

from llmrun.chat import templatelimits
from llmrun.chat.templatebudget import (
    BUDGET,
    Budget,
    as_text,
    check_binop,
    checked,
    int_arg,
    limit_items,
    limit_text,
    method_size,
    printf_size,
    replace_size,
    tick,
    weight,
)
from llmrun.chat.templatelimits import TemplateError

# -- filters: each one a step, with its result (and where arguments can blow it up, its size
# beforehand) bounded --------------------------------------------------------------------------


def _filter_size(name: str, a: tuple[Any, ...], kw: dict[str, Any]) -> tuple[Any, ...]:
    """Check what the filter `name` will build from its value and arguments `a` (value first);
    returns the arguments to call it with (a one-shot iterator becomes a list to look at)."""
    value = a[0] if a else None
    if name in ("join", "sum") and not isinstance(value, str | bytes | list | tuple | Mapping) \
            and isinstance(value, Iterable):  # a range, a generator: look at its items first
        value = list(value)
        limit_items(len(value))
        a = (value, *a[1:])
    if name == "center":
        limit_text(weight(value) + int_arg(a, kw, 1, "width", 80))
    elif name == "indent":
        text = as_text(value)
        width = a[1] if len(a) > 1 else kw.get("width", 4)
        prefix = len(width) if isinstance(width, str) else width if isinstance(width, int) else 4
        limit_text(len(text) + (text.count("\n") + 1) * prefix)
    elif name == "join":
        sep = weight(a[1] if len(a) > 1 else kw.get("d", ""))
        items = value if isinstance(value, list | tuple | Mapping) else ()
        limit_text(len(value) * (1 + sep) if isinstance(value, str | bytes)
                    else sum(weight(x) for x in items) + sep * len(items))
    elif name == "replace" and len(a) >= 3:
        limit_text(replace_size(as_text(value), a[1], a[2], a[3] if len(a) > 3 else -1))
    elif name == "format":
        limit_text(printf_size(as_text(value), [*a[1:], *kw.values()]))
    elif name == "wordwrap":
        text = as_text(value)
        width = max(1, int_arg(a, kw, 1, "width", 79))
        wrap = a[3] if len(a) > 3 else kw.get("wrapstring")
        lines = len(text) // width + text.count("\n") + 1
        limit_text(len(text) + lines * (len(wrap) if isinstance(wrap, str) else 1))
    elif name in ("string", "pprint", "tojson", "list", "unique", "sort"):
        limit_text(weight(value))
    elif name in ("batch", "slice"):
        limit_items(int_arg(a, kw, 1, "linecount" if name == "batch" else "slices", 0))
    elif name == "sum" and isinstance(value, list):
        parts = [x for x in value if isinstance(x, list | tuple | str)]
        if parts:  # each addition copies the sum so far: cost grows with the square
            total = sum(map(len, parts))
            limit_items(total)
            tick(len(value) * total // 8)
    return a


def _bounded_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    skip = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0  # context/environment

    @wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        tick()
        args = (*args[:skip], *_filter_size(name, args[skip:], kwargs))
        return checked(fn(*args, **kwargs))

    return run


def _listed(value: Any) -> list[Any]:
    """A one-shot iterator (what `map`, `select` and kin return) as the list llama.cpp's
    renderer would have made of it: DeepSeek R1's template (llama.cpp's copy) writes
    `tools | map(attribute='function') | tojson`. Bounded as it is read: its items were
    built lazily, each within bounds, but there may be many."""
    out: list[Any] = []
    size = 0
    for item in value:
        tick()
        out.append(item)
        limit_items(len(out))
        size += weight(item, templatelimits.MAX_OUTPUT - size)
        limit_text(size)
    return out


def _json_default(value: Any) -> Any:
    if isinstance(value, Iterator):
        return _listed(value)
    raise TypeError(f"Object of type {type(value).__name__} is not JSON serializable")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    """Hugging Face's tojson (its arguments, non-ASCII kept), with bounded widths."""
    if indent is not None and (len(indent) if isinstance(indent, str) else indent) > 16:
        raise TemplateError("chat template asks tojson for an indent over its limit of 16")
    if separators is not None and (
            not isinstance(separators, list | tuple) or len(separators) != 2
            or any(not isinstance(x, str) or len(x) > 16 for x in separators)):
        raise TemplateError("chat template asks tojson for separators other than two "
                            "strings of at most 16 characters")
    if isinstance(value, Iterator):
        value = _listed(value)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent,
                      separators=None if separators is None else tuple(separators),
                      sort_keys=sort_keys, default=_json_default)


def _raise(message: str) -> None:
    raise TemplateError(message)


# -- the environment ----------------------------------------------------------------------------


class _Generation(Extension):
    """Hugging Face's `{% generation %}...{% endgeneration %}`: it marks the assistant's part
    for training masks and renders its body unchanged (LFM2.5, Poolside Laguna). Parsed as
    Hugging Face parses it, a call block, so a `set` inside stays inside as it does there."""

    tags = {"generation"}  # noqa: RUF012 (Jinja's own class attribute)

    def parse(self, parser: jinja2.parser.Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Macro) -> str:
        return caller()


# Lists a template may grow or shrink, as llama.cpp's renderer lets it: its own lists only,
# since the variables it sees are copies (templates.py copies them).
_LIST_METHODS = frozenset({"append", "pop"})


class _Counted:
    """A loop's iterable whose items are steps: loops are where templates spend their time."""

    __slots__ = ("_budget", "_it", "_source")

    def __init__(self, source: Iterable[Any], budget: Budget) -> None:
        self._source, self._it, self._budget = source, iter(source), budget

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> Any:
        self._budget.tick()
        return next(self._it)

    def __len__(self) -> int:  # loop.length and loop.last without a copy, where there is one
        return len(self._source)  # type: ignore[arg-type]


class _CodeGenerator(CodeGenerator):
    """Jinja's compiler with two more hooks the sandbox lacks: every loop iterates through
    `environment.llmrun_iter` and every `~` joins through `environment.llmrun_concat`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.loop_iters: dict[int, nodes.Node] = {}  # by id; the node kept so the id stays its

    def visit_For(self, node: nodes.For, frame: Frame) -> None:
        self.loop_iters[id(node.iter)] = node.iter
        super().visit_For(node, frame)

    def visit(self, node: nodes.Node, *args: Any, **kwargs: Any) -> Any:
        if id(node) not in self.loop_iters:
            return super().visit(node, *args, **kwargs)
        self.write("environment.llmrun_iter(")
        super().visit(node, *args, **kwargs)
        self.write(")")
        return None

    @optimizeconst
    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.llmrun_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


def _join(pieces: Iterable[str]) -> str:
    """Joins what a macro, a {% set %} block or a {% filter %} block wrote: each piece was
    bounded, but a loop can write one many times."""
    pieces = list(pieces)
    limit_text(sum(map(len, pieces)))
    return "".join(pieces)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with every way a template can loop, recurse or grow a value
    counted against the render's budget (BUDGET) or refused past the limits above."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"+", "*", "**", "%"})
    concat = staticmethod(_join)

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True,
                         extensions=[_Generation, "jinja2.ext.loopcontrols"],
                         finalize=self._finalize, autoescape=False)
        del self.globals["lipsum"]  # lorem ipsum of any length: no chat template needs it
        self.globals["raise_exception"] = _raise
        self.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.filters["tojson"] = _tojson
        self.filters = {name: _bounded_filter(name, fn) for name, fn in self.filters.items()}

    @staticmethod
    def _finalize(value: Any) -> Any:
        """Every `{{ value }}`: printed only once its size is known to fit."""
        return value if isinstance(value, str) else as_text(value)

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        if type(obj) is list and attr in _LIST_METHODS:  # see _LIST_METHODS
            return SandboxedEnvironment.is_safe_attribute(self, obj, attr, value)
        return super().is_safe_attribute(obj, attr, value)

    def llmrun_iter(self, iterable: Any) -> Any:
        budget = BUDGET.get()
        return iterable if budget is None else _Counted(iterable, budget)

    def llmrun_concat(self, items: tuple[Any, ...]) -> str:
        tick()
        size = 0
        for item in items:
            size += weight(item, templatelimits.MAX_OUTPUT - size)
            limit_text(size)
        return "".join(map(str, items))

    # The hooks below run for most of what a template does: the step is counted inline.

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any,
                   right: Any) -> Any:
        budget = BUDGET.get()
        if budget is not None:
            budget.steps += 1
            if budget.steps >= budget.next_check:
                budget.check()
        if operator == "+" and type(left) is str and type(right) is str:  # '<|im_start|>' + x
            if len(left) + len(right) > templatelimits.MAX_OUTPUT:
                limit_text(len(left) + len(right))
            return left + right
        check_binop(operator, left, right)
        return self.binop_table[operator](left, right)

    def getattr(self, obj: Any, attribute: str) -> Any:
        budget = BUDGET.get()
        if budget is not None:
            budget.steps += 1
            if budget.steps >= budget.next_check:
                budget.check()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        budget = BUDGET.get()
        if budget is not None:
            budget.steps += 1
            if budget.steps >= budget.next_check:
                budget.check()
        return super().getitem(obj, argument)

    def call(__self, __context: jinja2.runtime.Context, __obj: Any,
             *args: Any, **kwargs: Any) -> Any:
        tick()
        target = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped by the sandbox
        owner = getattr(target, "__self__", None)
        if type(owner) is list and getattr(target, "__name__", "") == "append":
            limit_items(len(owner) + 1)
        elif isinstance(owner, str | bytes):
            size = method_size(owner, getattr(target, "__name__", ""), args, kwargs)
            if size is not None:
                limit_text(size)
        if not isinstance(__obj, Macro | LoopContext):
            return checked(super().call(__context, __obj, *args, **kwargs))
        budget = BUDGET.get()
        if budget is None:
            return checked(super().call(__context, __obj, *args, **kwargs))
        if isinstance(__obj, LoopContext) and args:  # a recursive loop's next level
            args = (_Counted(args[0], budget), *args[1:])
        budget.depth += 1
        try:
            if budget.depth > templatelimits.MAX_DEPTH:
                raise TemplateError(f"chat template nests macro calls deeper than its limit "
                                    f"of {templatelimits.MAX_DEPTH}")
            return checked(super().call(__context, __obj, *args, **kwargs))
        finally:
            budget.depth -= 1


ENV = _BoundedEnvironment()
