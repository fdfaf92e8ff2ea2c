"""Functionary v3.1 (`<function=NAME>{...}</function>`, `<|python_tag|>` code) and v3.2
(`>>>NAME\\n{...}`, `>>>all\\n` the answer; the prompt writes the first `>>>`), in the
shapes of llama.cpp's tests, whole and streamed in 1-character and random pieces."""

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

V31, V32 = "functionary-v3.1", "functionary-v3.2"
PYTHON = Tool(name="python", parameters={"type": "object", "properties": {
    "code": {"type": "string"}}, "required": ["code"]})
ORDERED = [ToolCall(id="a", name="get_weather", arguments={"city": "Zürich 東京",
                                                           "unit": "celsius", "days": 3}),
           CALLS[1]]


def run(name: str, text: str, pieces: list[str], truncated: bool = False,
        choice: Any = "auto", tools: list[Tool] | None = None) -> tuple[str, Any]:
    """(content, finished) of `text` streamed in `pieces` through the family's answer
    splitter (the runner's, for a template that does not think) and reader."""
    _, content, end = cases.run(name, text, pieces, truncated, choice, tools=tools,
                                template=None)
    return content, end


def written(name: str, calls: list[ToolCall], text: str = "Let me look.") -> str:
    body = BY_NAME[name].write_calls(calls, INFO)
    if name == V32:
        return (f"all\n{text}>>>" if text else "") + body
    return (text + " " if text else "") + body


@pytest.mark.parametrize(("template", "name"), [
    ("meetkai-functionary-medium-v3.1.jinja", V31),
    ("meetkai-functionary-medium-v3.2.jinja", V32),
])
def test_detected_from_the_real_template(template: str, name: str) -> None:
    assert formats.detect((TEMPLATES / template).read_text()).name == name


def test_no_other_corpus_template_is_functionary() -> None:
    for path in TEMPLATES.glob("*.jinja"):
        name = formats.detect(path.read_text()).name
        assert name.startswith("functionary") == path.name.startswith("meetkai-"), path.name


@pytest.mark.parametrize("name", [V31, V32])
def test_calls_read_whole_and_streamed_alike(name: str) -> None:
    text = written(name, CALLS)
    results = []
    for pieces in chunkings(text):
        content, end = run(name, text, pieces)
        results.append((content, [(c.name, c.arguments) for c in end.calls]))
    assert all(r == results[0] for r in results), name
    content, calls = results[0]
    assert calls == [(c.name, c.arguments) for c in CALLS]
    assert content.strip() == "Let me look."


@pytest.mark.parametrize("name", [V31, V32])
def test_llama_cpp_examples(name: str) -> None:
    special = Tool(name="special_function", parameters={
        "type": "object", "properties": {"arg1": {"type": "integer"}}, "required": ["arg1"]})
    text = '<function=special_function>{"arg1": 1}</function>' if name == V31 \
        else 'special_function\n{"arg1": 1}'
    for pieces in chunkings(text):
        content, end = run(name, text, pieces, tools=[special])
        assert [(c.name, c.arguments) for c in end.calls] == [("special_function", {"arg1": 1})]
        assert content == ""


@pytest.mark.parametrize(("name", "text", "expected"), [
    (V31, "Hello, world!\nWhat's up? <b>x</b> {\"a\": 1}",
     "Hello, world!\nWhat's up? <b>x</b> {\"a\": 1}"),
    (V32, "all\nHello, world!\nWhat's up? >> {\"a\": 1}",
     "Hello, world!\nWhat's up? >> {\"a\": 1}"),
    (V32, "all\nZürich 東京", "Zürich 東京"),
    (V32, "Hello, world!\nWhat's up?", "Hello, world!\nWhat's up?"),  # no recipient
    (V32, "get_weatherish\nnot a call", "get_weatherish\nnot a call"),
])
def test_text_alone_is_content(name: str, text: str, expected: str) -> None:
    for pieces in chunkings(text):
        content, end = run(name, text, pieces)
        assert not end.calls and content == expected, pieces


def test_v32_answer_after_a_call() -> None:
    text = 'get_weather\n{"city": "Paris"}>>>all\nChecking now.'
    for pieces in chunkings(text):
        content, end = run(V32, text, pieces)
        assert [(c.name, c.arguments) for c in end.calls] == [("get_weather", {"city": "Paris"})]
        assert content == "Checking now."


@pytest.mark.parametrize(("text", "expected"), [
    ("all\nHello, world!\nWhat's up?", "Hello, world!\nWhat's up?"),
    ("all", ""), ("al", "al"), ("alright\nthen", "alright\nthen"),
    ("Hello >>> world", "Hello >>> world"), ("", ""),
])
def test_v32_answer_without_tools(text: str, expected: str) -> None:
    """No tools, no reader: the answer splitter alone takes the recipient off."""
    for pieces in chunkings(text) if text else [[]]:
        split = BY_NAME[V32].answer_splitter()
        assert split is not None
        out = [split.push(p)[1] for p in pieces]
        assert "".join(out) + split.finish()[1] == expected, pieces
    assert BY_NAME[V31].answer_splitter() is None


def test_v32_answer_released_as_it_comes() -> None:
    reader = BY_NAME[V32].reader(ToolPlan(INFO, TOOLS, "auto"))
    assert reader.push("al")[0] == ""
    assert reader.push("l\nHello, wor")[0] == "Hello, wor"
    assert reader.push("ld >>")[0] == "ld "
    assert reader.push(">get_weather\n{\"city\": \"X\"}")[0] == ""
    end = reader.finish()
    assert [c.name for c in end.calls] == ["get_weather"] and end.text == ""


def test_v31_python_tag() -> None:
    text = "Running it.<|python_tag|>print('hey')\nprint(1 > 0)"
    for pieces in chunkings(text):
        content, end = run(V31, text, pieces, tools=[*TOOLS, PYTHON])
        assert [(c.name, c.arguments) for c in end.calls] == [
            ("python", {"code": "print('hey')\nprint(1 > 0)"})]
        assert content == "Running it."
    # without a python tool it is text
    content, end = run(V31, text, [text])
    assert not end.calls and "print('hey')" in content
    call = ToolCall(id="p", name="python", arguments={"code": "print(1)"})
    assert BY_NAME[V31].write_calls([call], INFO) == "<|python_tag|>print(1)"


@pytest.mark.parametrize("name", [V31, V32])
def test_a_call_cut_by_the_token_limit(name: str) -> None:
    text = written(name, CALLS[:1])
    cut_at = text.index("Zürich") + 3
    for pieces in chunkings(text[:cut_at]):
        content, end = run(name, text[:cut_at], pieces, truncated=True)
        assert not end.calls and end.partial is not None, name
        assert end.partial.name == "get_weather"
        assert end.partial.arguments.startswith('{"city": "Zü')
        assert content.strip() == "Let me look."


@pytest.mark.parametrize("name", [V31, V32])
def test_a_further_call_cut_off_is_dropped(name: str) -> None:
    text = written(name, CALLS)
    cut_at = text.index("a \\\"quoted")
    for pieces in chunkings(text[:cut_at]):
        _, end = run(name, text[:cut_at], pieces, truncated=True)
        assert [c.name for c in end.calls] == ["get_weather"], name


def test_v32_forced_call_cut_at_its_name() -> None:
    _, end = run(V32, "get_weather", ["get_", "weather"], truncated=True, choice="required")
    assert not end.calls and end.partial is not None and end.partial.name == "get_weather"


@pytest.mark.parametrize("name", [V31, V32])
def test_unknown_tools_and_bad_arguments_stay_text(name: str) -> None:
    bad = [ToolCall(id="a", name="get_weather", arguments={"days": 3})]  # no city
    for calls in (bad, [ToolCall(id="b", name="delete_all", arguments={})]):
        text = written(name, calls)
        content, end = run(name, text, [text])
        assert not end.calls
        assert "Let me look." in content


@pytest.mark.parametrize("name", [V31, V32])
def test_hostile_output_stays_text(name: str) -> None:
    opener = written(name, CALLS[:1])[:-30]
    for text in (opener + "[" * 5000, opener + '"' * 3000, opener + ">>>" * 2000,
                 "{" * 3000 + opener):
        for truncated in (False, True):
            _, end = run(name, text, [text], truncated=truncated)
            assert not end.calls


@pytest.mark.parametrize("name", [V31, V32])
def test_grammars_write_the_family_calls(name: str) -> None:
    fmt = BY_NAME[name]
    for parallel in (True, False):
        grammar = fmt.grammar(ToolPlan(INFO, TOOLS, "required", parallel))
        assert grammar is not None
        calls = ORDERED if parallel else ORDERED[:1]
        assert accepts(grammar, fmt.write_calls(calls, INFO)), (name, grammar)
        bad = [ToolCall(id="b", name="get_weather", arguments={"days": 3})]
        assert not accepts(grammar, fmt.write_calls(bad, INFO))
    named = fmt.grammar(ToolPlan(INFO, TOOLS, NamedTool(name="search"), False))
    assert named is not None
    assert accepts(named, fmt.write_calls(ORDERED[1:], INFO))
    assert not accepts(named, fmt.write_calls(ORDERED[:1], INFO))


@pytest.mark.parametrize(("name", "before"), [(V31, "Let me look. "), (V32, ""),
                                              (V32, "all\nLet me look.>>>")])
def test_steering_starts_at_the_call(name: str, before: str) -> None:
    fmt = BY_NAME[name]
    weather = Tool(name="get_weather", parameters=WEATHER.parameters)
    steer = fmt.steering(ToolPlan(INFO, [weather], "auto"))
    assert steer is not None
    text = "\n" + before + fmt.write_calls(ORDERED[:1], INFO)  # Lazy's text opens a line
    ends = [m.end() for m in (re.search(t, text) for t in steer.triggers) if m]
    assert ends
    assert accepts(steer.grammar, text[min(ends):]), (steer.grammar, text[min(ends):])
    # a tool's name inside the answer is no trigger
    prose = "\nall\nI could call get_weather\nor not."
    assert not any(re.search(t, prose) for t in steer.triggers)
    assert fmt.steering(ToolPlan(INFO, TOOLS, "required")) is None


def test_the_runner_takes_the_recipient_off_without_tools() -> None:
    """engine/outputs.py: a template that does not think, no tools offered: the format's
    answer splitter still filters the output."""
    from llmrun.engine.outputs import OutputFilters

    filters = OutputFilters(cancel=lambda rid: None)
    filters.watch("r", None, None, opened=False, keep=True, fmt=BY_NAME[V32])
    events = filters.apply([("r", "chunk", {"text": "al"}), ("r", "chunk", {"text": "l\nHi"}),
                            ("r", "chunk", {"text": " there"}), ("r", "done", {})])
    assert "".join(p.get("text", "") for _, kind, p in events if kind == "chunk") == \
        "Hi there"
    assert events[-1][1] == "done"
