"""Chat templates: the Jinja template a GGUF carries (or a Modelfile TEMPLATE, which may also be
Go text/template as Ollama's are: see gotemplate/), rendered safely.

Templates come from model files and from requests, i.e. from strangers: they are rendered in
Jinja's immutable sandbox (no attribute access to Python internals), with what Hugging Face's
renderer adds to it (`raise_exception`, `strftime_now`, its `tojson` and its arguments, its
`{% generation %}` tag) and the one thing llama.cpp's renderer allows that real templates
use: `append` and `pop` on lists (Kimi K2 queues its call ids in one). The variables are a
copy of what the caller passed, so a list a template appends to is never the caller's.
tests/unit/chat/test_corpus.py holds the renderer to Hugging Face's, template by template.
They run in the runner's engine thread, which every request on the model shares, so a render
is also bounded: steps, output, time, the size of every value it builds and the depth of its
macro calls (templatelimits.py: one place for both languages).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Mapping
from contextvars import ContextVar
from datetime import datetime
from functools import lru_cache, wraps
from typing import Any, cast

import jinja2
import jinja2.parser
from jinja2 import meta, nodes
from jinja2.compiler import CodeGenerator, Frame, optimizeconst
from jinja2.ext import Extension
from jinja2.runtime import LoopContext, Macro, Namespace
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEnvironment

from llmrun.chat import gotemplate, templatelimits
from llmrun.chat.templatelimits import TemplateError, check_size  # re-exported

# For models that carry no template of their own: a plain transcript that any base model
# continues sensibly.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% else %}Assistant: {{ m['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


# -- the budget of one render -------------------------------------------------------------------


class _Budget:
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


_BUDGET: ContextVar[_Budget | None] = ContextVar("llmrun_template_budget", default=None)


def _tick(n: int = 1) -> None:
    budget = _BUDGET.get()
    if budget is not None:
        budget.tick(n)


def _limit_text(size: int) -> None:
    if size > templatelimits.MAX_OUTPUT:
        raise TemplateError("chat template builds a string over its limit of "
                            f"{templatelimits.MAX_OUTPUT} characters")


def _limit_items(count: int) -> None:
    if count > templatelimits.MAX_ITEMS:
        raise TemplateError("chat template builds a list over its limit of "
                            f"{templatelimits.MAX_ITEMS} items")


def _limit_int(bits: int) -> None:
    if bits > templatelimits.MAX_INT_BITS:
        raise TemplateError(f"chat template computes an integer over its limit of "
                            f"{templatelimits.MAX_INT_BITS} bits")


def _checked(value: Any) -> Any:
    """A value a call or filter returned, refused if it is too big to keep."""
    if isinstance(value, str | bytes):
        _limit_text(len(value))
    elif isinstance(value, list | tuple):
        _limit_items(len(value))
    elif isinstance(value, int):
        _limit_int(value.bit_length())
    return value


def _weight(value: Any, limit: int = templatelimits.MAX_OUTPUT) -> int:
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
            _tick(len(v))
            stack += v.keys()
            stack += v.values()
            total += 2 + 4 * len(v)
        elif isinstance(v, list | tuple | set | frozenset):
            _tick(len(v))
            stack += v
            total += 2 + 2 * len(v)
        else:  # None, floats, ranges, views, generators, macros: short reprs
            total += 40
    return total


def _as_text(value: Any) -> str:
    """str(value), once it is known to fit."""
    if isinstance(value, str):
        return value
    _limit_text(_weight(value))
    return _checked(str(value))


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
    widest = max((_weight(v) for v in values), default=0)
    return len(fmt) + fields * (max(widths, default=0) + widest)


def _values(args: Any) -> list[Any]:
    if isinstance(args, tuple):
        return list(args)
    return list(args.values()) if isinstance(args, Mapping) else [args]


def _printf_size(fmt: str, values: list[Any]) -> int:
    specs = _PRINTF.findall(fmt)
    widths = [_number(x) for spec in specs for x in spec if x.isdigit()]
    stars = any("*" in spec for spec in specs)
    return _format_size(fmt, values, widths, stars, len(specs))


def _str_format_size(fmt: str, values: list[Any]) -> int:
    fields = _FIELD.findall(fmt)
    specs = [f.partition(":")[2] for f in fields]
    widths = [_number(x) for spec in specs for x in re.findall(r"\d+", spec)]
    return _format_size(fmt, values, widths, any("{" in spec for spec in specs), len(fields))


def _int_arg(args: tuple[Any, ...], kwargs: dict[str, Any], i: int, name: str,
             default: int) -> int:
    value = args[i] if len(args) > i else kwargs.get(name, default)
    return value if isinstance(value, int) else default


def _replace_size(s: str, old: Any, new: Any, count: Any) -> int:
    if not isinstance(old, str) or not isinstance(new, str):
        return len(s)
    hits = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        hits = min(hits, count)
    return len(s) + hits * max(0, len(new) - len(old))


def _method_size(s: str | bytes, name: str, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> int | None:
    """Most characters a str (or bytes) method can return, for those whose arguments can make
    it grow without bound; None for the others (their results are checked after)."""
    if name in ("center", "ljust", "rjust", "zfill"):
        return max(len(s), _int_arg(args, kwargs, 0, "width", 0))
    if name == "expandtabs":
        tabs = s.count(b"\t") if isinstance(s, bytes) else s.count("\t")
        return len(s) + tabs * max(0, _int_arg(args, kwargs, 0, "tabsize", 8))
    if name == "replace" and isinstance(s, str) and len(args) >= 2:
        return _replace_size(s, args[0], args[1], args[2] if len(args) > 2 else -1)
    if name == "join" and args:
        items = args[0] if isinstance(args[0], list | tuple) else ()
        _limit_items(len(items))
        return len(s) * len(items) + sum(_weight(x) for x in items)
    if name in ("format", "format_map") and isinstance(s, str):
        values = [*args, *kwargs.values()]
        if name == "format_map" and args and isinstance(args[0], Mapping):
            values = list(args[0].values())
        return _str_format_size(s, values)
    if name == "translate" and args:
        table = args[0]
        longest = max((_weight(v) for v in table.values()), default=1) \
            if isinstance(table, Mapping) else 1
        return len(s) * max(1, longest)
    return None


def _check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse an operation whose result would be too big, before Python builds it."""
    if operator == "*":
        if isinstance(left, int) and isinstance(right, int):
            _limit_int(left.bit_length() + right.bit_length())
            return
        seq, n = (left, right) if isinstance(right, int) else (right, left)
        if isinstance(n, int) and isinstance(seq, str | bytes):
            _limit_text(len(seq) * n)
        elif isinstance(n, int) and isinstance(seq, list | tuple):
            _limit_items(len(seq) * n)
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            _limit_int(left.bit_length() * right)
    elif operator == "+":
        if isinstance(left, str | bytes) and isinstance(right, str | bytes):
            _limit_text(len(left) + len(right))
        elif isinstance(left, list | tuple) and isinstance(right, list | tuple):
            _limit_items(len(left) + len(right))
    elif operator == "%" and isinstance(left, str):
        _limit_text(_printf_size(left, _values(right)))


# -- filters: each one a step, with its result (and where arguments can blow it up, its size
# beforehand) bounded --------------------------------------------------------------------------


def _filter_size(name: str, a: tuple[Any, ...], kw: dict[str, Any]) -> tuple[Any, ...]:
    """Check what the filter `name` will build from its value and arguments `a` (value first);
    returns the arguments to call it with (a one-shot iterator becomes a list to look at)."""
    value = a[0] if a else None
    if name in ("join", "sum") and not isinstance(value, str | bytes | list | tuple | Mapping) \
            and isinstance(value, Iterable):  # a range, a generator: look at its items first
        value = list(value)
        _limit_items(len(value))
        a = (value, *a[1:])
    if name == "center":
        _limit_text(_weight(value) + _int_arg(a, kw, 1, "width", 80))
    elif name == "indent":
        text = _as_text(value)
        width = a[1] if len(a) > 1 else kw.get("width", 4)
        prefix = len(width) if isinstance(width, str) else width if isinstance(width, int) else 4
        _limit_text(len(text) + (text.count("\n") + 1) * prefix)
    elif name == "join":
        sep = _weight(a[1] if len(a) > 1 else kw.get("d", ""))
        items = value if isinstance(value, list | tuple | Mapping) else ()
        _limit_text(len(value) * (1 + sep) if isinstance(value, str | bytes)
                    else sum(_weight(x) for x in items) + sep * len(items))
    elif name == "replace" and len(a) >= 3:
        _limit_text(_replace_size(_as_text(value), a[1], a[2], a[3] if len(a) > 3 else -1))
    elif name == "format":
        _limit_text(_printf_size(_as_text(value), [*a[1:], *kw.values()]))
    elif name == "wordwrap":
        text = _as_text(value)
        width = max(1, _int_arg(a, kw, 1, "width", 79))
        wrap = a[3] if len(a) > 3 else kw.get("wrapstring")
        lines = len(text) // width + text.count("\n") + 1
        _limit_text(len(text) + lines * (len(wrap) if isinstance(wrap, str) else 1))
    elif name in ("string", "pprint", "tojson", "list", "unique", "sort"):
        _limit_text(_weight(value))
    elif name in ("batch", "slice"):
        _limit_items(_int_arg(a, kw, 1, "linecount" if name == "batch" else "slices", 0))
    elif name == "sum" and isinstance(value, list):
        parts = [x for x in value if isinstance(x, list | tuple | str)]
        if parts:  # each addition copies the sum so far: cost grows with the square
            total = sum(map(len, parts))
            _limit_items(total)
            _tick(len(value) * total // 8)
    return a


def _bounded_filter(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    skip = 1 if getattr(fn, "jinja_pass_arg", None) is not None else 0  # context/environment

    @wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        _tick()
        args = (*args[:skip], *_filter_size(name, args[skip:], kwargs))
        return _checked(fn(*args, **kwargs))

    return run


def _listed(value: Any) -> list[Any]:
    """A one-shot iterator (what `map`, `select` and kin return) as the list llama.cpp's
    renderer would have made of it: DeepSeek R1's template (llama.cpp's copy) writes
    `tools | map(attribute='function') | tojson`. Bounded as it is read: its items were
    built lazily, each within bounds, but there may be many."""
    out: list[Any] = []
    size = 0
    for item in value:
        _tick()
        out.append(item)
        _limit_items(len(out))
        size += _weight(item, templatelimits.MAX_OUTPUT - size)
        _limit_text(size)
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
# since the variables it sees are copies (_plain).
_LIST_METHODS = frozenset({"append", "pop"})


def _plain(value: Any) -> Any:
    """What a template sees of a variable: its dicts and lists copied (Hugging Face gives
    templates such a copy too), anything else as it is (the variables are JSON-like: a tuple
    holds no list to change). Iterative: a request's JSON may nest hundreds deep."""
    def fresh(v: Any) -> Any:
        return {} if type(v) is dict else [] if type(v) is list else v

    top = fresh(value)
    stack = [(value, top)] if top is not value else []
    while stack:
        src, dst = stack.pop()
        for key, item in (src.items() if type(src) is dict else enumerate(src)):
            copy = fresh(item)
            if type(dst) is dict:
                dst[key] = copy
            else:
                dst.append(copy)
            if copy is not item:
                stack.append((item, copy))
    return top


class _Counted:
    """A loop's iterable whose items are steps: loops are where templates spend their time."""

    __slots__ = ("_budget", "_it", "_source")

    def __init__(self, source: Iterable[Any], budget: _Budget) -> None:
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
    _limit_text(sum(map(len, pieces)))
    return "".join(pieces)


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The immutable sandbox, with every way a template can loop, recurse or grow a value
    counted against the render's budget (_BUDGET) or refused past the limits above."""

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
        return value if isinstance(value, str) else _as_text(value)

    def is_safe_attribute(self, obj: Any, attr: str, value: Any) -> bool:
        if type(obj) is list and attr in _LIST_METHODS:  # see _LIST_METHODS
            return SandboxedEnvironment.is_safe_attribute(self, obj, attr, value)
        return super().is_safe_attribute(obj, attr, value)

    def llmrun_iter(self, iterable: Any) -> Any:
        budget = _BUDGET.get()
        return iterable if budget is None else _Counted(iterable, budget)

    def llmrun_concat(self, items: tuple[Any, ...]) -> str:
        _tick()
        size = 0
        for item in items:
            size += _weight(item, templatelimits.MAX_OUTPUT - size)
            _limit_text(size)
        return "".join(map(str, items))

    # The hooks below run for most of what a template does: the step is counted inline.

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any,
                   right: Any) -> Any:
        budget = _BUDGET.get()
        if budget is not None:
            budget.steps += 1
            if budget.steps >= budget.next_check:
                budget.check()
        if operator == "+" and type(left) is str and type(right) is str:  # '<|im_start|>' + x
            if len(left) + len(right) > templatelimits.MAX_OUTPUT:
                _limit_text(len(left) + len(right))
            return left + right
        _check_binop(operator, left, right)
        return self.binop_table[operator](left, right)

    def getattr(self, obj: Any, attribute: str) -> Any:
        budget = _BUDGET.get()
        if budget is not None:
            budget.steps += 1
            if budget.steps >= budget.next_check:
                budget.check()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        budget = _BUDGET.get()
        if budget is not None:
            budget.steps += 1
            if budget.steps >= budget.next_check:
                budget.check()
        return super().getitem(obj, argument)

    def call(__self, __context: jinja2.runtime.Context, __obj: Any,
             *args: Any, **kwargs: Any) -> Any:
        _tick()
        target = getattr(__obj, "__wrapped__", __obj)  # str.format comes wrapped by the sandbox
        owner = getattr(target, "__self__", None)
        if type(owner) is list and getattr(target, "__name__", "") == "append":
            _limit_items(len(owner) + 1)
        elif isinstance(owner, str | bytes):
            size = _method_size(owner, getattr(target, "__name__", ""), args, kwargs)
            if size is not None:
                _limit_text(size)
        if not isinstance(__obj, Macro | LoopContext):
            return _checked(super().call(__context, __obj, *args, **kwargs))
        budget = _BUDGET.get()
        if budget is None:
            return _checked(super().call(__context, __obj, *args, **kwargs))
        if isinstance(__obj, LoopContext) and args:  # a recursive loop's next level
            args = (_Counted(args[0], budget), *args[1:])
        budget.depth += 1
        try:
            if budget.depth > templatelimits.MAX_DEPTH:
                raise TemplateError(f"chat template nests macro calls deeper than its limit "
                                    f"of {templatelimits.MAX_DEPTH}")
            return _checked(super().call(__context, __obj, *args, **kwargs))
        finally:
            budget.depth -= 1


_ENV = _BoundedEnvironment()


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    # Compiling folds constant expressions by calling filters and operators: budgeted too.
    token = _BUDGET.set(_Budget())
    try:
        return _ENV.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"chat template does not compile: {exc}") from None
    except Exception as exc:  # e.g. RecursionError on absurd nesting: a request error
        raise TemplateError(f"chat template does not compile: {type(exc).__name__}: "
                            f"{exc}") from None
    finally:
        _BUDGET.reset(token)


def _generate(template: jinja2.Template, variables: dict[str, Any]) -> str:
    """Render piece by piece, stopping at the output limit or when the budget runs out."""
    budget = _Budget()
    token = _BUDGET.set(budget)
    # (a generator: jinja2 annotates it as an Iterator, which has no close())
    pieces = cast("Generator[str, None, None]", template.generate(**variables))
    try:
        out: list[str] = []
        size = 0
        for piece in pieces:
            size += len(piece)
            if size > templatelimits.MAX_OUTPUT:
                raise TemplateError("chat template output exceeds its limit of "
                                    f"{templatelimits.MAX_OUTPUT} characters")
            out.append(piece)
            budget.tick()
        return "".join(out)
    finally:
        pieces.close()
        _BUDGET.reset(token)


def check(source: str) -> None:
    """Raise TemplateError if `source` (Jinja or Go) is too big or does not compile."""
    check_size(source)
    if gotemplate.looks_like_go(source):
        gotemplate.check(source)
    else:
        _compile(source)


@lru_cache(maxsize=16)
def free_names(source: str) -> frozenset[str]:
    """The variables a Jinja template reads without setting them itself (none for a Go
    template, or one that does not compile): what a caller may have to supply."""
    if gotemplate.looks_like_go(source):
        return frozenset()
    check_size(source)
    token = _BUDGET.set(_Budget())
    try:
        return frozenset(meta.find_undeclared_variables(_ENV.parse(source)))
    except Exception:  # the render reports a broken template; here it just reads nothing
        return frozenset()
    finally:
        _BUDGET.reset(token)


def render(source: str, messages: list[dict[str, Any]], *, bos_token: str = "",
           eos_token: str = "", add_generation_prompt: bool = True, **extra: Any) -> str:
    """Render a chat template: Jinja (Hugging Face, GGUF files), or Go text/template as in
    Ollama Modelfiles, where the Jinja variables `tools`, `enable_thinking` and
    `reasoning_effort` become Ollama's `.Tools` and `.Think`."""
    check_size(source)
    if gotemplate.looks_like_go(source):
        think = extra.get("reasoning_effort") or extra.get("enable_thinking")
        return gotemplate.render(source, messages, tools=extra.get("tools"),
                                 add_generation_prompt=add_generation_prompt, think=think)
    template = _compile(source)
    try:
        return _generate(template, {
            "messages": _plain(messages), "bos_token": bos_token, "eos_token": eos_token,
            "add_generation_prompt": add_generation_prompt, **_plain(extra)})
    except TemplateError:
        raise
    except jinja2.exceptions.SecurityError as exc:
        raise TemplateError(f"chat template tried something unsafe: {exc}") from None
    except Exception as exc:  # a broken template must become a request error, not a crash
        raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None


def with_system(messages: list[dict[str, Any]], system: str | None) -> list[dict[str, Any]]:
    """Prepend the model's default system prompt unless the conversation has its own."""
    if system and not any(m.get("role") == "system" for m in messages):
        return [{"role": "system", "content": system}, *messages]
    return messages
