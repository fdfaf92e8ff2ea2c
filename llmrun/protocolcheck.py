"""The shape checker of llmrun.protocol: a check compiled from each message's type hints
(dataclasses, TypedDicts, pydantic models), which raises Bad naming what is wrong and where,
and the checks of what any runner reply may hold whatever its declared shape (finite numbers,
counts of zero or more).

A pydantic model field is checked here for its outer shape (an object); `builder` then
validates it into the model, so a message's typed fields arrive typed on the other side.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable, Iterable
from typing import Any, Literal, NotRequired, Union

from pydantic import BaseModel


class ProtocolError(ValueError):
    """A frame that is not a message of this protocol (what is wrong, and where)."""


class RefusedRequest(ProtocolError):
    """A request message of the right shape whose typed field (a pydantic model) does not
    validate: `cause` says why. The peer is sound, the request is not: it ends only request
    `id` (the runner answers it an error event), as when the runner validated it itself."""

    def __init__(self, rid: str, cause: Exception) -> None:
        super().__init__(f"request {rid[:40]!r}: {type(cause).__name__}")
        self.id = rid
        self.cause = cause


class Bad(Exception):
    """A check's failure on its way out: `path` is filled in by the containers it passes
    through, so a frame that checks out formats no string at all (the events of every step
    pass here)."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what
        self.path: list[str] = []

    def error(self, where: str) -> ProtocolError:
        path = "".join(p if p.startswith(("[", " ")) else f".{p}" for p in reversed(self.path))
        return ProtocolError(f"{where}{path}: {self.what}")


Check = Callable[[Any], None]


def expected(what: str, value: Any) -> Bad:
    shown = repr(value)[:40] if isinstance(value, str | int | float | None) \
        else type(value).__name__
    return Bad(f"expected {what}, got {shown}")


# The largest integer a float holds exactly (and JavaScript clients read exactly): counts,
# ids and sizes are far below it, so a number past it is a runner that lies.
MAX_INT = 1 << 53


def _scalar(kind: type, what: str) -> Check:
    def check(value: Any) -> None:
        # exact types: a JSON true is no integer here, an integer is a float's value
        if type(value) is not kind and not (kind is float and type(value) is int):
            raise expected(what, value)
        if kind is int or kind is float:
            _in_range(value)
    return check


def _in_range(value: Any) -> None:
    """A number a dialect's JSON and /metrics can carry: finite, and an integer within
    MAX_INT (the standard library's fallback reads NaN, Infinity and any integer)."""
    if type(value) is float and not math.isfinite(value):
        raise expected("a finite number", value)
    if type(value) is int and not -MAX_INT <= value <= MAX_INT:
        raise expected(f"a number within {MAX_INT}", value)


_CHECKS: dict[Any, Check] = {
    str: _scalar(str, "a string"), int: _scalar(int, "an integer"),
    bool: _scalar(bool, "a boolean"), float: _scalar(float, "a number"),
}


def _any(value: Any) -> None:
    pass


def compile_check(tp: Any) -> Check:
    """The check of a value of type `tp` (as the dataclasses and TypedDicts above use them)."""
    if tp in _CHECKS:
        return _CHECKS[tp]
    if tp is Any:
        return _any
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is NotRequired:
        return compile_check(args[0])
    if origin is Literal:
        choices = frozenset(args)

        def literal(value: Any) -> None:
            if type(value) is not str or value not in choices:
                raise expected(f"one of {sorted(choices)}", value)
        return literal
    if origin in (Union, types.UnionType):
        options = [compile_check(a) for a in args if a is not type(None)]
        nullable = type(None) in args
        what = " or ".join(str(a).replace("typing.", "") for a in args)

        def union(value: Any) -> None:
            if value is None and nullable:
                return
            for option in options:
                try:
                    option(value)
                    return
                except Bad:
                    pass
            raise expected(what, value)
        return union
    if origin is list:
        # int-lists: a plain type test per item, no call (token ids: thousands per message)
        if tp == list[int]:
            def ints(value: Any) -> None:
                if type(value) is not list or not all(isinstance(v, int) for v in value):
                    raise expected("a list of integers", value)
            return ints
        item = compile_check(args[0])

        def listed(value: Any) -> None:
            if type(value) is not list:
                raise expected("a list", value)
            if item is not _any:
                for i, v in enumerate(value):
                    try:
                        item(v)
                    except Bad as bad:
                        bad.path.append(f"[{i}]")
                        raise
        return listed
    if origin is dict:
        values = compile_check(args[1])

        def mapping(value: Any) -> None:
            if type(value) is not dict:
                raise expected("an object", value)
            if values is not _any:
                _members(value, {}, values)
        return mapping
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return object_check(tp)
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return mapping_check  # its outer shape; builder validates it into the model
    if typing.is_typeddict(tp):
        return typeddict_check(tp)
    raise TypeError(f"no check for {tp!r}")


def _members(value: dict[str, Any], checks: dict[str, Check], extra: Check | None) -> None:
    for name, v in value.items():
        c = checks.get(name, extra)
        if c is None:
            raise Bad(f"unknown field {str(name)[:40]!r}")
        try:
            c(v)
        except Bad as bad:
            bad.path.append(str(name)[:40])
            raise


def fields_check(hints: dict[str, Any], required: set[str], extra: Check | None = None) -> Check:
    """The check of an object with these fields (`extra`: what any other field may hold;
    None: no other field)."""
    checks = {name: compile_check(tp) for name, tp in hints.items()}
    needed = frozenset(required)

    def check(value: Any) -> None:
        if type(value) is not dict:
            raise expected("an object", value)
        if not needed <= value.keys():
            raise Bad(f"missing {', '.join(sorted(needed - value.keys()))}")
        _members(value, checks, extra)
    return check


def typeddict_check(tp: Any, extra: Check | None = None) -> Check:
    """The check of a TypedDict's fields. (Its own __required_keys__ is wrong on Python 3.11
    when annotations are strings, as here: every key reads as required.)"""
    hints = typing.get_type_hints(tp, include_extras=True)
    required = {k for k, v in hints.items() if typing.get_origin(v) is not NotRequired}
    return fields_check(hints, required, extra)


def model_check(model: type[BaseModel], omit: Iterable[str] = ()) -> Check:
    """The check of a payload that `model` (a pydantic model of request.py) reads: its fields
    and their types, required where the model has no default; `omit`: fields the daemon
    fills in itself, which the runner may not send. One type per event on both sides: the
    model the dialects read is the shape checked here."""
    fields = {name: f for name, f in model.model_fields.items() if name not in set(omit)}
    return fields_check({name: f.annotation for name, f in fields.items()},
                        {name for name, f in fields.items() if f.is_required()})


def object_check(cls: type) -> Check:
    """The check of a dataclass's fields (which then builds it: see builder)."""
    hints = typing.get_type_hints(cls)
    fields = dataclasses.fields(cls)
    required = {f.name for f in fields if f.default is dataclasses.MISSING
                and f.default_factory is dataclasses.MISSING}
    return fields_check({f.name: hints[f.name] for f in fields}, required)


def mapping_check(value: Any) -> None:
    if type(value) is not dict:
        raise expected("an object", value)


def builder(cls: type) -> Callable[[dict[str, Any]], Any]:
    """Check a frame against dataclass `cls` and build it (nested dataclasses too, pydantic
    model fields validated into their model: RefusedRequest if one does not validate)."""
    check = object_check(cls)
    hints = typing.get_type_hints(cls)
    nested = {name: typing.get_args(hint)[0] for name, hint in hints.items()
              if typing.get_origin(hint) is list
              and dataclasses.is_dataclass(typing.get_args(hint)[0])}
    models = {name: hint for name, hint in hints.items()
              if isinstance(hint, type) and issubclass(hint, BaseModel)}

    def build(msg: dict[str, Any]) -> Any:
        check(msg)
        kwargs = {k: v for k, v in msg.items() if k != "type"}
        for name, item in nested.items():
            if name in kwargs:
                kwargs[name] = [item(**v) for v in kwargs[name]]
        for name, model in models.items():
            if name in kwargs:
                try:
                    kwargs[name] = model.model_validate(kwargs[name])
                except Exception as exc:  # (RecursionError too: a request nested too deeply)
                    raise RefusedRequest(str(msg.get("id", "")), exc) from None
        return cls(**kwargs)
    return build


def number(value: Any) -> None:
    if type(value) not in (int, float):
        raise expected("a number", value)
    _in_range(value)


def word(value: Any) -> None:
    if value is not None and type(value) not in (str, int, float, bool):
        raise expected("a number, a string, a boolean or null", value)
    if type(value) in (int, float):
        _in_range(value)


# What the model computed or wrote, carried as data: a tool call's arguments may hold any
# number (-5, 1e300), and an embedding of a model that overflows in half precision a NaN
# (written as null, as before). The dialects write them as they are: no counts to check.
MODEL_DATA = frozenset({"tool_calls", "partial_call", "embeddings"})


def sane(value: Any) -> None:
    """What a runner reports, whatever its declared shape (logprobs and tool calls are read
    later by pydantic): every float finite (NaN is no JSON a client can read), every integer
    within MAX_INT. (Token ids may be negative: an image's positions are stand-in ids.)"""
    if type(value) is int:
        if not -MAX_INT <= value <= MAX_INT:
            raise expected(f"a number within {MAX_INT}", value)
    elif type(value) is float:
        if not math.isfinite(value):
            raise expected("a finite number", value)
    elif type(value) is dict:
        for k, v in value.items():
            if k not in MODEL_DATA:
                sane(v)
    elif type(value) is list:
        for v in value:
            sane(v)


def counts(payload: Any) -> None:
    """The counts of a statistics event (tokens, nanoseconds, steps) are zero or more: a
    negative one would run a /metrics counter backwards (prometheus raises)."""
    for v in payload.values():
        if type(v) in (int, float) and v < 0:
            raise expected("a count of zero or more", v)
