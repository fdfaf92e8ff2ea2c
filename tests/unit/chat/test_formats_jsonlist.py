"""The families whose calls are a JSON list after a marker (formats/jsonlist.py): Command R7B
and Cohere2 MoE, Command R+, Granite 3.3, Apriel 1.5/1.6, Firefunction v2. Outputs in the
shapes llama.cpp's tests give for these templates (tests/test-chat.cpp), read whole and
streamed in 1-character and random pieces."""

from __future__ import annotations

from typing import Any

import pytest

from llmrun.chat import formats
from llmrun.chat.formats import BY_NAME
from llmrun.chat.tools import ToolPlan
from llmrun.request import Tool, ToolCall
from tests.unit.chat import formatcases as cases
from tests.unit.chat.formatcases import CALLS, INFO, TEMPLATES, TOOLS, WEATHER, chunkings
from tests.unit.chat.grammarcheck import accepts

NAMES = ["command-r7b", "command-r-plus", "granite", "apriel", "firefunction"]
TEMPLATE = {"command-r7b": "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja",
            "command-r-plus": "CohereForAI-c4ai-command-r-plus-tool_use.jinja",
            "granite": "ibm-granite-granite-3.3-2B-Instruct.jinja",
            "apriel": "Apriel-1.6-15b-Thinker-fixed.jinja",
            "firefunction": "fireworks-ai-llama-3-firefunction-v2.jinja"}
# a thought as each family writes it before its answer, and whether the prompt opened it
THOUGHT = {"command-r7b": ("<|START_THINKING|>I'm\nthinking<|END_THINKING|>", False),
           "granite": ("<think>I'm\nthinking</think>", False),
           "apriel": ("I'm\nthinking\n[BEGIN FINAL RESPONSE]\n", True)}


def run(name: str, text: str, pieces: list[str], truncated: bool = False,
        choice: Any = "auto", tools: list[Tool] | None = None,
        template: str | None = None) -> tuple[str, str, Any]:
    """`cases.run` by the family's real template (the prompt opened a thought where
    THOUGHT says so and the text ends one)."""
    fmt = BY_NAME[name]
    source = (TEMPLATES / (template or TEMPLATE[name])).read_text()
    pair = fmt.think_pair(source)
    inside = bool(THOUGHT.get(name, ("", False))[1] and pair and text.find(pair[1]) != -1)
    return cases.run(name, text, pieces, truncated, choice, inside, tools, template=source)


def written(name: str, calls: list[ToolCall], thought: bool = True) -> str:
    body = BY_NAME[name].write_calls(calls, INFO)
    before = THOUGHT[name][0] if thought and name in THOUGHT else ""
    return before + "Let me look. " + body


@pytest.mark.parametrize(("template", "name"), [
    ("CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja", "command-r7b"),
    ("Cohere2MoE.jinja", "command-r7b"),
    ("CohereForAI-c4ai-command-r-plus-tool_use.jinja", "command-r-plus"),
    ("ibm-granite-granite-3.3-2B-Instruct.jinja", "granite"),
    # Granite 4.0 and 4.1 write Hermes <tool_call> JSON only: the default's
    ("ibm-granite-granite-4.0.jinja", "default"),
    ("ibm-granite-granite-4.1.jinja", "default"),
    ("unsloth-Apriel-1.5.jinja", "apriel"),
    ("Apriel-1.6-15b-Thinker-fixed.jinja", "apriel"),
    ("fireworks-ai-llama-3-firefunction-v2.jinja", "firefunction"),
])
def test_detected_from_the_real_template(template: str, name: str) -> None:
    assert formats.detect((TEMPLATES / template).read_text()).name == name


def test_no_other_corpus_template_is_one_of_these() -> None:
    mine = {t: n for t, n in [
        ("CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja", "command-r7b"),
        ("Cohere2MoE.jinja", "command-r7b"),
        ("CohereForAI-c4ai-command-r-plus-tool_use.jinja", "command-r-plus"),
        ("ibm-granite-granite-3.3-2B-Instruct.jinja", "granite"),
        ("unsloth-Apriel-1.5.jinja", "apriel"), ("Apriel-1.6-15b-Thinker-fixed.jinja", "apriel"),
        ("fireworks-ai-llama-3-firefunction-v2.jinja", "firefunction")]}
    for path in TEMPLATES.glob("*.jinja"):
        name = formats.detect(path.read_text()).name
        assert (name in NAMES) == (path.name in mine), path.name
        if path.name in mine:
            assert name == mine[path.name], path.name


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
    assert thought.strip() == ("I'm\nthinking" if name in THOUGHT else "")


@pytest.mark.parametrize("name", NAMES)
def test_one_call_without_text(name: str) -> None:
    call = ToolCall(id="a", name="get_weather", arguments={"city": "Paris", "days": 2})
    text = BY_NAME[name].write_calls([call], INFO)
    for pieces in chunkings(text):
        _, content, end = run(name, text, pieces)
        assert [(c.name, c.arguments) for c in end.calls] == [("get_weather", call.arguments)]
        assert content == ""


@pytest.mark.parametrize("name", NAMES)
def test_text_alone_is_content(name: str) -> None:
    text = "Sunny, 20 °C. Use <b> tags? {\"a\": 1} [1, 2]"
    for pieces in chunkings(text):
        thought, content, end = run(name, text, pieces)
        assert not end.calls and thought == "" and content == text


@pytest.mark.parametrize(("name", "text"), [
    ("command-r7b", "<|START_RESPONSE|>Hello, world!\nWhat's up?<|END_RESPONSE|>"),
    ("command-r7b", "<|START_THINKING|>I'm\nthinking<|END_THINKING|>"
                    "<|START_RESPONSE|>Hello, world!\nWhat's up?<|END_RESPONSE|>"),
    ("command-r7b", "<|START_THINKING|>I'm\nthinking<|END_THINKING|>"
                    "<|START_TEXT|>Hello, world!\nWhat's up?<|END_TEXT|>"),
    ("granite", "<think>I'm\nthinking</think><response>Hello, world!\nWhat's up?</response>"),
    ("granite", "<think>I'm\nthinking</think>Hello, world!\nWhat's up?"),
    ("apriel", "I'm\nthinking\n[BEGIN FINAL RESPONSE]\nHello, world!\nWhat's up?"),
    ("apriel", "I'm\nthinking\n[BEGIN FINAL RESPONSE]\nHello, world!\nWhat's up?\n"
               "[END FINAL RESPONSE]"),
])
def test_the_answer_markers_never_reach_the_content(name: str, text: str) -> None:
    for pieces in chunkings(text):
        thought, content, end = run(name, text, pieces)
        assert content.strip() == "Hello, world!\nWhat's up?", (name, pieces)
        assert not end.calls
        assert thought.strip() == ("I'm\nthinking" if "thinking" in text else "")


def test_cohere2moe_thought_opened_by_the_prompt() -> None:
    """Cohere2 MoE's prompt ends in <|START_THINKING|>: the output starts inside it."""
    fmt = BY_NAME["command-r7b"]
    pair = fmt.think_pair((TEMPLATES / "Cohere2MoE.jinja").read_text())
    assert pair is not None
    text = ("I'm\nthinking<|END_THINKING|><|START_ACTION|>[\n    {\"tool_call_id\": \"0\", "
            "\"tool_name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}},\n    "
            "{\"tool_call_id\": \"1\", \"tool_name\": \"search\", \"parameters\": "
            "{\"query\": \"print('hey')\"}}\n]<|END_ACTION|>")
    for pieces in chunkings(text):
        split = fmt.splitter(pair, inside=True, keep=True)
        reader = fmt.reader(ToolPlan(INFO, TOOLS, "auto"))
        thought, content = "", ""
        for piece in [*pieces, None]:
            t, c = split.push(piece) if piece is not None else split.finish()
            thought += t
            content += reader.push(c)[0]
        end = reader.finish()
        assert thought == "I'm\nthinking" and content + end.text == ""
        assert [(c.name, c.arguments) for c in end.calls] == [
            ("get_weather", {"city": "Paris"}), ("search", {"query": "print('hey')"})]


def test_command_r_plus_reads_the_template_layout() -> None:
    """What its template writes for past calls, and llama.cpp's example shape."""
    for text in ('Action:\n```json\n[{"tool_name": "get_weather", "parameters": '
                 '{"city": "Paris"}}]\n```',
                 'I will check.\nAction:\n```json\n[\n    {\n        "tool_name": '
                 '"get_weather",\n        "parameters": {\n            "city": "Paris"\n'
                 '        }\n    }\n]\n```'):
        for pieces in chunkings(text):
            _, content, end = run("command-r-plus", text, pieces)
            assert [(c.name, c.arguments) for c in end.calls] == [
                ("get_weather", {"city": "Paris"})]
            assert content.strip() in ("", "I will check.")


def test_firefunction_with_the_leading_space_and_either_key() -> None:
    text = (' functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
            '{"name": "search", "parameters": {"query": "x", "limit": 3}}]')
    for pieces in chunkings(text):
        _, content, end = run("firefunction", text, pieces)
        assert [(c.name, c.arguments) for c in end.calls] == [
            ("get_weather", {"city": "Paris"}), ("search", {"query": "x", "limit": 3})]
        assert content.strip() == ""


@pytest.mark.parametrize("name", NAMES)
def test_a_call_cut_by_the_token_limit(name: str) -> None:
    text = written(name, CALLS[:1], thought=False)
    cut_at = text.index("Zürich") + 3
    for pieces in chunkings(text[:cut_at]):
        _, content, end = run(name, text[:cut_at], pieces, truncated=True)
        assert not end.calls and end.partial is not None, name
        assert end.partial.name == "get_weather"
        assert end.partial.arguments.startswith('{"city": "Zü')
        assert content.strip() == "Let me look."


def test_a_call_cut_before_its_arguments_keeps_its_name() -> None:
    text = ('<|START_ACTION|>[\n    {"tool_call_id": "0", "tool_name": "get_weather", ')
    _, _, end = run("command-r7b", text, list(text), truncated=True)
    assert end.partial is not None and end.partial.name == "get_weather"


@pytest.mark.parametrize("name", NAMES)
def test_a_further_call_cut_off_is_dropped(name: str) -> None:
    text = written(name, CALLS, thought=False)
    cut_at = text.index("a \\\"quoted")
    for pieces in chunkings(text[:cut_at]):
        _, _, end = run(name, text[:cut_at], pieces, truncated=True)
        assert [c.name for c in end.calls] == ["get_weather"], name


@pytest.mark.parametrize("name", NAMES)
def test_unknown_tools_and_bad_arguments_stay_text(name: str) -> None:
    bad = [ToolCall(id="a", name="get_weather", arguments={"days": 3})]  # no city
    for calls in (bad, [ToolCall(id="b", name="delete_all", arguments={})]):
        text = written(name, calls, thought=False)
        _, content, end = run(name, text, [text])
        assert not end.calls
        assert "get_weather" in content or "delete_all" in content
    # a list with a call the schema refuses (an enum's value): that one is never a call
    text = written(name, [CALLS[0], ToolCall(id="c", name="get_weather", arguments={
        "city": "X", "unit": "kelvin"})], thought=False)
    _, _, end = run(name, text, [text])
    assert all(c.arguments.get("unit") != "kelvin" for c in end.calls)


@pytest.mark.parametrize("name", NAMES)
def test_hostile_output_stays_text(name: str) -> None:
    opener = BY_NAME[name].write_calls([CALLS[0]], INFO)[:-40]
    for text in (opener + "[" * 5000, opener + '"' * 3000, "{" * 3000 + opener):
        _, _content, end = run(name, text, [text], truncated=True)
        assert not end.calls


# the calls with their arguments in the schemas' order (the grammar writes them so)
ORDERED = [ToolCall(id="a", name="get_weather", arguments={"city": "Zürich 東京",
                                                           "unit": "celsius", "days": 3}),
           CALLS[1]]


@pytest.mark.parametrize("name", NAMES)
def test_grammars_write_the_family_calls(name: str) -> None:
    fmt = BY_NAME[name]
    for parallel in (True, False):
        plan = ToolPlan(INFO, TOOLS, "required", parallel)
        grammar = fmt.grammar(plan)
        assert grammar is not None
        calls = ORDERED if parallel else ORDERED[:1]
        assert accepts(grammar, fmt.write_calls(calls, INFO)), (name, grammar)
        bad = [ToolCall(id="b", name="get_weather", arguments={"days": 3})]
        assert not accepts(grammar, fmt.write_calls(bad, INFO))
        assert not accepts(grammar, fmt.write_calls(
            [ToolCall(id="c", name="get_weather", arguments={"city": "X", "unit": "K"})],
            INFO))
    named = ToolPlan(INFO, TOOLS, formats.base.tools.NamedTool(name="search"), False)
    grammar = fmt.grammar(named)
    assert grammar is not None
    assert accepts(grammar, fmt.write_calls(ORDERED[1:], INFO))
    assert not accepts(grammar, fmt.write_calls(ORDERED[:1], INFO))


@pytest.mark.parametrize("name", NAMES)
def test_steering_starts_after_the_family_marker(name: str) -> None:
    import re

    fmt = BY_NAME[name]
    steer = fmt.steering(ToolPlan(INFO, [Tool(name="get_weather",
                                              parameters=WEATHER.parameters)], "auto"))
    assert steer is not None
    text = fmt.write_calls(ORDERED[:1], INFO)
    [trigger] = steer.triggers
    m = re.search(trigger, "Let me look. " + text)
    assert m is not None
    rest = ("Let me look. " + text)[m.end():]
    assert accepts(steer.grammar, rest), (name, steer.grammar, rest)
    assert fmt.steering(ToolPlan(INFO, TOOLS, "required")) is None


def test_firefunction_template_renders_with_its_variables() -> None:
    """Its template takes `functions` and `datetime` (and fails without them): the runner's
    path gives them (capabilities.context: what the template reads), the tools as JSON."""
    from llmrun.chat import prompttext, templates, tools
    from llmrun.request import ChatRequest

    source = (TEMPLATES / TEMPLATE["firefunction"]).read_text()
    for offered in (TOOLS, None):
        req = ChatRequest.model_validate({"model": "m", "messages": [
            {"role": "user", "content": "Weather in Zürich?"}],
            "tools": offered or []})
        plan = tools.plan(req, source)
        messages, extra = prompttext.variables(req, source, plan)
        text = templates.render(source, messages, **extra)
        assert "Weather in Zürich?" in text and "functools[" in text
        assert ('"name": "get_weather"' in text) == bool(offered)
        assert "<tool_call>" not in text  # the template's own instructions, not Hermes'
    with pytest.raises(templates.TemplateError):
        templates.render(source, messages)


# -- what the one reader promises every family of formats/jsonlist.py ------------------------

ALL = sorted(n for n, f in BY_NAME.items() if isinstance(f, formats.jsonlist.JsonList))


def test_all_the_json_families_share_the_base() -> None:
    assert set(NAMES) < set(ALL)
    assert {"nemotron", "apertus", "minimax-m1", "gigachat3", "gigachat3.1"} < set(ALL)


@pytest.mark.parametrize("name", ALL)
def test_a_cut_call_whose_arguments_hold_a_name_key_is_the_tools(name: str) -> None:
    """The partial call is named by the object the cut is in, not by a `"name"` key inside
    its arguments (a search for people by name)."""
    call = ToolCall(id="a", name="search", arguments={
        "query": "x", "filters": {"name": "bob", "tags": ["y"]}})
    text = "Let me look. " + BY_NAME[name].write_calls([call], INFO)
    cut_at = text.index('"tags"')
    for pieces in cases.chunkings(text[:cut_at]):
        _, content, end = cases.run(name, text[:cut_at], pieces, truncated=True)
        assert not end.calls and end.partial is not None, name
        assert end.partial.name == "search", name
        assert '"name": "bob"' in end.partial.arguments
        assert content.strip() == "Let me look."


@pytest.mark.parametrize("name", [n for n in ALL if n != "command-r-plus"])  # (fenced anyway)
def test_calls_in_a_json_fence_are_read(name: str) -> None:
    """A model that fences its calls' JSON after the marker (as Command R+ is taught to)."""
    fmt = BY_NAME[name]
    body = fmt.write_calls(CALLS[:1], INFO)[len(fmt.open):]
    if fmt.close:
        body = body[:-len(fmt.close)]
    text = f"Let me look. {fmt.open}```json\n{body.strip()}\n```{fmt.close}"
    _, content, calls = cases.read_alike(name, text)
    assert calls == [(CALLS[0].name, CALLS[0].arguments)], text
    assert content.strip() == "Let me look."


@pytest.mark.parametrize("name", [n for n in ALL if BY_NAME[n].listed])
def test_a_lone_object_without_its_list_is_one_call(name: str) -> None:
    fmt = BY_NAME[name]
    one = fmt.write_calls(CALLS[:1], INFO)
    inner = one[len(fmt.open) + len(fmt.lead):len(one) - len(fmt.end) - len(fmt.close)]
    text = f"{fmt.open}{inner}{fmt.close} Done."
    _, content, calls = cases.read_alike(name, text)
    assert calls == [(CALLS[0].name, CALLS[0].arguments)], text
    assert content.strip() == "Done."
