"""Request bounds: what one request may ask of a runner, checked before a runner is leased.

A runner is shared by every request on its model, so nothing one request carries may crash
or stall it (docs: design.md, "Nothing one request carries ... can stop, crash or stall the
engine"). Each function here checks one kind of input and raises `EngineError` (400) with a
message naming the field, the value and the limit; each dialect words it in its own error
shape. This module sits at the floor: it imports only `config`, `request`, `ipc` (its frame
limit) and the standard library, so the daemon checks requests without loading llama.cpp.

JSON schemas (Ollama `format`, OpenAI `response_format`, Anthropic `output_config.format`,
and the parameters of a tool the model is forced to call) are enforced by llguidance
(engine/constraint.py), which implements repetition and numeric bounds natively: `maxLength`,
`maxItems` and `{m,n}` cost the same whatever their value, so they are not bounded here.
Two things are:

1. Keywords. Each schema keyword is one llguidance enforces (SUPPORTED), an annotation that
   constrains nothing (ANNOTATIONS), or neither: then a 400 naming it, or, when the client
   asked for non-strict output (`format_strict` False), a logged warning and the keyword is
   ignored. Never silently ignored. `format` is checked the same way against FORMATS.
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
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from llmrun import config, ipc, media
from llmrun.request import ChatRequest, EngineError, Message, NamedTool, Tool

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

# Schema keywords llguidance enforces (tests/integration/test_bounds.py checks each against it).
SUPPORTED = frozenset({
    "type", "enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
    "multipleOf", "minLength", "maxLength", "pattern", "format", "minItems", "maxItems",
    "prefixItems", "items", "required", "additionalProperties", "properties",
    "patternProperties", "minProperties", "maxProperties", "anyOf", "oneOf", "allOf",
    "$ref", "$defs", "definitions",
    "nullable",  # OpenAPI's; engine/constraint.py rewrites it as a type union
})
# Keywords that describe and constrain nothing.
ANNOTATIONS = frozenset({
    "title", "description", "default", "examples", "$schema", "$id", "$comment",
    "deprecated", "readOnly", "writeOnly",
})
# `format` values llguidance enforces (it refuses the others).
FORMATS = frozenset({"date-time", "date", "time", "duration", "email", "hostname", "ipv4",
                     "ipv6", "uuid", "uri"})
# Keywords whose value is a schema, a list of schemas, or a map of names to schemas.
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains",
              "propertyNames", "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions",
                   "dependentSchemas")

MAX_STOP_LENGTH = 1000  # characters in one stop string (matched against every new token)
MAX_TOOLS = 512  # tools declared in one request (each is rendered into the prompt)
# Load-time options are capped by the scheduler, not refused: num_batch past this only
# grows the compute buffers (llama-server's largest default ubatch is 512, batch 2048).
MAX_NUM_BATCH = 4096
# All images of one request, decoded, as a share of the IPC frame the request travels to the
# runner in: base64 takes 4/3 of it (5/6 of the frame), the rest is left for the text.
IMAGES_FRAME_SHARE = 5 / 8

# Reranking: documents per request (Cohere's recommended most), and characters in one
# document and in the query. Every document's prompt holds the query, so the query is kept
# short; a document's limit is about what the largest contexts hold (32k tokens of ~4
# characters), and the runner still refuses a prompt longer than the model's context.
MAX_RERANK_DOCUMENTS = 1000
MAX_RERANK_DOCUMENT_CHARS = 128 * 1024
MAX_RERANK_QUERY_CHARS = 16 * 1024

log = logging.getLogger(__name__)



def _refuse(message: str) -> EngineError:
    return EngineError(message, code="invalid_request")


# -- messages, stop strings, tools -----------------------------------------------------------


def check_messages(messages: list[Message]) -> None:
    limit = config.max_messages()
    if len(messages) > limit:
        raise _refuse(f"too many messages: {len(messages)}, the limit is {limit} "
                      "(LLMRUN_MAX_MESSAGES)")


def check_stop(stop: list[str] | None) -> None:
    """At most LLMRUN_MAX_STOP stop strings, each at most MAX_STOP_LENGTH characters: the
    client's (checked before the service puts the model's own beside them)."""
    stops = list(dict.fromkeys(stop or []))
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


def check_tools(tools: list[Tool], choice: Any, budget: Budget | None = None,
                strict: bool = True) -> None:
    if len(tools) > MAX_TOOLS:
        raise _refuse(f"too many tools: {len(tools)}, the limit is {MAX_TOOLS}")
    budget = budget or Budget()
    for tool in forced_tools(tools, choice):
        budget.alternatives += 1  # the grammar chooses among the forced tools
        check_schema(tool.parameters, f"tool '{tool.name}' parameters", budget, strict)


# -- images ----------------------------------------------------------------------------------


def images_total_limit() -> int:
    """Decoded bytes all images of one request may take (read at call time, as MAX_FRAME)."""
    return int(ipc.MAX_FRAME * IMAGES_FRAME_SHARE)


def check_image_size(size: int, where: str) -> None:
    limit = config.max_image_size()
    if size > limit:
        raise _refuse(f"{where}: image too large: {size} bytes, the limit is {limit} bytes "
                      "(LLMRUN_MAX_IMAGE_SIZE)")


def check_images_total(total: int, where: str = "images") -> None:
    limit = images_total_limit()
    if total > limit:
        raise _refuse(f"{where}: the request's images take {total} bytes in all, the limit "
                      f"is {limit} bytes (what one message to the model runner can carry)")


def check_images_count(messages: list[Message]) -> None:
    count = sum(len(m.images) for m in messages)
    limit = config.max_images()
    if count > limit:
        raise _refuse(f"too many images: {count}, the limit is {limit} (LLMRUN_MAX_IMAGES)")


def check_audio_size(size: int, where: str) -> None:
    limit = config.max_audio_size()
    if size > limit:
        raise _refuse(f"{where}: sound file too large: {size} bytes, the limit is {limit} "
                      "bytes (LLMRUN_MAX_AUDIO_SIZE)")


def check_images(messages: list[Message]) -> None:
    """At most LLMRUN_MAX_IMAGES images and LLMRUN_MAX_AUDIO sound files, each within its
    size limit decoded (LLMRUN_MAX_IMAGE_SIZE, LLMRUN_MAX_AUDIO_SIZE), all within one runner
    message. The dialects checked each one as they read it (naming their own field); this
    holds for every request, however it was built. An entry that is not canonical base64 (an
    image URL never fetched) is refused, never sent to the runner. A sound's duration and
    sample rate are read from its header (media.py) by the dialect that took it and again
    by the runner, before it is decoded (engine/sound.py)."""
    if not any(m.images or m.audio for m in messages):
        return
    check_images_count(messages)
    n_audio = sum(len(m.audio) for m in messages)
    if n_audio > config.max_audio():
        raise _refuse(f"too many sound files: {n_audio}, the limit is {config.max_audio()} "
                      "(LLMRUN_MAX_AUDIO)")
    total = 0
    for i, m in enumerate(messages):
        for field, items, check in (("images", m.images, check_image_size),
                                    ("audio", m.audio, check_audio_size)):
            for j, data in enumerate(items):
                where = f"messages[{i}].{field}[{j}]"
                if len(data) % 4 or ":" in data[:16]:
                    raise _refuse(f"{where}: not base64 data")
                size = media.decoded_size(data)
                check(size, where)
                total += size
    check_images_total(total)


# -- sound -----------------------------------------------------------------------------------


def check_sound(data: bytes, where: str = "a sound file") -> media.SoundLayout:
    """The layout of the sound file `data` (media.check_sound); 400 naming `where` for
    another format, a coding, rate or channel count not taken, a truncated file or more than
    media.MAX_SOUND_SECONDS."""
    try:
        return media.check_sound(data)
    except ValueError as exc:
        raise _refuse(f"{where}: {exc}") from None


def check_sound_header(data: bytes, where: str = "a sound file") -> float:
    """The seconds the sound file `data` declares (check_sound)."""
    return check_sound(data, where).seconds


# -- JSON schemas ----------------------------------------------------------------------------


@dataclass
class Budget:
    """What the schemas of one request have used so far (one grammar holds them all)."""

    nodes: int = 0
    chars: int = 0
    alternatives: int = 0


class _Schema:
    """One schema's checks. Walks are iterative, so a deeply nested schema meets the depth
    check, not Python's recursion limit."""

    def __init__(self, root: dict[str, Any], where: str, budget: Budget,
                 strict: bool = True) -> None:
        self.root = root
        self.strict = strict
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
        self.keywords()

    def keywords(self) -> None:
        """Every keyword at a schema position (not inside `enum`, `const`, `default` or a
        property's name) is enforced or an annotation; else a 400 naming it, or a warning
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
            for key in _SUBSCHEMA:
                if isinstance(node.get(key), dict):
                    stack.append((f"{at}/{key}", node[key]))
            for key in _SUBSCHEMA_LISTS:
                if isinstance(node.get(key), list):
                    stack.extend((f"{at}/{key}/{i}", s) for i, s in enumerate(node[key]))
            for key in _SUBSCHEMA_MAPS:
                if isinstance(node.get(key), dict):
                    stack.extend((f"{at}/{key}/{name}", s) for name, s in node[key].items())

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


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return value


def check_schema(schema: Any, where: str = "format", budget: Budget | None = None,
                 strict: bool = True) -> None:
    """A JSON schema that will become a grammar: within every ceiling of this module, and
    every keyword enforced (or, not `strict`, the others logged). `"json"` and None (a fixed
    grammar, or none) pass."""
    if isinstance(schema, dict):
        _Schema(schema, where, budget or Budget(), strict).check()


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


# -- reranking -------------------------------------------------------------------------------


def check_rerank(query: str, documents: list[str]) -> None:
    """A rerank request: a query, one document or more, each within its limit (a limit
    passed is 413, `too_large`; an empty query or list 400)."""
    if not query.strip():
        raise _refuse("'query' must be a non-empty string")
    if len(query) > MAX_RERANK_QUERY_CHARS:
        raise EngineError(f"'query' is {len(query)} characters, the limit is "
                          f"{MAX_RERANK_QUERY_CHARS}", code="too_large")
    if not documents:
        raise _refuse("'documents' must hold at least one document")
    if len(documents) > MAX_RERANK_DOCUMENTS:
        raise EngineError(f"too many documents: {len(documents)}, the limit is "
                          f"{MAX_RERANK_DOCUMENTS} in one request", code="too_large")
    for i, doc in enumerate(documents):
        if len(doc) > MAX_RERANK_DOCUMENT_CHARS:
            raise EngineError(f"'documents[{i}]' is {len(doc)} characters, the limit is "
                              f"{MAX_RERANK_DOCUMENT_CHARS}", code="too_large")


# -- one request -----------------------------------------------------------------------------


def check_request(req: ChatRequest) -> None:
    """Every bound of a chat request: messages, images, stop strings, tools, the schemas that
    become one grammar (the format's, and the forced tools', share one budget), and a raw
    grammar."""
    check_messages(req.messages)
    check_images(req.messages)
    check_stop(req.options.stop)
    budget = Budget()
    check_schema(req.format, "format", budget, req.format_strict)
    check_tools(req.tools, req.tool_choice, budget, req.format_strict)
    check_grammar(req.grammar)
