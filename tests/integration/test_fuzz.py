"""Fuzzing the real daemon: request bodies of all three dialects and `format` schemas, built by
hypothesis from valid requests with fields replaced by strange values (any JSON type, huge
numbers, deep nesting, unknown roles, hostile schemas).

What must hold for every body: an answer arrives (no hang), it is not a 5xx other than a clear
503, and the model is still served afterwards (no dead or wedged runner). Generation is capped
at a few tokens so the examples stay cheap; everything else is left to the fuzzer.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import Daemon, make_home

pytestmark = pytest.mark.model

MAX_TOKENS = 4
# per test; raise it for a longer hunt:
#   LLMRUN_FUZZ_EXAMPLES=500 pytest tests/integration/test_fuzz.py
EXAMPLES = int(os.environ.get("LLMRUN_FUZZ_EXAMPLES", "40"))


@pytest.fixture(scope="module")
def fuzz_daemon(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Daemon]:
    home = make_home(tmp_path_factory.mktemp("fuzz-home"), smollm2_path)
    d = Daemon(home, env={"LLMRUN_CONTEXT_LENGTH": "512"}).start()
    yield d
    d.stop()


# -- strategies ---------------------------------------------------------------------------

scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.sampled_from(["", "user", "assistant", "system", "tool", "json", "auto", "required",
                     "none", "any", "object", "\u0000", "<|im_end|>", "{{ .Prompt }}",
                     "{% for x in range(10) %}", "💥" * 10]),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)


def nested(depth: int, leaf: Any) -> Any:
    out = leaf
    for _ in range(depth):
        out = [out]
    return out


deep_values = st.builds(nested, st.integers(min_value=20, max_value=250), scalars)

schemas = st.recursive(
    st.one_of(
        st.fixed_dictionaries({"type": st.sampled_from(
            ["string", "integer", "number", "boolean", "null", "object", "array", "bogus"])}),
        st.fixed_dictionaries({"type": st.just("string"),
                               "maxLength": st.integers(-5, 10**7),
                               "minLength": st.integers(-5, 10**6)}),
        st.fixed_dictionaries({"type": st.just("integer"),
                               "minimum": st.integers(-(2**64), 2**64),
                               "maximum": st.integers(-(2**64), 2**64)}),
        st.fixed_dictionaries({"enum": st.lists(scalars, max_size=5)}),
        st.fixed_dictionaries({"const": scalars}),
        st.fixed_dictionaries({"$ref": st.sampled_from(["#", "#/$defs/x", "#/nope", "http://x"])}),
        st.fixed_dictionaries({"type": st.just("string"), "pattern": st.text(max_size=20)}),
        json_values,
    ),
    lambda inner: st.one_of(
        st.fixed_dictionaries({"type": st.just("object"),
                               "properties": st.dictionaries(st.text(max_size=6), inner,
                                                             max_size=3),
                               "required": st.lists(st.text(max_size=6), max_size=3)}),
        st.fixed_dictionaries({"type": st.just("array"), "items": inner,
                               "minItems": st.integers(-1, 10**6),
                               "maxItems": st.integers(-1, 10**7)}),
        st.fixed_dictionaries({"anyOf": st.lists(inner, max_size=3)}),
        st.fixed_dictionaries({"allOf": st.lists(inner, max_size=3)}),
        st.fixed_dictionaries({"$defs": st.fixed_dictionaries({"x": inner}), "$ref":
                               st.just("#/$defs/x")}),
    ),
    max_leaves=8,
)
odd = st.one_of(json_values, deep_values)


def perturb(base: dict[str, Any], fields: dict[str, st.SearchStrategy[Any]]) -> st.SearchStrategy:
    """`base` with some of `fields` set to fuzzed values (or removed)."""
    missing = object()

    def apply(changes: dict[str, Any]) -> dict[str, Any]:
        body = dict(base)
        for key, value in changes.items():
            if value is missing:
                body.pop(key, None)
            else:
                body[key] = value
        return body

    return st.fixed_dictionaries({}, optional={
        k: st.one_of(v, st.just(missing)) for k, v in fields.items()}).map(apply)


message = st.fixed_dictionaries({"role": st.one_of(st.sampled_from(
    ["user", "assistant", "system", "tool"]), json_values), "content": odd})
messages = st.one_of(st.lists(message, max_size=4), odd)
tools = st.one_of(odd, st.lists(st.fixed_dictionaries({
    "type": st.just("function"),
    "function": st.fixed_dictionaries({"name": st.text(max_size=10), "parameters": schemas})}),
    max_size=3))

OLLAMA = perturb(
    {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}], "stream": False},
    {"messages": messages, "format": st.one_of(schemas, st.just("json"), odd),
     "options": st.one_of(odd, st.fixed_dictionaries({}, optional={
         "num_ctx": st.integers(-10, 10**9), "num_batch": st.integers(-10, 10**9),
         "num_thread": st.integers(-10, 10**5), "stop": odd, "temperature": json_values,
         "seed": st.integers(-(2**70), 2**70), "top_k": st.integers(-10, 10**12)})),
     "tools": tools, "think": json_values, "keep_alive": json_values, "stream": json_values,
     "template": st.one_of(st.text(max_size=60), odd), "model": json_values,
     "logprobs": json_values, "top_logprobs": json_values})
OPENAI = perturb(
    {"model": "smollm2", "messages": [{"role": "user", "content": "Hi"}]},
    {"messages": messages, "response_format": st.one_of(
        odd, st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema":
                                    st.fixed_dictionaries({"name": st.just("x"),
                                                           "schema": schemas})})),
     "tools": tools, "tool_choice": json_values, "stop": odd, "n": st.integers(-5, 10**6),
     "logprobs": json_values, "top_logprobs": st.integers(-5, 10**6), "seed": json_values,
     "stream": st.booleans(), "stream_options": json_values, "temperature": json_values,
     "model": json_values, "reasoning_effort": json_values})
ANTHROPIC = perturb(
    {"model": "smollm2", "max_tokens": MAX_TOKENS,
     "messages": [{"role": "user", "content": "Hi"}]},
    {"messages": messages, "system": odd, "tools": st.one_of(odd, st.lists(
        st.fixed_dictionaries({"name": st.text(max_size=10), "input_schema": schemas}),
        max_size=3)),
     "tool_choice": json_values, "stop_sequences": odd, "thinking": json_values,
     "stream": st.booleans(), "model": json_values, "metadata": json_values,
     "output_config": st.one_of(odd, st.fixed_dictionaries(
         {"format": st.fixed_dictionaries({"type": st.just("json_schema"),
                                           "schema": schemas})}))})


# -- the property ---------------------------------------------------------------------------

def cap_tokens(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """Keep each example to a few tokens: the fuzzer explores shapes, not long answers."""
    if path == "/api/chat":
        opts = body.get("options")
        body["options"] = {**(opts if isinstance(opts, dict) else {}), "num_predict": MAX_TOKENS}
    elif path == "/v1/chat/completions":
        body["max_tokens"] = MAX_TOKENS
    else:
        body["max_tokens"] = MAX_TOKENS
    return body


def send(d: Daemon, path: str, body: dict[str, Any]) -> None:
    data = json.dumps(cap_tokens(path, body))
    with httpx.Client(base_url=d.url, timeout=120) as client, \
            client.stream("POST", path, content=data) as r:
        text = r.read().decode("utf-8", "replace")
    assert r.status_code < 500 or (r.status_code == 503 and "retry-after" in r.headers), \
        f"{path} answered {r.status_code}: {text[:500]}\nbody: {data[:2000]}"


def still_serves(d: Daemon) -> None:
    r = httpx.post(f"{d.url}/api/chat", timeout=120, json={
        "model": "smollm2", "stream": False, "options": {"num_predict": 2, "seed": 1},
        "messages": [{"role": "user", "content": "Hello"}]})
    assert r.status_code == 200, r.text
    assert r.json()["done"] is True


FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                derandomize=EXAMPLES <= 40,  # CI: the same examples every run
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("path,strategy", [("/api/chat", OLLAMA),
                                           ("/v1/chat/completions", OPENAI),
                                           ("/v1/messages", ANTHROPIC)],
                         ids=["ollama", "openai", "anthropic"])
def test_fuzzed_bodies_never_break_the_daemon(fuzz_daemon: Daemon, path: str,
                                              strategy: st.SearchStrategy) -> None:
    @FUZZ
    @given(body=strategy)
    def run(body: dict[str, Any]) -> None:
        send(fuzz_daemon, path, body)

    run()
    still_serves(fuzz_daemon)


def test_fuzzed_format_schemas(fuzz_daemon: Daemon) -> None:
    @FUZZ
    @given(schema=schemas)
    def run(schema: Any) -> None:
        send(fuzz_daemon, "/api/chat", {"model": "smollm2", "stream": False, "format": schema,
                                        "messages": [{"role": "user", "content": "Hi"}]})

    run()
    still_serves(fuzz_daemon)
