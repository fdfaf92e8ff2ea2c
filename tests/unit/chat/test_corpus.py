"""Every chat template of the corpus (tests/fakes/templates/: llama.cpp's, byte for byte)
rendered through llmrun's own path (tools.plan, prompttext.variables, templates.render: what
the runner does) for several conversations, against Hugging Face's renderer given the same
variables: equal, character for character.

The reference is Hugging Face's compiled template (transformers' `_compile_jinja_template`:
its sandbox, `tojson`, `{% generation %}`, `dict` and `namespace`) rendering llmrun's
variables. Not `render_jinja_template`'s own defaults: it passes `tools=None` (and
`documents=None`) where no tools are offered, where llmrun, like llama.cpp
(common/chat.cpp), leaves `tools` undefined; the two differ only for Command R's and Hermes 2
Pro's tool_use templates, which iterate `tools` unconditionally and which Hugging Face then
fails to render at all (test_hugging_face_defaults_fail_the_tool_use_templates).

Where Hugging Face cannot render a template, the reference is what llama.cpp's renderer
produces, built on Hugging Face's environment with llama.cpp's one difference (LLAMA_CPP).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jinja2
import pytest
from transformers.utils import chat_template_utils as hf  # the `test` extra has it

from llmrun.chat import formats, prompttext, templatelimits, templates, tools
from llmrun.chat.formats.sections import DeepSeekV31
from llmrun.chat.templatelimits import TemplateError
from llmrun.request import ChatRequest, Message, Tool, ToolCall

TEMPLATES = Path(__file__).parents[2] / "fakes" / "templates"
CORPUS = sorted(p.name for p in TEMPLATES.glob("*.jinja"))
BOS, EOS = "<s>", "</s>"

WEATHER = Tool(name="get_weather", description="The weather of a city, today and after",
               parameters={"type": "object", "properties": {
                   "city": {"type": "string", "description": "Its name"},
                   "days": {"type": "array", "items": {"type": "integer"},
                            "description": "From today, 0"},
                   # Command R's template needs every parameter described, and an
                   # object's additionalProperties
                   "units": {"type": "object", "additionalProperties": {"type": "string"},
                             "description": "Per quantity"}},
                   "required": ["city"]})
CALL = ToolCall(id="call_1", name="get_weather",
                arguments={"city": "Zürich", "days": [1, 2],
                           "units": {"temp": "°C", "note": "a \"quoted\"\nline"}})

PROBES: dict[str, dict[str, Any]] = {
    "plain chat with a system turn": {"messages": [
        Message(role="system", content="Be brief."),
        Message(role="user", content="Hello"),
        Message(role="assistant", content="Hi! How can I help?"),
        Message(role="user", content="Tell me a joke.")]},
    "tools offered": {"tools": [WEATHER], "messages": [
        Message(role="system", content="Be brief."),
        Message(role="user", content="What is the weather in Paris?")]},
    "a past call, its result, the answer": {"tools": [WEATHER], "messages": [
        Message(role="user", content="What is the weather in Zürich?"),
        Message(role="assistant", content="", tool_calls=[CALL]),
        Message(role="tool", tool_call_id="call_1", name="get_weather",
                content='{"temp": 21, "sky": "clear"}'),
        Message(role="assistant", content="It is 21 °C and clear."),
        Message(role="user", content="Thanks. And tomorrow?")]},
    "several calls with text before them": {"tools": [WEATHER], "messages": [
        Message(role="user", content="Zürich and Tokyo?"),
        Message(role="assistant", content="Checking both.", tool_calls=[
            CALL, ToolCall(id="call_2", name="get_weather", arguments={"city": "東京"})]),
        Message(role="tool", tool_call_id="call_1", name="get_weather", content="21"),
        Message(role="tool", tool_call_id="call_2", name="get_weather", content="18"),
        Message(role="assistant", content="21 °C and 18 °C.")]},
    "a past thought": {"messages": [
        Message(role="user", content="What is 2 + 2?"),
        Message(role="assistant", content="4.", thinking="Two and two make four."),
        Message(role="user", content="And 3 + 3?")]},
    "unicode": {"messages": [
        Message(role="system", content="Réponds en français 🙂, «brièvement»."),
        Message(role="user", content="日本語で？ naïve ☃ \u2028 ok 𝄞")]},
}


def _hf_template(source: str, mutable_lists: bool = False,
                 listing_tojson: bool = False) -> jinja2.Template:
    """Hugging Face's compiled template; with llama.cpp's renderer's one difference that a
    template needs, where Hugging Face's cannot render it."""
    compiled: jinja2.Template = hf._compile_jinja_template(source)
    if not (mutable_lists or listing_tojson):
        return compiled
    env = compiled.environment.overlay()
    env.filters = dict(env.filters)
    if mutable_lists:  # llama.cpp's lists have append and pop (common/jinja/value.cpp)
        safe = env.is_safe_attribute

        def is_safe_attribute(obj: Any, attr: str, value: Any) -> bool:
            return (type(obj) is list and attr in ("append", "pop")) or safe(obj, attr, value)

        env.is_safe_attribute = is_safe_attribute  # type: ignore[method-assign]
    if listing_tojson:  # llama.cpp's `map` and `select` give arrays, which tojson writes
        tojson: Callable[..., str] = env.filters["tojson"]

        def listing(x: Any, *args: Any, **kwargs: Any) -> str:
            return tojson(list(x) if isinstance(x, Iterator) else x, *args, **kwargs)

        env.filters["tojson"] = listing
    return env.from_string(source)


# Templates Hugging Face's renderer refuses, and why; the reference is then llama.cpp's.
LLAMA_CPP: dict[str, dict[str, bool]] = {
    # Kimi K2 queues the ids of its calls with `list.append`, which Hugging Face's immutable
    # sandbox refuses ("access to attribute 'append' of 'list' object is unsafe") whenever a
    # conversation holds a call; llama.cpp's renderer (and Kimi's own serving) runs it.
    "Kimi-K2-Instruct.jinja": {"mutable_lists": True},
    "Kimi-K2-Thinking.jinja": {"mutable_lists": True},
    # llama.cpp's own DeepSeek R1 template writes `tools | map(attribute='function') |
    # tojson`: a generator to Hugging Face's json.dumps ("Object of type generator is not
    # JSON serializable") whenever tools are offered; an array in llama.cpp's renderer.
    "llama-cpp-deepseek-r1.jinja": {"listing_tojson": True},
}


# Conversations a template refuses by its own rule (raise_exception), in llmrun as in Hugging
# Face's renderer, with the same words: Meta's Llama 3.x templates take one call a turn.
REFUSED = {(f"meta-llama-Llama-3.{v}.jinja", "several calls with text before them"):
           "This model only supports single tool-calls at once!"
           for v in ("1-8B-Instruct", "2-3B-Instruct", "3-70B-Instruct")}


def _ours(name: str, probe: dict[str, Any]) -> tuple[str, list[dict[str, Any]],
                                                     dict[str, Any]]:
    source = (TEMPLATES / name).read_text()
    req = ChatRequest(model="m", **probe)
    plan = tools.plan(req, source)
    messages, extra = prompttext.variables(req, source, plan)
    text = prompttext.render(req, source, plan, bos_token=BOS, eos_token=EOS)
    return text, messages, extra


@pytest.mark.parametrize("probe", list(PROBES))
@pytest.mark.parametrize("name", CORPUS)
def test_renders_as_hugging_face_renders_it(name: str, probe: str) -> None:
    source = (TEMPLATES / name).read_text()
    req = ChatRequest(model="m", **PROBES[probe])
    messages, extra = prompttext.variables(req, source, tools.plan(req, source))
    reference = _hf_template(source, **LLAMA_CPP.get(name, {}))
    variables = {"messages": json.loads(json.dumps(messages)), "bos_token": BOS,
                 "eos_token": EOS, "add_generation_prompt": True,
                 **json.loads(json.dumps(extra))}
    if (name, probe) in REFUSED:
        reason = REFUSED[name, probe]
        with pytest.raises(jinja2.exceptions.TemplateError, match=reason):
            reference.render(**variables)
        with pytest.raises(TemplateError, match=reason):
            _ours(name, PROBES[probe])
        return
    text, _, _ = _ours(name, PROBES[probe])
    assert text == reference.render(**variables)


def test_the_corpus_is_all_there() -> None:
    assert len(CORPUS) == 70


@pytest.mark.parametrize("name", sorted(LLAMA_CPP))
def test_hugging_face_refuses_what_llama_cpp_renders(name: str) -> None:
    """Each exception is one: Hugging Face's renderer does fail there (so if a release
    fixes it, the reference goes back to Hugging Face's)."""
    probe = PROBES["a past call, its result, the answer"]
    _, messages, extra = _ours(name, probe)
    with pytest.raises((jinja2.exceptions.SecurityError, TypeError)):
        _hf_template((TEMPLATES / name).read_text()).render(
            messages=messages, bos_token=BOS, eos_token=EOS, add_generation_prompt=True,
            **extra)


@pytest.mark.parametrize("name", ["CohereForAI-c4ai-command-r-plus-tool_use.jinja",
                                  "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use.jinja",
                                  "NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja"])
def test_hugging_face_defaults_fail_the_tool_use_templates(name: str) -> None:
    """Without tools, render_jinja_template's `tools=None` breaks these (they iterate it);
    llmrun's undefined `tools` renders them, as llama.cpp's does."""
    _, messages, extra = _ours(name, PROBES["plain chat with a system turn"])
    with pytest.raises(TypeError, match="not iterable"):
        hf.render_jinja_template([messages], chat_template=(TEMPLATES / name).read_text(),
                                 add_generation_prompt=True, **extra)


# -- what the pipeline had to learn about a template, one template each ---------------------


def _source(name: str) -> str:
    return (TEMPLATES / name).read_text()


def test_gemma_2_gets_the_system_prompt_in_its_first_user_turn() -> None:
    source = _source("google-gemma-2-2b-it.jinja")
    assert not tools.inspect_template(source).system_role
    with pytest.raises(jinja2.exceptions.TemplateError, match="System role not supported"):
        _hf_template(source).render(messages=[{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": "Hello"}])
    text, messages, _ = _ours("google-gemma-2-2b-it.jinja",
                              PROBES["plain chat with a system turn"])
    # llama.cpp's fold: the system text, a newline, the first turn's text
    assert messages[0] == {"role": "user", "content": "Be brief.\nHello"}
    assert "<start_of_turn>user\nBe brief.\nHello<end_of_turn>" in text


def test_a_lone_system_message_is_dropped_where_the_template_has_no_system_role() -> None:
    source = _source("google-gemma-2-2b-it.jinja")
    messages, _ = tools.chat_inputs([Message(role="system", content="Be brief.")], None,
                                    source, None)
    assert messages == []


def test_templates_that_render_a_system_turn_keep_it() -> None:
    for name in CORPUS:
        if name != "google-gemma-2-2b-it.jinja":
            assert tools.inspect_template(_source(name)).system_role, name


def test_functionary_3_2_reads_arguments_as_json_text() -> None:
    source = _source("meetkai-functionary-medium-v3.2.jinja")
    info = tools.inspect_template(source)
    assert info.native_calls and not info.object_arguments
    _, messages, _ = _ours("meetkai-functionary-medium-v3.2.jinja",
                           PROBES["a past call, its result, the answer"])
    arguments = messages[1]["tool_calls"][0]["function"]["arguments"]
    assert isinstance(arguments, str) and json.loads(arguments) == CALL.arguments
    with pytest.raises(TypeError, match="concatenate"):  # as an object, neither renders it
        _hf_template(source).render(messages=[
            {**m, "tool_calls": [{**c, "function": {**c["function"],
                                                    "arguments": CALL.arguments}}
                                 for c in m["tool_calls"]]} if "tool_calls" in m else m
            for m in messages], bos_token=BOS, add_generation_prompt=True)


def test_object_arguments_everywhere_else_that_renders_calls() -> None:
    strings = {n for n in CORPUS if not tools.inspect_template(_source(n)).object_arguments}
    assert strings == {"meetkai-functionary-medium-v3.2.jinja"}


def test_mistral_templates_get_nine_character_ids() -> None:
    for name in ("mistralai-Mistral-Nemo-Instruct-2407.jinja",
                 "Mistral-Small-3.2-24B-Instruct-2506.jinja"):
        text, messages, _ = _ours(name, PROBES["a past call, its result, the answer"])
        call_id = messages[1]["tool_calls"][0]["id"]
        assert len(call_id) == 9 and call_id.isalnum()
        assert messages[2]["tool_call_id"] == call_id and call_id in text


def test_firefunction_v2_gets_its_functions_and_date() -> None:
    name = "fireworks-ai-llama-3-firefunction-v2.jinja"
    assert tools.inspect_template(_source(name)).native
    text, _, extra = _ours(name, PROBES["tools offered"])
    assert json.loads(extra["functions"]) == [tools.tool_dict(WEATHER)]
    assert "Today is " + extra["datetime"] + "." in text
    assert "You are a function calling" not in text  # its own tool text, not the preamble


def test_deepseek_templates_render_calls_without_naming_tools() -> None:
    """V3.1's and the R1 distills' templates write calls and results themselves though
    they never name `tools`: rendering shows it, where the text alone did not."""
    for name in ("deepseek-ai-DeepSeek-V3.1.jinja",
                 "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"):
        info = tools.inspect_template(_source(name))
        assert (info.native, info.native_calls, info.native_results) == (False, True, True)


def test_templates_that_render_no_calls_are_told_so() -> None:
    # (R1 Distill Llama's renders calls only for a message whose content is None, which
    # llmrun never sends; SmolLM3's renders a `tool` message, but not the call before it)
    for name in ("HuggingFaceTB-SmolLM3-3B.jinja", "microsoft-Phi-3.5-mini-instruct.jinja",
                 "google-gemma-2-2b-it.jinja", "llama-cpp-rwkv-world.jinja",
                 "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja"):
        info = tools.inspect_template(_source(name))
        assert not (info.native or info.native_calls or info.native_results), name


def test_a_past_thought_is_there_under_both_names() -> None:
    _, messages, _ = _ours("openai-gpt-oss-120b.jinja", PROBES["a past thought"])
    assert messages[1]["thinking"] == messages[1]["reasoning_content"] == \
        "Two and two make four."


# -- history written by the family ----------------------------------------------------------


def _without_native_calls(source: str) -> tools.TemplateInfo:
    info = tools.inspect_template(source)
    return tools.TemplateInfo(info.family, info.native, native_calls=False,
                              native_results=info.native_results)


def test_calls_a_template_cannot_render_are_written_by_its_family() -> None:
    """The family's writer, fed a template that could not render calls, writes what the
    template itself writes for them: DeepSeek V3.1's sections, character for character."""
    source = _source("deepseek-ai-DeepSeek-V3.1.jinja")
    fmt = formats.detect(source)
    assert isinstance(fmt, DeepSeekV31)
    calls = [CALL, ToolCall(id="call_2", name="get_weather", arguments={"city": "東京"})]
    conversation = [Message(role="user", content="Weather in Zürich and Tokyo?"),
                    Message(role="assistant", content="", tool_calls=calls)]
    native = templates.render(source, tools.history(conversation,
                                                    tools.inspect_template(source)),
                              add_generation_prompt=False)
    flat = tools.history(conversation, _without_native_calls(source), fmt.write_calls)
    assert "tool_calls" not in flat[1]
    assert flat[1]["content"] == fmt.write_calls(calls, tools.inspect_template(source))
    assert templates.render(source, flat, add_generation_prompt=False) == native


def test_the_pipeline_asks_the_family_to_write_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    source = _source("deepseek-ai-DeepSeek-V3.1.jinja")
    info = _without_native_calls(source)
    monkeypatch.setattr(tools, "inspect_template", lambda _: info)
    req = ChatRequest(model="m", messages=[Message(role="user", content="Weather?"),
                                           Message(role="assistant", tool_calls=[CALL])])
    messages, _ = prompttext.variables(req, source, None)
    assert messages[1]["content"].startswith("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
                                             "get_weather<｜tool▁sep｜>{")


def test_the_default_family_still_writes_hermes() -> None:
    source = _source("HuggingFaceTB-SmolLM3-3B.jinja")
    req = ChatRequest(model="m", messages=[
        Message(role="user", content="Weather?"),
        Message(role="assistant", content="Let me look.", tool_calls=[CALL]),
        Message(role="tool", tool_call_id="call_1", content="sunny")])
    messages, _ = prompttext.variables(req, source, None)
    assert messages[1]["content"] == "Let me look.\n" + tools.format_calls(
        [CALL], tools.inspect_template(source))
    assert messages[2] == {"role": "user", "content": "<tool_response>\nsunny\n</tool_response>"}


# -- the renderer's new capabilities keep its bounds ----------------------------------------


def test_a_template_appending_forever_is_stopped() -> None:
    forever = ("{% set ns = namespace(xs=[]) %}{% for i in range(100000) %}"
               "{% for j in range(100000) %}{% set _ = ns.xs.append(j) %}{% endfor %}"
               "{% endfor %}")
    with pytest.raises(TemplateError, match="limit"):
        templates.render(forever, [])


def test_appending_stops_at_the_list_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(templatelimits, "MAX_ITEMS", 10)
    grow = "{% set xs = [] %}{% for i in range(11) %}{% set _ = xs.append(i) %}{% endfor %}"
    with pytest.raises(TemplateError, match="list over its limit of 10"):
        templates.render(grow, [])
    assert templates.render(grow.replace("11", "10") + "{{ xs | length }}", []) == "10"


def test_a_template_appends_to_a_copy_of_what_it_was_given() -> None:
    arguments: dict[str, Any] = {"days": [1]}
    messages = [{"role": "user", "content": "x", "args": arguments}]
    out = templates.render("{% set _ = messages[0].args.days.append(2) %}"
                           "{% set _ = messages.append(3) %}"
                           "{{ messages[0].args.days }} {{ messages | length }}", messages)
    assert out == "[1, 2] 2"
    assert arguments == {"days": [1]} and len(messages) == 1


def test_pop_and_no_other_mutation() -> None:
    assert templates.render("{% set xs = [1, 2] %}{{ xs.pop() }}{{ xs }}", []) == "2[1]"
    with pytest.raises(TemplateError, match="pop from empty list"):
        templates.render("{% set xs = [] %}{{ xs.pop() }}", [])
    for unsafe in ("{% set d = {} %}{{ d.update({'a': 1}) }}",
                   "{% set xs = [] %}{{ xs.extend([1]) }}", "{{ 'a'.append }}"):
        with pytest.raises(TemplateError):
            templates.render(unsafe + "{{ d.a }}", [])


def test_a_list_holding_itself_fails_in_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(templatelimits, "MAX_STEPS", 100_000)  # (quicker to the limit)
    loop = "{% set xs = [] %}{% set _ = xs.append(xs) %}"
    with pytest.raises(TemplateError, match="limit"):  # its size is counted, not assumed
        templates.render(loop + "{{ xs }}", [])
    with pytest.raises(TemplateError, match=r"limit|Circular"):
        templates.render(loop + "{{ xs | tojson }}", [])


def test_generation_blocks_render_their_body_as_hugging_face_does() -> None:
    source = ("{% set x = 1 %}{% generation %}<{{ x }}>{% set x = 2 %}{% endgeneration %}"
              "{{ x }}")
    assert templates.render(source, []) == _hf_template(source).render() == "<1>1"


def test_tojson_takes_hugging_faces_arguments() -> None:
    value = {"b": [1, "é"], "a": None}
    for args in ("", "indent=2", "separators=(',', ':')", "sort_keys=true",
                 "ensure_ascii=true", "indent=2, sort_keys=true"):
        source = "{{ value | tojson(" + args + ") }}"
        assert templates.render(source, [], value=value) == \
            _hf_template(source).render(value=value)


def test_tojson_widths_are_bounded() -> None:
    with pytest.raises(TemplateError, match="separators"):
        templates.render("{{ [1, 2] | tojson(separators=(',' * 17, ':')) }}", [])
    with pytest.raises(TemplateError, match="indent"):
        templates.render("{{ [1] | tojson(indent=17) }}", [])


def test_tojson_lists_an_iterator_within_bounds(monkeypatch: pytest.MonkeyPatch) -> None:
    assert templates.render("{{ messages | map(attribute='role') | tojson }}",
                            [{"role": "user"}, {"role": "é"}]) == '["user", "é"]'
    assert templates.render("{{ {'a': messages | map(attribute='role')} | tojson }}",
                            [{"role": "user"}]) == '{"a": ["user"]}'
    monkeypatch.setattr(templatelimits, "MAX_OUTPUT", 1000)
    with pytest.raises(TemplateError, match="limit"):
        templates.render("{{ range(1000) | map('string') | map('center', 100) | tojson }}",
                         [])


def test_a_template_out_of_budget_is_probed_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Probing renders a template several times: one that runs out of its budget stops the
    probes at the first, so a request's template costs at most one budget more."""
    calls = []
    render = templates.render

    def counted(*args: Any, **kwargs: Any) -> str:
        calls.append(1)
        return render(*args, **kwargs)

    monkeypatch.setattr(templates, "render", counted)
    slow = ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
            "{{ messages[0].content }} tools tool_calls")
    info = tools.inspect_template(slow)
    assert len(calls) == 1
    # what its text says, unconfirmed: it names tools and tool_calls, no tool role
    assert info.system_role and (info.native, info.native_calls, info.native_results) == \
        (True, True, False)


@pytest.mark.parametrize(("source", "system_role"), [
    ("{{ messages[-1].content }}", False),  # a user turn, never the system's
    ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}", True),
    ("{{ 'fixed text' }}", True),  # renders no turn at all: nothing learnt
    ("{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no') }}"
     "{% endif %}{{ m.content }}{% endfor %}", False),
    ("{{- range .Messages }}{{ if ne .Role \"system\" }}{{ .Content }}{{ end }}{{ end }}",
     False),  # Go, as Ollama's Modelfiles write them
    ("{{ .System }}|{{ range .Messages }}{{ .Role }}={{ .Content }};{{ end }}", True),
])
def test_the_system_role_as_rendering_shows_it(source: str, system_role: bool) -> None:
    assert tools.inspect_template(source).system_role is system_role
