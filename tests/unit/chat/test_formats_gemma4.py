"""Gemma 4 (formats/gemma4.py): calls in Gemma's notation, `<|tool_call>call:NAME{k:v}
<tool_call|>`, thoughts in `<|channel>thought ... <channel|>`; the outputs of llama.cpp's
tests for google-gemma-4-31B-it.jinja, whole and streamed in 1-character and random
pieces."""

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

FMT = BY_NAME["gemma4"]
GET_TIME = Tool(name="get_time", parameters={"type": "object", "properties": {
    "city": {"type": "string"}}, "required": ["city"]})
ANY = Tool(name="anything", parameters={"type": "object", "properties": {
    "arg1": {"type": "number"}, "enabled": {"type": "boolean"},
    "value": {"type": ["string", "null"]}, "todos": {"type": "array"},
    "config": {"type": "object"}}})
EMPTY = Tool(name="empty_args", parameters={"type": "object", "properties": {}})


def run(text: str, pieces: list[str], truncated: bool = False, choice: Any = "auto",
        tools: list[Tool] | None = None, inside: bool = False) -> tuple[str, str, Any]:
    return cases.run(FMT, text, pieces, truncated, choice, inside, tools, template=None)


@pytest.mark.parametrize("template", ["google-gemma-4-31B-it.jinja",
                                      "google-gemma-4-31B-it-interleaved.jinja"])
def test_detected_from_the_real_template(template: str) -> None:
    assert formats.detect((TEMPLATES / template).read_text()).name == "gemma4"


def test_no_other_corpus_template_is_gemma4() -> None:
    for path in TEMPLATES.glob("*.jinja"):
        is_gemma4 = formats.detect(path.read_text()).name == "gemma4"
        assert is_gemma4 == path.name.startswith("google-gemma-4"), path.name
    # Gemma 2 has no tools and no thought: the default
    assert formats.detect((TEMPLATES / "google-gemma-2-2b-it.jinja").read_text()).name \
        == "default"


@pytest.mark.parametrize(("text", "tool", "args"), [
    ('<|tool_call>call:get_time{city:<|"|>London<|"|>}<tool_call|>', GET_TIME,
     {"city": "London"}),
    ('<|tool_call>call:get_time{city:<|"|>San Francisco<|"|>}<tool_call|>', GET_TIME,
     {"city": "San Francisco"}),
    ("<|tool_call>call:empty_args{}<tool_call|>", EMPTY, {}),
    ("<|tool_call>call:anything{arg1:42}<tool_call|>", ANY, {"arg1": 42}),
    ("<|tool_call>call:anything{arg1:-7}<tool_call|>", ANY, {"arg1": -7}),
    ("<|tool_call>call:anything{arg1:3.14}<tool_call|>", ANY, {"arg1": 3.14}),
    ("<|tool_call>call:anything{arg1:1.5e10}<tool_call|>", ANY, {"arg1": 1.5e10}),
    ("<|tool_call>call:anything{enabled:true}<tool_call|>", ANY, {"enabled": True}),
    ("<|tool_call>call:anything{enabled:false}<tool_call|>", ANY, {"enabled": False}),
    ("<|tool_call>call:anything{value:null}<tool_call|>", ANY, {"value": None}),
    ('<|tool_call>call:anything{todos:[<|"|>buy milk<|"|>,<|"|>walk dog<|"|>]}<tool_call|>',
     ANY, {"todos": ["buy milk", "walk dog"]}),
    ('<|tool_call>call:anything{config:{theme:<|"|>dark<|"|>,count:3}}<tool_call|>', ANY,
     {"config": {"theme": "dark", "count": 3}}),
    ("<|tool_call>call:anything{todos:[]}<tool_call|>", ANY, {"todos": []}),
    ("<|tool_call>call:anything{config:{}}<tool_call|>", ANY, {"config": {}}),
    ('<|tool_call>call:anything{value:<|"|>a: {b}, [c] "d" 東京<|"|>,arg1:0}<tool_call|>',
     ANY, {"value": 'a: {b}, [c] "d" 東京', "arg1": 0}),
])
def test_llama_cpp_examples(text: str, tool: Tool, args: dict[str, Any]) -> None:
    for pieces in chunkings(text):
        thought, content, end = run(text, pieces, tools=[tool])
        assert [(c.name, c.arguments) for c in end.calls] == [(tool.name, args)]
        assert content == "" and thought == ""


def test_calls_read_whole_and_streamed_alike() -> None:
    text = ("<|channel>thought\nI'm\nthinking<channel|>Let me look."
            + FMT.write_calls(CALLS, INFO))
    results = []
    for pieces in chunkings(text):
        thought, content, end = run(text, pieces)
        results.append((thought, content, [(c.name, c.arguments) for c in end.calls]))
    assert all(r == results[0] for r in results)
    thought, content, calls = results[0]
    assert calls == [(c.name, c.arguments) for c in CALLS]
    assert content == "Let me look." and thought == "I'm\nthinking"


@pytest.mark.parametrize(("text", "thought"), [
    ("<|channel>thought\nI'm\nthinking<channel|>Hello, world!\nWhat's up?", "I'm\nthinking"),
    ("<|channel>thought<channel|>Hello, world!\nWhat's up?", ""),
    ("<|channel>thought\n<channel|>Hello, world!\nWhat's up?<channel|>", ""),
    ("<|channel>thought\n<channel|>Hello, world!\nWhat's up?<|channel>thought\n<channel|>", ""),
    ("<|channel>thought\n<channel|>Hello, world!\nWhat's up?<|channel>thought\n<channel|>"
     "<channel|>", ""),
    ("<|channel><|channel>thought\n<channel|>Hello, world!\nWhat's up?", ""),
    ("Hello, world!\nWhat's up?", ""),
])
def test_thoughts_and_stray_channel_marks(text: str, thought: str) -> None:
    for pieces in chunkings(text):
        got, content, end = run(text, pieces)
        assert (got, content.strip()) == (thought, "Hello, world!\nWhat's up?"), pieces
        assert not end.calls


def test_text_alone_is_content() -> None:
    text = "Sunny, 20 °C. Use <b> tags? {\"a\": 1} call:get_weather{city:x}"
    for pieces in chunkings(text):
        _, content, end = run(text, pieces)
        assert not end.calls and content == text


def test_text_before_a_call_and_several_calls() -> None:
    text = ('Hello, world!\nWhat\'s up?<|tool_call>call:get_time{city:<|"|>London<|"|>}'
            '<tool_call|><|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|>')
    for pieces in chunkings(text):
        _, content, end = run(text, pieces, tools=[GET_TIME, WEATHER])
        assert [(c.name, c.arguments) for c in end.calls] == [
            ("get_time", {"city": "London"}), ("get_weather", {"city": "Paris"})]
        assert content == "Hello, world!\nWhat's up?"


def test_a_call_cut_by_the_token_limit() -> None:
    text = "Let me look." + FMT.write_calls(CALLS[:1], INFO)
    for cut_at, expected in ((text.index("Zürich") + 3, "{"),
                             (text.index("unit:") + 8, '{"city": "Zürich 東京", "days": 3')):
        for pieces in chunkings(text[:cut_at]):
            _, content, end = run(text[:cut_at], pieces, truncated=True)
            assert not end.calls and end.partial is not None
            assert end.partial.name == "get_weather"
            assert end.partial.arguments == expected
            assert content == "Let me look."


def test_a_further_call_cut_off_is_dropped() -> None:
    text = FMT.write_calls(CALLS, INFO)
    cut_at = text.index("quoted")
    for pieces in chunkings(text[:cut_at]):
        _, _, end = run(text[:cut_at], pieces, truncated=True)
        assert [c.name for c in end.calls] == ["get_weather"]


def test_unknown_tools_bad_arguments_and_hostile_text_stay_text() -> None:
    for calls in ([ToolCall(id="a", name="get_weather", arguments={"days": 3})],
                  [ToolCall(id="b", name="delete_all", arguments={})],
                  [ToolCall(id="c", name="get_weather", arguments={"city": "X",
                                                                   "unit": "kelvin"})]):
        text = FMT.write_calls(calls, INFO)
        _, content, end = run(text, [text])
        assert not end.calls and "call:" in content
    head = "<|tool_call>call:get_weather{city:"
    for text in (head + "[" * 5000, head + "{a:" * 3000, head + '<|"|>' + "x" * 10000,
                 head + "1" * 5000, "<|tool_call>call:" + "x" * 5000):
        for truncated in (False, True):
            _, _, end = run(text, [text], truncated=truncated)
            assert not end.calls


ORDERED = [ToolCall(id="a", name="get_weather", arguments={"city": "Zürich 東京", "days": 3,
                                                           "unit": "celsius"}), CALLS[1]]


def test_grammars_write_the_family_calls() -> None:
    for parallel in (True, False):
        grammar = FMT.grammar(ToolPlan(INFO, TOOLS, "required", parallel))
        assert grammar is not None
        calls = ORDERED if parallel else ORDERED[:1]
        assert accepts(grammar, FMT.write_calls(calls, INFO)), grammar
        assert accepts(grammar, FMT.write_calls(
            [ToolCall(id="d", name="get_weather", arguments={"city": "X"})], INFO))
        for bad in ({"days": 3}, {"city": "X", "unit": "kelvin"}, {"city": 3},
                    {"city": "X", "days": 1.5}):
            assert not accepts(grammar, FMT.write_calls(
                [ToolCall(id="b", name="get_weather", arguments=bad)], INFO)), bad
    named = FMT.grammar(ToolPlan(INFO, TOOLS, NamedTool(name="search"), False))
    assert named is not None
    assert accepts(named, FMT.write_calls(ORDERED[1:], INFO))
    assert not accepts(named, FMT.write_calls(ORDERED[:1], INFO))
    empty = FMT.grammar(ToolPlan(INFO, [EMPTY], "required", False))
    assert empty is not None and accepts(empty, "<|tool_call>call:empty_args{}<tool_call|>")


def test_steering_starts_at_the_call() -> None:
    steer = FMT.steering(ToolPlan(INFO, [WEATHER], "auto"))
    assert steer is not None
    text = "\nLet me look." + FMT.write_calls(ORDERED[:1], INFO)
    [trigger] = steer.triggers
    m = re.search(trigger, text)
    assert m is not None and accepts(steer.grammar, text[m.end():])
    assert not re.search(trigger, "\n<|tool_call>call:delete_all{}")
    assert FMT.steering(ToolPlan(INFO, TOOLS, "required")) is None
