"""Constrained decoding with llguidance: every grammar a sequence may carry, compiled and checked.

One grammar dialect reaches the batcher: llguidance's (a Lark grammar, possibly embedding JSON
schemas with `%json {...}`, or a JSON schema, both as llguidance's grammar text). What each
request brings becomes that here, on the runner's message thread, never the engine thread:

    tok = constraint.tokenizer(model)            # once per runner (~0.5 s), cached
    grammar = constraint.compile(req, tok)       # None: unconstrained; ValueError: a 400
    matcher = constraint.matcher(tok, grammar)   # one per sequence, handed to the batcher

Why llguidance: it implements JSON Schema's bounds (numeric ranges, maxLength, maxItems,
formats, patterns) natively instead of unrolling them into grammar rules, so a `maxLength` of
200,000 costs what a `maxLength` of 10 does; it computes a whole vocabulary's mask in ~0.1-1 ms
with no per-candidate grammar walk, and it is the engine llama.cpp, vLLM and SGLang embed. Its
`LLExecutor` computes the masks of all constrained sequences of a step in parallel, outside the
GIL.

Limits (`LIMITS`): llguidance's defaults, which bound the work of any one mask step (lexer
fuel 200k, 50k Earley items per step) and the grammar's size (500k symbols), so no grammar
can stall the engine for long; a step that would pass them puts the matcher in an error
state, which ends that sequence alone (sampling.py). `verbose_errors` is off: an error names
the limit, not the parser's internal state (which echoes the schema back into logs).
"""

from __future__ import annotations

import functools
import logging
import re
import threading
import warnings
from typing import TYPE_CHECKING, Any, cast

import llguidance as lg
from llguidance.gbnf_to_lark import gbnf_to_lark
from llguidance.llamacpp import lltokenizer_from_vocab

from llmrun.engine.llama import Model
from llmrun.request import ChatRequest
from llmrun.structured.numbers import bound_numbers
from llmrun.structured.prepare import ANY_OBJECT, JSON_OPTIONS, prepare_schema

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # (in llguidance's stubs alone)

log = logging.getLogger(__name__)

# llguidance's vocabulary reader calls a llama-cpp-python alias that warns once per token.
warnings.filterwarnings("ignore", message="llama_token_get_attr is deprecated")

LIMITS = lg.LLParserLimits(verbose_errors=False)

_tok_lock = threading.Lock()


def tokenizer(model: Model) -> lg.LLTokenizer:
    """llguidance's view of `model`'s vocabulary, built once per model (~0.5 s on a 49k
    vocabulary: one llama_token_to_piece per token). Every end-of-generation token counts as
    EOS, so a finished grammar lets the model end with whichever its template uses."""
    with _tok_lock:
        cached: lg.LLTokenizer | None = getattr(model, "_llg_tokenizer", None)
        if cached is None:
            eog = [t for t in range(model.n_vocab) if model.is_eog(t)] or [model.eos]
            cached = lltokenizer_from_vocab(model.vocab, eos_token=eog)
            model._llg_tokenizer = cached  # type: ignore[attr-defined]
        return cached


def from_schema(schema: dict[str, Any], *, strict: bool = True) -> str:
    """llguidance grammar text for a JSON schema. Not strict: keywords llguidance cannot
    enforce are ignored (llguidance's `lenient`), and `compile` logs them as warnings. Its
    numbers are bounded so that what a client parses obeys it (structured/numbers.py)."""
    # (JSON_OPTIONS, in llmrun.structured, which may not import llguidance, is a plain dict)
    options = cast("JsonCompileOptions", {**JSON_OPTIONS, "lenient": not strict})
    prepared = bound_numbers(prepare_schema(schema))
    try:
        return lg.LLMatcher.grammar_from_json_schema(prepared, overrides=options)
    except ValueError as exc:
        raise ValueError(f"invalid JSON schema: {exc}") from None


def from_grammar(text: str) -> str:
    """llguidance grammar text for a raw grammar: Lark (llguidance's dialect), or GBNF
    (llama.cpp's, recognised by `::=`) converted to Lark."""
    if "::=" in text:
        try:
            text = gbnf_to_lark(text)
        except Exception as exc:  # the converter raises its own error types
            raise ValueError(f"invalid GBNF grammar: {exc}") from None
    return lg.LLMatcher.grammar_from_lark(text)


def check(grammar: str, tok: lg.LLTokenizer) -> None:
    """Raise ValueError when llguidance cannot build `grammar` for this vocabulary; log its
    warnings (keywords ignored in non-strict mode)."""
    is_error, messages = lg.LLMatcher.validate_grammar_with_warnings(grammar, tok, limits=LIMITS)
    if is_error:
        raise ValueError(f"structured output: {messages[0] if messages else 'invalid grammar'}")
    for message in messages:
        log.warning("structured output: %s (not enforced)", message)


def compile(req: ChatRequest, tok: lg.LLTokenizer, grammar: str | None = None) -> str | None:
    """The llguidance grammar `req` decodes under, checked; None when it is unconstrained.

    `grammar` (a forced tool call's, from tools.py) takes precedence, then the request's raw
    grammar, then its format."""
    grammar = grammar if grammar is not None else req.grammar
    if grammar is not None:
        text = from_grammar(grammar)
    elif req.format == "json":
        text = from_schema(ANY_OBJECT)
    elif isinstance(req.format, dict):
        text = from_schema(req.format, strict=req.format_strict)
    else:
        return None
    check(text, tok)
    return text


def matcher(tok: lg.LLTokenizer, grammar: str) -> lg.LLMatcher:
    """A fresh matcher for one sequence (building one drops the GIL; 1-300 ms for large
    grammars, so it is built on the message thread). A grammar that fails here (it passed
    `check`, so a limit) is a ValueError: the request's 400."""
    m = lg.LLMatcher(tok, grammar, log_level=0, limits=LIMITS)
    if m.is_error():
        raise ValueError(f"structured output: {m.get_error()}")
    return m


@functools.cache
def executor() -> lg.LLExecutor:
    """One pool for the mask work of a runner. Two threads: masks take ~0.1-1 ms each, and
    the decode threads need the cores more."""
    return lg.LLExecutor(2)



class Lazy:
    """A grammar that starts when the model begins a tool call (tool_choice "auto";
    llama-server's lazy grammar): fed each generated piece, it watches the text for one of
    its triggers (tools.Steering), outside a thought; at a match its matcher consumes what
    was written after the match and from then on constrains the sequence. Text that never
    matches is never constrained. Built on the message thread; fed on the engine thread."""

    KEEP = 512  # bytes of output kept for the trigger search: the longest trigger is shorter

    def __init__(self, tok: lg.LLTokenizer, grammar: str, triggers: list[str],
                 think: tuple[bytes, bytes] | None = None, inside: bool = False) -> None:
        self.tok = tok
        self.matcher = matcher(tok, grammar)
        self.triggers = [re.compile(t.encode()) for t in triggers]
        self.think = think
        self.inside = inside  # in a thought: no trigger counts there
        self.over = False  # triggered, or given up: the batcher drops it
        self._buf = b"\n"  # the output's start (and a thought's end) opens a line

    def feed(self, piece: bytes) -> lg.LLMatcher | None:
        """The matcher, once `piece` completes a trigger (it has then consumed the text after
        the trigger); None while none has matched, or when the text after one is not the
        grammar's (`over`: a call the grammar cannot follow stays free text)."""
        buf = self._buf + piece
        while self.think is not None:
            opener, closer = self.think
            if self.inside:
                at = buf.find(closer)
                if at == -1:
                    self._buf = buf[-len(closer):]
                    return None
                buf, self.inside = b"\n" + buf[at + len(closer):], False
                continue
            at = buf.find(opener)
            if at == -1:
                break
            found = self._trigger(buf[:at])
            if found is not None:
                return found
            buf, self.inside = buf[at + len(opener):], True
        found = self._trigger(buf)
        if found is None and not self.over:
            self._buf = buf[-self.KEEP:]
        return found

    def _trigger(self, text: bytes) -> lg.LLMatcher | None:
        ends = [m.end() for m in (t.search(text) for t in self.triggers) if m is not None]
        if not ends:
            return None
        self.over = True
        rest = text[min(ends):]
        if rest and not self.matcher.consume_tokens(self.tok.tokenize_bytes(rest)):
            log.info("a tool call began that its grammar cannot follow: left unconstrained")
            return None
        return self.matcher
