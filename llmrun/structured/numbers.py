"""Every number a JSON schema admits bounded so that what a client parses obeys the schema
and no number runs on (bound_numbers; the comment below says how and why), for response
formats and forced tool calls' arguments alike. Pure Python: the daemon's tool grammars and
the runner's compiler both rewrite schemas here before llguidance reads them.
"""

from __future__ import annotations

import math
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal
from typing import Any

from llmrun.structured.keywords import subschemas

# llguidance writes a number's digits without bound and compares them with a bound as decimal
# text: under `exclusiveMaximum: 1` it accepts "0.99999999999999999", which every client parses
# as the double 1.0 (outside the bound), and "0." followed by 400 zeros and a 1 under
# `exclusiveMinimum: 0`, which parses as 0.0; with no bound it accepts "1e400" (inf) and lets a
# number run to the token limit (SmolLM2 at temperature 1, `num_predict` 40: 4 of 8 seeds never
# closed the object; tests/integration/test_structured.py). It has no option to bound digits
# (1.9.1; its JSON compiler's number regexes are fixed), and JSON Schema has no keyword for
# digits, except that llguidance reads `multipleOf: 1e-k` as "at most k decimal places" (a
# trailing zero included: "0.30" is refused under 0.1). So before compiling, every place a
# number may appear is rewritten:
#
# - at most PLACES decimal places (`multipleOf`), where the schema has no `multipleOf` of its
#   own (which then bounds them itself); integers stay integers;
# - magnitudes within +-CAP (2^53 - 1, the largest integer every JSON client, JavaScript's
#   doubles included, reads exactly), so the integer part has at most 16 digits; together with
#   the places, a number is at most 27 characters and never overflows or underflows;
# - every bound inclusive and moved inward onto a decimal B' of at most 15 significant digits
#   and PLACES places such that the client's double parse of any text >= B' (<= B') obeys the
#   bound: parsing rounds monotonically, so text >= B' parses to >= double(B'), and B' is
#   chosen with double(B') >= the first double the bound admits (its successor for an
#   exclusive one). With 15 digits B' survives llguidance's own read of it (serde_json: one
#   correctly rounded division by an exact power of ten) and its shortest form is B' itself,
#   which is the text llguidance compares with. An integer's bounds are the exact integers.
#
# The cost: numbers have at most 10 decimal places (llguidance's multipleOf reading stops
# there: it multiplies the double by ten until it is whole, and 1e-11 never is), so a
# range narrower than that holds fewer values or none (refused), and an answer cannot come
# within 1e-10 (or a 15th significant digit) of an exclusive bound.

PLACES = 10
CAP = 2**53 - 1
ANY_DEF = "llmrun-any-json"  # the $defs entry for "any JSON value" with bounded numbers
_ANY_REF = {"$ref": f"#/$defs/{ANY_DEF}"}
_QUANTUM = Decimal(1).scaleb(-PLACES)
_DIGITS = 15  # significant digits a double always carries through decimal -> double -> decimal

# A node with one of these is (partly) another node's: its values or branches are rewritten
# there; bounds added beside them would be intersected into every branch for nothing.
_ELSEWHERE = ("$ref", "anyOf", "oneOf", "allOf", "enum", "const")


def _on_grid(first: float, up: bool) -> Decimal:
    """The decimal bound to write for `first`, the first double a lower (`up`) or upper bound
    admits: on the coarser of 10^-PLACES and `first`'s 15th significant digit, the nearest to
    `first` whose correctly rounded double is still on the admitted side of it."""
    exact = Decimal(first)
    quantum = _QUANTUM
    if exact:
        quantum = max(quantum, Decimal(1).scaleb(exact.adjusted() - _DIGITS + 1))
    inward, outward = (ROUND_CEILING, ROUND_FLOOR) if up else (ROUND_FLOOR, ROUND_CEILING)
    near = exact.quantize(quantum, rounding=outward)
    if (float(near) >= first) if up else (float(near) <= first):
        return near.normalize()
    return exact.quantize(quantum, rounding=inward).normalize()


def _first(bound: Any, exclusive: bool, up: bool) -> float:
    """The first double a lower (`up`) or upper bound admits."""
    value = float(bound)
    if exclusive:
        value = math.nextafter(value, math.inf if up else -math.inf)
    return value


def _bounds(node: dict[str, Any]) -> tuple[tuple[Any, bool] | None, tuple[Any, bool] | None]:
    """The node's tightest lower and upper bounds, each (value, exclusive), or None."""
    def pick(inclusive: str, exclusive: str, tighter: Any) -> tuple[Any, bool] | None:
        found: list[tuple[Any, bool]] = []
        ex = node.get(exclusive)
        if isinstance(ex, bool):  # draft 4: a flag on the inclusive keyword
            if _number(node.get(inclusive)):
                found.append((node[inclusive], ex))
        else:
            if _number(node.get(inclusive)):
                found.append((node[inclusive], False))
            if _number(ex):
                found.append((ex, True))
        if not found:
            return None
        # the tighter one; at a tie, the exclusive one
        return tighter(found, key=lambda b: (b[0], b[1] if tighter is max else not b[1]))
    return pick("minimum", "exclusiveMinimum", max), pick("maximum", "exclusiveMaximum", min)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value)


def _bound_number(node: dict[str, Any], integer: bool, path: str, cap: bool = True) -> None:
    """Rewrite the node's numeric bounds (see above); `cap`: also add the missing ones (+-CAP)
    and the places (`multipleOf`)."""
    lower, upper = _bounds(node)
    if not cap and lower is None and upper is None:
        return
    lo: int | float | None
    hi: int | float | None
    if integer:
        lo = None if lower is None else (math.floor(Decimal(lower[0])) + 1 if lower[1]
                                         else math.ceil(Decimal(lower[0])))
        hi = None if upper is None else (math.ceil(Decimal(upper[0])) - 1 if upper[1]
                                         else math.floor(Decimal(upper[0])))
    else:
        lo = None if lower is None else _json_number(_on_grid(_first(*lower, up=True), up=True))
        hi = None if upper is None else _json_number(_on_grid(_first(*upper, up=False),
                                                              up=False))
    if cap:
        lo = -CAP if lo is None else max(lo, -CAP)
        hi = CAP if hi is None else min(hi, CAP)
    if lo is not None and hi is not None and lo > hi:
        raise ValueError(
            f"at {path or '/'}: no number between its bounds can be written (numbers are "
            f"written within +-{CAP}, with at most {PLACES} decimal places)")
    for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        node.pop(key, None)
    if lo is not None:
        node["minimum"] = lo
    if hi is not None:
        node["maximum"] = hi
    if cap and not integer and "multipleOf" not in node:
        node["multipleOf"] = float(_QUANTUM)


def _json_number(value: Decimal) -> int | float:
    """`value` (at most 15 significant digits) as json.dumps should write it: an int when
    whole (exact at any size), else the float whose shortest form is `value` itself."""
    return int(value) if value == value.to_integral_value() else float(value)


def _types(node: dict[str, Any]) -> set[str] | None:
    kind = node.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    return None  # any type


def _visit(node: Any, path: str, uses_any: list[bool], merged: bool = False) -> Any:
    """Rewrite `node` and its subschemas in place. `merged`: under an `allOf`, whose branches
    llguidance intersects: there an open place keeps llguidance's own "any value" (unbounded
    numbers), since intersecting the recursive bounded one with itself never ends
    ("Schema intersection stack level exceeded", llguidance 1.9.1)."""
    if node is True and merged:
        return node
    if node is True:
        uses_any[0] = True
        return dict(_ANY_REF)
    if not isinstance(node, dict):
        return node
    for key, container, slot, at in subschemas(node):
        # an allOf's branches are merged, and so is a definition: it is read wherever it is
        # referenced, an allOf's branch included
        inner = merged or key in ("allOf", "$defs", "definitions")
        container[slot] = _visit(container[slot], f"{path}/{at}", uses_any, inner)
    types = _types(node)
    integer = types is not None and "number" not in types
    if any(k in node for k in _ELSEWHERE):
        if types is None or types & {"number", "integer"}:
            _bound_number(node, integer, path, cap=False)  # its own bounds, made safe
        return node
    if types is None or types & {"number", "integer"}:
        _bound_number(node, integer, path)
    if merged:
        return node
    if (types is None or "array" in types) and "items" not in node:
        uses_any[0] = True
        node["items"] = dict(_ANY_REF)
    if (types is None or "object" in types) and "additionalProperties" not in node:
        uses_any[0] = True
        node["additionalProperties"] = dict(_ANY_REF)
    return node


def bound_numbers(schema: dict[str, Any] | bool) -> dict[str, Any]:
    """`schema` (a prepare_schema copy: changed in place) with every number it admits,
    declared or left open (`{}`, `true`, an object's undeclared members, an array's items),
    bounded as the comment above says; a ValueError when a number's bounds leave no value
    that can be written so."""
    uses_any = [False]
    root = _visit({} if schema is True else schema, "", uses_any)
    if uses_any[0] and isinstance(root, dict):
        any_json: dict[str, Any] = {}
        _bound_number(any_json, False, "")
        any_json.update(items=dict(_ANY_REF), additionalProperties=dict(_ANY_REF))
        defs = root.get("$defs")
        root["$defs"] = {**(defs if isinstance(defs, dict) else {}), ANY_DEF: any_json}
    return root
