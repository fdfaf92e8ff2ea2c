"""Thinking ("reasoning") models: switching thinking on or off through the chat template, and
splitting the model's output into its thoughts and its answer.

Models that think write their thoughts between markers before the answer: `<think>...</think>`
(Qwen 3, DeepSeek R1, SmolLM3, ...) or `[THINK]...[/THINK]` (Magistral). Their templates take
`enable_thinking` (and some `reasoning_effort`); several open the thought in the generation
prompt itself, so the output starts inside it. Whether a model can think at all is read from
its template, as Ollama does: a template that never mentions thinking cannot switch it.

    pair = thinking.markers(template)            # None: this template does not think
    extra = thinking.template_vars(job.think)   # for templates.render
    stream = ThinkStream(pair, inside=thinking.opens(prompt_text, pair), keep=...)
    events = thinking.filter_events(streams, events)   # thoughts leave as their own chunks
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from llmrun.chat.textstream import partial_match

PAIRS: tuple[tuple[str, str], ...] = (("<think>", "</think>"), ("[THINK]", "[/THINK]"))
# Markers that are control tokens in some vocabularies (rendered as nothing by default).
CONTROL_MARKERS = tuple(m for pair in PAIRS for m in pair)

# Jinja's switch and history field, Go's (Ollama's) `.Think`, or the markers themselves
_MENTIONS = re.compile(r"enable_thinking|reasoning_content|\.Think\b|<think>|\[THINK\]")


def markers(template: str | None) -> tuple[str, str] | None:
    """The (open, close) markers of a template that supports thinking, else None."""
    if not template or not _MENTIONS.search(template):
        return None
    return PAIRS[1] if "[THINK]" in template else PAIRS[0]


def template_vars(think: bool | str | None) -> dict[str, Any]:
    """Variables that switch thinking in the usual templates; none when the request leaves
    it to the model's default."""
    if think is None:
        return {}
    out: dict[str, Any] = {"enable_thinking": bool(think)}
    if isinstance(think, str):
        out["reasoning_effort"] = think
    return out


def opens(prompt: str, pair: tuple[str, str]) -> bool:
    """True when the rendered prompt leaves a thought open, so the output starts inside it."""
    open_, close = pair
    tail = prompt.rstrip()
    return tail.endswith(open_) and tail.rfind(open_) > tail.rfind(close)


@dataclass
class ThinkStream:
    """Splits one request's streamed text into (thinking, content). A thought counts only at
    the start of the output (blank lines aside); text that could still become a marker is
    held back until it cannot. With `keep` False thoughts are dropped (thinking was switched
    off, yet a model may think anyway)."""

    pair: tuple[str, str]
    inside: bool = False
    keep: bool = True
    _held: str = ""
    _state: str = field(default="start")  # start -> thinking -> after -> content

    def __post_init__(self) -> None:
        if self.inside:
            self._state = "thinking"

    @property
    def thinking(self) -> bool:
        """Whether the text pushed so far is inside a thought."""
        return self._state == "thinking"

    def push(self, text: str) -> tuple[str, str]:
        self._held += text
        thinking: list[str] = []
        content: list[str] = []
        while self._held:
            open_, close = self.pair
            if self._state == "start":
                stripped = self._held.lstrip()
                if stripped.startswith(open_):
                    self._held = stripped[len(open_):]
                    self._state = "thinking"
                elif open_.startswith(stripped):
                    break  # blank, or a marker not yet complete
                else:
                    self._state = "content"
            elif self._state == "thinking":
                end = self._held.find(close)
                if end == -1:
                    keep = partial_match(self._held, (close,))
                    thinking.append(self._held[:len(self._held) - keep])
                    self._held = self._held[len(self._held) - keep:]
                    break
                thinking.append(self._held[:end])
                self._held = self._held[end + len(close):]
                self._state = "after"
            elif self._state == "after":  # the blank lines between thought and answer
                stripped = self._held.lstrip()
                if not stripped:
                    self._held = ""
                    break
                self._held = stripped
                self._state = "content"
            else:
                content.append(self._held)
                self._held = ""
        return ("".join(thinking) if self.keep else ""), "".join(content)

    def finish(self) -> tuple[str, str]:
        """What is still held when the output ends: a partial marker is just text."""
        held, self._held = self._held, ""
        if self._state == "thinking":
            return (held if self.keep else ""), ""
        if self._state == "after":
            return "", ""
        return "", held


class Splitter(Protocol):
    """What splits a request's streamed text into (thinking, content): a ThinkStream, or a
    chat format's own (formats/: harmony's channels)."""

    def push(self, text: str) -> tuple[str, str]: ...

    def finish(self) -> tuple[str, str]: ...


def filter_events(streams: dict[str, Splitter],
                  events: list[tuple[str, str, Any]]) -> list[tuple[str, str, Any]]:
    """Pass runner events through the think streams of the requests that have one.

    Thoughts leave as their own chunk, `{"text": "", "thinking": ...}`, ahead of the answer's
    text in the engine's usual payload (`{"text", "logprobs"?}`), which later filters (the
    tool parser) see alone. A finished request leaves `streams`."""
    out: list[tuple[str, str, Any]] = []
    for event in events:
        rid, kind, payload = event
        stream = streams.get(rid)
        if stream is None:
            out.append(event)
            continue
        if kind == "chunk":
            thought, answer = stream.push(payload["text"])
            if thought:
                out.append((rid, "chunk", {"text": "", "thinking": thought}))
            if len(payload) > 1 and (answer or payload.get("logprobs")
                                     or payload.get("prompt_logprobs")):
                out.append((rid, kind, {**payload, "text": answer}))
            elif answer:
                out.append((rid, kind, {"text": answer}))
            continue
        if kind not in ("done", "error"):
            out.append(event)
            continue
        streams.pop(rid, None)
        if kind == "done":
            thought, answer = stream.finish()
            if thought:
                out.append((rid, "chunk", {"text": "", "thinking": thought}))
            if answer:
                out.append((rid, "chunk", {"text": answer}))
        out.append(event)
    return out
