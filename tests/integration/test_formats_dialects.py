"""Each chat format's calls in the two dialects test_formats.py leaves out: Ollama's
/api/chat and OpenAI's Responses, whole and streamed. Same models (a copy of SmolLM2 given
the family's real template) and the same forced output (llama-server's `grammar`, which
both take as an llmrun extra): the call comes back as the dialect's own call, and no
family markup reaches the text."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.integration.test_formats import (
    CALL,
    DAEMON,
    SYSTEM,
    WEATHER,
    models,
    opens_thought,
    written,
)

__all__ = ["models"]  # the fixture, shared with test_formats.py



def thought_of(family: str) -> str:
    """The thought `written` puts before the call."""
    written_first = family in ("harmony", "muse-glimmer") or opens_thought(family)
    return "The user wants weather." if written_first else ""

# (test_formats.body: Solar's thought switched off, SmolLM2's first token could begin it)
THINK_OFF = {"solar-open"}


def clean(text: str) -> bool:
    return "<" not in text and "|" not in text and "｜" not in text and "[" not in text


def forced(model: str, family: str, **kw: Any) -> dict[str, Any]:
    return {"model": model, "grammar": "start: " + json.dumps(written(family)), **kw}


@pytest.mark.parametrize("family", DAEMON)
def test_ollama_chat_reads_the_family_whole_and_streamed(api: httpx.Client,
                                                         models: dict[str, str],
                                                         family: str) -> None:
    body = forced(models[family], family, tools=[WEATHER], stream=False,
                  messages=[{"role": "system", "content": SYSTEM},
                            {"role": "user", "content": "Weather in Zürich?"}],
                  options={"temperature": 0, "num_predict": 200},
                  **({"think": False} if family in THINK_OFF else {}))
    r = api.post("/api/chat", json=body, timeout=120)
    assert r.status_code == 200, r.text
    message = r.json()["message"]
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert call["function"]["arguments"] == CALL.arguments
    assert clean(message.get("content") or ""), message
    assert (message.get("thinking") or "").strip() == thought_of(family)

    calls, text, thought = [], "", ""
    with api.stream("POST", "/api/chat", json={**body, "stream": True}, timeout=120) as s:
        for line in s.iter_lines():
            if line:
                m = json.loads(line).get("message") or {}
                calls += m.get("tool_calls") or []
                text += m.get("content") or ""
                thought += m.get("thinking") or ""
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
        [("get_weather", CALL.arguments)]
    assert text == (message.get("content") or "") and thought.strip() == thought_of(family)


@pytest.mark.parametrize("family", DAEMON)
def test_responses_reads_the_family_whole_and_streamed(api: httpx.Client,
                                                       models: dict[str, str],
                                                       family: str) -> None:
    tool = {"type": "function", **WEATHER["function"]}
    body = forced(models[family], family, tools=[tool], instructions=SYSTEM,
                  input="Weather in Zürich?",
                  temperature=0, max_output_tokens=200, store=False,
                  **({"reasoning": {"effort": "none"}} if family in THINK_OFF else {}))
    r = api.post("/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    output = r.json()["output"]
    calls = [o for o in output if o["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == \
        [("get_weather", CALL.arguments)]
    texts = [p["text"] for o in output if o["type"] == "message" for p in o["content"]]
    assert all(clean(t) for t in texts), output
    reasoning = [o for o in output if o["type"] == "reasoning"]
    if thought_of(family):
        assert json.dumps(reasoning).count(thought_of(family)) == 1, reasoning

    done: list[dict[str, Any]] = []
    with api.stream("POST", "/v1/responses", json={**body, "stream": True}, timeout=120) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if event.get("type") == "response.output_item.done":
                    done.append(event["item"])
    streamed = [(i["name"], json.loads(i["arguments"])) for i in done
                if i["type"] == "function_call"]
    assert streamed == [("get_weather", CALL.arguments)]
    assert [i["type"] for i in done] == [o["type"] for o in output]
