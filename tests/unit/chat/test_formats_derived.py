"""Formats derived from the template itself (llmrun/chat/formats/derive.py): the pieces a
template writes calls with, found by rendering probe conversations, for real templates of
the corpus (tests/fakes/templates/) and for a template of no known family; the derived
format reading, forcing, steering and writing by them; the templates it leaves to the
default or to a named family; a template that fails or runs away derives nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from llmrun.chat import formats
from llmrun.chat.formats.derive import Derived, Envelope, derive, envelope, think_pair
from llmrun.chat.tools import TemplateInfo, ToolPlan
from llmrun.request import Tool, ToolCall
from tests.unit.chat import formatcases as cases
from tests.unit.chat.formatcases import chunkings

TEMPLATES = Path(__file__).parents[2] / "fakes" / "templates"
INFO = TemplateInfo("hermes", native=True, native_calls=True, native_results=True)
WEATHER = Tool(name="get_weather", parameters={
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "unit": {"enum": ["c", "f"]}}, "required": ["city"]})
SEARCH = Tool(name="search", parameters={
    "type": "object", "properties": {"query": {"type": "string"},
                                     "filters": {"type": "object"}}, "required": ["query"]})
CALLS = [ToolCall(id="a", name="get_weather", arguments={"city": "Zürich 東京", "days": 3}),
         ToolCall(id="b", name="search", arguments={"query": "a \"quoted\" <b>", "filters": {
             "tags": ["x", {"deep": [1, 2.5, None, True]}]}})]

# A template of no family: calls as JSON lines between <calls> and </calls>, each after
# `call NAME `, thoughts between <reason> and </reason>
OWN = """{%- if tools %}<tools>{{ tools | tojson }}</tools>{% endif -%}
{%- for m in messages -%}
<turn {{ m.role }}>
{%- if m.reasoning_content %}<reason>{{ m.reasoning_content }}</reason>{% endif -%}
{{ m.content }}
{%- if m.tool_calls %}<calls>
{%- for c in m.tool_calls %}call {{ c.function.name }} {{ c.function.arguments | tojson }}
{% endfor %}</calls>{% endif -%}
</turn>
{% endfor -%}
{%- if add_generation_prompt %}<turn assistant>{% endif -%}"""


def read(name: str) -> str:
    return (TEMPLATES / name).read_text()


@pytest.mark.parametrize(("template", "expected"), [
    ("NVIDIA-Nemotron-Nano-v2.jinja",
     Envelope('<TOOLCALL>[', '{"name": "', '", "arguments": ', "}", ", ", "]</TOOLCALL>")),
    ("Apertus-8B-Instruct.jinja",  # the name is the object's key
     Envelope("<|tools_prefix|>[", '{"', '": ', "}", ", ", "]<|tools_suffix|>")),
    ("MiniMax-M1.jinja",
     Envelope("<tool_calls>", '\n{"name": "', '", "arguments": ', "}", "", "\n</tool_calls>")),
    ("unsloth-Apriel-1.5.jinja",
     Envelope("<tool_calls>[", '{"name": "', '", "arguments": ', "}", ", ", "]</tool_calls>")),
])
def test_the_pieces_of_real_templates(template: str, expected: Envelope) -> None:
    assert envelope(read(template)) == expected


@pytest.mark.parametrize("template", [
    "Qwen-Qwen2.5-7B-Instruct.jinja",  # Hermes <tool_call>: the default's own reader
    "meta-llama-Llama-3.1-8B-Instruct.jinja",  # bare JSON: no marker to start on
    "mistralai-Mistral-Nemo-Instruct-2407.jinja",  # [TOOL_CALLS] with ids
    "meetkai-functionary-medium-v3.1.jinja",  # <function=: the default reads it
    "Qwen3-Coder.jinja",  # arguments as tagged text: a named family's
    "google-gemma-2-2b-it.jinja",  # no tools at all (and refuses a system turn)
])
def test_left_to_the_default_or_a_named_family(template: str) -> None:
    assert envelope(read(template)) is None


def test_a_template_that_fails_or_runs_away_derives_nothing() -> None:
    assert derive("{{ raise_exception('no') }}") is None
    assert derive("{% for i in range(10**9) %}{{ i }}{% endfor %}") is None
    assert derive("{{ messages[0].content }}") is None  # writes no call
    # calls in the history, but the tools not shown: llmrun's Hermes preamble teaches them
    assert derive(OWN.split("-%}", 1)[1]) is None
    assert think_pair("{{ messages[0].content }}") is None


def test_an_unknown_family_is_derived_and_detected() -> None:
    fmt = formats.detect(OWN)
    assert isinstance(fmt, Derived) and fmt is formats.detect(OWN)  # (cached)
    assert fmt.env == Envelope("<calls>", "call ", " ", "\n", "", "</calls>")
    assert fmt.think_pair(OWN) == ("<reason>", "</reason>")
    assert fmt.markers == ("<calls>", "</calls>")
    # the daemon, which never renders a template, does not derive
    assert formats.detect(OWN, probe=False) is formats.DEFAULT


def stream(fmt: Derived, text: str, pieces: list[str], truncated: bool = False,
           choice: str = "auto") -> tuple[str, list[tuple[str, dict]], object]:
    _, content, end = cases.run(fmt, text, pieces, truncated, choice, tools=[WEATHER, SEARCH],
                                split=False)
    return content, [(c.name, c.arguments) for c in end.calls], end.partial


def test_the_derived_format_reads_whole_and_streamed() -> None:
    fmt = formats.detect(OWN)
    assert isinstance(fmt, Derived)
    text = "Let me look. " + fmt.write_calls(CALLS, INFO) + " Done."
    assert text.startswith("Let me look. <calls>call get_weather {")
    results = [stream(fmt, text, pieces) for pieces in chunkings(text)]
    assert all(r == results[0] for r in results)
    content, calls, partial = results[0]
    assert calls == [(c.name, c.arguments) for c in CALLS] and partial is None
    assert content == "Let me look. Done."
    # several calls, spacing the model changed, a name no tool has: not a call
    loose = '<calls>\n call  get_weather  {"city": "Oslo"}\n\n</calls>'
    assert stream(fmt, loose, list(loose))[1] == [("get_weather", {"city": "Oslo"})]
    unknown = '<calls>call rm_rf {"path": "/"}\n</calls>'
    assert stream(fmt, unknown, [unknown])[1] == []
    assert "rm_rf" in stream(fmt, unknown, [unknown])[0]
    bad = '<calls>call get_weather {"days": "x"}\n</calls>'  # fails the schema
    assert stream(fmt, bad, [bad])[1] == []
    plain = "No calls: <b>bold</b> and {\"a\": 1}."
    assert stream(fmt, plain, list(plain)) == (plain, [], None)


def test_a_derived_call_cut_by_the_token_limit() -> None:
    fmt = formats.detect(OWN)
    assert isinstance(fmt, Derived)
    whole = fmt.write_calls(CALLS, INFO)
    cut = whole[:whole.index('"filters"') + 4]  # in the second call's arguments
    _, calls, partial = stream(fmt, cut, list(cut), truncated=True)
    assert calls == [("get_weather", CALLS[0].arguments)] and partial is None
    first = whole[:whole.index('"days"')]
    _, calls, partial = stream(fmt, first, [first], truncated=True)
    assert calls == [] and partial is not None and partial.name == "get_weather"


def test_derived_grammars_and_triggers_are_built() -> None:
    import llguidance

    from llmrun.engine import constraint

    fmt = formats.detect(OWN)
    assert isinstance(fmt, Derived)
    for parallel in (True, False):
        plan = ToolPlan(INFO, [WEATHER, SEARCH], "required", parallel)
        grammar = fmt.grammar(plan)
        assert grammar is not None and grammar.startswith('start: "<calls>"')
        assert llguidance.LLMatcher.validate_grammar(constraint.from_grammar(grammar)) == ""
        steer = fmt.steering(ToolPlan(INFO, [WEATHER, SEARCH], "auto", parallel))
        assert steer is not None and steer.triggers == ["<calls>"]
        assert llguidance.LLMatcher.validate_grammar(
            constraint.from_grammar(steer.grammar)) == ""
    # a marker that is one special token is named by its id
    special = fmt.grammar(ToolPlan(INFO, [WEATHER], "required"), {"<calls>": 7})
    assert special is not None and special.startswith("start: <[7]>")
    assert fmt.steering(ToolPlan(INFO, [WEATHER], "none")) is None


def test_derivation_agrees_with_the_named_families() -> None:
    """Where a named family's template also derives, the family writes calls as the
    template renders them (the table and the derivation say the same)."""
    checked = 0
    for path in sorted(TEMPLATES.glob("*.jinja")):
        source = path.read_text()
        fmt = formats.detect(source)
        env = envelope(source)
        if env is None or isinstance(fmt, Derived) or fmt is formats.DEFAULT:
            continue
        derived = Derived(env, None)
        ours = fmt.write_calls(CALLS, INFO)
        theirs = derived.write_calls(CALLS, INFO)
        assert "".join(ours.split()) == "".join(theirs.split()), path.name
        checked += 1
    # Apertus, Apriel 1.5 and 1.6, Command R7B, Cohere2 MoE, MiniMax M1, Nemotron Nano 2
    assert checked == 7
    assert json.dumps(CALLS[0].arguments, ensure_ascii=False) in \
        Derived(Envelope("<c>", "", " ", "", "", "</c>"), None).write_calls(CALLS[:1], INFO)
