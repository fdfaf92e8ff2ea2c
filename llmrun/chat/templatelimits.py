"""The limits of one chat template, Jinja (templates.py) or Go (gotemplate/), and the error
every template failure becomes. Both languages read the limits from here when they render, so
this module is the one place to change them (tests patch them here)."""

from __future__ import annotations

# A chat prompt is at most a model's context (some 100k tokens, well under a megabyte), and a
# real template renders one in about a millisecond: these are far above any real use, and far
# below what would stall the engine thread that all requests on a model share.

# Template source, in characters: refused at create (Modelfile TEMPLATE) and per request.
# Jinja compiles about 10 us per character (measured: 128 KiB in 1.5 s, 1 MiB in 13-26 s), in
# the engine thread for a request's template; the largest real chat templates are ~20 KiB.
MAX_TEMPLATE_SIZE = 128 << 10
# Characters one render may produce, and the longest string (or bytes) it may build on the way.
MAX_OUTPUT = 10 * 1024 * 1024
# Units of work in one render. Jinja: loop iterations, calls, filters, attribute and item
# lookups, operators, output pieces. Go: nodes visited and loop iterations.
MAX_STEPS = 2_000_000
# Wall-clock bound of one render, checked as it steps (no signals, no threads).
MAX_SECONDS = 2.0
# Items in a list a template builds (`[x] * n`, `a + b`): Jinja's sandbox caps range() alike.
MAX_ITEMS = 100_000
# Jinja macro calls (and recursive loops) inside one another: deeper recursion is a bug.
MAX_DEPTH = 50
# Integers a template computes: `2 ** 10 ** 10` would take minutes and gigabytes.
MAX_INT_BITS = 1 << 16
# Go: control structures and parentheses inside one another (its parser recurses on them).
MAX_NESTING = 100


class TemplateError(ValueError):
    pass


class BudgetError(TemplateError):
    """A render that ran out of steps or time: what a caller rendering a template several
    times (capabilities.py's probes) stops at, so one request's template costs at most one
    budget more."""


def check_size(source: str) -> None:
    """Refuse a template source over MAX_TEMPLATE_SIZE before anything parses it."""
    if len(source) > MAX_TEMPLATE_SIZE:
        raise TemplateError(f"chat template is {len(source)} characters, over the limit of "
                            f"{MAX_TEMPLATE_SIZE}")
