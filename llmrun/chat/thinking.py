"""Thinking ("reasoning") models: switching thinking on or off through the chat template, and
splitting the model's output into its thoughts and its answer.

Models that think write their thoughts between markers before the answer: `<think>...</think>`
(Qwen 3, DeepSeek R1, SmolLM3, ...) or `[THINK]...[/THINK]` (Magistral). Each template
switches thinking its own way (a variable, an effort level, a word in the system prompt: see
SWITCHES), read here from its text; several open the thought in the generation prompt
itself, so the output starts inside it (thinking off closes it: `closed`). Whether a model
can think at all is read from its template, as Ollama does: a template that never mentions
thinking cannot switch it.

    pair = thinking.markers(template)            # None: this template does not think
    extra = thinking.template_vars(req.think, template, req.think_budget)  # templates.render
    messages = thinking.switch_messages(template, messages, req.think)    # /think, /no_think
    stream = ThinkStream(pair, inside=thinking.opens(prompt_text, pair), keep=...)
    events = thinking.filter_events(streams, events)   # thoughts leave as their own chunks
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, Protocol

from llmrun.chat import gotemplate, templates
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


# -- each template's own switch ------------------------------------------------------------
#
# Templates switch thinking through variables of their own (llama.cpp's corpus,
# tests/fakes/templates/): a boolean (`enable_thinking`: Qwen 3, GLM, SmolLM3, Command R7B;
# `thinking`: DeepSeek V3.1 to V4, Granite 3.3, Kimi K3), an effort level (`reasoning_effort`:
# gpt-oss's "Reasoning: low|medium|high", Cohere's "none", Hunyuan's "no_think";
# `thinking_effort`: Kimi K3; `reasoning_strength`), a mode (`thinking_mode`: MiniMax M3) or a
# budget of tokens (`thinking_budget`: Seed-OSS, whose 0 is "no thinking"). Which of them a
# template reads is found in its text; the values an effort may take are the quoted words
# the template compares it with. A template that reads none of them but looks for `/think`
# or `/no_think` in the messages (Nemotron Nano v2) is switched by that word in the system
# prompt.

SWITCHES: dict[str, str] = {
    "enable_thinking": "bool", "thinking": "bool",
    "reasoning_effort": "effort", "thinking_effort": "effort", "reasoning_strength": "effort",
    "thinking_mode": "mode", "thinking_budget": "budget",
}
LEVELS = ("minimal", "low", "medium", "high", "max")  # in order of effort
OFF_WORDS = ("none", "no_think", "disabled", "off", "minimal")  # an effort meaning "do not"
_SLASH_SWITCH = re.compile(r"""["']/(?:no_)?think["']\s+(?:not\s+)?in\b""")
_WORD = re.compile(r"""["']([a-z_]{1,20})["']""")
# a template's own (keyword) arguments to render: never a request's template kwargs
RESERVED = frozenset({"messages", "tools", "bos_token", "eos_token", "add_generation_prompt"})


@lru_cache(maxsize=64)
def switches(template: str) -> tuple[str, ...]:
    """The thinking switches (SWITCHES' names) a Jinja template reads, or ("/think",) for
    one that reads the word in its messages; () for none."""
    names = tuple(name for name in SWITCHES if name in _free_variables(template))
    if names:
        return names
    return ("/think",) if _SLASH_SWITCH.search(template) else ()


def _free_variables(template: str) -> frozenset[str]:
    """The variables a template reads that it does not set itself (undefined ones tested
    with `is defined` included), parsed as the renderer parses it ({% generation %} and
    all); none if it does not parse (rendering will say why)."""
    try:
        return templates.free_names(template)
    except templates.TemplateError:
        return frozenset()


@lru_cache(maxsize=64)
def _words(template: str, name: str) -> frozenset[str]:
    """The quoted words in the statements of `template` that mention variable `name` (what
    it is compared with, or defaults to)."""
    return frozenset(w for statement in _statements(template) if name in statement
                     for w in _WORD.findall(statement))


def _statements(template: str) -> list[str]:
    """The text of each `{% ... %}` statement, found in one pass (a request may bring its
    own template: no pattern that could backtrack over it)."""
    return [part.split("%}", 1)[0] for part in template.split("{%")[1:]]


def _effort(template: str, name: str, think: bool | str, boolean: bool) -> str | None:
    """The value of effort variable `name` for `think` (None: leave it unset). A level the
    template does not offer becomes the nearest it does (ties upward: Hunyuan has low and
    high only); off is the template's word for "none", else, with no boolean switch beside
    it, the least effort (gpt-oss cannot stop thinking: "low" is what it has)."""
    words = _words(template, name)
    offered = [lv for lv in LEVELS if lv in words and lv != "minimal"]
    if think is False:
        off = next((w for w in OFF_WORDS if w in words), None)
        if off is not None:
            return off
        if boolean:
            return None
        return offered[0] if len(offered) > 1 else "low"
    if think is True:
        # a template whose effort can say "none" may default to it (Hunyuan): say "on"
        return (offered[-1] if offered else "high") \
            if any(w in words for w in OFF_WORDS) else None
    if think in offered or len(offered) < 2:
        return think
    want = LEVELS.index(think)
    return min(offered, key=lambda lv: (abs(LEVELS.index(lv) - want), -LEVELS.index(lv)))


def template_vars(think: bool | str | None, template: str | None = None,
                  budget: int | None = None) -> dict[str, Any]:
    """The variables that switch thinking as `template` reads them (none when the request
    leaves it to the model's default). Without a template (or for a Go template, which
    reads Ollama's `.Think` from these two), `enable_thinking` and `reasoning_effort`."""
    if think is None and budget is None:
        return {}
    if template is None or gotemplate.looks_like_go(template):
        if think is None:
            return {}
        out: dict[str, Any] = {"enable_thinking": bool(think)}
        if isinstance(think, str):
            out["reasoning_effort"] = think
        return out
    names = switches(template)
    boolean = any(SWITCHES.get(n) == "bool" for n in names)
    out = {}
    for name in names:
        kind = SWITCHES.get(name)
        if kind == "budget":
            value: Any = 0 if think is False else budget
        elif think is None:
            continue
        elif kind == "bool":
            value = bool(think)
        elif kind == "mode":
            value = "enabled" if think else "disabled"
        elif kind == "effort":
            value = _effort(template, name, think, boolean)
        else:
            continue
        if value is not None:
            out[name] = value
    return out


def switch_messages(template: str | None, messages: list[dict[str, Any]],
                    think: bool | str | None) -> list[dict[str, Any]]:
    """`messages` with `/think` or `/no_think` at the end of the system prompt, for a
    template switched by that word (Nemotron Nano v2 reads it there, and strips it)."""
    if think is None or not template or switches(template) != ("/think",):
        return messages
    word = "/think" if think else "/no_think"
    if messages and messages[0].get("role") == "system" \
            and isinstance(messages[0].get("content"), str):
        head = messages[0]
        return [{**head, "content": f"{head['content'].rstrip()} {word}".lstrip()},
                *messages[1:]]
    return [{"role": "system", "content": word}, *messages]


def closed(prompt: str, pair: tuple[str, str]) -> str:
    """A prompt whose generation prompt opened a thought, with that thought closed (empty),
    as llama.cpp closes it when thinking is off: for templates that always open one
    (DeepSeek R1's, QwQ's), so thinking off never leaves the output inside a thought."""
    return prompt + pair[1] + "\n\n" if opens(prompt, pair) else prompt


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
