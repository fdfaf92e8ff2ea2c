"""Go text/template's executor: one render walks the parsed nodes over the data, bounded in
steps, time and output."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from llmrun.chat import templatelimits
from llmrun.chat.gotemplate.funcs import _FUNCS, _PRINTERS, _Fail, _truth
from llmrun.chat.gotemplate.parse import (
    _Action,
    _Branch,
    _Chain,
    _Dot,
    _Field,
    _Func,
    _Lit,
    _Loop,
    _Pipe,
    _Text,
    _Var,
)
from llmrun.chat.gotemplate.values import _fmt, _Struct, _type_name
from llmrun.chat.templatelimits import TemplateError


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
        self.deadline = time.monotonic() + templatelimits.MAX_SECONDS

    def run(self, nodes: tuple[Any, ...], data: dict[str, Any]) -> None:
        self.vars = [["$", data]]
        try:
            self.walk(data, nodes)
        except _Fail as exc:
            raise TemplateError(f"template: line {self.line}: {exc}") from None

    def write(self, text: str) -> None:
        self.size += len(text)
        if self.size > templatelimits.MAX_OUTPUT:
            raise _Fail(f"output exceeds its limit of {templatelimits.MAX_OUTPUT} characters")
        self.out.append(text)

    def tick(self) -> None:
        self.steps += 1
        if self.steps > templatelimits.MAX_STEPS:
            raise _Fail(f"exceeds its limit of {templatelimits.MAX_STEPS} steps")
        if not self.steps & 63 and time.monotonic() > self.deadline:  # the clock costs more
            raise _Fail(f"exceeds its time limit of {templatelimits.MAX_SECONDS:g} seconds")

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
                > templatelimits.MAX_OUTPUT:  # `print $s $s $s ...`: refused before it is built
            raise _Fail(f"{name} makes a string over its limit of "
                        f"{templatelimits.MAX_OUTPUT} characters")
        try:
            result = fn(*values, *(() if final is _MISSING else (final,)))
        except (ValueError, TypeError, OverflowError) as exc:
            raise _Fail(f"error calling {name}: {exc}") from None
        if isinstance(result, str) and len(result) > templatelimits.MAX_OUTPUT:
            raise _Fail(f"{name} makes a string over its limit of "
                        f"{templatelimits.MAX_OUTPUT} characters")
        return result


def _describe(node: Any) -> str:
    if isinstance(node, _Field | _Var):
        head = "" if isinstance(node, _Field) else node.name
        return head + "".join("." + n for n in node.names)
    return repr(node.value) if isinstance(node, _Lit) else "value"
