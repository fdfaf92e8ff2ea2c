"""Chat formats (llmrun/chat/formats/): each family's output, as that family writes it, read
whole and streamed (1-character and random-size pieces give what the whole gives), its calls
cut by the token limit, its detection from the real templates (tests/fakes/templates/)."""

from __future__ import annotations

from typing import Any

import pytest

from llmrun.chat import formats
from llmrun.chat.formats import BY_NAME, convert
from llmrun.chat.tools import ToolPlan
from llmrun.request import ToolCall
from tests.unit.chat.formatcases import CALLS, INFO, TEMPLATES, TOOLS, chunkings, run


@pytest.mark.parametrize(("template", "name"), [
    ("openai-gpt-oss-120b.jinja", "harmony"),
    ("Qwen3-Coder.jinja", "qwen3-coder"),
    ("GLM-4.6.jinja", "glm"),
    ("GLM-4.7-Flash.jinja", "glm"),
    ("deepseek-ai-DeepSeek-V3.1.jinja", "deepseek-v3.1"),
    ("moonshotai-Kimi-K2.jinja", "kimi-k2"),
    ("Kimi-K2-Instruct.jinja", "kimi-k2"),
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "default"),
    ("Qwen-Qwen3-0.6B.jinja", "default"),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "default"),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "default"),
])
def test_detected_from_the_real_template(template: str, name: str) -> None:
    assert formats.detect((TEMPLATES / template).read_text()).name == name


def test_no_template_is_the_default() -> None:
    assert formats.detect(None) is formats.DEFAULT and formats.detect("") is formats.DEFAULT


def written(name: str, calls: list[ToolCall]) -> str:
    """Calls as the family writes them, text around them (harmony: after a thought)."""
    fmt = BY_NAME[name]
    body = fmt.write_calls(calls, INFO)
    if name == "harmony":
        return ("<|channel|>analysis<|message|>Need weather, then search.<|end|>"
                "<|start|>assistant<|channel|>commentary<|message|>Let me look.<|end|>"
                + body)
    return "Let me look. " + body


FAMILIES = ["harmony", "qwen3-coder", "glm", "deepseek-v3.1", "kimi-k2"]


@pytest.mark.parametrize("name", FAMILIES)
def test_calls_read_whole_and_streamed_alike(name: str) -> None:
    text = written(name, CALLS)
    results = []
    for pieces in chunkings(text):
        thought, content, end = run(name, text, pieces)
        results.append((thought, content, [(c.name, c.arguments) for c in end.calls]))
    assert all(r == results[0] for r in results)
    thought, content, calls = results[0]
    assert calls == [(c.name, c.arguments) for c in CALLS]
    assert content.strip() == "Let me look."  # (text before a call leaves as it comes)
    assert "<" not in content
    if name == "harmony":
        assert thought == "Need weather, then search."


@pytest.mark.parametrize("name", FAMILIES)
def test_text_alone_is_content(name: str) -> None:
    text = ("<|channel|>final<|message|>Sunny, 20 °C. Use <b> tags?<|return|>"
            if name == "harmony" else "Sunny, 20 °C. Use <b> tags? {\"a\": 1}")
    for pieces in chunkings(text):
        thought, content, end = run(name, text, pieces)
        assert not end.calls and thought == ""
        assert content == ("Sunny, 20 °C. Use <b> tags?" if name == "harmony"
                           else text)


@pytest.mark.parametrize("name", FAMILIES)
def test_a_call_cut_by_the_token_limit(name: str) -> None:
    text = written(name, CALLS[:1])
    cut_at = text.index("Zürich") + 3
    for pieces in chunkings(text[:cut_at]):
        _, content, end = run(name, text[:cut_at], pieces, truncated=True)
        assert not end.calls and end.partial is not None, name
        assert end.partial.name == "get_weather"
        assert content.strip() == "Let me look."


@pytest.mark.parametrize("name", FAMILIES)
def test_a_further_call_cut_off_is_dropped(name: str) -> None:
    text = written(name, CALLS)
    cut_at = text.index("a \\\"quoted" if name in ("harmony", "deepseek-v3.1", "kimi-k2")
                        else "a \"quoted")
    _, _, end = run(name, text[:cut_at], [text[:cut_at]], truncated=True)
    assert [c.name for c in end.calls] == ["get_weather"]


@pytest.mark.parametrize("name", FAMILIES)
def test_unknown_tools_and_bad_arguments_stay_text(name: str) -> None:
    bad = [ToolCall(id="a", name="get_weather", arguments={"days": 3})]  # no city
    for calls in (bad, [ToolCall(id="b", name="delete_all", arguments={})]):
        text = written(name, calls)
        _, _content, end = run(name, text, [text])
        assert not end.calls


@pytest.mark.parametrize(("value", "schema", "expected"), [
    ("3", {"type": "integer"}, 3),
    ("\n-12\n", {"type": "integer"}, -12),
    ("2.5", {"type": "number"}, 2.5),
    ("7", {"type": "number"}, 7),
    ("True", {"type": "boolean"}, True),
    ('{"a": [1]}', {"type": "object"}, {"a": [1]}),
    ("[1, 2]", {"type": "array"}, [1, 2]),
    ("null", {"type": ["integer", "null"]}, None),
    ("12", {"type": "string"}, "12"),
    ("twelve", {"type": "integer"}, "twelve"),
    ("celsius", {"enum": ["celsius", "kelvin"]}, "celsius"),
    ("5", {"anyOf": [{"type": "integer"}, {"type": "string"}]}, 5),
])
def test_parameters_converted_by_their_schema(value: str, schema: Any, expected: Any) -> None:
    assert convert(value, schema) == expected


def test_harmony_reads_the_recipient_before_the_channel() -> None:
    text = ('<|start|>assistant to=functions.get_weather<|channel|>commentary json'
            '<|message|>{"city": "Paris"}<|call|>')
    _, content, end = run("harmony", text, list(text))
    assert [(c.name, c.arguments) for c in end.calls] == [("get_weather", {"city": "Paris"})]
    assert content == ""


def test_qwen_coder_reads_a_call_without_its_closing_tags() -> None:
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    _, _content, end = run("qwen3-coder", text, [text])
    assert [(c.name, c.arguments) for c in end.calls] == [("get_weather", {"city": "Paris"})]


def test_a_family_falls_back_to_the_tolerant_reader() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for name in ("qwen3-coder", "glm"):
        _, _, end = run(name, text, list(text))
        assert [c.name for c in end.calls] == ["get_weather"]


@pytest.mark.parametrize("name", FAMILIES)
def test_grammars_and_triggers_are_built(name: str) -> None:
    """Each family's forced grammar and steering compile in llguidance (what they let a
    model write is checked on a real vocabulary in tests/integration/test_formats.py)."""
    from llmrun.engine import constraint

    fmt = BY_NAME[name]
    for choice in ("required", "auto"):
        for parallel in (True, False):
            plan = ToolPlan(INFO, TOOLS, choice, parallel)
            grammar = fmt.grammar(plan) if choice == "required" else None
            steer = fmt.steering(plan)
            text = grammar if grammar is not None else steer.grammar if steer else None
            assert text is not None
            import llguidance

            assert llguidance.LLMatcher.validate_grammar(constraint.from_grammar(text)) == ""
