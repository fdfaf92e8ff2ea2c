"""MiniCPM 5 (`<function name="NAME"><param name="KEY">value</param></function>`, values
converted by their schema, CDATA for text with markup) and Solar Open (a marked section of
JSON calls with ids; its thought and answer markers), whole and streamed in 1-character and
random pieces."""

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

NAMES = ["minicpm5", "solar-open"]
TEMPLATE = {"minicpm5": "openbmb-MiniCPM5-1B.jinja",
            "solar-open": "upstage-Solar-Open-100B.jinja"}
THOUGHT = {"minicpm5": "<think>\nI'm\nthinking\n</think>\n\n",
           "solar-open": "<|think|>I'm\nthinking<|end|><|begin|>assistant"}
BEFORE = {"minicpm5": "Let me look.\n", "solar-open": "<|content|>Let me look.<|end|>"}
ORDERED = [ToolCall(id="a", name="get_weather", arguments={"city": "Zürich 東京",
                                                           "unit": "celsius", "days": 3}),
           CALLS[1]]


def run(name: str, text: str, pieces: list[str], truncated: bool = False,
        choice: Any = "auto") -> tuple[str, str, Any]:
    template = (TEMPLATES / TEMPLATE[name]).read_text()
    assert BY_NAME[name].think_pair(template) is not None
    return cases.run(name, text, pieces, truncated, choice, template=template)


def written(name: str, calls: list[ToolCall], thought: bool = True) -> str:
    return (THOUGHT[name] if thought else "") + BEFORE[name] \
        + BY_NAME[name].write_calls(calls, INFO)


@pytest.mark.parametrize("name", NAMES)
def test_detected_from_the_real_template_only(name: str) -> None:
    for path in TEMPLATES.glob("*.jinja"):
        detected = formats.detect(path.read_text()).name
        assert (detected == name) == (path.name == TEMPLATE[name]), path.name


@pytest.mark.parametrize("name", NAMES)
def test_calls_read_whole_and_streamed_alike(name: str) -> None:
    text = written(name, CALLS)
    results = []
    for pieces in chunkings(text):
        thought, content, end = run(name, text, pieces)
        results.append((thought, content, [(c.name, c.arguments) for c in end.calls]))
    assert all(r == results[0] for r in results), name
    thought, content, calls = results[0]
    assert calls == [(c.name, c.arguments) for c in CALLS]
    assert content.strip() == "Let me look."
    assert thought.strip() == "I'm\nthinking"


@pytest.mark.parametrize(("name", "text"), [
    ("minicpm5", "<think>\nI'm\nthinking\n</think>\n\nHello, world!\nWhat's up?"),
    ("solar-open", "<|think|>I'm\nthinking<|end|><|begin|>assistant<|content|>Hello, world!\n"
                   "What's up?<|end|>"),
    ("solar-open", "<|content|>Hello, world!\nWhat's up?<|end|>"),
])
def test_answers(name: str, text: str) -> None:
    for pieces in chunkings(text):
        thought, content, end = run(name, text, pieces)
        assert content == "Hello, world!\nWhat's up?" and not end.calls
        assert thought.strip() == ("I'm\nthinking" if "thinking" in text else "")


def test_minicpm5_cdata_and_layout() -> None:
    text = ('<function name="search"><param name="query"><![CDATA[a <b> & c\n</param> d]]>'
            '</param>\n<param name="limit">3</param></function>\n<function name="get_weather">'
            '<param name="city">Paris</param></function>')
    for pieces in chunkings(text):
        _, content, end = run("minicpm5", text, pieces)
        assert [(c.name, c.arguments) for c in end.calls] == [
            ("search", {"query": "a <b> & c\n</param> d", "limit": 3}),
            ("get_weather", {"city": "Paris"})]
        assert content == ""


def test_solar_ids_are_any_and_text_around() -> None:
    text = ("<|tool_calls|><|tool_call:begin|>call_x1<|tool_call:name|>get_weather"
            '<|tool_call:args|>{"city": "Paris"}<|tool_call:end|><|tool_call:begin|>2'
            '<|tool_call:name|>search<|tool_call:args|>{"query": "q"}<|tool_call:end|>'
            "<|calls|>")
    for pieces in chunkings(text):
        _, content, end = run("solar-open", text, pieces)
        assert [(c.name, c.arguments) for c in end.calls] == [
            ("get_weather", {"city": "Paris"}), ("search", {"query": "q"})]
        assert content == ""


@pytest.mark.parametrize("name", NAMES)
def test_a_call_cut_by_the_token_limit(name: str) -> None:
    text = written(name, CALLS[:1], thought=False)
    cut_at = text.index("Zürich") + 3
    for pieces in chunkings(text[:cut_at]):
        _, content, end = run(name, text[:cut_at], pieces, truncated=True)
        assert not end.calls and end.partial is not None, name
        assert end.partial.name == "get_weather"
        assert content.strip() == "Let me look."


@pytest.mark.parametrize("name", NAMES)
def test_a_further_call_cut_off_is_dropped(name: str) -> None:
    text = written(name, CALLS, thought=False)
    cut_at = text.index("quoted")
    for pieces in chunkings(text[:cut_at]):
        _, _, end = run(name, text[:cut_at], pieces, truncated=True)
        assert [c.name for c in end.calls] == ["get_weather"], name


@pytest.mark.parametrize("name", NAMES)
def test_unknown_tools_bad_arguments_and_hostile_text(name: str) -> None:
    for calls in ([ToolCall(id="a", name="get_weather", arguments={"days": 3})],
                  [ToolCall(id="b", name="delete_all", arguments={})],
                  [ToolCall(id="c", name="get_weather", arguments={"city": "X",
                                                                   "unit": "kelvin"})]):
        text = written(name, calls, thought=False)
        _, _, end = run(name, text, [text])
        assert not end.calls
    head = BY_NAME[name].write_calls(CALLS[:1], INFO)[:60]
    for text in (head + "[" * 5000, head + "<param" * 3000, "{" * 3000 + head):
        for truncated in (False, True):
            _, _, end = run(name, text, [text], truncated=truncated)
            assert not end.calls


@pytest.mark.parametrize("name", NAMES)
def test_grammars_write_the_family_calls(name: str) -> None:
    fmt = BY_NAME[name]
    for parallel in (True, False):
        grammar = fmt.grammar(ToolPlan(INFO, TOOLS, "required", parallel))
        assert grammar is not None
        calls = ORDERED if parallel else ORDERED[:1]
        assert accepts(grammar, fmt.write_calls(calls, INFO)), (name, grammar)
        for bad in ({"days": 3}, {"city": "X", "unit": "kelvin"}):
            assert not accepts(grammar, fmt.write_calls(
                [ToolCall(id="b", name="get_weather", arguments=bad)], INFO)), bad
    named = fmt.grammar(ToolPlan(INFO, TOOLS, NamedTool(name="search"), False))
    assert named is not None
    assert accepts(named, fmt.write_calls(ORDERED[1:], INFO))
    assert not accepts(named, fmt.write_calls(ORDERED[:1], INFO))


@pytest.mark.parametrize("name", NAMES)
def test_steering_starts_at_the_call(name: str) -> None:
    fmt = BY_NAME[name]
    steer = fmt.steering(ToolPlan(INFO, [Tool(name="get_weather",
                                              parameters=WEATHER.parameters)], "auto"))
    assert steer is not None
    text = "\n" + BEFORE[name] + fmt.write_calls(ORDERED[:1], INFO)
    [trigger] = steer.triggers
    m = re.search(trigger, text)
    assert m is not None and accepts(steer.grammar, text[m.end():]), steer.grammar
    assert fmt.steering(ToolPlan(INFO, TOOLS, "required")) is None
