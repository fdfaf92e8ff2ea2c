"""Chat templates: the Jinja template a GGUF carries (or a Modelfile TEMPLATE, which may also be
Go text/template as Ollama's are: see gotemplate.py), rendered safely.

Templates come from model files, i.e. from strangers: they are rendered in Jinja's immutable
sandbox (no attribute access to Python internals, no mutation of the objects passed in), with
only the helpers Hugging Face's renderer provides (`raise_exception`, `strftime_now`, a
`tojson` that keeps non-ASCII).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

# For models that carry no template of their own: a plain transcript that any base model
# continues sensibly.
FALLBACK_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}User: {{ m['content'] }}\n"
    "{% else %}Assistant: {{ m['content'] }}\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}"
)


class TemplateError(ValueError):
    pass


def _raise(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, **_: Any) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise TemplateError(f"chat template does not compile: {exc}") from None


def check(source: str) -> None:
    """Raise TemplateError if `source` (Jinja or Go) does not compile."""
    from llmrun.engine import gotemplate

    if gotemplate.looks_like_go(source):
        gotemplate.check(source)
    else:
        _compile(source)


def render(source: str, messages: list[dict[str, Any]], *, bos_token: str = "",
           eos_token: str = "", add_generation_prompt: bool = True, **extra: Any) -> str:
    """Render a chat template: Jinja (Hugging Face, GGUF files), or Go text/template as in
    Ollama Modelfiles, where the Jinja variables `tools`, `enable_thinking` and
    `reasoning_effort` become Ollama's `.Tools` and `.Think`."""
    from llmrun.engine import gotemplate  # it imports TemplateError from here

    if gotemplate.looks_like_go(source):
        think = extra.get("reasoning_effort") or extra.get("enable_thinking")
        return gotemplate.render(source, messages, tools=extra.get("tools"),
                                 add_generation_prompt=add_generation_prompt, think=think)
    template = _compile(source)
    try:
        return template.render(
            messages=messages,
            bos_token=bos_token,
            eos_token=eos_token,
            add_generation_prompt=add_generation_prompt,
            **extra,
        )
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
