"""Request bounds (llmrun/bounds.py): what the engine cannot afford is a 400 naming the limit,
in every dialect, before anything reaches the shared runner; what it can afford is served.

Unit tests of the checks, a test that the schema ceilings are llama.cpp's own (so they are
revisited when the grammar engine changes), and tests against the real daemon and SmolLM2.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest

from llmrun import bounds
from llmrun.request import ChatRequest, EngineError, Message, NamedTool, Options, Tool
from tests.conftest import Daemon
from tests.tinymodel import write_tiny_llama

MODEL = "smollm2"
HUGE = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 200000}},
        "required": ["a"]}  # issue 11: this schema made the runner die with SIGSEGV
MODEST = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 50}},
          "required": ["a"]}
USER = [{"role": "user", "content": "Say something."}]


def nested(depth: int, leaf: dict[str, Any] | None = None) -> dict[str, Any]:
    schema = leaf or {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def refused(schema: Any) -> str:
    with pytest.raises(EngineError) as info:
        bounds.check_schema(schema)
    assert info.value.status == 400
    return info.value.message


# -- the checks ------------------------------------------------------------------------------


def test_repetition_bounds() -> None:
    assert "'maxLength' 200000" in refused(HUGE) and "1000" in refused(HUGE)
    bounds.check_schema({"type": "string", "minLength": 10, "maxLength": 1010})  # 1000 optional
    assert "'maxLength' 1011" in refused({"type": "string", "minLength": 10, "maxLength": 1011})
    assert "'maxItems' 5000" in refused({"type": "array", "items": {}, "maxItems": 5000})
    assert "'minItems' 100001" in refused({"type": "array", "items": {}, "minItems": 100001})
    bounds.check_schema({"type": "string", "minLength": 100000})  # flat, cheap: served
    assert "'{0,200000}'" in refused({"type": "string", "pattern": "^a{0,200000}$"})
    bounds.check_schema({"type": "string", "pattern": "^a{3,}b{2}$"})
    # many affordable bounds add up to an unaffordable grammar
    wide = {"type": "object", "required": [f"p{i}" for i in range(21)],
            "properties": {f"p{i}": {"type": "string", "maxLength": 1000} for i in range(21)}}
    assert "add up" in refused(wide)


def test_shape_bounds() -> None:
    bounds.check_schema(nested(31))
    assert "nested over 64 levels" in refused(nested(200))
    assert "1000 alternatives" in refused({"enum": list(range(1001))})
    assert "optional properties" in refused(
        {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(101)}})
    assert "values in all" in refused({"type": "array", "items": [{}] * 20000})
    assert "groups nested" in refused({"type": "string", "pattern": "(" * 40 + ")" * 40})
    assert "local references" in refused({"$ref": "https://example.com/s.json"})
    assert "points to nothing" in refused({"properties": {"a": {"$ref": "#/$defs/b"}}})
    # found by tests/test_fuzz.py: a property named "\x04" made llama.cpp's grammar abort
    assert "control character" in refused({"type": "object", "properties": {
        "\x04\x18p": {"type": "integer"}}})
    assert "control character" in refused({"enum": ["ok", "a\nb"]})
    assert "control character" in refused({"const": "\x00"})
    bounds.check_schema({"type": "object", "description": "two\nlines",
                         "properties": {"ünïcode ✓": {"type": "string"}}})
    # a deep JSON value is refused by the depth check, not Python's recursion limit
    deep: dict[str, Any] = {}
    cur = deep
    for _ in range(5000):
        cur["x"] = {}
        cur = cur["x"]
    refused(deep)


def test_refs_count_the_depth_they_lead_to() -> None:
    chain = {"type": "object", "properties": {"x": {"$ref": "#/$defs/a0"}}, "$defs": {
        **{f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(2000)},
        "a2000": {"type": "integer"}}}
    assert "nested over" in refused(chain)  # the converter would recurse 2000 deep
    tree = {"type": "object", "properties": {"root": {"$ref": "#/$defs/node"}}, "$defs": {
        "node": {"type": "object", "required": ["v", "kids"], "properties": {
            "v": {"type": "integer"},
            "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}}}
    bounds.check_schema(tree)  # recursion through a ref is a loop in the grammar: fine


def test_stop_messages_tools() -> None:
    with pytest.raises(EngineError, match="too many stop strings: 17, the limit is 16"):
        bounds.check_stop([f"s{i}" for i in range(17)])
    bounds.check_stop([f"s{i}" for i in range(16)] + ["<|im_end|>"],
                      exempt=frozenset({"<|im_end|>"}))  # the model's own do not count
    with pytest.raises(EngineError, match="stop string too long: 1001 characters"):
        bounds.check_stop(["x" * 1001])
    with pytest.raises(EngineError, match="LLMRUN_MAX_MESSAGES"):
        bounds.check_messages([Message(role="user", content="hi")] * 4097)
    tools = [Tool(name=f"t{i}") for i in range(513)]
    with pytest.raises(EngineError, match="too many tools: 513"):
        bounds.check_tools(tools, "auto")
    huge = [Tool(name="big", parameters=HUGE), Tool(name="small")]
    bounds.check_tools(huge, "auto")  # not forced: the schema only reaches the prompt
    bounds.check_tools(huge, NamedTool(name="small"))
    with pytest.raises(EngineError, match="tool 'big' parameters: 'maxLength' 200000"):
        bounds.check_tools(huge, "required")
    # the format and the forced tools become one grammar: one budget
    req = ChatRequest(model="m", messages=[], format={"enum": list(range(600))},
                      tools=[Tool(name="t", parameters={"enum": list(range(600))})],
                      tool_choice="required", options=Options())
    with pytest.raises(EngineError, match="alternatives"):
        bounds.check_request(req)


def test_raw_grammar_bounds() -> None:
    bounds.check_grammar('root ::= "((((" [(((] # ((((\n')  # literals, classes, comments
    with pytest.raises(EngineError, match="nested over 1000"):
        bounds.check_grammar("root ::= " + "(" * 1001 + '"a"' + ")" * 1001)
    with pytest.raises(EngineError, match="bytes"):
        bounds.check_grammar('root ::= "' + "a" * (1 << 20) + '"')


def test_ceilings_are_what_llama_cpp_builds(tmp_path: Any) -> None:
    """At each ceiling llama.cpp builds the grammar; one past the repetition ceiling it
    refuses it (past ~18,000 it crashes instead, which is why the bound exists). When this
    fails, the grammar engine changed: revisit the constants in llmrun/bounds.py."""
    from llmrun.engine.llama import LlamaError, Model, Sampler, schema_grammar

    model = Model(write_tiny_llama(tmp_path / "tiny.gguf"))

    def builds(schema: dict[str, Any]) -> bool:
        try:
            sampler = Sampler(model, grammar=schema_grammar(schema), temperature=0.0,
                              top_k=0, top_p=1.0, min_p=0.0, typical_p=1.0, repeat_last_n=0,
                              repeat_penalty=1.0, presence_penalty=0.0,
                              frequency_penalty=0.0, seed=0)
        except LlamaError:
            return False
        sampler.close()
        return True

    try:
        n = bounds.MAX_OPTIONAL_REPEAT
        at_ceiling = [{"type": "string", "maxLength": n},
                      {"type": "array", "items": {"type": "integer"}, "maxItems": n},
                      {"type": "string", "pattern": f"^a{{0,{n}}}$"},
                      {"type": "string", "minLength": bounds.MAX_REQUIRED_REPEAT},
                      nested(bounds.MAX_SCHEMA_DEPTH // 2 - 1),
                      {"enum": list(range(bounds.MAX_ALTERNATIVES))}]
        for schema in at_ceiling:
            bounds.check_schema(schema)
            assert builds(schema), schema
        assert not builds({"type": "string", "maxLength": n + 1})
    finally:
        model.close()


# -- against the real daemon -----------------------------------------------------------------


@pytest.fixture(scope="module")
def oa(daemon: Daemon) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=daemon.url + "/v1", api_key="x", max_retries=0,
                       timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def an(daemon: Daemon) -> Iterator[anthropic.Anthropic]:
    with anthropic.Anthropic(base_url=daemon.url, api_key="x", max_retries=0,
                             timeout=120) as c:
        yield c


def chat(api: httpx.Client, **body: Any) -> httpx.Response:
    body = {"model": MODEL, "messages": USER, "stream": False, **body}
    body["options"] = {"num_predict": 4, "temperature": 0, **body.get("options", {})}
    return api.post("/api/chat", json=body)


def test_unaffordable_schema_is_400_in_every_dialect_while_a_stream_runs(
        api: httpx.Client, oa: openai.OpenAI, an: anthropic.Anthropic) -> None:
    story = {"model": MODEL, "messages": [{"role": "user", "content": "Count from 1 to 100."}],
             "options": {"num_predict": 40, "temperature": 0}}
    with api.stream("POST", "/api/chat", json=story) as stream:
        lines = stream.iter_lines()
        assert "message" in json.loads(next(lines))  # generating on the shared runner

        r = chat(api, format=HUGE)
        assert r.status_code == 400
        assert "'maxLength' 200000" in r.json()["error"] and "1000" in r.json()["error"]

        with pytest.raises(openai.BadRequestError) as oe:
            oa.chat.completions.create(model=MODEL, messages=USER, max_tokens=4,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "a", "schema": HUGE}})
        assert "'maxLength' 200000" in oe.value.body["message"]  # type: ignore[index]

        with pytest.raises(openai.BadRequestError) as oe:  # a forced tool's parameters
            oa.chat.completions.create(
                model=MODEL, messages=USER, max_tokens=4, tool_choice="required",
                tools=[{"type": "function", "function": {"name": "f", "parameters": HUGE}}])
        assert "tool 'f' parameters: 'maxLength' 200000" in oe.value.message

        with pytest.raises(anthropic.BadRequestError) as ae:
            an.messages.create(model=MODEL, messages=USER, max_tokens=4,  # type: ignore[arg-type]
                               output_config={"format": {"type": "json_schema",
                                                         "schema": HUGE}})
        assert ae.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        assert "'maxLength' 200000" in ae.value.body["error"]["message"]  # type: ignore[index]

        rest = [json.loads(line) for line in lines]
    assert rest and rest[-1]["done"] is True and "error" not in rest[-1]
    assert all("error" not in x for x in rest)
    assert chat(api).status_code == 200  # the runner still serves


def test_deep_schema_is_refused(api: httpx.Client) -> None:
    r = chat(api, format=nested(200))
    assert r.status_code == 400 and "nested over 64 levels" in r.json()["error"]


def test_affordable_bounds_are_served_and_obeyed(api: httpx.Client) -> None:
    r = chat(api, format=MODEST, options={"num_predict": 80},
             messages=[{"role": "user", "content": "Describe the sea as JSON."}])
    assert r.status_code == 200, r.text
    out = json.loads(r.json()["message"]["content"])
    assert isinstance(out["a"], str) and len(out["a"]) <= 50
    at_ceiling = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 1000}},
                  "required": ["a"]}
    assert chat(api, format=at_ceiling).status_code == 200


def test_stop_strings_are_bounded(api: httpx.Client, oa: openai.OpenAI) -> None:
    r = chat(api, options={"stop": [f"stop{i}" for i in range(17)]})
    assert r.status_code == 400
    assert r.json()["error"] == "too many stop strings: 17, the limit is 16 (LLMRUN_MAX_STOP)"
    assert chat(api, options={"stop": [f"stop{i}" for i in range(16)]}).status_code == 200
    r = chat(api, options={"stop": ["x" * 1001]})
    assert r.status_code == 400 and "1001 characters" in r.json()["error"]
    with pytest.raises(openai.BadRequestError, match="too many stop strings"):
        oa.chat.completions.create(model=MODEL, messages=USER, max_tokens=4,  # type: ignore[arg-type]
                                   stop=[f"s{i}" for i in range(17)])


def test_messages_and_tools_are_bounded(api: httpx.Client, an: anthropic.Anthropic) -> None:
    r = chat(api, messages=[{"role": "user", "content": "hi"}] * 4097)
    assert r.status_code == 400 and "LLMRUN_MAX_MESSAGES" in r.json()["error"]
    tools = [{"type": "function", "function": {"name": f"t{i}", "parameters": {}}}
             for i in range(513)]
    r = chat(api, tools=tools)
    assert r.status_code == 400 and "too many tools: 513" in r.json()["error"]
    with pytest.raises(anthropic.BadRequestError, match="LLMRUN_MAX_MESSAGES"):
        an.messages.count_tokens(model=MODEL,
                                 messages=[{"role": "user", "content": "hi"}] * 4097)
