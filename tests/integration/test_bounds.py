"""Request bounds (llmrun/bounds.py): what the engine cannot afford is a 400 naming the limit,
in every dialect, before anything reaches the shared runner; what it can afford is served.

Unit tests of the checks, a test that the keyword lists and ceilings are llguidance's own (so
they are revisited when the constraint engine changes), and tests against the real daemon and
SmolLM2.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from llmrun import bounds
from llmrun.request import ChatRequest, EngineError, Message, NamedTool, Options, Tool
from llmrun.structured import keywords, limits

MODEL = "smollm2"
HUGE = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 200000}},
        "required": ["a"]}  # this schema once made llama.cpp's GBNF path die with SIGSEGV
# a keyword structured output cannot enforce: a 400 naming it
UNSUPPORTED = {"type": "object", "properties": {"a": {"type": "array", "items": {},
                                                      "uniqueItems": True}},
               "required": ["a"]}
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
    assert info.value.code == "invalid_request"
    return info.value.message


# -- the checks ------------------------------------------------------------------------------


def test_repetition_bounds_are_served() -> None:
    """llguidance enforces repetition bounds natively: none is refused for its size."""
    for schema in (HUGE, {"type": "array", "items": {}, "maxItems": 200000},
                   {"type": "string", "minLength": 100000},
                   {"type": "string", "pattern": "^a{0,200000}$"}):
        bounds.check_schema(schema)


def test_keywords_are_enforced_or_refused() -> None:
    for key, value in [("not", {}), ("if", {}), ("then", {}), ("else", {}),
                       ("uniqueItems", True), ("contains", {}), ("minContains", 1),
                       ("dependentRequired", {}), ("dependentSchemas", {}),
                       ("propertyNames", {}), ("unevaluatedProperties", False),
                       ("additionalItems", False), ("x-guidance", {}), ("foo", 1)]:
        assert f"the keyword '{key}' is not supported" in refused({"type": "object",
                                                                   key: value})
    # found where it sits: in properties, items, $defs, anyOf...
    assert "(at /properties/a/uniqueItems)" in refused(UNSUPPORTED)
    assert "'not'" in refused({"$defs": {"x": {"anyOf": [{"not": {}}]}}})
    assert "'format' 'regex'" in refused({"type": "string", "format": "regex"})
    # names and values are not keywords
    bounds.check_schema({"type": "object", "properties": {"not": {"const": {"if": 1}}},
                         "enum": [{"uniqueItems": 2}], "default": {"contains": 0},
                         "title": "t", "description": "d", "examples": [], "$comment": "c",
                         "$schema": "https://json-schema.org/draft/2020-12/schema"})
    bounds.check_schema({"type": "string", "nullable": True, "format": "date-time"})
    bounds.check_schema(UNSUPPORTED, strict=False)  # non-strict: a logged warning


def test_shape_bounds() -> None:
    bounds.check_schema(nested(31))
    assert "nested over 64 levels" in refused(nested(200))
    assert "10000 alternatives" in refused({"enum": list(range(10001))})
    bounds.check_schema(  # 1000 optional properties: llguidance's cost is modest
        {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(1000)}})
    assert "16384" in refused({"const": "x" * 20000})  # one long literal: a slow first mask
    assert "values in all" in refused({"type": "array", "items": [{}] * 30000})
    assert "groups nested" in refused({"type": "string", "pattern": "(" * 40 + ")" * 40})
    assert "local references" in refused({"$ref": "https://example.com/s.json"})
    assert "points to nothing" in refused({"properties": {"a": {"$ref": "#/$defs/b"}}})
    # found by tests/integration/test_fuzz.py: a property named "\x04" made llama.cpp's GBNF
    # abort; with llguidance it is served (written escaped: tests/integration/test_constraint.py)
    bounds.check_schema({"type": "object", "properties": {"\x04\x18p": {"type": "integer"}}})
    bounds.check_schema({"enum": ["ok", "a\nb"], "const": "\x00"})
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
    bounds.check_stop([f"s{i}" for i in range(16)] + ["s0"])  # the same one counts once
    with pytest.raises(EngineError, match="stop string too long: 1001 characters"):
        bounds.check_stop(["x" * 1001])
    with pytest.raises(EngineError, match="LLMRUN_MAX_MESSAGES"):
        bounds.check_messages([Message(role="user", content="hi")] * 4097)
    tools = [Tool(name=f"t{i}") for i in range(513)]
    with pytest.raises(EngineError, match="too many tools: 513"):
        bounds.check_tools(tools, "auto")
    odd = [Tool(name="odd", parameters=UNSUPPORTED), Tool(name="small")]
    bounds.check_tools(odd, "auto")  # not forced: the schema only reaches the prompt
    bounds.check_tools(odd, NamedTool(name="small"))
    with pytest.raises(EngineError, match="tool 'odd' parameters: the keyword 'uniqueItems'"):
        bounds.check_tools(odd, "required")
    bounds.check_tools(odd, "required", strict=False)
    # the format and the forced tools become one grammar: one budget
    req = ChatRequest(model="m", messages=[], format={"enum": list(range(6000))},
                      tools=[Tool(name="t", parameters={"enum": list(range(6000))})],
                      tool_choice="required", options=Options())
    with pytest.raises(EngineError, match="alternatives"):
        bounds.check_request(req)


def test_raw_grammar_bounds() -> None:
    bounds.check_grammar('root ::= "((((" [(((] # ((((\n')  # literals, classes, comments
    with pytest.raises(EngineError, match="nested over 1000"):
        bounds.check_grammar("root ::= " + "(" * 1001 + '"a"' + ")" * 1001)
    with pytest.raises(EngineError, match="bytes"):
        bounds.check_grammar('root ::= "' + "a" * (1 << 20) + '"')


def test_lists_and_ceilings_are_what_llguidance_builds(smollm2_path: Any) -> None:
    """Each supported keyword and format compiles, each refused one is refused by llguidance
    too (or silently ignored by it, which is why it is refused), and schemas at the ceilings
    build. When this fails, the constraint engine changed: revisit llmrun/structured/."""
    from llmrun.engine import constraint
    from llmrun.engine.llama import Model
    from llmrun.request import ChatRequest

    model = Model(smollm2_path)
    tok = constraint.tokenizer(model)

    def builds(schema: dict[str, Any]) -> bool:
        try:
            grammar = constraint.compile(
                ChatRequest(model="test", messages=[], format=schema), tok)
            constraint.matcher(tok, grammar or "")
        except ValueError:
            return False
        return True

    try:
        for fmt in keywords.FORMATS:
            assert builds({"type": "string", "format": fmt}), fmt
        for fmt in ("regex", "uri-reference", "iri", "json-pointer", "idn-email"):
            assert not builds({"type": "string", "format": fmt}), fmt
        for key in ("not", "if", "uniqueItems", "contains", "dependentRequired",
                    "propertyNames", "unevaluatedProperties"):
            assert not builds({"type": "object", key: {}}), key
        at_ceiling = [HUGE, nested(limits.MAX_SCHEMA_DEPTH // 2 - 1),
                      {"enum": list(range(limits.MAX_ALTERNATIVES))},
                      {"const": "x" * limits.MAX_LITERAL_CHARS},
                      {"type": "object", "properties": {"a": {"type": "number",
                       "multipleOf": 0.5, "exclusiveMinimum": 0}, "b": {"type": "object",
                       "patternProperties": {"^x": {}}, "minProperties": 1}}}]
        for schema in at_ceiling:
            bounds.check_schema(schema)
            assert builds(schema), str(schema)[:80]
    finally:
        model.close()


# -- against the real daemon -----------------------------------------------------------------


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

        r = chat(api, format=UNSUPPORTED)
        assert r.status_code == 400
        assert "the keyword 'uniqueItems' is not supported" in r.json()["error"]

        with pytest.raises(openai.BadRequestError) as oe:
            oa.chat.completions.create(model=MODEL, messages=USER, max_tokens=4,
                                       response_format={"type": "json_schema", "json_schema": {
                                           "name": "a", "schema": UNSUPPORTED,
                                           "strict": True}})
        assert "'uniqueItems'" in oe.value.body["message"]  # type: ignore[index]

        with pytest.raises(openai.BadRequestError) as oe:  # a forced tool's parameters
            oa.chat.completions.create(
                model=MODEL, messages=USER, max_tokens=4, tool_choice="required",
                tools=[{"type": "function", "function": {"name": "f", "strict": True,
                                                         "parameters": UNSUPPORTED}}])
        assert "tool 'f' parameters: the keyword 'uniqueItems'" in oe.value.message

        with pytest.raises(anthropic.BadRequestError) as ae:
            an.messages.create(model=MODEL, messages=USER, max_tokens=4,  # type: ignore[arg-type]
                               output_config={"format": {"type": "json_schema",
                                                         "schema": UNSUPPORTED}})
        assert ae.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
        assert "'uniqueItems'" in ae.value.body["error"]["message"]  # type: ignore[index]

        rest = [json.loads(line) for line in lines]
    assert rest and rest[-1]["done"] is True and "error" not in rest[-1]
    assert all("error" not in x for x in rest)
    assert chat(api).status_code == 200  # the runner still serves


def test_deep_schema_is_refused(api: httpx.Client) -> None:
    r = chat(api, format=nested(200))
    assert r.status_code == 400 and "nested over 64 levels" in r.json()["error"]


def test_bounds_are_served_and_obeyed(api: httpx.Client) -> None:
    r = chat(api, format=MODEST, options={"num_predict": 80},
             messages=[{"role": "user", "content": "Describe the sea as JSON."}])
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["message"]["content"]), MODEST)
    assert chat(api, format=HUGE).status_code == 200  # the old SIGSEGV: now an ordinary request


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
