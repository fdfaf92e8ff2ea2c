"""A model served by a remote engine, end to end: two daemons on loopback, the
second serving SmolLM2 behind an API key, the first holding a remote model that points at a
dead replica and then at the second. The three SDKs stream through the first; the key
reaches the upstream and appears nowhere on the first; a stopped upstream is a clear error."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.conftest import Daemon, make_home

KEY = "sk-upstream-7f3c9d2e1b"  # what the upstream daemon requires
QUESTION = [{"role": "user", "content": "Name three colours."}]


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again: nothing listens there


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory,
         smollm2_path: Path) -> Iterator[tuple[Daemon, Daemon]]:
    upstream = Daemon(make_home(tmp_path_factory.mktemp("upstream"), smollm2_path),
                      env={"LLMRUN_API_KEYS": KEY}).start()
    front_home = tmp_path_factory.mktemp("front")
    # the owner names the one key remote models may send, and where it is read from
    front = Daemon(front_home, env={"UPSTREAM_KEY": KEY,
                                    "LLMRUN_REMOTE_KEYS": "upstream=UPSTREAM_KEY"}).start()
    modelfile = front_home / "Modelfile"
    modelfile.write_text(f"FROM http://127.0.0.1:{dead_port()}/v1\n"
                         f"PARAMETER remote_replica {upstream.url}/v1\n"
                         "PARAMETER remote_model smollm2\n"
                         "PARAMETER remote_key upstream\n")
    # through the CLI, which writes the store itself (over HTTP the daemon refuses remote
    # models unless its owner set LLMRUN_REMOTE_CREATE=1)
    done = subprocess.run([sys.executable, "-m", "llmrun", "create", "big", "-f",
                           str(modelfile)], env=front.env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    yield upstream, front
    front.stop()
    upstream.stop()


def direct(upstream: Daemon, max_tokens: int = 24) -> str:
    r = httpx.post(upstream.url + "/v1/chat/completions", headers={"Authorization":
                   f"Bearer {KEY}"}, timeout=120, json={
        "model": "smollm2", "messages": QUESTION, "temperature": 0, "max_tokens": max_tokens})
    r.raise_for_status()
    return str(r.json()["choices"][0]["message"]["content"])


def test_three_sdks_stream_through_the_remote_model(pair: tuple[Daemon, Daemon]) -> None:
    upstream, front = pair
    expected = direct(upstream)
    oai = openai.OpenAI(base_url=front.url + "/v1", api_key="unused", max_retries=0)
    text, usage = "", None
    for chunk in oai.chat.completions.create(model="big", messages=QUESTION,  # type: ignore[arg-type]
                                             temperature=0, max_tokens=24, stream=True,
                                             stream_options={"include_usage": True}):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        usage = chunk.usage or usage
    assert text == expected
    assert usage is not None and usage.prompt_tokens > 0 and usage.completion_tokens > 0
    client = anthropic.Anthropic(base_url=front.url, api_key="unused", max_retries=0)
    with client.messages.stream(model="big", messages=QUESTION, max_tokens=24,  # type: ignore[arg-type]
                                extra_body={"temperature": 0}) as stream:
        assert "".join(stream.text_stream) == expected
    parts = list(ollama.Client(host=front.url).chat(
        model="big", messages=QUESTION, stream=True,
        options={"temperature": 0, "num_predict": 24}))
    assert "".join(p.message.content or "" for p in parts) == expected
    assert parts[-1].done and (parts[-1].eval_count or 0) > 0


def test_tool_calls_and_formats_pass_through(pair: tuple[Daemon, Daemon]) -> None:
    _, front = pair
    oai = openai.OpenAI(base_url=front.url + "/v1", api_key="unused", max_retries=0)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"]}}}]
    r = oai.chat.completions.create(model="big", tools=tools, tool_choice="required",  # type: ignore[arg-type]
                                    messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                    temperature=0, max_tokens=40)
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"
    assert len(json.loads(call.function.arguments)["city"]) <= 12
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 10}},
              "required": ["colour"], "additionalProperties": False}
    r = oai.chat.completions.create(  # type: ignore[call-overload]
        model="big", messages=QUESTION, temperature=0, max_tokens=60,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "c", "schema": schema, "strict": True}})
    assert list(json.loads(r.choices[0].message.content or "")) == ["colour"]


def test_replicas_in_ps_and_the_key_nowhere(pair: tuple[Daemon, Daemon]) -> None:
    upstream, front = pair
    direct(upstream, 4)
    httpx.post(front.url + "/api/chat", timeout=120, json={
        "model": "big", "messages": QUESTION, "stream": False, "options": {"num_predict": 4}})
    ps = httpx.get(front.url + "/api/ps").json()["models"]
    (entry,) = [m for m in ps if m["name"].startswith("big")]
    assert [r["state"] for r in entry["remote"]] == ["down", "up"]
    show = httpx.post(front.url + "/api/show", json={"model": "big"}).json()
    assert "remote_key upstream" in show["modelfile"]  # the key's name, not its value
    cli = subprocess.run([sys.executable, "-m", "llmrun", "show", "big", "--modelfile"],
                         env=front.env, capture_output=True, text=True, timeout=60)
    listed = subprocess.run([sys.executable, "-m", "llmrun", "list"], env=front.env,
                            capture_output=True, text=True, timeout=60)
    assert "big" in listed.stdout and "remote" in listed.stdout
    ps_cli = subprocess.run([sys.executable, "-m", "llmrun", "ps"], env=front.env,
                            capture_output=True, text=True, timeout=60)
    assert ps_cli.returncode == 0, ps_cli.stderr
    assert f"{upstream.url}/v1" in ps_cli.stdout and "down" in ps_cli.stdout
    seen: list[Any] = [json.dumps(show), json.dumps(ps), cli.stdout, cli.stderr]
    seen += [p.read_bytes().decode("utf-8", "replace") for p in front.home.rglob("*")
             if p.is_file()]  # the store, the logs
    assert not any(KEY in s for s in seen)


def test_a_stopped_upstream_is_a_clear_error(tmp_path: Path, smollm2_path: Path,
                                             pair: tuple[Daemon, Daemon]) -> None:
    _, front = pair
    lone = Daemon(make_home(tmp_path / "lone", smollm2_path)).start()
    modelfile = front.home / "Modelfile.lone"
    modelfile.write_text(f"FROM {lone.url}/v1\nPARAMETER remote_model smollm2\n")
    done = subprocess.run([sys.executable, "-m", "llmrun", "create", "gone", "-f",
                           str(modelfile)], env=front.env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    lone.stop()
    r = httpx.post(front.url + "/v1/chat/completions", timeout=60, json={
        "model": "gone", "messages": QUESTION, "max_tokens": 8})
    assert r.status_code == 503
    assert "no replica of its remote server answers" in r.json()["error"]["message"]
    r = httpx.post(front.url + "/api/chat", timeout=60, json={
        "model": "gone", "messages": QUESTION, "stream": True})
    assert r.status_code == 503 and "cannot connect" in r.json()["error"]
