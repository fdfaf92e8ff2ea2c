"""The ceilings a request's schemas and raw grammar are held to before a runner is leased.

A runner is shared by every request on its model, so no schema one request carries may
crash or stall the constraint engine of the others. JSON schemas (Ollama `format`, OpenAI
`response_format`, Anthropic `output_config.format`, and the parameters of a tool the model
is forced to call) are enforced by llguidance (engine/constraint.py), which implements
repetition and numeric bounds natively: `maxLength`, `maxItems` and `{m,n}` cost the same
whatever their value, so they are not bounded here. Two things are:

1. Keywords. Each schema keyword is one llguidance enforces (keywords.SUPPORTED), an
   annotation that constrains nothing (keywords.ANNOTATIONS), or neither: then refused,
   naming it, or, when the client asked for non-strict output (`format_strict` False), a
   logged warning and the keyword is ignored. Never silently ignored. `format` is checked
   the same way against keywords.FORMATS.
2. Size and shape, where llguidance's cost grows. Measured here (llguidance 1.9.1, SmolLM2's
   49k vocabulary; "mask" is the first mask computation, on the engine's step):
   - maxLength 200,000, minLength 100,000, maxItems 200,000, `a{0,200000}`: ~1 ms.
   - nesting: llguidance reads the schema with serde_json's recursion limit of 128 levels of
     JSON (an object level of a schema is two: `properties`, then the name), so 64 object
     levels fail to compile (cleanly); a chain of 2000 `$ref`s: 22 ms.
   - `enum` of 10,000 values: 0.06 s to compile, 0.06 s to build a matcher; 50,000: 0.26 s;
     100,000 hits llguidance's lexer limit (a clean error). 1000 `anyOf` objects: 0.13 s.
   - 1000 optional properties: 0.1 s compile, 0.2 s matcher, 20 ms per mask step.
   - a `const` string of N characters: the first mask takes ~4.5 us per character (256 KB:
     1.3 s of a stalled engine), hence MAX_LITERAL_CHARS.
For comparison, OpenAI's structured outputs allow 10 levels of nesting, 5000 properties
and 1000 enum values in all.

A fault is a `Refused` (a ValueError) whose message names the field, the place in the schema
and the limit; llmrun/bounds.py makes it the request's 400.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from llmrun.structured.keywords import ANNOTATIONS, FORMATS, SUPPORTED, subschemas

# -- the ceilings (see the measurements above) ------------------------------------------------

# JSON nesting (objects and arrays; a `$ref` counts as the depth of what it points to):
# well under the 128 JSON levels llguidance can read.
MAX_SCHEMA_DEPTH = 64
# Values in one request's schemas (objects, arrays, strings, numbers...).
MAX_SCHEMA_NODES = 20_000
# Characters of keys and strings in one request's schemas (consts, enum values, names).
MAX_SCHEMA_CHARS = 256 * 1024
# One `const` or `enum` string: its first mask costs ~4.5 us per character (16k: ~70 ms).
MAX_LITERAL_CHARS = 16 * 1024
# `enum`, `anyOf`/`oneOf` and type-list entries in all (10,000: ~0.12 s to build).
MAX_ALTERNATIVES = 10_000
MAX_PATTERN_LENGTH = 1000
MAX_PATTERN_NESTING = 32  # groups in groups
# A raw grammar (ChatRequest.grammar: llama-server's `grammar` field; Lark or GBNF).
MAX_GRAMMAR_BYTES = 1 << 20
MAX_GRAMMAR_NESTING = 1000  # the GBNF-to-Lark converter recurses into each group

log = logging.getLogger(__name__)


class Refused(ValueError):
    """A schema or grammar past a ceiling, or a keyword not enforced (strict output)."""


@dataclass
class Budget:
    """What the schemas of one request have used so far (one grammar holds them all)."""

    nodes: int = 0
    chars: int = 0
    alternatives: int = 0


class _Schema:
    """One schema's checks, each fault a Refused. Walks are iterative, so a deeply nested
    schema meets the depth check, not Python's recursion limit."""

    def __init__(self, root: dict[str, Any], where: str, budget: Budget,
                 strict: bool = True) -> None:
        self.root = root
        self.strict = strict
        self.where = where
        self.budget = budget
        self.ref_depths: dict[str, int] = {}  # $ref -> depth of its target, refs followed
        self.resolving: set[str] = set()

    def refuse(self, what: str, at: str) -> Refused:
        at = at if len(at) < 200 else at[:200] + "..."
        return Refused(f"{self.where}: {what} (at {at or '/'}); structured output cannot "
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
        self.keywords()

    def keywords(self) -> None:
        """Every keyword at a schema position (not inside `enum`, `const`, `default` or a
        property's name) is enforced or an annotation; else refused, naming it, or a warning
        when the client asked for non-strict output."""
        stack: list[tuple[str, Any]] = [("", self.root)]
        while stack:
            at, node = stack.pop()
            if not isinstance(node, dict):
                continue  # true/false schemas, or a malformed value llguidance reports
            for key in node:
                if key not in SUPPORTED and key not in ANNOTATIONS:
                    self.unsupported(f"the keyword {key!r} is not supported", f"{at}/{key}")
            fmt = node.get("format")
            if fmt is not None and fmt not in FORMATS:
                self.unsupported(f"'format' {str(fmt)[:40]!r} is not supported (supported: "
                                 f"{', '.join(sorted(FORMATS))})", f"{at}/format")
            stack.extend((f"{at}/{path}", container[slot])
                         for _, container, slot, path in subschemas(node))

    def unsupported(self, what: str, at: str) -> None:
        if self.strict:
            raise self.refuse(what, at)
        log.warning("%s: %s (at %s); not enforced (the client asked for non-strict output)",
                    self.where, what, at[:200])

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
        """The target of a local `$ref` ('#' for the root, '#/$defs/x'), with JSON
        Pointer's escapes ('~1' is '/', '~0' is '~')."""
        if ref == "#":
            return self.root
        if not ref.startswith("#/"):
            raise self.refuse(f"'$ref' {ref[:100]!r}: only local references ('#', '#/...') "
                              "are supported", at)
        target: Any = self.root
        for raw in ref[2:].split("/"):
            part = raw.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                raise self.refuse(f"'$ref' {ref[:100]!r} points to nothing", at)
            target = target[part]
        return target

    def check_node(self, node: dict[str, Any], at: str) -> None:
        alts = sum(len(v) for k in ("enum", "anyOf", "oneOf", "type")
                   if isinstance(v := node.get(k), list))
        self.budget.alternatives += alts
        if self.budget.alternatives > MAX_ALTERNATIVES:
            raise self.refuse(f"over {MAX_ALTERNATIVES} alternatives ('enum', 'anyOf', "
                              "'oneOf' entries) in all", at)
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            self.check_pattern(pattern, at)
        self.check_literals(node, at)

    def check_literals(self, node: dict[str, Any], at: str) -> None:
        """Property names and `enum`/`const` strings become literals of the grammar: a huge
        one stalls the first mask (a 256 KB `const` took 1.3 s). Control characters in them
        are fine: llguidance writes them escaped (llama.cpp's GBNF wrote them raw, and a
        property named "\x04" made it abort the runner)."""
        props = node.get("properties")
        literals = list(props) if isinstance(props, dict) else []
        enum = node.get("enum")
        literals += enum if isinstance(enum, list) else []
        literals.append(node.get("const"))
        for text in literals:
            if isinstance(text, str) and len(text) > MAX_LITERAL_CHARS:
                raise self.refuse(f"a 'const' or 'enum' string of {len(text)} characters, "
                                  f"over the limit of {MAX_LITERAL_CHARS}", at)

    def check_pattern(self, pattern: str, at: str) -> None:
        at = f"{at}/pattern"
        if len(pattern) > MAX_PATTERN_LENGTH:
            raise self.refuse(f"'pattern' of {len(pattern)} characters, over the limit of "
                              f"{MAX_PATTERN_LENGTH}", at)
        depth = 0
        for c in re.sub(r"\\.", "", pattern):
            depth += (c == "(") - (c == ")")
            if depth > MAX_PATTERN_NESTING:
                raise self.refuse(f"'pattern' groups nested over {MAX_PATTERN_NESTING} "
                                  "deep", at)


def check_schema(schema: Any, where: str = "format", budget: Budget | None = None,
                 strict: bool = True) -> None:
    """A JSON schema that will become a grammar: within every ceiling of this module, and
    every keyword enforced (or, not `strict`, the others logged); Refused, naming `where`,
    the place and the limit, otherwise. `"json"` and None (a fixed grammar, or none)
    pass."""
    if isinstance(schema, dict):
        _Schema(schema, where, budget or Budget(), strict).check()


def check_grammar(gbnf: str | None) -> None:
    """A raw GBNF grammar: its size and how deep its groups nest (Refused past either)."""
    if gbnf is None:
        return
    if len(gbnf) > MAX_GRAMMAR_BYTES:
        raise Refused(f"grammar: {len(gbnf)} bytes, over the limit of {MAX_GRAMMAR_BYTES}")
    # literals ("..."), character classes ([...]) and comments (# ...) hold no groups
    bare = re.sub(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|#[^\n]*', "", gbnf)
    depth = 0
    for c in bare:
        depth += (c == "(") - (c == ")")
        if depth > MAX_GRAMMAR_NESTING:
            raise Refused(f"grammar: groups nested over {MAX_GRAMMAR_NESTING} deep")
