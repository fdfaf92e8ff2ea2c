"""Where the corpus templates that are no family of their own belong: each one's outputs
(the shapes llama.cpp's tests and the templates themselves give) read by the format it is
detected as, whole and streamed, and its calls written by that format's grammar."""

from __future__ import annotations

import re
from typing import Any

import pytest

from llmrun.chat import formats, thinking, tools
from llmrun.chat.tools import ToolPlan
from llmrun.request import ToolCall
from tests.unit.chat import formatcases as cases
from tests.unit.chat.formatcases import TEMPLATES, TOOLS, WEATHER, chunkings
from tests.unit.chat.grammarcheck import accepts

# template -> the format it is detected as (and why, where it is not its own family)
PLACES = {
    # Mistral: the default reads [TOOL_CALLS] (a JSON list, or name[ARGS]{...}, with
    # Small 3.2's [CALL_ID]) and thinks in [THINK]
    "mistralai-Ministral-3-14B-Reasoning-2512.jinja": "default",
    "Mistral-Small-3.2-24B-Instruct-2506.jinja": "default",
    "unsloth-mistral-Devstral-Small-2507.jinja": "default",
    "mistralai-Mistral-Nemo-Instruct-2407.jinja": "default",
    # Hermes <tool_call> JSON: the default's
    "MiMo-VL.jinja": "default",
    "Reka-Edge.jinja": "default",
    "Bielik-11B-v3.0-Instruct.jinja": "default",
    "ibm-granite-granite-4.0.jinja": "default",
    "ibm-granite-granite-4.1.jinja": "default",
    "HuggingFaceTB-SmolLM3-3B.jinja": "default",  # renders no tools: the default's preamble
    # no tools at all
    "microsoft-Phi-3.5-mini-instruct.jinja": "default",
    "google-gemma-2-2b-it.jinja": "default",
    "llama-cpp-rwkv-world.jinja": "default",
    # the families' own forms
    "StepFun3.5-Flash.jinja": "qwen3-coder",
    "Spark2.5.jinja": "glm",
    "poolside-Laguna-S-2.1.jinja": "glm",
    "poolside-Laguna-XS-2.1.jinja": "glm",
    "poolside-Laguna-XS.2.jinja": "glm",
}


def source(name: str) -> str:
    return (TEMPLATES / name).read_text()


@pytest.mark.parametrize(("template", "name"), list(PLACES.items()))
def test_placed(template: str, name: str) -> None:
    assert formats.detect(source(template)).name == name


def run(template: str, text: str, pieces: list[str], truncated: bool = False,
        choice: Any = "auto") -> tuple[str, str, Any]:
    """(thinking, content, finished) through the template's format, as the runner applies
    it: its splitter when the template thinks, its reader."""
    src = source(template)
    return cases.run(formats.detect(src), text, pieces, truncated, choice, template=src,
                     info=tools.inspect_template(src))


MINISTRAL = "mistralai-Ministral-3-14B-Reasoning-2512.jinja"


@pytest.mark.parametrize(("text", "thought", "calls"), [
    ("[THINK]I'm\nthinking[/THINK]Hello, world!\nWhat's up?", "I'm\nthinking", []),
    ('[TOOL_CALLS]get_weather[ARGS]{"city":"Paris"}', "", [("get_weather", {"city": "Paris"})]),
    ('[THINK]I\'m\nthinking[/THINK][TOOL_CALLS]get_weather[ARGS]{"city":"Paris"}',
     "I'm\nthinking", [("get_weather", {"city": "Paris"})]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]search[ARGS]'
     '{"query": "x", "limit": 2}', "",
     [("get_weather", {"city": "Paris"}), ("search", {"query": "x", "limit": 2})]),
    # a call's marker inside the thought is the thought's
    ('[THINK]Let me think about [TOOL_CALLS]get_weather[ARGS]{"city":"X"} and more[/THINK]'
     '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}',
     'Let me think about [TOOL_CALLS]get_weather[ARGS]{"city":"X"} and more',
     [("get_weather", {"city": "Paris"})]),
])
def test_ministral_3_reasoning_by_the_default(text: str, thought: str,
                                               calls: list[tuple[str, Any]]) -> None:
    assert thinking.markers(source(MINISTRAL)) == ("[THINK]", "[/THINK]")
    for pieces in chunkings(text):
        got, content, end = run(MINISTRAL, text, pieces)
        assert got == thought
        assert [(c.name, c.arguments) for c in end.calls] == calls
        assert content == ("" if calls else "Hello, world!\nWhat's up?")


@pytest.mark.parametrize(("template", "text"), [
    (MINISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}'),
    ("unsloth-mistral-Devstral-Small-2507.jinja",
     '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 2}'),
    ("Mistral-Small-3.2-24B-Instruct-2506.jinja",
     '[TOOL_CALLS]get_weather[CALL_ID]a1b2c3d4e[ARGS]{"city": "Paris", "days": 2}'),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja",
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}, '
     '"id": "123456789"}]'),
])
def test_mistral_calls_by_the_default(template: str, text: str) -> None:
    for pieces in chunkings(text):
        _, content, end = run(template, text, pieces)
        assert [(c.name, c.arguments) for c in end.calls] == [
            ("get_weather", {"city": "Paris", "days": 2})]
        assert content == ""
    info = tools.inspect_template(source(template))
    grammar = ToolPlan(info, [WEATHER], "required", False).grammar()
    assert grammar is not None
    written = tools.format_calls([ToolCall(id="a", name="get_weather",
                                           arguments={"city": "Paris", "days": 2})], info)
    assert accepts(grammar, written), (grammar, written)


@pytest.mark.parametrize(("template", "text"), [
    ("MiMo-VL.jinja", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
                      '\n</tool_call>'),
    ("Reka-Edge.jinja", '<think>\nhm\n</think>\n\n<tool_call>\n{"name": "get_weather", '
                        '"arguments": {"city": "Paris"}}\n</tool_call>'),
    ("Bielik-11B-v3.0-Instruct.jinja", '<think>hm</think>\n<tool_call>\n{"name": '
                                       '"get_weather", "arguments": {"city": "Paris"}}\n'
                                       '</tool_call>'),
    ("ibm-granite-granite-4.0.jinja", '<tool_call>\n{"name": "get_weather", "arguments": '
                                      '{"city": "Paris"}}\n</tool_call>'),
    ("HuggingFaceTB-SmolLM3-3B.jinja", '<think>\nhm\n</think>\n<tool_call>\n{"name": '
                                       '"get_weather", "arguments": {"city": "Paris"}}\n'
                                       '</tool_call>'),
])
def test_hermes_writers_by_the_default(template: str, text: str) -> None:
    for pieces in chunkings(text):
        thought, content, end = run(template, text, pieces)
        assert [(c.name, c.arguments) for c in end.calls] == [("get_weather",
                                                                {"city": "Paris"})]
        assert content == ""
        assert thought.strip() == ("hm" if "<think>" in text else "")


def test_phi_4_mini_calls_by_the_default() -> None:
    """Phi-4-mini (no template in the corpus) writes `<|tool_call|>[...]<|/tool_call|>`:
    the default's tolerant reader takes it, whatever the template's family."""
    text = ('Checking. <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}},'
            ' {"name": "search", "arguments": {"query": "x"}}]<|/tool_call|>')
    for pieces in chunkings(text):
        _, content, end = run("microsoft-Phi-3.5-mini-instruct.jinja", text, pieces)
        assert [(c.name, c.arguments) for c in end.calls] == [
            ("get_weather", {"city": "Paris"}), ("search", {"query": "x"})]
        assert content.strip() == "Checking."


@pytest.mark.parametrize("template", ["Spark2.5.jinja", "poolside-Laguna-S-2.1.jinja",
                                      "poolside-Laguna-XS.2.jinja"])
def test_glm_layouts_without_newlines(template: str) -> None:
    """Spark 2.5 and Laguna S 2.1 write GLM's calls with no newline between their parts
    (Laguna XS.2 with GLM's own): read, steered and forced alike."""
    src = source(template)
    nl = "\n" if "</arg_key>\\n" in src else ""
    text = (f"Checking.<tool_call>get_weather{nl}<arg_key>city</arg_key>{nl}<arg_value>Paris"
            f"</arg_value>{nl}<arg_key>days</arg_key>{nl}<arg_value>2</arg_value>{nl}"
            "</tool_call>")
    for pieces in chunkings(text):
        _, content, end = run(template, text, pieces)
        assert [(c.name, c.arguments) for c in end.calls] == [
            ("get_weather", {"city": "Paris", "days": 2})]
        assert content == "Checking."
    fmt = formats.detect(src)
    plan = ToolPlan(tools.inspect_template(src), [WEATHER], "required", False)
    grammar = fmt.grammar(plan)
    assert grammar is not None and accepts(grammar, text[len("Checking."):])
    steer = fmt.steering(ToolPlan(tools.inspect_template(src), [WEATHER], "auto"))
    assert steer is not None
    [trigger] = steer.triggers
    m = re.search(trigger, "\n" + text)
    assert m is not None and accepts(steer.grammar, ("\n" + text)[m.end():])


MINE = ["command-r7b", "command-r-plus", "granite", "apriel", "firefunction",
        "functionary-v3.1", "functionary-v3.2", "gemma4", "minicpm5", "solar-open",
        "muse-glimmer"]


@pytest.mark.parametrize("name", MINE)
def test_grammars_build_with_the_markers_as_special_tokens(name: str) -> None:
    """Where the family's markers are special tokens, the grammars name them by token (and
    still compile in llguidance)."""
    import llguidance

    from llmrun.engine import constraint

    fmt = formats.BY_NAME[name]
    special = {m: 60000 + i for i, m in enumerate(fmt.markers)}
    for choice in ("required", "auto"):
        for parallel in (True, False):
            plan = ToolPlan(tools.inspect_template(None), TOOLS, choice, parallel)
            grammar = fmt.grammar(plan, special) if choice == "required" else None
            steer = fmt.steering(plan, special)
            text = grammar if grammar is not None else steer.grammar if steer else None
            assert text is not None
            assert llguidance.LLMatcher.validate_grammar(constraint.from_grammar(text)) == ""
            if choice == "required" and not name.startswith("functionary"):
                # (Functionary's calls hold none of its markers)
                assert any(f"<[{i}]>" in text for i in special.values()), name
