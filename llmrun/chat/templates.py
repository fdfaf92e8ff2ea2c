"""Chat templates: the Jinja template a GGUF carries (or a Modelfile TEMPLATE, which may also be
Go text/template as Ollama's are: see gotemplate/), checked, compiled and rendered safely.

Templates come from model files and from requests, i.e. from strangers: they are rendered in
Jinja's immutable sandbox (no attribute access to Python internals), with what Hugging Face's
renderer adds to it and the one thing llama.cpp's renderer allows that real templates use
(jinjaenv.py). The variables are a copy of what the caller passed (made here), so a list a
template appends to is never the caller's. tests/unit/chat/test_corpus.py holds the renderer
to Hugging Face's, template by template. They run in the runner's engine thread, which every
request on the model shares, so a render is also bounded: steps, output, time, the size of
every value it builds and the depth of its macro calls (templatelimits.py: one place for
both languages; templatebudget.py counts them for Jinja).
"""

from __future__ import annotations

from collections.abc import Generator
from functools import lru_cache
from typing import Any, cast

import jinja2
from jinja2 import meta

from llmrun.chat import gotemplate, templatelimits
from llmrun.chat.jinjaenv import ENV
from llmrun.chat.templatebudget import BUDGET, Budget
from llmrun.chat.templatelimits import TemplateError, check_size  # re-exported

# For models that carry no template of their own: a plain transcript that any base model
# continues sensibly.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% else %}Assistant: {{ m['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


def _plain(value: Any) -> Any:
    """What a template sees of a variable: its dicts and lists copied (Hugging Face gives
    templates such a copy too), anything else as it is (the variables are JSON-like: a tuple
    holds no list to change). Iterative: a request's JSON may nest hundreds deep."""
    def fresh(v: Any) -> Any:
        return {} if type(v) is dict else [] if type(v) is list else v

    top = fresh(value)
    stack = [(value, top)] if top is not value else []
    while stack:
        src, dst = stack.pop()
        for key, item in (src.items() if type(src) is dict else enumerate(src)):
            copy = fresh(item)
            if type(dst) is dict:
                dst[key] = copy
            else:
                dst.append(copy)
            if copy is not item:
                stack.append((item, copy))
    return top


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    # Compiling folds constant expressions by calling filters and operators: budgeted too.
    token = BUDGET.set(Budget())
    try:
        return ENV.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"chat template does not compile: {exc}") from None
    except Exception as exc:  # e.g. RecursionError on absurd nesting: a request error
        raise TemplateError(f"chat template does not compile: {type(exc).__name__}: "
                            f"{exc}") from None
    finally:
        BUDGET.reset(token)


def _generate(template: jinja2.Template, variables: dict[str, Any]) -> str:
    """Render piece by piece, stopping at the output limit or when the budget runs out."""
    budget = Budget()
    token = BUDGET.set(budget)
    # (a generator: jinja2 annotates it as an Iterator, which has no close())
    pieces = cast("Generator[str, None, None]", template.generate(**variables))
    try:
        out: list[str] = []
        size = 0
        for piece in pieces:
            size += len(piece)
            if size > templatelimits.MAX_OUTPUT:
                raise TemplateError("chat template output exceeds its limit of "
                                    f"{templatelimits.MAX_OUTPUT} characters")
            out.append(piece)
            budget.tick()
        return "".join(out)
    finally:
        pieces.close()
        BUDGET.reset(token)


def check(source: str) -> None:
    """Raise TemplateError if `source` (Jinja or Go) is too big or does not compile."""
    check_size(source)
    if gotemplate.looks_like_go(source):
        gotemplate.check(source)
    else:
        _compile(source)


@lru_cache(maxsize=16)
def free_names(source: str) -> frozenset[str]:
    """The variables a Jinja template reads without setting them itself (none for a Go
    template, or one that does not compile): what a caller may have to supply."""
    if gotemplate.looks_like_go(source):
        return frozenset()
    check_size(source)
    token = BUDGET.set(Budget())
    try:
        return frozenset(meta.find_undeclared_variables(ENV.parse(source)))
    except Exception:  # the render reports a broken template; here it just reads nothing
        return frozenset()
    finally:
        BUDGET.reset(token)


def render(source: str, messages: list[dict[str, Any]], *, bos_token: str = "",
           eos_token: str = "", add_generation_prompt: bool = True, **extra: Any) -> str:
    """Render a chat template: Jinja (Hugging Face, GGUF files), or Go text/template as in
    Ollama Modelfiles, where the Jinja variables `tools`, `enable_thinking` and
    `reasoning_effort` become Ollama's `.Tools` and `.Think`."""
    check_size(source)
    if gotemplate.looks_like_go(source):
        think = extra.get("reasoning_effort") or extra.get("enable_thinking")
        return gotemplate.render(source, messages, tools=extra.get("tools"),
                                 add_generation_prompt=add_generation_prompt, think=think)
    template = _compile(source)
    try:
        return _generate(template, {
            "messages": _plain(messages), "bos_token": bos_token, "eos_token": eos_token,
            "add_generation_prompt": add_generation_prompt, **_plain(extra)})
    except TemplateError:
        raise
    except jinja2.exceptions.SecurityError as exc:
        raise TemplateError(f"chat template tried something unsafe: {exc}") from None
    except Exception as exc:  # a broken template must become a request error, not a crash
        raise TemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None


def with_system(messages: list[dict[str, Any]], system: str | None) -> list[dict[str, Any]]:
    """Prepend the model's default system prompt unless the conversation has its own."""
    if system and not any(m.get("role") == "system" for m in messages):
        return [{"role": "system", "content": system}, *messages]
    return messages
