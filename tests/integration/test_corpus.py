"""The corpus templates that llmrun used to refuse, through the real daemon: a copy of SmolLM2
given each one (tests/fakes/templates/), asked a tool conversation with a past call, its
result and a past thought, in the OpenAI dialect. Each renders (200, not 400 "chat template
failed"); tests/unit/chat/test_corpus.py checks what each renders, character for character."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import ollama
import pytest

from tests.conftest import Daemon

TEMPLATES = Path(__file__).parents[1] / "fakes" / "templates"
REFUSED = {  # why each one failed to render
    "kimi": "Kimi-K2-Instruct.jinja",  # list.append
    "lfm": "LFM2.5-8B-A1B.jinja",  # {% generation %}
    "laguna": "poolside-Laguna-XS.2.jinja",  # {% generation %}
    "r1": "llama-cpp-deepseek-r1.jinja",  # map(...) | tojson
    "firefunction": "fireworks-ai-llama-3-firefunction-v2.jinja",  # `functions`, `datetime`
    "functionary": "meetkai-functionary-medium-v3.2.jinja",  # arguments as JSON text
    "gemma2": "google-gemma-2-2b-it.jinja",  # no system role
}
WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
MESSAGES: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Zürich?"},
    {"role": "assistant", "content": "", "reasoning_content": "The user wants weather.",
     "tool_calls": [{"id": "call_1", "type": "function", "function": {
         "name": "get_weather", "arguments": '{"city": "Zürich"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "assistant", "content": "21 °C."},
    {"role": "user", "content": "Thanks!"},
]


@pytest.mark.parametrize("key", list(REFUSED))
def test_a_template_once_refused_renders(daemon: Daemon, api: httpx.Client, key: str) -> None:
    c = ollama.Client(host=daemon.url)
    name = f"smollm2-corpus-{key}"
    c.create(model=name, from_="smollm2", template=(TEMPLATES / REFUSED[key]).read_text())
    try:
        r = api.post("/v1/chat/completions", timeout=120, json={
            "model": name, "messages": MESSAGES, "tools": [WEATHER], "max_tokens": 2,
            "temperature": 0})
    finally:
        c.delete(name)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > 20
