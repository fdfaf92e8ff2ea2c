"""Filtering a request's streamed text: what may be the start of a call is held back until
it is plainly not one (released at once) or plainly one (held to the end, then parsed by the
reader). What it holds while undecided is a few dozen characters at most."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Protocol

from llmrun.chat.textstream import partial_match
from llmrun.chat.toolcalls.check import ToolCheck
from llmrun.chat.toolcalls.jsontext import whole_object
from llmrun.chat.toolcalls.reader import MARKERS, cut_call, new_call_id, parse_calls
from llmrun.request import PartialCall, ToolCall

NO, MAYBE, YES = 0, 1, 2  # `shape`'s verdicts
# What may begin a call in streamed text: held back from here while undecided.
_STARTS = re.compile(r"[{\[`<]|functools\[")
# a fence a call may come in: ```json, ```tool_call (or ```tool_code ...), or no language
_FENCE_OPEN = re.compile(r"```(?:json|tool[\w-]{0,16})?[ \t]*\n")
_FENCE_PARTIAL = re.compile(r"`{1,3}|```(?:j|js|jso|json|t|to|too|tool[\w-]{0,16})?[ \t]*")
_SHAPE_WINDOW = 300  # characters of undecided text looked at; longer is not a call's start


@lru_cache(maxsize=64)


def _heads(names: frozenset[str], pythonic: bool) -> tuple[str, ...]:
    """How a call of one of `names` begins, whitespace removed."""
    out = []
    for name in sorted(names):
        n = json.dumps(name, ensure_ascii=False)
        for head in ('{"name":' + n, '{"function":' + n, '{"function":{"name":' + n,
                     '{"type":"function","function":{"name":' + n):
            out += [head, "[" + head]
        if pythonic:
            out.append(f"[{name}(")
    return tuple(out)


def shape(text: str, names: frozenset[str], pythonic: bool = False) -> int:
    """Whether `text` (which starts where a call might) begins a call of one of `names`: YES,
    NO, or MAYBE while too little of it is there to tell."""
    for marker in MARKERS:
        if text.startswith(marker):
            return YES
        if marker.startswith(text):
            return MAYBE
    head = text[:_SHAPE_WINDOW]
    if head.startswith("`"):
        fence = _FENCE_OPEN.match(head)
        if fence is None:
            return MAYBE if _FENCE_PARTIAL.fullmatch(head) else NO
        head = head[fence.end():]
    compact = "".join(head.split())
    if not compact:
        return MAYBE if len(text) < _SHAPE_WINDOW else NO
    undecided = NO
    for call in _heads(names, pythonic):
        if compact.startswith(call):
            return YES
        if call.startswith(compact) and len(text) < _SHAPE_WINDOW:
            undecided = MAYBE
    return undecided


@dataclass


class Finished:
    text: str
    logprobs: list[Any]
    calls: list[ToolCall]
    partial: PartialCall | None = None  # a call the token limit cut off (no whole ones)


def distinct(calls: list[ToolCall]) -> list[ToolCall]:
    """Calls without exact repeats (same function, same arguments): small models, greedy
    ones especially, tend to repeat a call until the token limit."""
    seen: set[str] = set()
    out = []
    for call in calls:
        key = json.dumps([call.name, call.arguments], sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(call)
    return out


@dataclass


class ToolStream:
    """Filters one request's streamed text: text is released as it comes, except from a
    point where a call may begin (`shape`): held while undecided, released the moment it
    is not a call, held to the end once it is one, then parsed. Text that was not a call
    after all is released then. Logprob entries travel with the text of their tokens.

    A call the token limit cut off is never released as text: it ends as a `PartialCall`
    (or, when its arguments were whole and only the call's closing was cut, as a call).
    `forced`: a grammar made the whole output a call (tool_choice required or named), so
    none of it is text even when the cut came before the tool's name was whole; `only`: the
    one tool such a call can name (a named choice, or a single tool), whose name it then
    is."""

    family: str
    check: ToolCheck
    parallel: bool = True
    forced: bool = False
    only: str | None = None
    _pieces: list[tuple[str, list[Any]]] = field(default_factory=list)
    _capturing: bool = False

    def __post_init__(self) -> None:
        self._names = frozenset(self.check.names)
        self._pythonic = self.family == "llama3"

    def _held(self) -> str:
        return "".join(t for t, _ in self._pieces)

    def push(self, text: str, logprobs: list[Any] | None = None) -> tuple[str, list[Any]]:
        """Add generated text; return (text, logprob entries) that can be released now."""
        self._pieces.append((text, list(logprobs or ())))
        if self._capturing:
            return "", []
        held = self._held()
        i = 0
        while (m := _STARTS.search(held, i)) is not None:
            verdict = shape(held[m.start():], self._names, self._pythonic)
            if verdict == YES:
                self._capturing = True
                return self._release(m.start())
            if verdict == MAYBE:
                return self._release(m.start())
            i = m.start() + 1
        return self._release(len(held) - partial_match(held, MARKERS))

    def _release(self, n: int) -> tuple[str, list[Any]]:
        text, lps, self._pieces = release(self._pieces, n)
        return text, lps

    def finish(self, truncated: bool = False) -> Finished:
        """The end of generation (`truncated`: by the token limit): the calls, and whatever
        text is still held."""
        held = self._held()
        lps = [e for _, entries in self._pieces for e in entries]
        self._pieces = []
        if self._capturing:
            parsed = parse_calls(held, self.family, self.check, truncated)
            if parsed is not None:
                calls, rest = parsed
                return Finished(rest, lps, distinct(calls) if self.parallel else calls[:1])
        if truncated and (self._capturing or self.forced):
            cut = cut_call(held, self._names, begun=not self.forced)
            if cut is None and self.forced and self.only is not None and held.strip():
                cut = self.only, ""  # cut before its name was whole (a thought: not begun)
            if cut is not None:
                name, args = cut
                whole = whole_object(args)
                if whole is not None and self.check.accepts(name, whole):
                    # only the call's own closing (`}`, `</tool_call>`) was cut
                    return Finished("", lps, [ToolCall(id=new_call_id(), name=name,
                                                       arguments=whole)])
                return Finished("", lps, [], PartialCall(id=new_call_id(), name=name,
                                                         arguments=args))
            if self.forced:  # cut before the name of one of several tools was whole
                return Finished("", lps, [])
        return Finished(held, lps, [])


class CallReader(Protocol):
    """What reads a request's calls out of its streamed text: a ToolStream, or a chat
    format's own (formats/)."""

    def push(self, text: str, logprobs: list[Any] | None = None) -> tuple[str, list[Any]]: ...

    def finish(self, truncated: bool = False) -> Finished: ...


def filter_events(streams: dict[str, CallReader],
                  events: list[tuple[str, str, Any]]) -> list[tuple[str, str, Any]]:
    """Pass runner events through the `streams` of tool-enabled requests.

    Chunk payloads are `{"text", "logprobs"?}` as the engine makes them (a thought's,
    `{"text": "", "thinking"}`, passes: see thinking.py); the parsed calls leave as one chunk
    whose payload is `{"text", "tool_calls", "logprobs"?}`, and the done event's
    finish_reason becomes "tool_calls"; a call the token limit cut off leaves as
    `{"text": "", "partial_call"}` before a done event whose finish_reason stays "length".
    A finished request leaves `streams`."""
    out: list[tuple[str, str, Any]] = []
    for event in events:
        rid, kind, payload = event
        stream = streams.get(rid)
        if stream is None or (kind == "chunk" and ("thinking" in payload
                                                   or "prompt_logprobs" in payload)):
            out.append(event)
        elif kind == "chunk":
            lps = payload.get("logprobs")
            text, lps = stream.push(payload["text"], lps)
            if "logprobs" in payload and (text or lps):
                out.append((rid, kind, {"text": text, "logprobs": lps}))
            elif text:
                out.append((rid, kind, {"text": text}))
        elif kind == "done":
            streams.pop(rid, None)
            if payload.get("finish_reason") == "cancel":
                out.append(event)
                continue
            end = stream.finish(truncated=payload.get("finish_reason") == "length")
            if end.calls:
                chunk: dict[str, Any] = {"text": end.text,
                                         "tool_calls": [c.model_dump() for c in end.calls]}
                if end.logprobs:
                    chunk["logprobs"] = end.logprobs
                out.append((rid, "chunk", chunk))
                # "length" too: what was cut off was a further call, dropped; these are whole
                if payload.get("finish_reason") in ("stop", "length"):
                    payload = {**payload, "finish_reason": "tool_calls"}
            elif end.partial is not None:  # finish_reason stays "length"
                chunk = {"text": "", "partial_call": end.partial.model_dump()}
                if end.logprobs:
                    chunk["logprobs"] = end.logprobs
                out.append((rid, "chunk", chunk))
            elif end.text or end.logprobs:
                out.append((rid, "chunk", {"text": end.text, "logprobs": end.logprobs}
                            if end.logprobs else {"text": end.text}))
            out.append((rid, kind, payload))
        else:
            if kind == "error":
                streams.pop(rid, None)
            out.append(event)
    return out


def release(pieces: list[tuple[str, list[Any]]], n: int
            ) -> tuple[str, list[Any], list[tuple[str, list[Any]]]]:
    """The first `n` characters of held `pieces` (text and its logprob entries, a piece cut
    in two keeping its entries with the part let go), those entries, and what stays held."""
    out: list[str] = []
    lps: list[Any] = []
    keep: list[tuple[str, list[Any]]] = []
    count = 0
    for text, entries in pieces:
        if count >= n and (text or keep):
            keep.append((text, entries))
        elif count + len(text) <= n:
            out.append(text)
            lps += entries
            count += len(text)
        else:
            cut = n - count
            out.append(text[:cut])
            lps += entries
            keep.append((text[cut:], []))
            count = n
    return "".join(out), lps, keep
