"""Request bounds: what one request may ask of a runner, checked before a runner is leased.

A runner is shared by every request on its model, so nothing one request carries may crash
or stall it (docs: design.md, "Nothing one request carries ... can stop, crash or stall the
engine"). Each function here checks one kind of input and raises `EngineError` (400) with a
message naming the field, the value and the limit; each dialect words it in its own error
shape. This module sits at the floor: it imports only `config`, `request` and the standard
library, so the daemon checks requests without loading llama.cpp.

JSON schemas (Ollama `format`, OpenAI `response_format`, Anthropic `output_config.format`,
and the parameters of a tool the model is forced to call) become a GBNF grammar through
llama-cpp-python's `json_schema_to_gbnf`, then llama.cpp's grammar sampler. The ceilings
below are what that pair can afford; a bound under them is served and the output obeys it.
When the GBNF converter is replaced (llguidance enforces repetition bounds natively), only
the constants of this module need relaxing.

Measured here (llama-cpp-python 0.3.36, SmolLM2's 49k vocabulary, each case in its own
process; "apply" is one grammar pass over the whole vocabulary, which the engine runs
whenever the grammar rejects the token sampled without it):
- maxLength / maxItems N (minus the min): the converter nests N optional groups, `(c (c
  ...)?)?`. llama.cpp refuses over 1000 cleanly ("number of rules that are going to be
  repeated ... exceeds sane defaults": 1000 builds, 1001 does not, nor does 18,000); by
  20,000 its recursive parser overflows the stack and the runner dies (SIGSEGV; 200,000 too).
  One group of 1000 costs 8 KB of grammar and 2 ms; 100 of them 800 KB and 0.55 s.
- minLength / minItems N: written flat; 100,000 costs 1.8 MB and 65 ms (cheap).
- nesting: 300 object levels convert (378 KB of grammar: rule names grow with the path,
  so size is quadratic in depth); 500 levels raise RecursionError in the converter.
  A chain of 2000 `$ref`s also raises RecursionError; 300 convert. Self- or mutually
  recursive refs with nothing in between are refused by llama.cpp ("left recursion").
- alternatives (`enum`, `anyOf`): 1000 values: apply 0.35-0.8 s; 10,000: init 0.4 s,
  apply 3 s; 100,000: init 42 s, apply 47 s (a stalled engine).
- optional properties of one object: 100: 0.02-0.03 s; 300: 0.36 s (quadratic); 1000:
  RecursionError. 2500 required properties: 0.1 s.
- pattern: 1000 nested groups raise RecursionError; `{m,n}` expands like maxLength.
- a 1 MB `const`: 0.11 s (cheap, but bounded with the rest of the schema's size).
For comparison, OpenAI's structured outputs allow 10 levels of nesting, 5000 properties
and 1000 enum values in all.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from llmrun import config
from llmrun.request import ChatRequest, EngineError, GenerateJob, Message, NamedTool, Tool

# -- the ceilings (see the measurements above) ------------------------------------------------

# maxLength - minLength, maxItems - minItems, `{m,n}` in a pattern: llama.cpp's own limit.
MAX_OPTIONAL_REPEAT = 1000
# minLength, minItems, `{m}`: flat and cheap, but a larger value cannot fit any context.
MAX_REQUIRED_REPEAT = 100_000
# Sums over one request's schemas: each repetition is grammar text to build.
MAX_TOTAL_OPTIONAL_REPEAT = 20_000  # ~0.1 s of grammar building
MAX_TOTAL_REQUIRED_REPEAT = 200_000
# JSON nesting (objects and arrays; a `$ref` counts as the depth of what it points to).
MAX_SCHEMA_DEPTH = 64
# Values in one request's schemas (objects, arrays, strings, numbers...).
MAX_SCHEMA_NODES = 10_000
# Characters of keys and strings in one request's schemas (consts, enum values, names).
MAX_SCHEMA_CHARS = 256 * 1024
# `enum`, `anyOf`/`oneOf` and type-list entries in all: each is a grammar stack that the
# sampler walks for every candidate token.
MAX_ALTERNATIVES = 1000
MAX_OPTIONAL_PROPERTIES = 100  # per object (the converter is quadratic in them)
MAX_PATTERN_LENGTH = 1000
MAX_PATTERN_NESTING = 32  # groups in groups
# A raw GBNF grammar (GenerateJob.grammar; no HTTP route carries one today).
MAX_GRAMMAR_BYTES = 1 << 20
MAX_GRAMMAR_NESTING = 1000  # llama.cpp's parser recurses into each group

MAX_STOP_LENGTH = 1000  # characters in one stop string (matched against every new token)
MAX_TOOLS = 512  # tools declared in one request (each is rendered into the prompt)
# Load-time options are capped by the scheduler, not refused: num_batch past this only
# grows the compute buffers (llama-server's largest default ubatch is 512, batch 2048).
MAX_NUM_BATCH = 4096

# `{m}`, `{m,}`, `{m,n}` in a pattern
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")
_QUANTIFIER = re.compile(r"\{\s*(\d*)\s*(,\s*(\d*)\s*)?\}")


def _refuse(message: str) -> EngineError:
    return EngineError(message, status=400, kind="invalid_request")


# -- messages, stop strings, tools -----------------------------------------------------------


def check_messages(messages: list[Message]) -> None:
    limit = config.max_messages()
    if len(messages) > limit:
        raise _refuse(f"too many messages: {len(messages)}, the limit is {limit} "
                      "(LLMRUN_MAX_MESSAGES)")


def check_stop(stop: list[str] | None, exempt: frozenset[str] = frozenset()) -> None:
    """At most LLMRUN_MAX_STOP stop strings, each at most MAX_STOP_LENGTH characters. The
    model's own (`exempt`) are not counted: a dialect may add them to the client's."""
    stops = [s for s in dict.fromkeys(stop or []) if s not in exempt]
    limit = config.max_stop()
    if len(stops) > limit:
        raise _refuse(f"too many stop strings: {len(stops)}, the limit is {limit} "
                      "(LLMRUN_MAX_STOP)")
    for s in stops:
        if len(s) > MAX_STOP_LENGTH:
            raise _refuse(f"stop string too long: {len(s)} characters, the limit is "
                          f"{MAX_STOP_LENGTH}")


def forced_tools(tools: list[Tool], choice: Any) -> list[Tool]:
    """The tools whose parameters become a grammar: all for "required", the named one for a
    named choice, none for "auto"/"none" (their schemas only reach the prompt)."""
    if isinstance(choice, NamedTool):
        return [t for t in tools if t.name == choice.name]
    return list(tools) if choice == "required" else []


def check_tools(tools: list[Tool], choice: Any, budget: Budget | None = None) -> None:
    if len(tools) > MAX_TOOLS:
        raise _refuse(f"too many tools: {len(tools)}, the limit is {MAX_TOOLS}")
    budget = budget or Budget()
    for tool in forced_tools(tools, choice):
        budget.alternatives += 1  # the grammar chooses among the forced tools
        check_schema(tool.parameters, f"tool '{tool.name}' parameters", budget)


# -- JSON schemas ----------------------------------------------------------------------------


@dataclass
class Budget:
    """What the schemas of one request have used so far (one grammar holds them all)."""

    nodes: int = 0
    chars: int = 0
    alternatives: int = 0
    optional: int = 0
    required: int = 0


class _Schema:
    """One schema's checks. Walks are iterative, so a deeply nested schema meets the depth
    check, not Python's recursion limit."""

    def __init__(self, root: dict[str, Any], where: str, budget: Budget) -> None:
        self.root = root
        self.where = where
        self.budget = budget
        self.ref_depths: dict[str, int] = {}  # $ref -> depth of its target, refs followed
        self.resolving: set[str] = set()

    def refuse(self, what: str, at: str) -> EngineError:
        at = at if len(at) < 200 else at[:200] + "..."
        return _refuse(f"{self.where}: {what} (at {at or '/'}); structured output cannot "
                       "enforce this schema")

    def check(self) -> None:
        stack: list[tuple[str, Any]] = [("", self.root)]
        while stack:
            at, value = stack.pop()
            self.count(at, value)
            if isinstance(value, dict):
                self.check_node(value, at)
                stack.extend((f"{at}/{k}", child) for k, child in value.items())
            elif isinstance(value, list):
                stack.extend((f"{at}/{i}", child) for i, child in enumerate(value))
        self.depth(self.root, "", 1)  # after the size checks: the size bounds this walk

    def depth(self, value: Any, at: str, base: int) -> int:
        """How deep `value` nests (1: a scalar) when every `$ref` in it is followed into its
        target, as the converter recurses; refused once `base` plus that passes the limit.
        A ref already being followed adds nothing (the converter does not recurse there)."""
        deepest = 1
        stack: list[tuple[str, Any, int]] = [(at, value, 1)]
        while stack:
            at, node, d = stack.pop()
            if base + d - 1 > MAX_SCHEMA_DEPTH:
                raise self.refuse(f"nested over {MAX_SCHEMA_DEPTH} levels deep", at)
            deepest = max(deepest, d)
            if isinstance(node, dict):
                ref = node.get("$ref")
                if isinstance(ref, str) and ref not in self.resolving:
                    deepest = max(deepest, d + self.ref_depth(ref, at, base + d))
                stack.extend((f"{at}/{k}", child, d + 1) for k, child in node.items())
            elif isinstance(node, list):
                stack.extend((f"{at}/{i}", child, d + 1) for i, child in enumerate(node))
        return deepest

    def ref_depth(self, ref: str, at: str, base: int) -> int:
        if ref not in self.ref_depths:
            self.resolving.add(ref)
            try:
                self.ref_depths[ref] = self.depth(self.resolve(ref, at), ref, base)
            finally:
                self.resolving.discard(ref)
        if base + self.ref_depths[ref] - 1 > MAX_SCHEMA_DEPTH:
            raise self.refuse(f"nested over {MAX_SCHEMA_DEPTH} levels deep", at)
        return self.ref_depths[ref]

    def count(self, at: str, value: Any) -> None:
        b = self.budget
        b.nodes += 1
        if isinstance(value, str):
            b.chars += len(value)
        elif isinstance(value, dict):
            b.chars += sum(len(k) for k in value if isinstance(k, str))
        if b.nodes > MAX_SCHEMA_NODES:
            raise self.refuse(f"over {MAX_SCHEMA_NODES} values in all", at)
        if b.chars > MAX_SCHEMA_CHARS:
            raise self.refuse(f"over {MAX_SCHEMA_CHARS} characters of names and strings "
                              "in all", at)

    def resolve(self, ref: str, at: str) -> Any:
        """The target of a local `$ref` ('#/$defs/x'), as the converter resolves it."""
        if not ref.startswith("#/"):
            raise self.refuse(f"'$ref' {ref[:100]!r}: only local references ('#/...') are "
                              "supported", at)
        target: Any = self.root
        for part in ref[2:].split("/"):
            if not isinstance(target, dict) or part not in target:
                raise self.refuse(f"'$ref' {ref[:100]!r} points to nothing", at)
            target = target[part]
        return target

    def check_node(self, node: dict[str, Any], at: str) -> None:
        for low_key, high_key in (("minLength", "maxLength"), ("minItems", "maxItems")):
            low = _number(node.get(low_key))
            high = _number(node.get(high_key))
            self.repeat(low, None if high is None else high - (low or 0),
                        f"'{low_key}' {low}" if high is None else f"'{high_key}' {high}", at)
        alts = sum(len(v) for k in ("enum", "anyOf", "oneOf", "type")
                   if isinstance(v := node.get(k), list))
        self.budget.alternatives += alts
        if self.budget.alternatives > MAX_ALTERNATIVES:
            raise self.refuse(f"over {MAX_ALTERNATIVES} alternatives ('enum', 'anyOf', "
                              "'oneOf' entries) in all", at)
        props = node.get("properties")
        if isinstance(props, dict):
            required = node.get("required")
            names = set(required) if isinstance(required, list) else set()
            optional = sum(1 for k in props if k not in names)
            if optional > MAX_OPTIONAL_PROPERTIES:
                raise self.refuse(f"{optional} optional properties in one object, over the "
                                  f"limit of {MAX_OPTIONAL_PROPERTIES} (list more of them in "
                                  "'required')", at)
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            self.check_pattern(pattern, at)
        self.check_literals(node, at)

    def check_literals(self, node: dict[str, Any], at: str) -> None:
        """Property names and `enum`/`const` strings become literals of the grammar, which
        writes a control character raw instead of escaped (invalid JSON) and, for some,
        aborts llama.cpp's grammar matcher (measured: a property named "\x04" kills the
        runner with SIGABRT)."""
        props = node.get("properties")
        literals = list(props) if isinstance(props, dict) else []
        enum = node.get("enum")
        literals += enum if isinstance(enum, list) else []
        literals.append(node.get("const"))
        for text in literals:
            if isinstance(text, str) and _CONTROL.search(text):
                raise self.refuse(f"the name or value {text[:40]!r} holds a control "
                                  "character, which structured output cannot write", at)

    def repeat(self, required: float | None, optional: float | None, what: str,
               at: str) -> None:
        """Charge `required` flat and `optional` nested repetitions, within the ceilings."""
        if required is not None and required > MAX_REQUIRED_REPEAT:
            raise self.refuse(f"{what} is over the limit of {MAX_REQUIRED_REPEAT}", at)
        if optional is not None and optional > MAX_OPTIONAL_REPEAT:
            raise self.refuse(f"{what} allows {optional:g} optional repetitions, over the "
                              f"limit of {MAX_OPTIONAL_REPEAT} (keep max - min within it)", at)
        b = self.budget
        b.required += max(0, int(required or 0))
        b.optional += max(0, int(optional or 0))
        if b.required > MAX_TOTAL_REQUIRED_REPEAT or b.optional > MAX_TOTAL_OPTIONAL_REPEAT:
            raise self.refuse(
                f"{what}: the schema's repetition bounds add up to over "
                f"{MAX_TOTAL_REQUIRED_REPEAT} required or {MAX_TOTAL_OPTIONAL_REPEAT} "
                "optional repetitions", at)

    def check_pattern(self, pattern: str, at: str) -> None:
        at = f"{at}/pattern"
        if len(pattern) > MAX_PATTERN_LENGTH:
            raise self.refuse(f"'pattern' of {len(pattern)} characters, over the limit of "
                              f"{MAX_PATTERN_LENGTH}", at)
        for m in _QUANTIFIER.finditer(pattern):
            low = int(m[1] or 0)
            high = low if m[2] is None else int(m[3]) if m[3] else None
            self.repeat(low, None if high is None else high - low, f"{m[0]!r}", at)
        depth = 0
        for c in re.sub(r"\\.", "", pattern):
            depth += (c == "(") - (c == ")")
            if depth > MAX_PATTERN_NESTING:
                raise self.refuse(f"'pattern' groups nested over {MAX_PATTERN_NESTING} "
                                  "deep", at)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value


def check_schema(schema: Any, where: str = "format", budget: Budget | None = None) -> None:
    """A JSON schema that will become a grammar: within every ceiling of this module.
    `"json"` and None (a fixed grammar, or none) pass."""
    if isinstance(schema, dict):
        _Schema(schema, where, budget or Budget()).check()


def check_grammar(gbnf: str | None) -> None:
    """A raw GBNF grammar: its size and how deep its groups nest."""
    if gbnf is None:
        return
    if len(gbnf) > MAX_GRAMMAR_BYTES:
        raise _refuse(f"grammar: {len(gbnf)} bytes, over the limit of {MAX_GRAMMAR_BYTES}")
    # literals ("..."), character classes ([...]) and comments (# ...) hold no groups
    bare = re.sub(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|#[^\n]*', "", gbnf)
    depth = 0
    for c in bare:
        depth += (c == "(") - (c == ")")
        if depth > MAX_GRAMMAR_NESTING:
            raise _refuse(f"grammar: groups nested over {MAX_GRAMMAR_NESTING} deep")


# -- one request -----------------------------------------------------------------------------


def check_request(req: ChatRequest, model_stops: frozenset[str] = frozenset()) -> None:
    """Every bound of a chat request: messages, stop strings, tools, and the schemas that
    become one grammar (the format's, and the forced tools', share one budget)."""
    check_messages(req.messages)
    check_stop(req.options.stop, model_stops)
    budget = Budget()
    check_schema(req.format, "format", budget)
    check_tools(req.tools, req.tool_choice, budget)


def check_job(job: GenerateJob) -> None:
    """What a runner's job carries beyond the request: a raw grammar."""
    check_grammar(job.grammar)
