"""Each chat format through the real daemon: a copy of SmolLM2 given the family's real chat
template (tests/fakes/templates/), its output forced (llama-server's `grammar` field) to what
a model of that family writes, read in the OpenAI dialect whole and streamed (tool_calls,
reasoning_content, no markup in the content); and a call forced by tool_choice in the
family's own syntax (its grammar, formats/), read in the Anthropic dialect. The forced
grammars are also checked against SmolLM2's vocabulary: they let a model write the calls as
the family writes them, and each steering grammar starts at its trigger (outside a thought)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest

from llmrun.chat import formats, templates, thinking
from llmrun.chat.tools import TemplateInfo, ToolPlan
from llmrun.request import Tool, ToolCall
from tests.conftest import Daemon

TEMPLATES = Path(__file__).parents[1] / "fakes" / "templates"
FAMILIES = {"harmony": "openai-gpt-oss-120b.jinja", "qwen3-coder": "Qwen3-Coder.jinja",
            "glm": "GLM-4.6.jinja", "deepseek-v3.1": "deepseek-ai-DeepSeek-V3.1.jinja",
            "kimi-k2": "moonshotai-Kimi-K2.jinja", "seed-oss": "ByteDance-Seed-OSS.jinja",
            "minimax-m2": "MiniMax-M2.jinja", "minimax-m1": "MiniMax-M1.jinja",
            "deepseek-r1": "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
            "deepseek-v3.2": "deepseek-ai-DeepSeek-V3.2.jinja",
            "deepseek-v4": "deepseek-ai-DeepSeek-V4.jinja",
            "nemotron": "NVIDIA-Nemotron-Nano-v2.jinja", "apertus": "Apertus-8B-Instruct.jinja",
            "lfm2": "LFM2-8B-A1B.jinja", "gigachat3": "GigaChat3-10B-A1.8B.jinja",
            "gigachat3.1": "GigaChat3.1-10B-A1.8B.jinja", "hunyuan": "tencent-Hy3.jinja",
            "kimi-k3": "Kimi-K3.jinja", "minimax-m3": "MiniMax-M3.jinja",
            "ling": "inclusionai-ling-3.0-flash.jinja",
            "command-r7b": "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja",
            "command-r-plus": "CohereForAI-c4ai-command-r-plus-tool_use.jinja",
            "granite": "ibm-granite-granite-3.3-2B-Instruct.jinja",
            "apriel": "Apriel-1.6-15b-Thinker-fixed.jinja",
            "firefunction": "fireworks-ai-llama-3-firefunction-v2.jinja",
            "functionary-v3.1": "meetkai-functionary-medium-v3.1.jinja",
            "functionary-v3.2": "meetkai-functionary-medium-v3.2.jinja",
            "gemma4": "google-gemma-4-31B-it.jinja",
            "minicpm5": "openbmb-MiniCPM5-1B.jinja",
            "solar-open": "upstage-Solar-Open-100B.jinja",
            "muse-glimmer": "muse-glimmer.jinja"}
# Through the daemon: Apriel's prompt opens its thought, so a grammar (the request's or a
# forced call's) waits for the thought's end marker, which SmolLM2 never writes; its
# grammars are checked on SmolLM2's vocabulary below.
DAEMON = [f for f in FAMILIES if f != "apriel"]
# A forced call: Muse Glimmer's grammar lets a thought (a message to=self) come first, as
# the model writes one; SmolLM2 takes that road and never ends the thought.
FORCED = [f for f in DAEMON if f != "muse-glimmer"]
# The system prompt every request gives: Nemotron Nano 2's template opens a thought in its
# generation prompt unless the system prompt says `/no_think` (a forced call then waits for
# the thought's end, which SmolLM2 does not write); the other templates take it as text.
SYSTEM = "/no_think"
# MiniMax M2's, Kimi K3's and Ling 3.0's generation prompts open a thought (K3's and
# Ling's unless switched off, which these requests do not do), and a grammar (the
# request's, or a forced call's) applies after its end, which SmolLM2 never writes: their
# models get the template with that opening taken out (the thought after it is split as
# the unit tests show, tests/unit/chat/test_formats_tagged.py).
EDITS = {"minimax-m2": ("']~b]ai' ~ '\\n' ~ '<think>' ~ '\\n'", "']~b]ai' ~ '\\n'"),
         "kimi-k3": ("{%- set thinking = true -%}", "{%- set thinking = false -%}"),
         "ling": ("{%- elif thinking_option is not defined %}\n    {%- set thinking_option = "
                  "'on' %}", "{%- elif thinking_option is not defined %}\n    "
                  "{%- set thinking_option = 'off' %}")}


def template_of(family: str) -> str:
    """The family's real template (tests/fakes/templates/), with its EDITS."""
    source = (TEMPLATES / FAMILIES[family]).read_text()
    if family in EDITS:
        old, new = EDITS[family]
        assert old in source
        source = source.replace(old, new)
    return source


WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    # (each parameter described: Command R+'s template writes every one's description)
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "description": "The city"},
        "days": {"type": "integer", "description": "How many days"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"],
                 "description": "The unit"}},
        "required": ["city"]}}}
CALL = ToolCall(id="a", name="get_weather", arguments={"city": "Zürich", "days": 3})
INFO = TemplateInfo("hermes", native=True, native_calls=True, native_results=True)


def opens_thought(family: str) -> tuple[str, str] | None:
    """The think pair of `family` where its generation prompt leaves a thought open."""
    source = template_of(family)
    pair = formats.BY_NAME[family].think_pair(source)
    if pair is None:
        return None
    prompt = templates.render(source, [{"role": "system", "content": SYSTEM},
                                       {"role": "user", "content": "Weather in Zürich?"}],
                              tools=[WEATHER])
    return pair if thinking.opens(prompt, pair) else None


def written(family: str) -> str:
    """What a model of `family` writes to call get_weather (harmony, and a family whose
    prompt opens a thought: after a thought)."""
    body = formats.BY_NAME[family].write_calls([CALL], INFO)
    if family == "harmony":
        return ("<|channel|>analysis<|message|>The user wants weather.<|end|>"
                "<|start|>assistant" + body[len("<|start|>assistant"):])
    if family == "muse-glimmer":  # the prompt wrote the first `<|start|>assistant`
        return (" to=self<|message|>The user wants weather.<|eom|><|start|>assistant to=user"
                "<|message|>Checking.<|eom|>" + body)
    if family == "functionary-v3.2":  # the prompt wrote the first `>>>`
        return "all\nChecking.>>>" + body
    if family == "apriel":  # the prompt opened the thought
        return "The user wants weather.\n[BEGIN FINAL RESPONSE]\nChecking. " + body
    pair = opens_thought(family)
    # (Kimi K3 writes its answer in a section the prompt opened: its end before the calls)
    wrapping = getattr(formats.BY_NAME[family], "wrapping", ("", ""))
    return ("The user wants weather." + pair[1] + "\n\n" if pair else "") + "Checking. " \
        + wrapping[1] + body


@pytest.fixture(scope="module")
def models(daemon: Daemon) -> Iterator[dict[str, str]]:
    c = ollama.Client(host=daemon.url)
    names = {}
    for family in DAEMON:
        names[family] = f"smollm2-{family.replace('.', '')}"
        c.create(model=names[family], from_="smollm2",
                 template=template_of(family))
    yield names
    for name in names.values():
        c.delete(name)


def body(model: str, family: str, **kw: Any) -> dict[str, Any]:
    if family == "solar-open":
        # SmolLM2's free first token, "<|", may begin Solar's `<|think|>` (one special token
        # in Solar's own vocabulary), so the grammar would wait for a thought's end: off
        kw.setdefault("chat_template_kwargs", {"enable_thinking": False})
    return {"model": model, "messages": [{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": "Weather in Zürich?"}],
            "tools": [WEATHER], "max_tokens": 200, "temperature": 0,
            "grammar": "start: " + json.dumps(written(family)), **kw}


@pytest.mark.parametrize("family", DAEMON)
def test_openai_reads_the_family_whole_and_streamed(api: httpx.Client, models: dict[str, str],
                                                    family: str) -> None:
    r = api.post("/v1/chat/completions", json=body(models[family], family), timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    message = choice["message"]
    assert choice["finish_reason"] == "tool_calls", message
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == CALL.arguments
    content = message.get("content") or ""
    assert "<" not in content and "|" not in content, content
    if family == "harmony":
        assert message.get("reasoning_content") == "The user wants weather."
        assert content == ""
    else:
        assert content.strip() == "Checking."
        if opens_thought(family):
            assert message.get("reasoning_content") == "The user wants weather."

    thought, text, finish = "", "", None
    calls: dict[int, dict[str, str]] = {}
    with api.stream("POST", "/v1/chat/completions",
                    json=body(models[family], family, stream=True), timeout=120) as s:
        for line in s.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            c = json.loads(line[6:])["choices"][0]
            delta = c["delta"]
            thought += delta.get("reasoning_content") or ""
            text += delta.get("content") or ""
            for tc in delta.get("tool_calls") or []:
                entry = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
                entry["name"] += tc.get("function", {}).get("name") or ""
                entry["arguments"] += tc.get("function", {}).get("arguments") or ""
            finish = c.get("finish_reason") or finish
    assert finish == "tool_calls"
    assert [(v["name"], json.loads(v["arguments"])) for v in calls.values()] == \
        [("get_weather", CALL.arguments)]
    assert text == content and thought == (message.get("reasoning_content") or "")


@pytest.mark.parametrize("family", FORCED)
def test_anthropic_forced_call_in_the_family_syntax(api: httpx.Client,
                                                    models: dict[str, str],
                                                    family: str) -> None:
    """tool_choice "any", one call: the format's own grammar writes it (the unit is an
    enum, so the call is short whatever the model prefers)."""
    tool = {"name": "set_unit", "description": "Set the unit",
            "input_schema": {"type": "object", "properties": {
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"],
                         "description": "The unit"}},
                "required": ["unit"]}}
    r = api.post("/v1/messages", json={
        "model": models[family], "max_tokens": 120, "temperature": 0, "system": SYSTEM,
        "messages": [{"role": "user", "content": "Use celsius."}],
        "tools": [tool],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True}}, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["stop_reason"] == "tool_use", out
    uses = [b for b in out["content"] if b["type"] == "tool_use"]
    assert [u["name"] for u in uses] == ["set_unit"]
    assert uses[0]["input"]["unit"] in ("celsius", "fahrenheit")
    assert not any("<" in b.get("text", "") for b in out["content"] if b["type"] == "text")


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path: Any) -> Iterator[Any]:
    import warnings

    from llguidance.llamacpp import lltokenizer_from_vocab

    from llmrun.engine.llama import Model

    model = Model(smollm2_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        yield lltokenizer_from_vocab(model.vocab)
    model.close()


def consumed(tokenizer: Any, grammar: str, text: str) -> bool:
    """Whether the grammar lets a model write `text` whole (and end there)."""
    import llguidance

    from llmrun.engine import constraint

    matcher = llguidance.LLMatcher(tokenizer, constraint.from_grammar(grammar))
    assert not matcher.is_error(), matcher.get_error()
    ids = tokenizer.tokenize_str(text)
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) \
        and matcher.is_accepting()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_forced_grammar_writes_the_family_calls(smollm2_tokenizer: Any, family: str) -> None:
    fmt = formats.BY_NAME[family]
    weather = Tool(name="get_weather", parameters=WEATHER["function"]["parameters"])
    plan = ToolPlan(INFO, [weather], "required", parallel=True)
    grammar = fmt.grammar(plan)
    assert grammar is not None
    call = fmt.write_calls([CALL], INFO)
    bad = fmt.write_calls([ToolCall(id="b", name="get_weather", arguments={"days": 3})], INFO)
    if family in ("harmony", "muse-glimmer"):  # the prompt wrote the first header's start
        call, bad = call[len("<|start|>assistant"):], bad[len("<|start|>assistant"):]
    if family == "harmony":
        assert consumed(smollm2_tokenizer, grammar, "<|channel|>analysis<|message|>Hm <b>."
                        "<|end|><|start|>assistant" + call)
    assert consumed(smollm2_tokenizer, grammar, call), (grammar, call)
    assert not consumed(smollm2_tokenizer, grammar, bad)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_steering_starts_at_the_family_trigger(smollm2_tokenizer: Any, family: str) -> None:
    """tool_choice "auto": nothing is constrained before the family's call begins (a thought
    aside: harmony's analysis channel is no trigger), and from its trigger on the grammar
    takes the call as the family writes it."""
    from llmrun.engine import constraint

    fmt = formats.BY_NAME[family]
    weather = Tool(name="get_weather", parameters=WEATHER["function"]["parameters"])
    steer = fmt.steering(ToolPlan(INFO, [weather], "auto"))
    assert steer is not None
    pair = fmt.think_pair("<think>")
    think = (pair[0].encode(), pair[1].encode()) if pair else None
    text = written(family)
    if family == "harmony":  # a trigger's text inside the thought does not count
        text = text.replace("The user wants weather.",
                            "maybe <|channel|>commentary to=functions.get_weather")
    lazy = constraint.Lazy(smollm2_tokenizer, constraint.from_grammar(steer.grammar),
                           steer.triggers, think)
    ids = smollm2_tokenizer.tokenize_str(text)
    for n, token in enumerate(ids):
        found = lazy.feed(smollm2_tokenizer.decode_bytes([token]))
        if found is not None:
            before = smollm2_tokenizer.decode_str(ids[:n + 1])
            assert "<|end|>" in before or family != "harmony"  # after the thought
            assert all(found.consume_token(t) for t in ids[n + 1:]), family
            return
        assert not lazy.over, family
    pytest.fail(f"{family}: no trigger matched")
