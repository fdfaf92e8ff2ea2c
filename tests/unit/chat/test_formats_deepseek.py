"""DeepSeek R1 and V3 (formats/sections.py, beside V3.1): calls as their templates write
them, the arguments in a ```json fence after the name, thoughts in `<think>` opened by the
generation prompt; the checks every family passes (formatcases.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from llmrun.chat.formats import BY_NAME
from llmrun.request import Tool
from tests.unit.chat.formatcases import (
    CALLS,
    CHECKS,
    INFO,
    detected,
    only_these_are,
    read_alike,
    written_as_its_template_writes,
)

SPECIAL = Tool(name="special_function", parameters={
    "type": "object", "properties": {"arg1": {"type": "integer"}}, "required": ["arg1"]})


DETECTED = dict([
    ("llama-cpp-deepseek-r1.jinja", "deepseek-r1"),
    ("deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja", "deepseek-r1"),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "deepseek-r1"),
    ("deepseek-ai-DeepSeek-V3.1.jinja", "deepseek-v3.1"),
])


@pytest.mark.parametrize(("template", "name"), list(DETECTED.items()))
def test_detected_from_the_real_template(template: str, name: str) -> None:
    assert detected(template) == name


def test_no_other_corpus_template_is_one_of_these() -> None:
    only_these_are(["deepseek-r1"], DETECTED)


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_family(check: Callable[[str], None]) -> None:
    check("deepseek-r1")


def test_r1_call_after_its_thought() -> None:
    """The prompt opens the thought; the fence's end may follow the JSON directly."""
    text = ("I'm\nthinking</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function"
            "<｜tool▁sep｜>special_function\n```json\n{\"arg1\": 1}```<｜tool▁call▁end｜>"
            "<｜tool▁calls▁end｜>")
    thought, content, calls = read_alike("deepseek-r1", text, inside=True, tools=[SPECIAL])
    assert (thought, content, calls) == ("I'm\nthinking", "",
                                         [("special_function", {"arg1": 1})])


def test_r1_several_calls_a_line_apart() -> None:
    """The distills' templates put a newline between calls."""
    text = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>special_function"
            "\n```json\n{\"arg1\": 1}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function"
            "<｜tool▁sep｜>special_function\n```json\n{\"arg1\": 2}\n```<｜tool▁call▁end｜>"
            "<｜tool▁calls▁end｜>Done.")
    _, content, calls = read_alike("deepseek-r1", text, tools=[SPECIAL])
    assert calls == [("special_function", {"arg1": 1}), ("special_function", {"arg1": 2})]
    assert content == "Done."


def test_r1_writes_its_template_form() -> None:
    body = BY_NAME["deepseek-r1"].write_calls(CALLS[:1], INFO)
    assert body == ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather"
                    "\n```json\n{\"city\": \"Zürich 東京\", \"unit\": \"celsius\", \"days\": 3}"
                    "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")


@pytest.mark.parametrize("template", [
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
])
def test_past_calls_written_as_the_template_writes_them(template: str) -> None:
    written_as_its_template_writes(template)
