"""Structured output conformance: JSON schemas through the real daemon and SmolLM2.

Every case is one schema, one prompt and one dialect: Ollama `format` (raw HTTP), OpenAI
`response_format` json_schema with `"strict": true` (the `openai` SDK) or Anthropic
`output_config.format` (the `anthropic` SDK). Decoding is greedy, with a token budget the
answer fits in: a length cut is a failure, as a truncated document is invalid JSON to the
client. Every answer is parsed and validated with `jsonschema` (formats included), and the
properties of every object must come in the schema's order.

Objects repeat no key (llguidance lets the names that `additionalProperties` or
`patternProperties` admit repeat: see docs/structured-output.md; no case here does).

Many prompts ask for what the schema forbids (a huge age, a long word where seven letters
are allowed, ten items where three are): a 135M model follows the prompt, so only the
constraint engine keeps the answer valid.

Keywords the engine cannot enforce are refused with a 400 naming them (Ollama, OpenAI strict,
Anthropic) and only logged when the client asked for non-strict output (OpenAI json_schema
without `strict`).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterator
from datetime import date, time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import jsonschema
import ollama
import openai
import pytest

from tests.conftest import Daemon

MODEL = "smollm2"
BUDGET = 200  # tokens: every case below finishes well inside it

# -- validation -------------------------------------------------------------------------------

# jsonschema checks date, email, ipv4 and uuid itself; date-time, time and uri need optional
# packages, so they are checked here, as RFC 3339 and RFC 3986 define them.
_RFC3339_TIME = (r"(?:[01]\d|2[0-3]):[0-5]\d:(?:[0-5]\d|60)(?:\.\d+)?"
                 r"(?:[zZ]|[+-](?:[01]\d|2[0-3]):[0-5]\d)")
_FORMATS = jsonschema.FormatChecker()


@_FORMATS.checks("date-time", raises=ValueError)
def _date_time(value: object) -> bool:
    if not isinstance(value, str):
        return True
    m = re.fullmatch(r"(\d{4}-\d{2}-\d{2})[tT ](" + _RFC3339_TIME + ")", value)
    if not m:
        return False
    date.fromisoformat(m[1])  # a real calendar day
    return True


@_FORMATS.checks("time", raises=ValueError)
def _time(value: object) -> bool:
    if not isinstance(value, str):
        return True
    if not re.fullmatch(_RFC3339_TIME, value):
        return False
    time.fromisoformat(re.sub(r"[zZ]$", "+00:00", value.replace(":60", ":59")))
    return True


@_FORMATS.checks("uri")
def _uri(value: object) -> bool:
    # RFC 3986 absolute URI: a scheme, then no spaces or characters it never allows
    return not isinstance(value, str) or bool(
        re.fullmatch(r"[A-Za-z][A-Za-z0-9+.\-]*:[^\s<>\"{}|\\^`]*", value))


@_FORMATS.checks("uuid", raises=ValueError)
def _uuid(value: object) -> bool:
    return not isinstance(value, str) or (
        len(value) == 36 and str(uuid.UUID(value)) == value.lower())


def parse(text: str) -> Any:
    """The answer as JSON, refusing a repeated key (RFC 8259: names SHOULD be unique; parsers
    disagree on which value wins, so the schema check would be moot)."""
    def unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        keys = [k for k, _ in pairs]
        assert len(set(keys)) == len(keys), f"repeated key in {text!r}"
        return dict(pairs)
    return json.loads(text, object_pairs_hook=unique)


def validate(instance: Any, schema: dict[str, Any]) -> None:
    jsonschema.Draft202012Validator(schema, format_checker=_FORMATS).validate(instance)
    check_order(instance, schema)


def check_order(instance: Any, schema: Any) -> None:
    """Properties come in the order the schema lists them (clients rely on it, as OpenAI
    documents for strict outputs)."""
    if not isinstance(schema, dict):
        return
    props = schema.get("properties")
    if isinstance(instance, dict) and isinstance(props, dict):
        known = [k for k in instance if k in props]
        assert known == [k for k in props if k in instance], (list(instance), list(props))
        for k in known:
            check_order(instance[k], props[k])
    if isinstance(instance, list) and isinstance(schema.get("items"), dict):
        for x in instance:
            check_order(x, schema["items"])


# -- the cases ----------------------------------------------------------------------------------


def obj(props: dict[str, Any], required: list[str] | None = None, **extra: Any
        ) -> dict[str, Any]:
    """A closed object: all properties required unless said otherwise."""
    return {"type": "object", "properties": props,
            "required": list(props) if required is None else required,
            "additionalProperties": False, **extra}


NAME = {"type": "string", "maxLength": 20}

# (id, dialect, schema, prompt)
CASES: list[tuple[str, str, dict[str, Any], str]] = [
    # type and unions
    ("types", "ollama", obj({"name": NAME, "legs": {"type": "integer"},
                             "weight": {"type": "number"}, "pet": {"type": "boolean"},
                             "owner": {"type": "null"}}), "Describe a cat as JSON."),
    ("type-union", "openai", obj({"v": {"type": ["integer", "boolean"]}}),
     "Give me the word 'seventeen' as JSON."),
    ("root-integer", "ollama", {"type": "integer", "minimum": 0, "maximum": 150},
     "Write the number 987654321987."),
    ("root-array", "anthropic", {"type": "array", "items": {"type": "boolean"}, "maxItems": 4},
     "List some truths as JSON."),
    # enum, const
    ("enum", "openai", obj({"color": {"enum": ["red", "green", "blue"]}}),
     "What color is a banana? Answer yellow."),
    ("enum-mixed", "anthropic", obj({"v": {"enum": [1, "two", None, True, 3.5]}}),
     "Pick the number 4 as JSON."),
    ("const", "ollama", obj({"kind": {"const": "invoice"}, "n": {"type": "integer",
                                                                "minimum": 1, "maximum": 9}}),
     "Make a receipt number 42 as JSON."),
    ("const-object", "openai", obj({"cfg": {"const": {"a": 1, "b": [True, None]}}}),
     "Give any config as JSON."),
    # numeric bounds, integers and numbers
    ("age-0-150", "openai", obj({"name": NAME, "age": {"type": "integer", "minimum": 0,
                                                       "maximum": 150}}),
     "A person named Bob whose age is 987654321987. Give his name and age as JSON."),
    ("int-exclusive", "anthropic", obj({"n": {"type": "integer", "exclusiveMinimum": 10,
                                              "exclusiveMaximum": 20}}),
     "Give n = 5 as JSON."),
    ("int-negative", "ollama", obj({"t": {"type": "integer", "minimum": -50,
                                          "maximum": -10}}),
     "The temperature is 100 degrees. Give t as JSON."),
    ("int-large-bounds", "openai", obj({"pop": {"type": "integer", "minimum": 1_000_000,
                                                "maximum": 1_000_000_000}}),
     "The population is 3. Give pop as JSON."),
    ("number-bounds", "anthropic", obj({"x": {"type": "number", "minimum": 0.5,
                                              "maximum": 2.5}}),
     "x is one billion. Give x as JSON."),
    # (multipleOf keeps the fraction finite: greedy SmolLM2 otherwise writes 0.98999... to the
    # token limit, a valid prefix that never ends)
    ("number-exclusive", "ollama", obj({"p": {"type": "number", "exclusiveMinimum": 0,
                                              "exclusiveMaximum": 1, "multipleOf": 0.01}}),
     "The probability is 1.5. Give p as JSON."),
    ("number-max-only", "openai", obj({"debt": {"type": "number", "maximum": -1.5}}),
     "My balance is 2000 dollars. Give debt as JSON."),
    # strings: lengths and patterns
    ("seven-lowercase", "ollama", obj({"word": {"type": "string", "pattern": "^[a-z]{7}$"}}),
     "Write the word SUPERCALIFRAGILISTIC in capitals as JSON."),
    ("exact-length", "anthropic", obj({"code": {"type": "string", "minLength": 7,
                                                "maxLength": 7}}),
     "Give the code 'hi' as JSON."),
    ("min-length", "openai", obj({"s": {"type": "string", "minLength": 30,
                                        "maxLength": 40}}),
     "Say 'ok' as JSON."),
    ("max-length", "ollama", obj({"s": {"type": "string", "maxLength": 3}}),
     "Write a long sentence about the sea as JSON."),
    ("pattern-phone", "anthropic", obj({"phone": {"type": "string",
                                                  "pattern": "^[0-9]{3}-[0-9]{4}$"}}),
     "My phone is +44 20 7946 0958. Give phone as JSON."),
    ("pattern-code", "openai", obj({"id": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}}),
     "The id is abc-12345678. Give id as JSON."),
    ("pattern-hex", "ollama", obj({"color": {"type": "string",
                                             "pattern": "^#[0-9a-f]{6}$"}}),
     "My favourite colour is sky blue. Give color as JSON."),
    # formats
    # maxLength: RFC 3339 allows any number of fraction digits, and SmolLM2 writes them
    # until the budget runs out
    ("date-time", "openai", obj({"when": {"type": "string", "format": "date-time",
                                          "maxLength": 30}}),
     "The meeting is next Tuesday afternoon. Give when as JSON."),
    ("date", "anthropic", obj({"day": {"type": "string", "format": "date"}}),
     "My birthday is the 31st of February. Give day as JSON."),
    ("time", "ollama", obj({"at": {"type": "string", "format": "time", "maxLength": 20}}),
     "Lunch is at noon-ish. Give at as JSON."),
    ("email", "openai", obj({"email": {"type": "string", "format": "email",
                                       "maxLength": 40}}),
     "Contact Bob at bob at example dot com. Give email as JSON."),
    ("uuid", "anthropic", obj({"id": {"type": "string", "format": "uuid"}}),
     "Make up an id for order 7. Give id as JSON."),
    ("uri", "ollama", obj({"url": {"type": "string", "format": "uri", "maxLength": 40}}),
     "The site is example dot org. Give url as JSON."),
    ("ipv4", "openai", obj({"ip": {"type": "string", "format": "ipv4"}}),
     "The server is at 999.1.2.3.4. Give ip as JSON."),
    # arrays
    ("three-items", "anthropic", obj({"nums": {"type": "array", "minItems": 3, "maxItems": 3,
                                               "items": {"type": "integer", "minimum": 0,
                                                         "maximum": 9}}}),
     "List the numbers from 1 to 10 as JSON."),
    ("items-range", "ollama", obj({"tags": {"type": "array", "minItems": 2, "maxItems": 4,
                                            "items": {"type": "string", "maxLength": 10}}}),
     "Give one tag for a photo of a beach as JSON."),
    ("prefix-items", "openai", obj({"row": {"type": "array", "prefixItems": [
        {"type": "string", "maxLength": 10}, {"type": "integer", "minimum": 18},
        {"type": "boolean"}], "items": False, "minItems": 3}}),
     "A row with a name, an age and whether they vote, as JSON."),
    ("prefix-and-items", "anthropic", obj({"p": {"type": "array", "prefixItems": [
        {"const": "point"}], "items": {"type": "number"}, "minItems": 2, "maxItems": 3}}),
     "A 2D point as JSON."),
    ("array-of-objects", "ollama", obj({"cart": {"type": "array", "maxItems": 2, "items": obj(
        {"item": NAME, "qty": {"type": "integer", "minimum": 1, "maximum": 5}})}}),
     "A shopping cart with 100 apples, as JSON."),
    ("empty-array", "openai", obj({"none": {"type": "array", "maxItems": 0}}),
     "List every planet as JSON."),
    # objects
    ("required-subset", "anthropic", obj({"a": NAME, "b": {"type": "integer"},
                                          "c": {"type": "boolean"}}, required=["a"]),
     "Give a as JSON."),
    ("additional-typed", "ollama", {"type": "object", "properties": {"id": {"type": "integer"}},
                                    "required": ["id"],
                                    "additionalProperties": {"type": "integer", "minimum": 0,
                                                             "maximum": 9}},
     "Give id 1 and score 1000 as JSON."),
    ("pattern-properties", "anthropic", {"type": "object", "additionalProperties": False,
                                         "patternProperties": {"^[a-z]{2,8}$": {
                                             "type": "integer", "minimum": 0, "maximum": 9}}},
     "Scores of the players Ann (12 points) and Bob (40 points) as JSON."),
    ("property-order", "openai", obj({"zeta": {"type": "integer", "maximum": 1000}, "alpha": NAME,
                                      "mid": {"type": "boolean"}}),
     "Give alpha first, then mid, then zeta, as JSON."),
    ("nested", "anthropic", obj({"user": obj({"name": NAME, "address": obj(
        {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}})})}),
     "Bob lives in Paris, postcode 75001-AB. As JSON."),
    ("empty-object", "ollama", obj({}), "Describe the universe as JSON."),
    # combinators
    ("any-of", "openai", obj({"v": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 5},
                                              {"type": "string", "pattern": "^x{1,5}$"}]}}),
     "Give v = 'hello' as JSON."),
    ("one-of", "anthropic", {"oneOf": [
        obj({"kind": {"const": "circle"}, "r": {"type": "number", "minimum": 0}}),
        obj({"kind": {"const": "square"}, "side": {"type": "integer", "maximum": 10}})]},
     "A triangle as JSON."),
    ("all-of-bounds", "ollama", obj({"n": {"allOf": [{"type": "integer", "minimum": 0},
                                                     {"maximum": 10}]}}),
     "n is 5000. Give n as JSON."),
    ("all-of-objects", "openai", {"allOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "object", "properties": {"b": NAME}, "required": ["b"]}]},
     "Give a and b as JSON."),
    # $ref and $defs, recursion
    ("ref-defs", "anthropic", {"$defs": {"place": obj({"city": NAME})},
                               **obj({"home": {"$ref": "#/$defs/place"},
                                      "work": {"$ref": "#/$defs/place"}})},
     "I live in Rome and work in Milan. As JSON."),
    # (a linked list, `"next": {"anyOf": [{"$ref": ...}, {"type": "null"}]}`, is served too,
    # but greedy SmolLM2 never picks null and nests until the budget ends; through an array
    # it can stop with [])
    ("ref-recursive-defs", "ollama", {"$defs": {"dir": obj({
        "name": NAME, "subdirs": {"type": "array", "maxItems": 2,
                                  "items": {"$ref": "#/$defs/dir"}}})}, "$ref": "#/$defs/dir"},
     "A folder 'docs' holding a folder 'img', which is empty. As JSON."),
    ("ref-recursive-tree", "openai", obj({"name": NAME, "kids": {
        "type": "array", "maxItems": 2, "items": {"$ref": "#"}}}),
     "A family tree: Ann has a child Bo, who has no children. As JSON."),
    # nullable forms
    ("nullable-type-list", "anthropic", obj({"middle": {"type": ["string", "null"],
                                                        "maxLength": 10},
                                             "age": {"type": ["integer", "null"],
                                                     "minimum": 0, "maximum": 150}}),
     "Bob has no middle name; he is 200 years old. As JSON."),
    ("nullable-any-of", "ollama", obj({"spouse": {"anyOf": [NAME, {"type": "null"}]},
                                       "kids": {"anyOf": [{"type": "integer", "minimum": 0,
                                                           "maximum": 20},
                                                          {"type": "null"}]}}),
     "Ann is single with 99 kids. As JSON."),
]


# -- clients -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def api(daemon: Daemon) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=daemon.url, timeout=120) as c:
        yield c


def user(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


class Cut(AssertionError):
    """The model did not finish its answer within BUDGET tokens."""


def finished(done: bool, text: object) -> None:
    if not done:
        raise Cut(f"cut at {BUDGET} tokens: {text}")


def answered(call: Callable[[str], str], prompt: str) -> str:
    """`call(prompt)`, or the same question asked for brevity when the answer runs past
    BUDGET: a 135M model's greedy answer can loop (a number's digits, a string's letters) on
    one CPU's arithmetic and finish on another's. What is checked is that every answer obeys
    its schema; an answer cut twice fails the test."""
    try:
        return call(prompt)
    except Cut:
        return call(prompt + " Answer in as few words as you can.")


def via_ollama(api: httpx.Client, schema: dict[str, Any], prompt: str) -> str:
    r = api.post("/api/chat", json={"model": MODEL, "messages": user(prompt), "stream": False,
                                    "format": schema,
                                    "options": {"temperature": 0, "num_predict": BUDGET}})
    assert r.status_code == 200, r.text
    body = r.json()
    finished(body["done_reason"] == "stop", body["message"])
    return str(body["message"]["content"])


def via_openai(oa: openai.OpenAI, schema: dict[str, Any], prompt: str,
               strict: bool | None = True) -> str:
    spec: dict[str, Any] = {"name": "answer", "schema": schema}
    if strict is not None:
        spec["strict"] = strict
    r = oa.chat.completions.create(model=MODEL, messages=user(prompt),  # type: ignore[arg-type]
                                   max_tokens=BUDGET, temperature=0, seed=1,
                                   response_format={"type": "json_schema", "json_schema": spec})
    choice = r.choices[0]
    finished(choice.finish_reason == "stop", choice.message.content)
    return choice.message.content or ""


def via_anthropic(an: anthropic.Anthropic, schema: dict[str, Any], prompt: str) -> str:
    msg = an.messages.create(model=MODEL, max_tokens=BUDGET, messages=user(prompt),  # type: ignore[arg-type]
                             output_config={"format": {"type": "json_schema",
                                                       "schema": schema}},
                             extra_body={"temperature": 0})
    finished(msg.stop_reason == "end_turn", msg.content)
    (block,) = msg.content
    assert block.type == "text"
    return block.text


def ask(dialect: str, schema: dict[str, Any], prompt: str, api: httpx.Client,
        oa: openai.OpenAI, an: anthropic.Anthropic) -> str:
    if dialect == "ollama":
        return answered(lambda p: via_ollama(api, schema, p), prompt)
    if dialect == "openai":
        return answered(lambda p: via_openai(oa, schema, p), prompt)
    return answered(lambda p: via_anthropic(an, schema, p), prompt)


# -- conformance -------------------------------------------------------------------------------


def test_the_suite_covers_issue_12() -> None:
    """At least 40 schemas, every dialect used, every keyword of the issue present."""
    assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)
    assert {c[1] for c in CASES} == {"ollama", "openai", "anthropic"}
    text = json.dumps([c[2] for c in CASES])
    for keyword in ["type", "enum", "const", "minimum", "maximum", "exclusiveMinimum",
                    "exclusiveMaximum", "minLength", "maxLength", "pattern", "minItems",
                    "maxItems", "prefixItems", "items", "required", "additionalProperties",
                    "properties", "patternProperties", "anyOf", "oneOf", "allOf", "$ref", "$defs"]:
        assert f'"{keyword}"' in text, keyword
    for fmt in ["date-time", "date", "time", "email", "uuid", "uri", "ipv4"]:
        assert f'"format": "{fmt}"' in text, fmt


@pytest.mark.parametrize(("dialect", "schema", "prompt"), [c[1:] for c in CASES],
                         ids=[f"{c[1]}-{c[0]}" for c in CASES])
def test_schema_is_obeyed(dialect: str, schema: dict[str, Any], prompt: str,
                          api: httpx.Client, oa: openai.OpenAI, an: anthropic.Anthropic
                          ) -> None:
    text = ask(dialect, schema, prompt, api, oa, an)
    validate(parse(text), schema)


# -- unsupported keywords ----------------------------------------------------------------------

# (the keyword as the error must name it, a schema that uses it once)
UNSUPPORTED: list[tuple[str, dict[str, Any]]] = [
    ("not", obj({"n": {"type": "integer", "minimum": 0, "maximum": 9, "not": {"const": 3}}})),
    ("if", obj({"n": {"type": "integer", "minimum": 0, "maximum": 9}},
               **{"if": {"properties": {"n": {"const": 1}}},
                  "then": {"required": ["n"]}, "else": {"required": []}})),
    ("uniqueItems", obj({"l": {"type": "array", "maxItems": 3, "uniqueItems": True,
                               "items": {"type": "integer", "minimum": 0, "maximum": 9}}})),
    ("contains", obj({"l": {"type": "array", "maxItems": 3, "contains": {"const": 1},
                            "items": {"type": "integer", "minimum": 0, "maximum": 9}}})),
    ("propertyNames", {"type": "object", "propertyNames": {"maxLength": 3},
                       "additionalProperties": {"type": "integer", "minimum": 0,
                                                "maximum": 9}}),
    ("dependentRequired", obj({"a": {"type": "integer", "minimum": 0, "maximum": 9},
                               "b": {"type": "boolean"}}, required=["a"],
                              dependentRequired={"a": ["b"]})),
    ("no-such-format", obj({"s": {"type": "string", "maxLength": 10,
                                  "format": "no-such-format"}})),
    # oneOf whose branches overlap (7 is both): llguidance can only enforce anyOf
    ("oneOf", obj({"v": {"oneOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                   {"type": "number", "minimum": 0, "maximum": 9}]}})),
]
UNSUPPORTED_IDS = [kw for kw, _ in UNSUPPORTED]


def names(message: str, keyword: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(keyword)}(?![\w-])", message) is not None


@pytest.mark.parametrize(("keyword", "schema"), UNSUPPORTED, ids=UNSUPPORTED_IDS)
def test_unsupported_keyword_is_400_naming_it(keyword: str, schema: dict[str, Any],
                                              api: httpx.Client, oa: openai.OpenAI,
                                              an: anthropic.Anthropic) -> None:
    r = api.post("/api/chat", json={"model": MODEL, "messages": user("Hi"), "stream": False,
                                    "format": schema, "options": {"num_predict": 4}})
    assert r.status_code == 400 and names(r.json()["error"], keyword), r.text

    with pytest.raises(openai.BadRequestError) as oe:
        via_openai(oa, schema, "Hi", strict=True)
    assert names(oe.value.message, keyword), oe.value.message

    with pytest.raises(anthropic.BadRequestError) as ae:
        via_anthropic(an, schema, "Hi")
    assert names(ae.value.message, keyword), ae.value.message


def without(schema: Any, keyword: str) -> Any:
    """The schema with the keyword (and its if/then/else partners) taken out: what a
    non-strict request is enforced against."""
    drop = {"if", "then", "else"} if keyword == "if" else {keyword}
    if isinstance(schema, dict):
        out = {k: without(v, keyword) for k, v in schema.items() if k not in drop}
        if out.get("format") == keyword:
            del out["format"]
        return out
    if isinstance(schema, list):
        return [without(x, keyword) for x in schema]
    return schema


@pytest.mark.parametrize(("keyword", "schema"), UNSUPPORTED, ids=UNSUPPORTED_IDS)
def test_unsupported_keyword_is_served_when_not_strict(keyword: str, schema: dict[str, Any],
                                                       oa: openai.OpenAI, daemon: Daemon
                                                       ) -> None:
    """OpenAI json_schema without `strict`: the keyword is logged, the rest enforced."""
    # the daemon's log (keywords it knows it cannot enforce) and the runner's (what llguidance
    # itself approximates); each handler flushes its record before the answer goes out
    def logs() -> list[Path]:
        return [daemon.log, *sorted((daemon.home / "logs").glob("runner-*.log"))]
    seen = {path: path.stat().st_size for path in logs()}
    text = answered(lambda p: via_openai(oa, schema, p, strict=None),
                    "Give a small example as JSON.")
    validate(parse(text), without(schema, keyword))
    new: list[str] = []
    for path in logs():  # a runner started by this request has a new log
        with open(path, "rb") as f:
            f.seek(seen.get(path, 0))
            new += f.read().decode(errors="replace").splitlines()
    warned = [line for line in new if "not enforced" in line and names(line, keyword)]
    assert warned, f"no warning naming {keyword!r} in the daemon's or the runner's log"


# -- one schema and one forced tool call through the three SDKs --------------------------------

PERSON = obj({"name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
              "age": {"type": "integer", "minimum": 0, "maximum": 150},
              "email": {"type": "string", "format": "email", "maxLength": 40}})
PERSON_PROMPT = "Bob Smith is 987654321 years old; write to bob@example.com. As JSON."
WEATHER = obj({"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,15}$"},
               "days": {"type": "integer", "minimum": 1, "maximum": 7}})
WEATHER_PROMPT = "What will the weather be in PARIS for the next 30 days?"


def test_one_schema_through_the_three_sdks(daemon: Daemon, oa: openai.OpenAI,
                                           an: anthropic.Anthropic) -> None:
    r = ollama.Client(host=daemon.url, timeout=120).chat(
        model=MODEL, messages=user(PERSON_PROMPT), format=PERSON,
        options={"temperature": 0, "num_predict": BUDGET})
    assert r.done_reason == "stop"
    outputs = [r.message.content or "", via_openai(oa, PERSON, PERSON_PROMPT),
               via_anthropic(an, PERSON, PERSON_PROMPT)]
    for text in outputs:
        validate(parse(text), PERSON)


def test_one_forced_tool_call_through_the_sdks(oa: openai.OpenAI,
                                               an: anthropic.Anthropic) -> None:
    """Ollama's API has no tool_choice, so no call can be forced through its client: the
    OpenAI (named, strict) and Anthropic (`tool`) forms carry it."""
    r = oa.chat.completions.create(
        model=MODEL, messages=user(WEATHER_PROMPT), max_tokens=BUDGET,  # type: ignore[arg-type]
        temperature=0, seed=1, parallel_tool_calls=False,
        tools=[{"type": "function", "function": {"name": "forecast", "parameters": WEATHER,
                                                 "strict": True}}],
        tool_choice={"type": "function", "function": {"name": "forecast"}})
    (call,) = r.choices[0].message.tool_calls or []
    assert call.type == "function" and call.function.name == "forecast"
    validate(parse(call.function.arguments), WEATHER)

    msg = an.messages.create(
        model=MODEL, max_tokens=BUDGET, messages=user(WEATHER_PROMPT),  # type: ignore[arg-type]
        tools=[{"name": "forecast", "description": "Weather forecast",
                "input_schema": WEATHER}],
        tool_choice={"type": "tool", "name": "forecast", "disable_parallel_tool_use": True},
        extra_body={"temperature": 0})
    (use,) = [b for b in msg.content if b.type == "tool_use"]
    assert use.name == "forecast" and msg.stop_reason == "tool_use"
    validate(use.input, WEATHER)


# -- numbers -----------------------------------------------------------------------------------

PROBABILITY = {"type": "object", "properties": {"p": {"type": "number", "exclusiveMinimum": 0,
                                                      "exclusiveMaximum": 1},
                                                "n": {"type": "number"}},
               "required": ["p", "n"], "additionalProperties": False}


GRAMMAR_MAX = 256  # tokens: more than the longest text PROBABILITY's grammar allows


@pytest.mark.parametrize("seed", range(8))
def test_sampled_numbers_validate_and_end(seed: int, api: httpx.Client,
                                          oa: openai.OpenAI) -> None:
    """Sampled hot, a small model's numbers stay within their bounds as a client parses them
    and end (unbounded digits ran to the token limit on 3 of 8 seeds). The budget is what the
    grammar allows at most, whatever is sampled: 2 numbers of at most 28 characters, 9 places
    for at most 21 characters of whitespace each, and the punctuation, under 256 characters,
    each token one at least. (A budget of 40 could pass or fail by the sampled path, which
    moves with the last bits of the logits: a prompt read from the prefix cache or cold.)"""
    prompt = ("How likely is rain tomorrow, as a probability p written with as many digits as "
              "you can, and the number n of raindrops, as JSON?")
    r = api.post("/api/chat", json={"model": MODEL, "messages": user(prompt), "stream": False,
                                    "format": PROBABILITY,
                                    "options": {"temperature": 1.0, "seed": seed,
                                                "num_predict": GRAMMAR_MAX}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["done_reason"] == "stop", body
    jsonschema.validate(json.loads(body["message"]["content"]), PROBABILITY)
    c = oa.chat.completions.create(
        model=MODEL, messages=user(prompt), max_tokens=GRAMMAR_MAX, temperature=0.8, seed=seed,  # type: ignore[arg-type]
        response_format={"type": "json_schema",
                         "json_schema": {"name": "p", "schema": PROBABILITY, "strict": True}})
    assert c.choices[0].finish_reason == "stop", c.choices[0].message
    jsonschema.validate(json.loads(c.choices[0].message.content or ""), PROBABILITY)
