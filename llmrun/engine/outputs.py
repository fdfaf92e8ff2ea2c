"""What a request's output goes through: the grammar it decodes under (a forced tool call,
the request's grammar or format; tool calls steered once the model begins one), and the
thinking and tool-call filters its events pass on their way to the daemon."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from llmrun.chat import formats, thinking, toolcalls, tools
from llmrun.engine import constraint
from llmrun.engine.batcher import Event
from llmrun.engine.llama import Model
from llmrun.protocol import FINAL
from llmrun.request import ChatRequest, error_event

log = logging.getLogger("llmrun.runner")


def grammar_matcher(model: Model, req: ChatRequest, plan: tools.ToolPlan | None,
                    fmt: formats.Format = formats.DEFAULT) -> Any:
    """The llguidance matcher `req` decodes under (None: unconstrained), built here on the
    message thread, never the engine's: a forced tool call's grammar (in `fmt`'s syntax),
    else the request's raw grammar, else its format. A grammar llguidance refuses is a
    ValueError (a 400)."""
    forced_call = plan is not None and plan.choice != "auto"
    if not forced_call and req.grammar is None and req.format is None:
        return None
    tok = constraint.tokenizer(model)  # built at start-up (serve); cached
    # markers that are one special token are forced as that token, as the model was
    # trained to write them, not spelled out character by character
    forced = fmt.grammar(plan, special_markers(tok, fmt)) if forced_call and plan else None
    grammar = constraint.compile(req, tok, forced)
    return None if grammar is None else constraint.matcher(tok, grammar)


def special_markers(tok: Any, fmt: formats.Format) -> dict[str, int]:
    """The markers of tools.py's families and of `fmt` that are one special token of this
    vocabulary, with their ids (tools.special_markers)."""
    return tools.special_markers(tok, fmt.markers)


def tool_steering(model: Model, req: ChatRequest, plan: tools.ToolPlan | None,
                  pair: tuple[str, str] | None, text: str,
                  fmt: formats.Format = formats.DEFAULT) -> constraint.Lazy | None:
    """For tool_choice "auto": the grammar that takes over once the model begins a call
    (tools.steering), built here on the message thread. None when nothing is offered or
    the request is constrained otherwise; a grammar llguidance refuses (a schema it
    cannot read) leaves calls free, as they were before steering, with a log line."""
    if plan is None or req.grammar is not None or req.format is not None:
        return None
    tok = constraint.tokenizer(model)
    try:  # ~20 ms for Claude Code's tools; no separate check: the matcher's build is one
        steer = fmt.steering(plan, special_markers(tok, fmt))
        if steer is None:
            return None
        grammar = constraint.from_grammar(steer.grammar)
        think = (pair[0].encode(), pair[1].encode()) if pair is not None else None
        inside = pair is not None and thinking.opens(text, pair)
        return constraint.Lazy(tok, grammar, steer.triggers, think, inside)
    except ValueError as exc:
        log.warning("tool calls are not steered for this request: %s", exc)
        return None


def by_request(events: list[Event]) -> dict[str, list[Event]]:
    """Events grouped by request id, each request's in their order."""
    groups: dict[str, list[Event]] = {}
    for event in events:
        groups.setdefault(event[0], []).append(event)
    return groups


class OutputFilters:
    """The requests whose output is filtered (thinking split from the answer, tool calls
    parsed out of it), and those failed here whose further events are not sent. Events go
    through `apply` on the engine's thread, requests start and end on the message thread:
    each request's stream is added and removed whole (dict and set operations are atomic)."""

    def __init__(self, cancel: Callable[[str], None]) -> None:
        self._cancel = cancel  # the engine's: a request failed here is stopped there
        # requests that offer tools / that may think: their format's reader and splitter
        self.tool_streams: dict[str, formats.CallReader] = {}
        self.think_streams: dict[str, formats.Splitter] = {}
        self._dropped: set[str] = set()  # failed here: their further events are not sent

    def watch(self, rid: str, plan: tools.ToolPlan | None, pair: tuple[str, str] | None,
              opened: bool, keep: bool, fmt: formats.Format = formats.DEFAULT) -> None:
        """Filter request `rid`'s output as `fmt` reads it: tool calls by `plan`, thoughts
        between `pair` (`opened`: the prompt opened one; `keep`: thoughts are reported, not
        dropped)."""
        if plan is not None:
            self.tool_streams[rid] = fmt.reader(plan)
        if pair is not None:
            self.think_streams[rid] = fmt.splitter(pair, inside=opened, keep=keep)
        elif (answer := fmt.answer_splitter()) is not None:
            self.think_streams[rid] = answer

    def forget(self, rid: str) -> None:
        self.think_streams.pop(rid, None)
        self.tool_streams.pop(rid, None)

    def apply(self, events: list[Event]) -> list[Event]:
        """`events` as they go out: without those of dropped requests, filtered."""
        if self._dropped:
            events = self._without_dropped(events)
        if self.think_streams or self.tool_streams:
            events = self._filter(events)
        return events

    def _without_dropped(self, events: list[Event]) -> list[Event]:
        out = []
        for event in events:
            rid, kind, _ = event
            if rid not in self._dropped:
                out.append(event)
            elif kind in FINAL:
                self._dropped.discard(rid)
        return out

    def _filter(self, events: list[Event]) -> list[Event]:
        """Events through the thinking and tool-call filters, one request at a time, so a
        filter that raises on one request's output fails that request alone."""
        out: list[Event] = []
        for rid, group in by_request(events).items():
            if rid in self.think_streams or rid in self.tool_streams:
                try:
                    if rid in self.think_streams:  # thoughts first: tools see the answer
                        group = thinking.filter_events(self.think_streams, group)
                    if rid in self.tool_streams:
                        group = toolcalls.filter_events(self.tool_streams, group)
                except Exception as exc:
                    log.error("request %s: its output filter failed", rid, exc_info=exc)
                    group = self.abandon(rid, group, error_event(
                        "internal", f"the model's output could not be processed "
                                    f"({type(exc).__name__}); generation was stopped"))
            out += group
        return out

    def abandon(self, rid: str, group: list[Event], error: dict[str, Any]) -> list[Event]:
        """End request `rid` with `error` in place of `group` (its events of this step): its
        stream state goes, and unless the group already finished it, the engine cancels it
        and whatever it still emits for it is dropped."""
        self.think_streams.pop(rid, None)
        self.tool_streams.pop(rid, None)
        if not any(kind in FINAL for _, kind, _ in group):
            self._dropped.add(rid)
            self._cancel(rid)
        return [(rid, "error", error)]

