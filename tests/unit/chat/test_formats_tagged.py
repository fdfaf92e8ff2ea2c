"""The families that write each argument between tags of its own (formats/xml.py's
Seed-OSS, Tencent Hy3 and GLM, formats/invoke.py's MiniMax M2 and DeepSeek V3.2/V4 DSML):
their outputs as llama.cpp's tests (tests/test-chat.cpp) give them, and the checks every
family passes (formatcases.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from llmrun.chat.formats import BY_NAME
from llmrun.request import Tool
from tests.unit.chat.formatcases import CHECKS, detected, read_alike, run

FAMILIES = ["seed-oss", "minimax-m2", "deepseek-v3.2", "deepseek-v4", "hunyuan", "glm"]
SPECIAL = Tool(name="special_function", parameters={
    "type": "object", "properties": {"arg1": {"type": "integer"}}, "required": ["arg1"]})
OPTIONAL = Tool(name="special_function_with_opt", parameters={
    "type": "object", "properties": {"arg1": {"type": "integer"}, "arg2": {"type": "integer"}},
    "required": ["arg1"]})
TODO = Tool(name="todo_list", parameters={"type": "object", "properties": {"todos": {
    "type": "array", "items": {"type": "object", "properties": {
        "item": {"type": "string"}, "selected": {"type": "boolean"}}}}}, "required": ["todos"]})
EDIT = Tool(name="edit", parameters={"type": "object", "properties": {
    "filename": {"type": "string"}, "oldString": {"type": "string"},
    "newString": {"type": "string"}}, "required": ["filename", "oldString", "newString"]})
EMPTY = Tool(name="empty_args", parameters={"type": "object", "properties": {}})
TIME = Tool(name="get_time", parameters={
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})


@pytest.mark.parametrize(("template", "name"), [
    ("ByteDance-Seed-OSS.jinja", "seed-oss"),
    ("MiniMax-M2.jinja", "minimax-m2"),
    ("deepseek-ai-DeepSeek-V3.2.jinja", "deepseek-v3.2"),
    ("deepseek-ai-DeepSeek-V4.jinja", "deepseek-v4"),
    ("deepseek-ai-DeepSeek-V4-Flash-0731.jinja", "deepseek-v4"),
    ("tencent-Hy3.jinja", "hunyuan"),
    # Ling 3.0 writes GLM's calls (`<tool_call>NAME\n<arg_key>..`, its template's own
    # instructions and history), in `<role>` turns
    ("inclusionai-ling-3.0-flash.jinja", "glm"),
    # Qwen3-Coder's `<function=` calls without Seed's blocks stay Qwen3-Coder's
    ("Qwen3-Coder.jinja", "qwen3-coder"),
])
def test_detected_from_the_real_template(template: str, name: str) -> None:
    assert detected(template) == name


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", FAMILIES)
def test_family(name: str, check: Callable[[str], None]) -> None:
    check(name)


def test_seed_oss_thought_is_split_from_the_answer() -> None:
    text = "<seed:think>I'm thinking about the answer</seed:think>\nHello, world!"
    thought, content, calls = read_alike("seed-oss", text)
    assert (thought, content.strip(), calls) == ("I'm thinking about the answer",
                                                 "Hello, world!", [])


def test_seed_oss_calls_as_its_model_writes_them() -> None:
    text = ("<seed:tool_call>\n<function=special_function>\n<parameter=arg1>1</parameter>\n"
            "</function>\n</seed:tool_call>\n<seed:tool_call>\n"
            "<function=special_function_with_opt>\n<parameter=arg1>1</parameter>\n"
            "<parameter=arg2>2</parameter>\n</function>\n</seed:tool_call>")
    _, content, calls = read_alike("seed-oss", text, tools=[SPECIAL, OPTIONAL])
    assert calls == [("special_function", {"arg1": 1}),
                     ("special_function_with_opt", {"arg1": 1, "arg2": 2})]
    assert content == ""
    text = ("<seed:tool_call>\n<function=todo_list>\n<parameter=todos>[{\"item\": \"Check "
            "stuff\", \"selected\": false}, {\"item\": \"Prepare stuff\", \"selected\": true}]"
            "</parameter>\n</function>\n</seed:tool_call>")
    _, _, calls = read_alike("seed-oss", text, tools=[TODO])
    assert calls == [("todo_list", {"todos": [{"item": "Check stuff", "selected": False},
                                              {"item": "Prepare stuff", "selected": True}]})]
    text = ("<seed:tool_call>\n<function=edit>\n<parameter=filename>foo.cpp</parameter>\n"
            "<parameter=oldString>def foo(arg = \"14\"):\n    return arg + \"bar\"\n"
            "</parameter>\n<parameter=newString>def foo(arg = \"15\"):\n    pass\n"
            "</parameter>\n</function>\n</seed:tool_call>")
    _, _, calls = read_alike("seed-oss", text, tools=[EDIT])
    assert calls == [("edit", {"filename": "foo.cpp",
                               "oldString": "def foo(arg = \"14\"):\n    return arg + \"bar\"",
                               "newString": "def foo(arg = \"15\"):\n    pass"})]


def test_minimax_m2_thought_opened_by_its_prompt() -> None:
    """MiniMax M2's generation prompt ends in `<think>\\n`: the output starts inside the
    thought, and a call after it is read from the answer."""
    text = "I'm\nthinking\n</think>\n\nHello, world!\nWhat's up?"
    thought, content, _ = read_alike("minimax-m2", text, inside=True)
    assert (thought.strip(), content.strip()) == ("I'm\nthinking", "Hello, world!\nWhat's up?")
    text = ("Let's call a tool:\n</think>\n\n<minimax:tool_call>\n<invoke name=\"empty_args\">\n"
            "</invoke>\n</minimax:tool_call>")
    thought, content, calls = read_alike("minimax-m2", text, inside=True, tools=[EMPTY])
    assert (thought.strip(), content, calls) == ("Let's call a tool:", "",
                                                 [("empty_args", {})])
    text = ("\n</think>\n\n<minimax:tool_call>\n<invoke name=\"special_function\">\n<parameter "
            "name=\"arg1\">1</parameter>\n</invoke>\n</minimax:tool_call>")
    _, content, calls = read_alike("minimax-m2", text, inside=True, tools=[SPECIAL])
    assert (content, calls) == ("", [("special_function", {"arg1": 1})])


def test_deepseek_dsml_calls_as_its_model_writes_them() -> None:
    text = ("Let me check the time</think>\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke "
            "name=\"get_time\">\n<｜DSML｜parameter name=\"city\" string=\"true\">Tokyo"
            "</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜function_calls>")
    thought, content, calls = read_alike("deepseek-v3.2", text, inside=True, tools=[TIME])
    assert (thought, content, calls) == ("Let me check the time", "",
                                         [("get_time", {"city": "Tokyo"})])
    text = ("<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"special_function\">\n<｜DSML｜parameter "
            "name=\"arg1\" string=\"false\">1</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
            "<｜DSML｜invoke name=\"get_time\">\n<｜DSML｜parameter name=\"city\" "
            "string=\"true\">Paris</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>")
    _, content, calls = read_alike("deepseek-v4", text, tools=[SPECIAL, TIME])
    assert (content, calls) == ("", [("special_function", {"arg1": 1}),
                                     ("get_time", {"city": "Paris"})])


def test_deepseek_dsml_writes_string_by_the_schema() -> None:
    """`string="true"` for a text value, "false" and JSON for any other: as its template."""
    from tests.unit.chat.formatcases import CALLS, INFO

    body = BY_NAME["deepseek-v3.2"].write_calls(CALLS, INFO)
    assert '<｜DSML｜parameter name="city" string="true">Zürich 東京</｜DSML｜parameter>' in body
    assert '<｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>' in body
    assert 'name="filters" string="false">{"tags": ["x", {"deep": [1, 2]}]}<' in body


@pytest.mark.parametrize("name", FAMILIES)
def test_a_blocks_markup_alone_stays_text(name: str) -> None:
    """An opening tag with no call after it is not a call (and nothing is lost)."""
    fmt = BY_NAME[name]
    text = f"Write {fmt.starts[0]} to begin."  # type: ignore[attr-defined]
    _, content, end = run(name, text, [text])
    assert not end.calls and content == text


def test_hunyuan_calls_as_its_template_writes_them() -> None:
    text = ("<think:opensource>Paris.</think:opensource>Sure.<tool_calls:opensource>\n"
            "<tool_call:opensource>get_time<tool_sep:opensource>\n"
            "<arg_key:opensource>city</arg_key:opensource>\n"
            "<arg_value:opensource>Paris</arg_value:opensource>\n</tool_call:opensource>\n"
            "<tool_call:opensource>special_function<tool_sep:opensource>\n"
            "<arg_key:opensource>arg1</arg_key:opensource>\n"
            "<arg_value:opensource>1</arg_value:opensource>\n</tool_call:opensource>\n"
            "</tool_calls:opensource>")
    thought, content, calls = read_alike("hunyuan", text, tools=[TIME, SPECIAL])
    assert (thought, content, calls) == ("Paris.", "Sure.", [("get_time", {"city": "Paris"}),
                                                             ("special_function", {"arg1": 1})])


def test_ling_calls_are_glm_calls() -> None:
    """Ling 3.0's outputs (test-chat.cpp): GLM's reader takes its calls, text after them."""
    call = ("<tool_call>get_time\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
            "</tool_call>")
    text = "Let me check the time.\n</think>\nChecking it now.\n" + call + "\nDone."
    thought, content, calls = read_alike("glm", text, inside=True, tools=[TIME])
    assert thought.strip() == "Let me check the time."
    assert content.split() == ["Checking", "it", "now.", "Done."]
    assert calls == [("get_time", {"city": "Paris"})]
    _, _, calls = read_alike("glm", "</think>\n" + call + "\n" + call.replace("Paris", "Oslo"),
                             inside=True, tools=[TIME])
    assert calls == [("get_time", {"city": "Paris"}), ("get_time", {"city": "Oslo"})]
