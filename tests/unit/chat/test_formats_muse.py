"""Muse Glimmer (formats/muse.py): messages to=self (the thought), to=user (the answer) and
to=NAME (an ATEM call), the shapes of llama.cpp's tests for muse-glimmer.jinja, through the
format's splitter and reader, whole and streamed in 1-character and random pieces."""

from __future__ import annotations

import re
from typing import Any

import pytest

from llmrun.chat import formats
from llmrun.chat.formats import BY_NAME
from llmrun.chat.tools import ToolPlan
from llmrun.request import NamedTool, Tool, ToolCall
from tests.unit.chat import formatcases as cases
from tests.unit.chat.formatcases import CALLS, INFO, TEMPLATES, TOOLS, WEATHER, chunkings
from tests.unit.chat.grammarcheck import accepts

FMT = BY_NAME["muse-glimmer"]
SPECIAL = Tool(name="special_function", parameters={
    "type": "object", "properties": {"arg1": {"type": "integer"}}, "required": ["arg1"]})
MARKUP = ('<atem:function_calls>\n<atem:invoke name="special_function">\n'
          '<atem:parameter name="arg1">1</atem:parameter>\n</atem:invoke>\n'
          "</atem:function_calls>")
ORDERED = [ToolCall(id="a", name="get_weather", arguments={"city": "Zürich 東京",
                                                           "unit": "celsius", "days": 3}),
           CALLS[1]]


def run(text: str, pieces: list[str], truncated: bool = False, choice: Any = "auto",
        tools: list[Tool] | None = None) -> tuple[str, str, Any]:
    assert FMT.think_pair(None) is not None
    return cases.run(FMT, text, pieces, truncated, choice, tools=tools, template=None)


def output(calls: list[ToolCall]) -> str:
    """Calls as the output writes them: the prompt wrote the first `<|start|>assistant`."""
    return FMT.write_calls(calls, INFO)[len("<|start|>assistant"):]


def test_detected_from_the_real_template_only() -> None:
    for path in TEMPLATES.glob("*.jinja"):
        is_muse = formats.detect(path.read_text()).name == "muse-glimmer"
        assert is_muse == (path.name == "muse-glimmer.jinja"), path.name


@pytest.mark.parametrize(("text", "thought", "content", "calls"), [
    (" to=user<|message|>Hello, world!\nWhat's up?<|eot|>", "", "Hello, world!\nWhat's up?",
     []),
    (" to=special_function<|message|>" + MARKUP, "", "", [("special_function", {"arg1": 1})]),
    (" to=user<|message|>Hello, world!\nWhat's up?<|eom|><|start|>assistant "
     "to=special_function<|message|>" + MARKUP, "", "Hello, world!\nWhat's up?",
     [("special_function", {"arg1": 1})]),
    # markup quoted in the answer is the answer's
    (" to=user<|message|>You invoke it like this:\n" + MARKUP + "<|eot|>", "",
     "You invoke it like this:\n" + MARKUP, []),
    # and in the thought, the thought's
    (" to=self<|message|>I could use " + MARKUP + " here<|eom|><|start|>assistant "
     "to=user<|message|>Hello!<|eot|>", "I could use " + MARKUP + " here", "Hello!", []),
    (" to=self<|message|>I'm\nthinking<|eom|><|start|>assistant to=special_function"
     "<|message|>" + MARKUP + "<|eom|>", "I'm\nthinking", "", [("special_function",
                                                                 {"arg1": 1})]),
    ("<|message|>No recipient: the user's.<|eot|>", "", "No recipient: the user's.", []),
    ("Plain text, no messages at all.", "", "Plain text, no messages at all.", []),
])
def test_llama_cpp_examples(text: str, thought: str, content: str,
                            calls: list[tuple[str, Any]]) -> None:
    for pieces in chunkings(text):
        got_thought, got, end = run(text, pieces, tools=[SPECIAL])
        assert (got_thought, got, [(c.name, c.arguments) for c in end.calls]) == \
            (thought, content, calls), pieces


def test_calls_read_whole_and_streamed_alike() -> None:
    text = (" to=self<|message|>Need weather, then search.<|eom|><|start|>assistant to=user"
            "<|message|>Let me look.<|eom|>" + FMT.write_calls(CALLS, INFO) + "<|eom|>")
    results = []
    for pieces in chunkings(text):
        thought, content, end = run(text, pieces)
        results.append((thought, content, [(c.name, c.arguments) for c in end.calls]))
    assert all(r == results[0] for r in results)
    thought, content, calls = results[0]
    assert calls == [(c.name, c.arguments) for c in CALLS]
    assert content == "Let me look." and thought == "Need weather, then search."


def test_a_call_cut_by_the_token_limit() -> None:
    text = output(CALLS[:1])
    for cut_at, expected in ((text.index("Zürich") + 3, "{"),
                             (text.index('"days"') + 3,
                              '{"city": "Zürich 東京", "unit": "celsius"')):
        for pieces in chunkings(text[:cut_at]):
            _, content, end = run(text[:cut_at], pieces, truncated=True)
            assert not end.calls and end.partial is not None
            assert end.partial.name == "get_weather"
            assert end.partial.arguments == expected
            assert content == ""


def test_a_further_call_cut_off_is_dropped() -> None:
    text = output(CALLS)
    cut_at = text.index("quoted")
    for pieces in chunkings(text[:cut_at]):
        _, _, end = run(text[:cut_at], pieces, truncated=True)
        assert [c.name for c in end.calls] == ["get_weather"]


def test_unknown_tools_bad_arguments_and_hostile_text() -> None:
    for calls in ([ToolCall(id="a", name="get_weather", arguments={"days": 3})],
                  [ToolCall(id="b", name="delete_all", arguments={})],
                  [ToolCall(id="c", name="get_weather", arguments={"city": "X",
                                                                   "unit": "kelvin"})]):
        text = output(calls)
        _, content, end = run(text, [text])
        assert not end.calls and "atem:invoke" in content
    # the recipient and the invoked name must agree
    text = output(CALLS[:1]).replace('invoke name="get_weather"', 'invoke name="search"')
    _, _, end = run(text, [text])
    assert not end.calls
    head = output(CALLS[:1])[:80]
    for text in (head + "<atem:parameter" * 3000, " to=" + "x" * 5000,
                 "<|message|>" * 2000, head + "[" * 5000):
        for truncated in (False, True):
            _, _, end = run(text, [text], truncated=truncated)
            assert not end.calls


def test_grammars_write_the_family_calls() -> None:
    for parallel in (True, False):
        grammar = FMT.grammar(ToolPlan(INFO, TOOLS, "required", parallel))
        assert grammar is not None
        calls = ORDERED if parallel else ORDERED[:1]
        assert accepts(grammar, output(calls)), grammar
        assert accepts(grammar, " to=self<|message|>Hm, <atem:x> to=user.<|eom|>"
                       "<|start|>assistant" + output(calls))
        for bad in ({"days": 3}, {"city": "X", "unit": "kelvin"}):
            assert not accepts(grammar, output([ToolCall(id="b", name="get_weather",
                                                         arguments=bad)])), bad
    named = FMT.grammar(ToolPlan(INFO, TOOLS, NamedTool(name="search"), False))
    assert named is not None
    assert accepts(named, output(ORDERED[1:]))
    assert not accepts(named, output(ORDERED[:1]))


@pytest.mark.parametrize("before", ["", " to=user<|message|>Let me look.<|eom|>"
                                        "<|start|>assistant"])
def test_steering_starts_at_the_call(before: str) -> None:
    steer = FMT.steering(ToolPlan(INFO, [WEATHER], "auto"))
    assert steer is not None
    text = "\n" + before + output(ORDERED[:1])
    [trigger] = steer.triggers
    m = re.search(trigger, text)
    assert m is not None and accepts(steer.grammar, text[m.end():]), steer.grammar
    assert not re.search(trigger, "\n to=user<|message|>x")
    assert not re.search(trigger, "\n to=self<|message|>x")
    assert FMT.steering(ToolPlan(INFO, TOOLS, "required")) is None
