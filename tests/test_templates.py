"""llmrun.engine.templates: chat templates rendered in Jinja's sandbox."""

from __future__ import annotations

import pytest

from llmrun.engine.templates import FALLBACK_TEMPLATE, TemplateError, render, with_system

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
]


def test_chatml_with_generation_prompt() -> None:
    assert render(CHATML, MESSAGES) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_chatml_without_generation_prompt() -> None:
    assert render(CHATML, MESSAGES, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )


def test_bos_eos_and_extra_variables() -> None:
    source = "{{ bos_token }}{{ messages[0]['content'] }}{{ eos_token }}|{{ tools | length }}"
    out = render(source, [{"role": "user", "content": "x"}], bos_token="<s>",
                 eos_token="</s>", tools=[1, 2])
    assert out == "<s>x</s>|2"


def test_block_whitespace_is_trimmed() -> None:
    source = (
        "{% for m in messages %}\n  {% if m.role == 'user' %}\n[{{ m.content }}]\n"
        "{% endif %}\n{% endfor %}"
    )
    assert render(source, [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]) == (
        "[a]\n[b]\n"
    )


def test_loop_controls_are_available() -> None:
    source = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{{ m.content }}{% endfor %}"
    )
    assert render(source, MESSAGES) == "Be brief."


def test_fallback_template() -> None:
    msgs = [*MESSAGES, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "?"}]
    assert render(FALLBACK_TEMPLATE, msgs) == (
        "Be brief.\n\nUser: Hi\nAssistant: Hello.\nUser: ?\nAssistant:"
    )


def test_raise_exception_becomes_template_error() -> None:
    source = (
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('first must be user') }}{% endif %}"
    )
    with pytest.raises(TemplateError) as exc:
        render(source, MESSAGES)
    assert str(exc.value) == "first must be user"


@pytest.mark.parametrize(
    ("source", "attribute", "owner"),
    [
        ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "__class__", "str"),
        ("{{ cycler.__init__.__globals__ }}", "__init__", "type"),
        ("{{ messages.__class__.__base__.__subclasses__() }}", "__class__", "list"),
        ("{{ raise_exception.__globals__['__builtins__'] }}", "__globals__", "function"),
    ],
)
def test_sandbox_escapes_are_refused(source: str, attribute: str, owner: str) -> None:
    with pytest.raises(TemplateError) as exc:
        render(source, MESSAGES)
    assert str(exc.value) == (
        "chat template tried something unsafe: "
        f"access to attribute '{attribute}' of '{owner}' object is unsafe."
    )


def test_templates_cannot_mutate_messages() -> None:
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(TemplateError, match="unsafe"):
        render("{{ messages.append({'role': 'user', 'content': 'y'}) }}", msgs)
    assert msgs == [{"role": "user", "content": "x"}]


def test_syntax_error() -> None:
    with pytest.raises(TemplateError) as exc:
        render("{% for m in messages %}{{ m.content }}", MESSAGES)
    assert str(exc.value).startswith("chat template does not compile: ")


def test_runtime_error_becomes_template_error() -> None:
    with pytest.raises(TemplateError) as exc:
        render("{{ 1 / 0 }}", MESSAGES)
    assert str(exc.value) == "chat template failed: ZeroDivisionError: division by zero"


def test_tojson_keeps_non_ascii() -> None:
    msgs = [{"role": "user", "content": "héllo 世界 😀"}]
    assert render("{{ messages[0] | tojson }}", msgs) == (
        '{"role": "user", "content": "héllo 世界 😀"}'
    )
    assert render("{{ messages[0]['content'] | tojson(indent=2) }}", msgs) == '"héllo 世界 😀"'


def test_with_system_prepends_when_there_is_none() -> None:
    msgs = [{"role": "user", "content": "Hi"}]
    assert with_system(msgs, "Be kind.") == [
        {"role": "system", "content": "Be kind."},
        {"role": "user", "content": "Hi"},
    ]
    assert msgs == [{"role": "user", "content": "Hi"}]  # the input is not changed


def test_with_system_keeps_an_existing_system_message() -> None:
    msgs = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "Mine."}]
    assert with_system(msgs, "Default.") == msgs


@pytest.mark.parametrize("system", [None, ""])
def test_with_system_without_a_default(system: str | None) -> None:
    msgs = [{"role": "user", "content": "Hi"}]
    assert with_system(msgs, system) == [{"role": "user", "content": "Hi"}]
