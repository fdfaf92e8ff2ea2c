"""Each template's own thinking switch, as the runner renders a request (engine/prompt.py
over chat/thinking.py): the real templates of llama.cpp's corpus (tests/fakes/templates/),
rendered with thinking on and off, differ the way each template means them to, and off never
leaves the output inside an opened thought."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from llmrun.chat import formats, thinking
from llmrun.engine.prompt import Prompter
from llmrun.request import ChatRequest, Message, Think

TEMPLATES = Path(__file__).parents[2] / "fakes" / "templates"
CORPUS = {p.name: p.read_text() for p in sorted(TEMPLATES.glob("*.jinja"))}


class TextModel:
    """What Prompter asks of a model, for text only: a token per character."""

    bos = eos = -1
    add_bos = add_eos = False
    n_vocab = 0x110000

    def chat_template(self) -> str | None:
        return None

    def special_texts(self, markers: Any = ()) -> list[str]:
        return []  # no special tokens: nothing a client writes needs breaking

    def piece(self, token: int) -> bytes:
        return chr(token).encode()

    def tokenize(self, text: str, add_special: bool = False,
                 parse_special: bool = False) -> list[int]:
        return [ord(c) for c in text]


PROMPTER = Prompter(TextModel(), 1 << 20, 512)  # type: ignore[arg-type]


def rendered(template: str, think: Think, system: bool = True, **kw: Any) -> str:
    messages = [Message(role="user", content="Hi")]
    if system:
        messages.insert(0, Message(role="system", content="Be brief."))
    req = ChatRequest(model="m", messages=messages, template=template, think=think, **kw)
    return PROMPTER.render(req)[1]


def thinks(name: str) -> bool:
    """Whether a corpus template can think: it has a switch or a thought's markers (and
    renders here: a few use Jinja tags this renderer does not know)."""
    source = CORPUS[name]
    if not (thinking.switches(source) or formats.detect(source).think_pair(source)):
        return False
    try:
        rendered(source, None)
    except ValueError:
        return False
    return True


THINKING = [name for name in CORPUS if thinks(name)]
# templates with no switch whose prompt opens no thought (their models think by their own
# choice: the templates only drop old thoughts). Apriel 1.6's prompt opens one, which off
# closes (its format's end marker, [BEGIN FINAL RESPONSE])
NO_SWITCH = {"Kimi-K2-Thinking.jinja", "mistralai-Ministral-3-14B-Reasoning-2512.jinja",
             "LFM2.5-8B-A1B.jinja"}


def test_the_corpus_has_the_thinking_templates() -> None:
    assert len(THINKING) >= 35, THINKING


@pytest.mark.parametrize("name", THINKING)
def test_off_never_leaves_an_opened_thought(name: str) -> None:
    source = CORPUS[name]
    pair = formats.detect(source).think_pair(source)
    differs = []
    for system in (True, False):
        off = rendered(source, False, system)
        if pair is not None:
            assert not thinking.opens(off, pair), off[-80:]
        differs.append(rendered(source, True, system) != off)
    # (Granite 3.3 switches only where the conversation brings no system prompt)
    assert any(differs) == (name not in NO_SWITCH)


# what the template writes when thinking is off, and when on, at the prompt's end (or in it)
INTENDED: dict[str, tuple[str, str]] = {
    "Qwen-Qwen3-0.6B.jinja": ("<|im_start|>assistant\n<think>\n\n</think>\n\n",
                              "<|im_start|>assistant\n"),
    "Qwen3.5-4B.jinja": ("<think>\n\n</think>\n\n", "assistant\n<think>\n"),
    "GLM-4.6.jinja": ("<|assistant|>\n<think></think>", "<|assistant|>"),
    "GLM-4.7-Flash.jinja": ("<|assistant|></think>", "<|assistant|><think>"),
    "deepseek-ai-DeepSeek-V3.1.jinja": ("<｜Assistant｜><think></think>", "<｜Assistant｜><think>"),
    "deepseek-ai-DeepSeek-V4.jinja": ("<｜Assistant｜></think>", "<｜Assistant｜><think>"),
    "HuggingFaceTB-SmolLM3-3B.jinja": ("<think>\n\n</think>\n", "<|im_start|>assistant\n"),
    "NVIDIA-Nemotron-Nano-v2.jinja": ("Assistant\n<think></think>", "Assistant\n<think>\n"),
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja": ("<think></think>", "assistant\n<think>\n"),
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use.jinja": (
        "<|CHATBOT_TOKEN|><|START_THINKING|><|END_THINKING|>", "<|CHATBOT_TOKEN|>"),
    "Cohere2MoE.jinja": ("<|START_THINKING|><|END_THINKING|>", "<|START_THINKING|>"),
    "tencent-Hy3.jinja": ("<think:opensource></think:opensource>", "<think:opensource>"),
    "upstage-Solar-Open-100B.jinja": ("assistant<|think|><|end|><|begin|>assistant",
                                      "<|user|>"),
    "Kimi-K3.jinja": ("<|open|>response<|sep|>", "<|open|>think<|sep|>"),
    "MiniMax-M3.jinja": ("ai\n</mm:think>", "ai\n<mm:think>"),
    "ByteDance-Seed-OSS.jinja": ("</seed:think>", "assistant\n"),
    # templates that always open the thought: off closes it, as llama.cpp does
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja": ("<think>\n</think>\n\n", "<think>\n"),
    "StepFun3.5-Flash.jinja": ("<think>\n</think>\n\n", "<think>\n"),
    "MiniMax-M2.jinja": ("<think>\n</think>\n\n", "<think>\n"),
}


@pytest.mark.parametrize("name", sorted(INTENDED))
def test_each_template_switched_its_own_way(name: str) -> None:
    off_end, on_end = INTENDED[name]
    off, on = rendered(CORPUS[name], False), rendered(CORPUS[name], True)
    assert off.endswith(off_end), off[-80:]
    if on_end == "<|user|>":  # (Solar: on writes no empty thought)
        assert "<|think|><|end|>" not in on
    else:
        assert on.endswith(on_end) and not on.endswith(off_end), on[-80:]


def test_a_switch_word_in_the_system_prompt() -> None:
    """Nemotron Nano v2 reads /think and /no_think in the messages (and strips them):
    the runner says it at the system prompt's end, or in a system prompt of its own."""
    source = CORPUS["NVIDIA-Nemotron-Nano-v2.jinja"]
    assert thinking.switches(source) == ("/think",)
    for system in (True, False):
        off = rendered(source, False, system)
        assert off.endswith("<think></think>") and "/no_think" not in off
    msgs = [{"role": "system", "content": "Be brief."}]
    assert thinking.switch_messages(source, msgs, "low")[0]["content"] == "Be brief. /think"
    assert thinking.switch_messages(source, msgs, None) == msgs
    assert thinking.switch_messages(CORPUS["Qwen-Qwen3-0.6B.jinja"], msgs, False) == msgs


def test_effort_levels_as_each_template_offers_them() -> None:
    gpt_oss = CORPUS["openai-gpt-oss-120b.jinja"]
    for level in ("low", "medium", "high"):
        assert f"Reasoning: {level}\n" in rendered(gpt_oss, level)
    assert "Reasoning: medium\n" in rendered(gpt_oss, True)  # its default
    assert "Reasoning: low\n" in rendered(gpt_oss, False)  # the least it has: it always thinks
    hy3 = CORPUS["tencent-Hy3.jinja"]  # low, high and no_think only: medium is high
    assert thinking.template_vars("medium", hy3) == {"reasoning_effort": "high"}
    assert thinking.template_vars(True, hy3) == {"reasoning_effort": "high"}
    assert thinking.template_vars(False, hy3) == {"reasoning_effort": "no_think"}
    kimi = CORPUS["Kimi-K3.jinja"]  # low, high, max
    assert thinking.template_vars("medium", kimi) == {"thinking": True, "thinking_effort": "high"}
    assert thinking.template_vars("low", kimi) == {"thinking": True, "thinking_effort": "low"}
    assert thinking.template_vars(False, kimi) == {"thinking": False}
    assert "thinking_effort=low" in rendered(kimi, "low")
    cohere = CORPUS["Cohere2MoE.jinja"]
    assert thinking.template_vars(False, cohere) == {"reasoning_effort": "none"}
    assert thinking.template_vars(None, gpt_oss) == {}


def test_a_budget_reaches_a_template_that_takes_one() -> None:
    seed = CORPUS["ByteDance-Seed-OSS.jinja"]
    assert thinking.template_vars(True, seed, budget=512) == {"thinking_budget": 512}
    assert "thinking budget, which is 512" in rendered(seed, True, think_budget=512)
    assert "your thinking budget is 0" in rendered(seed, True, think_budget=0)
    assert thinking.template_vars(True, seed) == {}
    qwen = CORPUS["Qwen-Qwen3-0.6B.jinja"]  # no budget of its own: the runner keeps it
    assert thinking.template_vars(True, qwen, budget=512) == {"enable_thinking": True}
    # budget 0: no thought at all, as thinking off
    assert rendered(qwen, True, think_budget=0) == rendered(qwen, False)


def test_the_request_template_kwargs_win() -> None:
    qwen = CORPUS["Qwen-Qwen3-0.6B.jinja"]
    off = rendered(qwen, True, template_kwargs={"enable_thinking": False})
    assert off.endswith("<think>\n\n</think>\n\n")
    gpt_oss = CORPUS["openai-gpt-oss-120b.jinja"]
    assert "Reasoning: high\n" in rendered(gpt_oss, "low",
                                           template_kwargs={"reasoning_effort": "high"})
    with pytest.raises(ValueError, match="cannot set messages"):
        rendered(qwen, None, template_kwargs={"messages": []})


def test_go_templates_keep_ollamas_think() -> None:
    go = "{{ if .Think }}THINK{{ end }}{{ range .Messages }}{{ .Content }}{{ end }}"
    assert thinking.template_vars("high", go) == {"enable_thinking": True,
                                                  "reasoning_effort": "high"}
    assert rendered(go, True).startswith("THINK") and not rendered(go, False).startswith("T")


def test_an_unparsable_template_has_no_switch() -> None:
    assert thinking.switches("{% if enable_thinking %}") == ()
    assert thinking.template_vars(True, "{% if enable_thinking %}") == {}


def test_template_kwargs_reach_the_template_nested_and_unicode() -> None:
    source = "{{ custom.a[1] }}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert rendered(source, None, system=False,
                    template_kwargs={"custom": {"a": [1, "Zürich ✓"]}}) == "Zürich ✓Hi"


def test_a_hostile_template_is_read_in_one_pass() -> None:
    """A request may bring its own template: the statements are found without a pattern
    that backtracks (a million openers and no closer)."""
    import time

    hostile = "{%" * 1_000_000 + " reasoning_effort == 'low' "
    start = time.perf_counter()
    assert thinking.template_vars(False, hostile) == {}  # it does not parse: no switch
    assert thinking._words(hostile, "reasoning_effort") == frozenset({"low"})
    assert time.perf_counter() - start < 5
