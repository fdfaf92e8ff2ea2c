"""Thinking models: which templates can think, and splitting a streamed answer into its thought
and its text however the pieces fall (no model needed)."""

from __future__ import annotations

import pytest

from llmrun.chat import templates, thinking
from llmrun.chat.thinking import ThinkStream

QWEN3_LIKE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{%- endif %}{%- endif %}")
OPENS_THOUGHT = QWEN3_LIKE.replace("{%- endif %}{%- endif %}",
                                   "{%- else %}<think>\n{%- endif %}{%- endif %}")


def split(stream: ThinkStream, pieces: list[str]) -> tuple[str, str]:
    thought, text = [], []
    for p in pieces:
        a, b = stream.push(p)
        thought.append(a)
        text.append(b)
    a, b = stream.finish()
    return "".join(thought) + a, "".join(text) + b


def every_split(output: str) -> list[list[str]]:
    """The output cut into pieces at every pair of positions (markers split any way)."""
    cuts = [[output]]
    for i in range(1, len(output)):
        cuts.append([output[:i], output[i:]])
        for j in range(i + 1, len(output), 3):
            cuts.append([output[:i], output[i:j], output[j:]])
    return cuts


def test_markers_come_from_the_template() -> None:
    assert thinking.markers(QWEN3_LIKE) == ("<think>", "</think>")
    assert thinking.markers("{{ '[THINK]' }}{{ m.reasoning_content }}") == ("[THINK]", "[/THINK]")
    assert thinking.markers("{% for m in messages %}{{ m.content }}{% endfor %}") is None
    assert thinking.markers(None) is None
    assert thinking.markers(templates.FALLBACK_TEMPLATE) is None


def test_template_vars() -> None:
    assert thinking.template_vars(None) == {}
    assert thinking.template_vars(False) == {"enable_thinking": False}
    assert thinking.template_vars("high") == {"enable_thinking": True, "reasoning_effort": "high"}


def test_a_prompt_that_opens_the_thought() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    pair = ("<think>", "</think>")
    on = templates.render(OPENS_THOUGHT, msgs, enable_thinking=True)
    off = templates.render(OPENS_THOUGHT, msgs, enable_thinking=False)
    assert thinking.opens(on, pair) and not thinking.opens(off, pair)
    assert not thinking.opens(templates.render(QWEN3_LIKE, msgs), pair)


@pytest.mark.parametrize("output,want", [
    ("<think>Hm, a greeting.</think>\n\nHello!", ("Hm, a greeting.", "Hello!")),
    ("\n<think>x</think>y", ("x", "y")),
    ("Hello <think>not a thought</think>", ("", "Hello <think>not a thought</think>")),
    ("<think>cut short", ("cut short", "")),
    ("<thi", ("", "<thi")),
    ("plain", ("", "plain")),
    ("", ("", "")),
])
def test_split_however_the_pieces_fall(output: str, want: tuple[str, str]) -> None:
    for pieces in every_split(output):
        assert split(ThinkStream(("<think>", "</think>")), pieces) == want, pieces


def test_output_that_starts_inside_the_thought() -> None:
    output = "The user greets me.</think>\n\nHi there."
    for pieces in every_split(output):
        got = split(ThinkStream(("<think>", "</think>"), inside=True), pieces)
        assert got == ("The user greets me.", "Hi there."), pieces


def test_thoughts_are_dropped_when_thinking_was_switched_off() -> None:
    stream = ThinkStream(("<think>", "</think>"), keep=False)
    assert split(stream, ["<think>private</think>", "Answer"]) == ("", "Answer")


def test_text_is_released_as_soon_as_it_cannot_be_a_marker() -> None:
    stream = ThinkStream(("<think>", "</think>"), inside=True)
    assert stream.push("one two") == ("one two", "")
    assert stream.push(" three </th") == (" three ", "")  # "</th" may begin the close
    assert stream.push("ink>Done") == ("", "Done")


def test_filter_events_puts_thoughts_in_their_own_chunks() -> None:
    streams = {"r1": ThinkStream(("<think>", "</think>"), inside=True)}
    lp = {"token": "c", "logprob": -1.0, "bytes": [99], "top": []}
    events = [("r1", "chunk", {"text": "a"}), ("r2", "chunk", {"text": "other"}),
              ("r1", "chunk", {"text": "b</think>c", "logprobs": [lp]}),
              ("r1", "done", {"finish_reason": "stop"})]
    out = thinking.filter_events(streams, events)
    assert out == [("r1", "chunk", {"text": "", "thinking": "a"}),
                   ("r2", "chunk", {"text": "other"}),
                   ("r1", "chunk", {"text": "", "thinking": "b"}),
                   ("r1", "chunk", {"text": "c", "logprobs": [lp]}),
                   ("r1", "done", {"finish_reason": "stop"})]
    assert streams == {}
