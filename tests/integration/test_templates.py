"""llmrun.chat.templates: chat templates rendered in Jinja's sandbox, within bounds."""

from __future__ import annotations

import httpx
import pytest

from llmrun.chat import templatelimits
from llmrun.chat.templatelimits import MAX_TEMPLATE_SIZE
from llmrun.chat.templates import (
    FALLBACK_TEMPLATE,
    TemplateError,
    check,
    render,
    with_system,
)

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
    """A list may grow (llama.cpp's renderer lets Kimi K2's template append), but only the
    template's copy of it; dicts stay immutable."""
    msgs = [{"role": "user", "content": "x"}]
    assert render("{{ messages.append({'role': 'user', 'content': 'y'}) }}"
                  "{{ messages | length }}", msgs) == "None2"
    with pytest.raises(TemplateError, match="unsafe"):
        render("{{ messages[0].update({'content': 'y'}) }}", msgs)
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


# -- bounded rendering ---------------------------------------------------------------------------

LIMIT_CASES = {
    "nested loops": ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                     "{% endfor %}", "exceeds its limit of 20000 steps"),
    "nested loops over the messages": ("{% for a in messages %}{% for b in messages %}"
                                       "{% for c in messages %}{% endfor %}{% endfor %}"
                                       "{% endfor %}", "exceeds its limit of 20000 steps"),
    "filtered loop": ("{% for i in range(100000) %}{% for j in range(100000) if j < 0 %}"
                      "{% endfor %}{% endfor %}", "exceeds its limit of 20000 steps"),
    "recursive loop": ("{% for x in [[1, 2]] recursive %}{{ loop([x, x]) }}{% endfor %}",
                       "nests macro calls deeper than its limit of 50"),
    "endless macro recursion": ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
                                "nests macro calls deeper than its limit of 50"),
    "exponential macro": ("{% macro f(n) %}{% if n %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}"
                          "{% endmacro %}{{ f(40) }}", "exceeds its limit of 20000 steps"),
    "string times a billion": ("{{ 'x' * 10**9 }}", "builds a string over its limit"),
    "list times a billion": ("{{ [1] * 10**9 }}", "builds a list over its limit of 100000 items"),
    "huge power": ("{% set n = 100000000 %}{{ 2 ** n }}", "integer over its limit of 65536 bits"),
    "doubling with +": ("{% set ns = namespace(s='x') %}{% for i in range(60) %}"
                        "{% set ns.s = ns.s + ns.s %}{% endfor %}", "builds a string over"),
    "doubling with ~": ("{% set ns = namespace(s='x') %}{% for i in range(60) %}"
                        "{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "builds a string over"),
    "chained ~": ("{% set a = 'x' * 1000000 %}{% set b = a ~ a ~ a ~ a ~ a ~ a ~ a ~ a ~ a ~ a"
                  " ~ a %}", "builds a string over"),
    "one string printed many times": ("{% set s = 'x' * 1000000 %}{{ [s] * 20 }}",
                                      "builds a string over"),
    "macro output": ("{% macro m() %}{% for i in range(15000) %}" + "y" * 1000 +
                     "{% endfor %}{% endmacro %}{{ m() }}", "builds a string over"),
    "output": ("{% for i in range(6000) %}{{ 'x' * 2000 }}{% endfor %}",
               "output exceeds its limit of 10485760 characters"),
    "center filter": ("{{ 'x' | center(10**9) }}", "builds a string over"),
    "center method": ("{{ 'x'.center(10**9) }}", "builds a string over"),
    "format method": ("{{ '{:>1000000000}'.format('x') }}", "builds a string over"),
    "printf operator": ("{{ '%1000000000s' % 'x' }}", "builds a string over"),
    "format filter": ("{{ '%*s' | format(10**9, 'x') }}", "builds a string over"),
    "join separator": ("{{ range(100000) | join('x' * 10000000) }}", "builds a string over"),
    "replace": ("{% set s = 'x' * 100000 %}{{ s | replace('x', s) }}", "builds a string over"),
    "indent": ("{{ ('\n' * 1000) | indent(10**8) }}", "builds a string over"),
    "batch": ("{{ [1] | batch(10**9, 'x') | list }}", "builds a list over"),
    "sum of lists": ("{{ ([[1]] * 50000) | sum(start=[]) }}", "exceeds its limit of"),
    "tojson indent": ("{{ messages | tojson(indent=100000) }}", "indent over its limit of 16"),
}


@pytest.mark.parametrize(("source", "message"), LIMIT_CASES.values(), ids=LIMIT_CASES.keys())
def test_runaway_templates_stop_at_their_limit(source: str, message: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(templatelimits, "MAX_STEPS", 20_000)  # the real limit takes a second
    # the step limit decides, not the clock
    monkeypatch.setattr(templatelimits, "MAX_SECONDS", 3600.0)
    conversation = [{"role": "user", "content": str(i)} for i in range(100)]
    with pytest.raises(TemplateError) as exc:
        render(source, conversation)
    assert message in str(exc.value)


def test_time_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(templatelimits, "MAX_SECONDS", -1.0)  # already past: the first clock check
    with pytest.raises(TemplateError, match="exceeds its time limit"):
        render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
               "{% endfor %}", MESSAGES)


def test_the_limits_leave_real_templates_alone() -> None:
    conversation = [{"role": ("user", "assistant")[i % 2], "content": "word " * 200}
                    for i in range(4096)]  # LLMRUN_MAX_MESSAGES' default, a megabyte of text
    assert render(CHATML, conversation).count("<|im_start|>") == 4097
    macros = (  # what tool-calling templates do: macros, namespaces, filters, formatting
        "{% macro show(v) %}{% if v is mapping %}{% for k, x in v | dictsort %}{{ k }}="
        "{{ show(x) }};{% endfor %}{% else %}{{ v | string | trim }}{% endif %}{% endmacro %}"
        "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
        "{{ '%s:%d ' | format(m.role, loop.index) }}{{ '{}!'.format(m.content | upper) }}"
        "{% endfor %}{{ show(tools[0]) }}{{ tools | tojson(indent=2) | length > 0 }}{{ ns.n }}")
    out = render(macros, MESSAGES, tools=[{"name": "f", "parameters": {"a": {"b": 1}}}])
    assert out == "system:1 BE BRIEF.!user:2 HI!name=f;parameters=a=b=1;;;True2"


def test_lipsum_is_gone() -> None:
    with pytest.raises(TemplateError, match="'lipsum' is undefined"):
        render("{{ lipsum(10**9) }}", MESSAGES)


def test_compile_errors_become_template_errors() -> None:
    for source in ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}",  # RecursionError inside Jinja
                   "{% if x %}" * 3000 + "{% endif %}" * 3000):
        with pytest.raises(TemplateError, match="does not compile"):
            check(source)


def test_source_size_limit() -> None:
    source = "{{ messages }}" + " " * MAX_TEMPLATE_SIZE
    with pytest.raises(TemplateError, match=f"over the limit of {MAX_TEMPLATE_SIZE}"):
        check(source)
    with pytest.raises(TemplateError, match=f"over the limit of {MAX_TEMPLATE_SIZE}"):
        render(source, MESSAGES)


# -- through the daemon: a request's template ---------------------------------------------------

RUNAWAY_TEMPLATES = {
    "go": "{{ range 1000000000 }}{{ end }}{{ .Prompt }}",
    "jinja": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
             "{{ messages[0]['content'] }}",
}


@pytest.mark.parametrize("source", RUNAWAY_TEMPLATES.values(), ids=RUNAWAY_TEMPLATES.keys())
def test_a_runaway_request_template_is_a_400_and_the_model_serves_on(
        api: httpx.Client, source: str) -> None:
    options = {"num_predict": 2, "temperature": 0}
    r = api.post("/api/generate", json={"model": "smollm2", "prompt": "Hi", "template": source,
                                        "stream": False, "options": options})
    assert r.status_code == 400, r.text
    error = r.json()["error"]  # e.g. "template: line 1: exceeds its limit of 2000000 steps"
    assert "template" in error and "limit of" in error
    r = api.post("/api/generate", json={"model": "smollm2", "prompt": "Hi", "stream": False,
                                        "options": options})
    assert r.status_code == 200, r.text
    assert r.json()["done"] and r.json()["eval_count"] == 2
