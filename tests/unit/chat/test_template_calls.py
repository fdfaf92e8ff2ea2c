"""Past calls and results in the history, rendered by a template that writes them but not
the tools' definitions (DeepSeek V3.1's: its calls in its own markers, the tools described in
the system prompt), and flattened to text by one that writes neither."""

from __future__ import annotations

from pathlib import Path

from llmrun.chat import templates, tools
from llmrun.request import ChatRequest, Message, Tool, ToolCall

TEMPLATES = Path(__file__).parents[2] / "fakes" / "templates"
DEEPSEEK = (TEMPLATES / "deepseek-ai-DeepSeek-V3.1.jinja").read_text()
PLAIN = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
WEATHER = Tool(name="get_weather", parameters={"type": "object", "properties": {
    "city": {"type": "string"}}})


def request() -> ChatRequest:
    return ChatRequest(model="m", tools=[WEATHER], messages=[
        Message(role="user", content="Weather in Zürich?"),
        Message(role="assistant", tool_calls=[
            ToolCall(id="call_1", name="get_weather", arguments={"city": "Zürich"})]),
        Message(role="tool", content="sunny", tool_call_id="call_1", name="get_weather")])


def rendered(source: str) -> str:
    req = request()
    plan = tools.plan(req, source)
    messages, extra = tools.chat_inputs(req.messages, None, source, plan)
    return templates.render(source, messages, **extra)


def test_deepseek_renders_its_past_calls_and_results_itself() -> None:
    info = tools.inspect_template(DEEPSEEK)
    assert (info.native, info.native_calls, info.native_results) == (False, True, True)
    text = rendered(DEEPSEEK)
    assert "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>" in text
    assert '{"city": "Zürich"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>' in text
    assert "<｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜>" in text
    # the tools are described in the system prompt (no template variable holds them)
    assert text.index("get_weather") < text.index("<｜User｜>")
    assert "<tool_call>\n{\"name\": \"get_weather\"" not in text  # no call as Hermes text


def test_a_template_writing_no_calls_gets_them_as_text() -> None:
    info = tools.inspect_template(PLAIN)
    assert (info.native, info.native_calls, info.native_results) == (False, False, False)
    text = rendered(PLAIN)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}' in text
    assert "<tool_response>\nsunny\n</tool_response>" in text


def test_a_template_writing_calls_only_without_content_gets_them_as_text() -> None:
    """DeepSeek R1 Distill's template writes a call only when the message's content is none,
    which it never is here: the call stays in the content, as Hermes text."""
    source = (TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Llama-8B.jinja").read_text()
    info = tools.inspect_template(source)
    assert (info.native_calls, info.native_results) == (False, False)
    text = rendered(source)
    assert '"arguments": {"city": "Zürich"}' in text and "sunny" in text
