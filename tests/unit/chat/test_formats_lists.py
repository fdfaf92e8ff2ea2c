"""The families that write their calls as JSON objects or a list after a marker
(formats/jsonlist.py's Nemotron Nano 2, Apertus, MiniMax M1, GigaChat 3 and 3.1;
formats/pythonic.py's LFM2): their outputs as llama.cpp's tests (tests/test-chat.cpp) or
their templates give them, and the checks every family passes (formatcases.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from llmrun.chat import formats
from llmrun.chat.formats import BY_NAME
from llmrun.request import Tool
from tests.unit.chat.formatcases import (
    CHECKS,
    SINGLE_CHECKS,
    TEMPLATES,
    detected,
    only_these_are,
    read_alike,
    run,
    written_as_its_template_writes,
)

FAMILIES = ["nemotron", "apertus", "minimax-m1", "lfm2"]
SINGLE = ["gigachat3", "gigachat3.1"]  # one call a message
SPECIAL = Tool(name="special_function", parameters={
    "type": "object", "properties": {"arg1": {"type": "integer"}}, "required": ["arg1"]})
OPTIONAL = Tool(name="special_function_with_opt", parameters={
    "type": "object", "properties": {"arg1": {"type": "integer"}, "arg2": {"type": "integer"}},
    "required": ["arg1"]})
TIME = Tool(name="get_time", parameters={
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
TOGGLE = Tool(name="toggle", parameters={
    "type": "object", "properties": {"enabled": {"type": "boolean"}}, "required": ["enabled"]})
NULLABLE = Tool(name="set_nullable", parameters={
    "type": "object", "properties": {"value": {"type": ["string", "null"]}}})
CONFIG = Tool(name="set_config", parameters={
    "type": "object", "properties": {"config": {"type": "object"}}, "required": ["config"]})
PYTHON = Tool(name="python", parameters={
    "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]})
CALENDAR = Tool(name="Calendar.create_event", parameters={"type": "object", "properties": {
    "title": {"type": "string"}, "participants": {"type": "array"},
    "metadata": {"type": "object"}}})
LFM2_TOOLS = [SPECIAL, OPTIONAL, TIME, TOGGLE, NULLABLE, CONFIG, PYTHON, CALENDAR]


DETECTED = dict([
    ("NVIDIA-Nemotron-Nano-v2.jinja", "nemotron"),
    # Nemotron 3 Nano writes Qwen3-Coder's `<tool_call><function=...>` calls (llama.cpp
    # reads it with its Qwen3-Coder parser too)
    ("NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja", "qwen3-coder"),
    ("Apertus-8B-Instruct.jinja", "apertus"),
    ("LFM2-8B-A1B.jinja", "lfm2"),
    ("LFM2.5-8B-A1B.jinja", "lfm2"),
    ("LFM2.5-Instruct.jinja", "lfm2"),
    ("MiniMax-M1.jinja", "minimax-m1"),
    ("GigaChat3-10B-A1.8B.jinja", "gigachat3"),
    ("GigaChat3.1-10B-A1.8B.jinja", "gigachat3.1"),
])


@pytest.mark.parametrize(("template", "name"), list(DETECTED.items()))
def test_detected_from_the_real_template(template: str, name: str) -> None:
    assert detected(template) == name


def test_no_other_corpus_template_is_one_of_these() -> None:
    only_these_are(FAMILIES + SINGLE, DETECTED)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", FAMILIES)
def test_family(name: str, check: Callable[[str], None]) -> None:
    check(name)


@pytest.mark.parametrize("check", SINGLE_CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", SINGLE)
def test_single_call_family(name: str, check: Callable[[str], None]) -> None:
    check(name)


@pytest.mark.parametrize(("name", "opener"), [
    ("gigachat3", "<|message_sep|>\n\nfunction call<|role_sep|>\n"),
    ("gigachat3.1", "<|function_call|>"),
])
def test_gigachat_call_as_its_model_writes_it(name: str, opener: str) -> None:
    call = opener + '{"name": "special_function", "arguments": {"arg1": 1}}'
    for text, before in ((call, ""), ("Hello, world!\nWhat's up?" + call,
                                      "Hello, world!\nWhat's up?")):
        _, content, calls = read_alike(name, text, tools=[SPECIAL])
        assert (content, calls) == (before, [("special_function", {"arg1": 1})])


def test_minimax_m1_one_call_a_line() -> None:
    text = ('<tool_calls>\n{"name": "special_function", "arguments": {"arg1": 1}}\n'
            '{"name": "get_time", "arguments": {"city": "Zürich"}}\n</tool_calls>')
    _, content, calls = read_alike("minimax-m1", text, tools=[SPECIAL, TIME])
    assert (content, calls) == ("", [("special_function", {"arg1": 1}),
                                     ("get_time", {"city": "Zürich"})])


def test_nemotron_leaves_no_markup_in_the_content() -> None:
    """The default reader found Nemotron's call but left `<TOOLCALL></TOOLCALL>` behind."""
    for text in ('I\'m\nthinking\n</think>\n<TOOLCALL>[{"name": "special_function", '
                 '"arguments": {"arg1": 1}}]</TOOLCALL>',
                 'I\'m\nthinking\n</think>\n\n<TOOLCALL>[{"name": "special_function", '
                 '"arguments": {"arg1": 1}}]</TOOLCALL>\n'):
        thought, content, calls = read_alike("nemotron", text, inside=True, tools=[SPECIAL])
        assert (thought.strip(), content, calls) == ("I'm\nthinking", "",
                                                     [("special_function", {"arg1": 1})])


def test_nemotron_arguments_given_as_a_json_string() -> None:
    """Its template writes `arguments` as given: a string of JSON is read as the object."""
    text = '<TOOLCALL>[{"name": "special_function", "arguments": "{\\"arg1\\": 1}"}]</TOOLCALL>'
    _, content, calls = read_alike("nemotron", text, tools=[SPECIAL])
    assert (content, calls) == ("", [("special_function", {"arg1": 1})])


def test_apertus_call_and_thought() -> None:
    text = '<|tools_prefix|>[{"special_function": {"arg1": 1}}]<|tools_suffix|>'
    _, content, calls = read_alike("apertus", text, tools=[SPECIAL])
    assert (content, calls) == ("", [("special_function", {"arg1": 1})])
    text = ("<|inner_prefix|>Need the time.<|inner_suffix|>It is "
            '<|tools_prefix|>[{"get_time": {"city": "Paris"}}, '
            '{"special_function": {"arg1": 2}}]<|tools_suffix|>')
    thought, content, calls = read_alike("apertus", text, tools=[SPECIAL, TIME])
    assert (thought, content.strip(), calls) == (
        "Need the time.", "It is", [("get_time", {"city": "Paris"}),
                                    ("special_function", {"arg1": 2})])


def test_apertus_item_of_two_keys_is_no_call() -> None:
    text = '<|tools_prefix|>[{"special_function": {"arg1": 1}, "x": {}}]<|tools_suffix|>'
    _, _, end = run("apertus", text, [text], tools=[SPECIAL])
    assert not end.calls


@pytest.mark.parametrize(("text", "expected"), [
    ("[special_function(arg1=1)]", [("special_function", {"arg1": 1})]),
    ('[get_time(city="XYZCITY")]', [("get_time", {"city": "XYZCITY"})]),
    ("[toggle(enabled=True)]", [("toggle", {"enabled": True})]),
    ("[set_nullable(value=None)]", [("set_nullable", {"value": None})]),
    ('[set_config(config={"enabled": True, "count": 3})]',
     [("set_config", {"config": {"enabled": True, "count": 3}})]),
    ('[set_config(config={"enabled": true, "note": null, "t": (1, -2.5)})]',
     [("set_config", {"config": {"enabled": True, "note": None, "t": [1, -2.5]}})]),
    ('[Calendar.create_event(title="demo", participants=["Alice", "Bob"], '
     'metadata={"priority": "high", "reminder": true})]',
     [("Calendar.create_event", {"title": "demo", "participants": ["Alice", "Bob"],
                                 "metadata": {"priority": "high", "reminder": True}})]),
    ("[python(code=\"def hello():\\n    print('hey')\")]",
     [("python", {"code": "def hello():\n    print('hey')"})]),
    ('[python(code="print(\\"hi\\")\\tx")]', [("python", {"code": 'print("hi")\tx'})]),
    ("[python(code='''a\nb''')]", [("python", {"code": "a\nb"})]),
    ("[special_function(arg1=1), special_function_with_opt(arg1=1, arg2=2)]",
     [("special_function", {"arg1": 1}), ("special_function_with_opt", {"arg1": 1, "arg2": 2})]),
    ('[get_time(city="東京 🌧")]', [("get_time", {"city": "東京 🌧"})]),
])
def test_lfm2_calls_as_its_model_writes_them(text: str, expected: list[object]) -> None:
    text = "Let me check the time.<|tool_call_start|>" + text + "<|tool_call_end|>"
    _, content, calls = read_alike("lfm2", text, tools=LFM2_TOOLS)
    assert (content, calls) == ("Let me check the time.", expected)


@pytest.mark.parametrize("call", [
    "[special_function(1)]",                      # positional
    "[special_function(arg1=__import__('os'))]",  # a call in a value
    "[special_function(arg1=x)]",                 # a name
    "[special_function(arg1=1 + 1)]",             # an operator
    "[special_function(**{'arg1': 1})]",          # unpacked
    "[special_function(arg1=1)",                  # not closed
    "[special_function(arg1=" + "[" * 300 + "]" * 300 + ")]",  # nested too deep
    "[get_time(city=b'x')]",                      # bytes
    "[set_config(config={1: 2})]",                # a key that is no string
])
def test_lfm2_what_is_no_call_stays_text(call: str) -> None:
    text = "<|tool_call_start|>" + call + "<|tool_call_end|>"
    _, content, end = run("lfm2", text, [text], tools=LFM2_TOOLS)
    assert not end.calls and content == text


def test_lfm2_markdown_links_stay_content() -> None:
    text = "Use this format: [link text](url). Example: [Wikipedia](https://www.wikipedia.org)."
    _, content, calls = read_alike("lfm2", text, tools=LFM2_TOOLS)
    assert (content, calls) == (text, [])


def test_lfm2_a_long_list_is_bounded() -> None:
    """A list longer than the parser is given stays text (ast builds a tree of it all)."""
    from llmrun.chat.formats.pythonic import MAX_TEXT

    code = "x" * MAX_TEXT
    text = f'<|tool_call_start|>[python(code="{code}")]<|tool_call_end|>'
    _, _, end = run("lfm2", text, [text], tools=LFM2_TOOLS)
    assert not end.calls
    short = f'<|tool_call_start|>[python(code="{code[:1000]}")]<|tool_call_end|>'
    assert run("lfm2", short, [short], tools=LFM2_TOOLS)[2].calls


def test_lfm2_thought() -> None:
    """LFM2.5 8B thinks in `<think>`; its template says so."""
    source = (TEMPLATES / "LFM2.5-8B-A1B.jinja").read_text()
    assert formats.BY_NAME["lfm2"].think_pair(source) == ("<think>", "</think>")
    text = ("<think>Paris time.</think><|tool_call_start|>[get_time(city=\"Paris\")]"
            "<|tool_call_end|>")
    thought, content, calls = read_alike("lfm2", text, tools=LFM2_TOOLS)
    assert (thought, content, calls) == ("Paris time.", "", [("get_time", {"city": "Paris"})])


def test_lfm2_writes_what_it_reads() -> None:
    from tests.unit.chat.formatcases import CALLS, INFO

    body = BY_NAME["lfm2"].write_calls(CALLS, INFO)
    assert body.startswith('<|tool_call_start|>[get_weather(city="Zürich 東京", unit="celsius", '
                           "days=3), search(")


EMPTY = Tool(name="empty_args", parameters={"type": "object", "properties": {}})


def test_lfm2_empty_arguments_a_cut_call_and_a_call_in_a_thought() -> None:
    """test-chat.cpp's LFM2 cases: `[empty_args()]`; a call cut after `arg1=` is a partial
    call; a call inside the thought is thought."""
    text = "<|tool_call_start|>[empty_args()]<|tool_call_end|>"
    assert read_alike("lfm2", text, tools=[EMPTY]) == ("", "", [("empty_args", {})])
    text = "<|tool_call_start|>[special_function(arg1="
    for pieces in ([text], list(text)):
        _, content, end = run("lfm2", text, pieces, truncated=True, tools=[SPECIAL])
        assert (content, end.calls) == ("", [])
        assert end.partial is not None and end.partial.name == "special_function"
    call = "<|tool_call_start|>[special_function(arg1=1)]<|tool_call_end|>"
    text = f"<think>Let me think about {call} hmm</think>{call}"
    assert read_alike("lfm2", text, tools=[SPECIAL]) == (
        f"Let me think about {call} hmm", "", [("special_function", {"arg1": 1})])


@pytest.mark.parametrize("template", [
    "NVIDIA-Nemotron-Nano-v2.jinja",
    "Apertus-8B-Instruct.jinja",
    "MiniMax-M1.jinja",
    "GigaChat3-10B-A1.8B.jinja",
    "GigaChat3.1-10B-A1.8B.jinja",
])
def test_past_calls_written_as_the_template_writes_them(template: str) -> None:
    written_as_its_template_writes(template)
