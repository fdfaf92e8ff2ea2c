"""OpenAI's Responses API against the real daemon and SmolLM2, through the `openai` SDK's
`client.responses`; the request translation without a model; `/api/version`."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from llmrun.api.openai.errors import ApiError
from llmrun.api.openai.responses import ResponsesBody, to_request
from llmrun.server.responsestore import NotStored, ResponseStore, new_id
from tests.conftest import Daemon

MODEL = "smollm2"
GREEDY: dict[str, Any] = {"temperature": 0}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                    "maxLength": 30}},
                          "required": ["city"]}}


@pytest.fixture(scope="module")
def client(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="any", max_retries=0,
                       timeout=120) as c:
        yield c


# -- through the SDK ------------------------------------------------------------------------


def test_text_whole_and_streamed_agree(client: openai.OpenAI) -> None:
    whole = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=12,
                                    instructions="You are terse.", **GREEDY)
    assert whole.object == "response" and whole.id.startswith("resp_")
    assert whole.status in ("completed", "incomplete")
    assert whole.output_text and whole.output[0].type == "message"
    assert whole.usage is not None and whole.usage.input_tokens > 0
    assert 0 < whole.usage.output_tokens <= 12
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens

    events = list(client.responses.create(model=MODEL, input="Say hello.",
                                          max_output_tokens=12, instructions="You are terse.",
                                          stream=True, **GREEDY))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                          "response.output_item.done", f"response.{whole.status}"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text
    final = events[-1].response  # type: ignore[union-attr]
    assert final.output_text == text and final.usage.output_tokens == whole.usage.output_tokens


def test_function_call_round_trip(client: openai.OpenAI) -> None:
    first = client.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
        **GREEDY)
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1
    call = calls[0]
    assert call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    # the call and its output go back as items: the model reads them and answers in text
    second = client.responses.create(
        model=MODEL, tools=[WEATHER], max_output_tokens=30, **GREEDY,  # type: ignore[list-item]
        input=[{"role": "user", "content": "What is the weather in Paris?"},
               {"type": "function_call", "call_id": call.call_id, "name": call.name,
                "arguments": call.arguments},
               {"type": "function_call_output", "call_id": call.call_id,
                "output": "Sunny, 24 degrees"}],
        tool_choice="none")
    assert second.output_text and second.output[0].type == "message"
    alone = client.responses.create(model=MODEL, tools=[WEATHER], max_output_tokens=1,  # type: ignore[list-item]
                                    input="What is the weather in Paris?", tool_choice="none")
    # the call and its result were read (tool_choice "none" shows the model no tools)
    assert second.usage and alone.usage
    assert second.usage.input_tokens > alone.usage.input_tokens + 10

    streamed = list(client.responses.create(
        model=MODEL, input="What is the weather in Paris?", tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required", max_output_tokens=60, stream=True, **GREEDY))
    kinds = [e.type for e in streamed]
    assert "response.function_call_arguments.delta" in kinds
    done = [e for e in streamed if e.type == "response.function_call_arguments.done"]
    assert done and json.loads(done[0].arguments)  # type: ignore[union-attr]
    final = streamed[-1].response  # type: ignore[union-attr]
    assert [o.type for o in final.output] == ["function_call"]


def test_json_schema_format_is_enforced(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.responses.create(
        model=MODEL, input="Invent a person.", max_output_tokens=80, **GREEDY,
        text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                         "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_previous_response_id_continues_and_store_is_kept(client: openai.OpenAI,
                                                          daemon: Daemon) -> None:
    first = client.responses.create(model=MODEL, input="My name is Ada. Say hi.",
                                    max_output_tokens=10, **GREEDY)
    second = client.responses.create(model=MODEL, input="What is my name?",
                                     previous_response_id=first.id, max_output_tokens=10,
                                     **GREEDY)
    # the whole first turn (its input and output) was read again before the new question
    assert second.usage and first.usage
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert second.previous_response_id == first.id
    # continued from the slot's cells: the first turn is a cached prefix
    assert second.usage.input_tokens_details.cached_tokens > 0
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    items = client.responses.input_items.list(first.id)
    assert [i.type for i in items.data] == ["message"]
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as exc:  # its chain is broken now
        client.responses.create(model=MODEL, input="Again?", previous_response_id=second.id,
                                max_output_tokens=5)
    assert exc.value.body["code"] is None or isinstance(exc.value.body, dict)  # type: ignore[index]
    # store false keeps nothing
    unsaved = client.responses.create(model=MODEL, input="Hi", max_output_tokens=3, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unsaved.id)
    stored = list((daemon.home / "responses").glob("resp_*.json"))
    assert stored and all(p.stat().st_mode & 0o077 == 0 for p in stored)


def test_errors_in_openai_shape(client: openai.OpenAI, daemon: Daemon) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client.responses.create(model="no-such-model", input="hi")
    assert exc.value.body["code"] == "model_not_found"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:
        client.responses.create(model=MODEL, input=[{"type": "mystery"}])  # type: ignore[list-item]
    assert "mystery" in bad.value.body["message"]  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input=[{"role": "user", "content": [
            {"type": "input_image", "image_url": "data:image/png;base64,AAAA"}]}])
    # an unknown /v1 route and a bad response id answer in OpenAI's shape too
    r = httpx.post(daemon.url + "/v1/responses-and-more", json={})
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(daemon.url + "/v1/responses/resp_nothing")
    assert r.status_code == 404 and "'resp_nothing'" in r.json()["error"]["message"]
    r = httpx.get(daemon.url + "/v1/responses/../../etc/passwd")
    assert r.status_code == 404 and "error" in r.json()


def test_input_tokens_counts_what_a_request_reads(client: openai.OpenAI,
                                                  daemon: Daemon) -> None:
    body = {"model": MODEL, "input": "Count these words please.", "instructions": "Be brief.",
            "tools": [WEATHER]}
    counted = httpx.post(daemon.url + "/v1/responses/input_tokens", json=body, timeout=60)
    assert counted.status_code == 200
    n = counted.json()["input_tokens"]
    read = client.responses.create(**body, max_output_tokens=1, store=False)  # type: ignore[arg-type]
    assert read.usage and read.usage.input_tokens == n


def test_codex_shaped_request(client: openai.OpenAI, daemon: Daemon) -> None:
    # what Codex sends: developer messages, input_text parts, a namespace of functions, a
    # hosted tool, reasoning and include fields, client metadata
    body = {
        "model": MODEL, "stream": False, "store": False,
        "input": [
            {"type": "message", "role": "developer",
             "content": [{"type": "input_text", "text": "You are a coding agent."}]},
            {"type": "message", "role": "user",
             "content": [{"type": "input_text", "text": "List the files."}]}],
        "tools": [
            {"type": "function", "name": "shell", "description": "Run a command",
             "strict": False, "parameters": {"type": "object", "properties": {
                 "command": {"type": "array", "items": {"type": "string"}}},
                 "required": ["command"]}},
            {"type": "namespace", "name": "multi_agent_v1", "tools": [
                {"type": "function", "name": "spawn", "parameters": {
                    "type": "object", "properties": {"task": {"type": "string"}}}}]},
            {"type": "custom", "name": "apply_patch", "description": "Edit files"},
            {"type": "web_search"}],
        "tool_choice": {"type": "function", "name": "spawn", "namespace": "multi_agent_v1"},
        "parallel_tool_calls": True, "reasoning": {"summary": "auto"},
        "include": ["reasoning.encrypted_content"], "prompt_cache_key": "abc",
        "client_metadata": {"x": "y"}, "max_output_tokens": 40, "temperature": 0}
    r = httpx.post(daemon.url + "/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    (call,) = [o for o in r.json()["output"] if o["type"] == "function_call"]
    assert call["name"] == "spawn" and call["namespace"] == "multi_agent_v1"
    body["tool_choice"] = {"type": "custom", "name": "apply_patch"}
    r = httpx.post(daemon.url + "/v1/responses", json=body, timeout=120)
    (call,) = [o for o in r.json()["output"] if o["type"] == "custom_tool_call"]
    assert call["name"] == "apply_patch" and isinstance(call["input"], str)


def test_a_custom_tool_with_a_regex_grammar_is_called_within_it(client: openai.OpenAI
                                                                 ) -> None:
    pattern = "^[0-9]{3}-[a-z]{2,4}$"
    tool = {"type": "custom", "name": "ticket", "description": "File a ticket",
            "format": {"type": "grammar", "syntax": "regex", "definition": pattern}}
    r = client.responses.create(model=MODEL, input="File ticket 123 for the web team.",
                                tools=[tool], tool_choice={"type": "custom", "name": "ticket"},  # type: ignore[list-item,typeddict-item]
                                max_output_tokens=40, store=False, **GREEDY)
    (call,) = [o for o in r.output if o.type == "custom_tool_call"]
    assert re.fullmatch(pattern.strip("^$"), call.input)  # type: ignore[union-attr]


def test_api_version_reports_the_ollama_level(daemon: Daemon) -> None:
    r = httpx.get(daemon.url + "/api/version")
    major, minor, patch = (int(x) for x in r.json()["version"].split("."))
    assert (major, minor, patch) >= (0, 13, 4)  # what Codex's --oss check asks for
    assert r.json()["llmrun_version"] == r.headers["x-llmrun-version"]


# -- the translation, without a model -------------------------------------------------------


def test_items_become_one_conversation() -> None:
    body = ResponsesBody.model_validate({
        "model": "m", "instructions": "Be kind.",
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
            {"type": "reasoning", "summary": []},
            {"type": "message", "role": "assistant",
             "content": [{"type": "output_text", "text": "Checking."}]},
            {"type": "function_call", "call_id": "c1", "name": "get_weather",
             "arguments": "{\"city\": \"Oslo\"}"},
            {"type": "function_call", "call_id": "c2", "name": "spawn",
             "namespace": "agents", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c1", "output": "Rain"},
            {"type": "custom_tool_call", "call_id": "c3", "name": "apply_patch",
             "input": "*** Begin Patch"},
            {"type": "custom_tool_call_output", "call_id": "c3",
             "output": [{"type": "input_text", "text": "done"}]}],
        "tools": [WEATHER, {"type": "namespace", "name": "agents",
                            "tools": [{"type": "function", "name": "spawn"}]},
                  {"type": "custom", "name": "apply_patch"}]})
    req, tools = to_request(body, [])
    roles = [(m.role, m.content) for m in req.messages]
    assert roles == [("system", "Be kind.\n\nUse tools."), ("user", "Weather?"),
                     ("assistant", "Checking."), ("tool", "Rain"), ("assistant", ""),
                     ("tool", "done")]
    assert [c.name for c in req.messages[2].tool_calls] == ["get_weather", "agents.spawn"]
    assert req.messages[3].name == "get_weather"
    assert req.messages[4].tool_calls[0].arguments == {"input": "*** Begin Patch"}
    assert [t.name for t in req.tools] == ["get_weather", "agents.spawn", "apply_patch"]
    assert tools.names["agents.spawn"] == ("agents", "spawn", "function")


@pytest.mark.parametrize("bad", [
    {"input": [{"type": "function_call", "name": "x"}]},  # no call_id
    {"input": [{"type": "function_call", "call_id": "a", "name": "x", "arguments": "[1]"}]},
    {"input": [{"role": "wizard", "content": "hi"}]},
    {"input": [{"type": "item_reference", "id": "msg_1"}]},
    {"tools": [{"type": "function"}]},
    {"tools": [{"type": "retrieval", "name": "x"}]},
    {"tool_choice": "sometimes"},
    {"tool_choice": {"type": "function", "name": "absent"}},
    {"tool_choice": "required"},
    {"text": {"format": {"type": "json_schema"}}},
    {"text": {"format": {"type": "yaml"}}},
])
def test_bad_requests_name_their_parameter(bad: dict[str, Any]) -> None:
    body = ResponsesBody.model_validate({"model": "m", "input": "hi", **bad})
    with pytest.raises(ApiError) as exc:
        to_request(body, [])
    assert exc.value.status == 400 and exc.value.param


def test_store_rebuilds_a_chain_and_refuses_strange_ids(tmp_path: Path) -> None:
    store = ResponseStore(tmp_path)
    first, second = new_id(), new_id()
    store.save({"id": first, "output": [{"type": "message", "role": "assistant",
                                         "content": "A1"}]},
               [{"role": "user", "content": "Q1"}], None)
    store.save({"id": second, "output": [{"type": "message", "role": "assistant",
                                          "content": "A2"}]},
               [{"role": "user", "content": "Q2"}], first)
    assert [i["content"] for i in store.conversation(second)] == ["Q1", "A1", "Q2", "A2"]
    for bad in ("../x", "resp_../../etc", first + "0", "", "resp_" + "g" * 32):
        with pytest.raises(NotStored):
            store.get(bad)
    (tmp_path / f"{second}.json").write_text("{not json")
    with pytest.raises(NotStored):
        store.conversation(second)
    store.delete(first)
    with pytest.raises(NotStored):
        store.delete(first)
