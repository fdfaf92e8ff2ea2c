"""The rest of Ollama's native API (generate, embed, embeddings, ps) with the official client."""

from __future__ import annotations

import json

import numpy as np
import ollama
import pytest

from tests.conftest import wait_until

GREEDY = {"temperature": 0, "repeat_penalty": 1.0, "seed": 1}


@pytest.fixture
def client(daemon) -> ollama.Client:
    return ollama.Client(host=daemon.url)


def test_generate_stream_and_not(client: ollama.Client) -> None:
    whole = client.generate(model="smollm2", prompt="Say hi.", options={"num_predict": 8, **GREEDY})
    assert whole.done and whole.done_reason == "length" and whole.eval_count == 8
    assert whole.response.strip()
    parts = list(client.generate(model="smollm2", prompt="Say hi.", stream=True,
                                 options={"num_predict": 8, **GREEDY}))
    assert parts[-1].done and parts[-1].prompt_eval_count == whole.prompt_eval_count
    assert "".join(p.response for p in parts) == whole.response


def test_generate_raw_and_system(client: ollama.Client) -> None:
    templated = client.generate(model="smollm2", prompt="Hi", options={"num_predict": 6, **GREEDY})
    raw = client.generate(model="smollm2", raw=True, options={"num_predict": 6, **GREEDY},
                          prompt="<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    # raw skips the template (and its default system prompt): fewer prompt tokens
    assert raw.prompt_eval_count < templated.prompt_eval_count
    pirate = client.generate(model="smollm2", prompt="Hi", system="You are a pirate.",
                             options={"num_predict": 6, **GREEDY})
    assert pirate.prompt_eval_count != templated.prompt_eval_count


def test_generate_refuses_what_it_cannot_do(client: ollama.Client) -> None:
    with pytest.raises(ollama.ResponseError) as err:
        client.generate(model="smollm2", prompt="x", images=["aGVsbG8="])
    assert err.value.status_code == 400 and "images" in str(err.value)
    with pytest.raises(ollama.ResponseError) as err:
        client.generate(model="nope", prompt="x")
    assert err.value.status_code == 404


def test_embed(client: ollama.Client) -> None:
    texts = ["The cat sat on the mat.", "A feline rested on the rug.",
             "Quarterly revenue grew five percent."]
    out = client.embed(model="smollm2", input=texts)
    v = np.array(out.embeddings)
    assert v.shape == (3, 576)
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0)
    sim = v @ v.T
    assert sim[0, 1] > sim[0, 2] and sim[0, 1] > sim[1, 2]  # meaning, not noise
    assert out.prompt_eval_count > 10
    # the same text alone or in a batch embeds the same
    single = np.array(client.embed(model="smollm2", input=texts[0]).embeddings[0])
    assert np.allclose(single, v[0], atol=1e-4)
    short = client.embed(model="smollm2", input=texts[:1], dimensions=64)
    assert len(short.embeddings[0]) == 64
    legacy = client.embeddings(model="smollm2", prompt=texts[0]).embedding
    assert np.allclose(legacy, v[0], atol=1e-4)


def test_embed_too_long_without_truncate(client: ollama.Client) -> None:
    long = "word " * 3000
    with pytest.raises(ollama.ResponseError) as err:
        client.embed(model="smollm2", input=long, truncate=False)
    assert err.value.status_code == 400 and "num_ctx" in str(err.value)
    ok = client.embed(model="smollm2", input=long)  # truncate defaults to true
    assert len(ok.embeddings[0]) == 576


def test_ps_and_unload(client: ollama.Client) -> None:
    client.generate(model="smollm2", prompt="x", options={"num_predict": 1})
    models = client.ps().models
    assert [m.model for m in models] == ["smollm2:latest"]
    assert models[0].context_length == 2048
    assert models[0].expires_at is not None
    gone = client.generate(model="smollm2", prompt="", keep_alive=0)
    assert gone.done_reason == "unload"
    # at once when idle; a lease still being released (a stream that just ended) defers it
    wait_until(lambda: client.ps().models == [], what="the model was not unloaded")


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}


def test_chat_with_tools_round_trip(client: ollama.Client) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris? Use the tool."}]
    # SmolLM2 is not trained for tools; a JSON-schema format is not a tool choice, so only
    # check that tool calls, when the model makes them, arrive parsed and never as text
    out = client.chat(model="smollm2", messages=ask, tools=[WEATHER],
                      options={"num_predict": 48, **GREEDY})
    assert "<tool_call>" not in (out.message.content or "")
    for call in out.message.tool_calls or []:
        assert call.function.name == "get_weather"
        assert isinstance(call.function.arguments, dict)
    history = [*ask, {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_name": "get_weather", "content": "22 degrees and sunny"}]
    final = client.chat(model="smollm2", messages=history, tools=[WEATHER],
                        options={"num_predict": 24, **GREEDY})
    assert final.done
    # the tool result reached the prompt (it is longer than the question alone)
    assert final.prompt_eval_count > out.prompt_eval_count


# -- format: enforced (Ollama has no tool_choice; forced calls are the other dialects') ------

GUEST = {"type": "object", "additionalProperties": False,
         "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 150},
                        "guest": {"type": "string", "maxLength": 8}},
         "required": ["age", "guest"]}
GUEST_ASK = "Bartholomew Maximilian Fitzgerald is 987654321987 years old. As JSON:"


def test_format_schema_holds_bounds_and_max_length(client: ollama.Client) -> None:
    import jsonschema

    chat = client.chat(model="smollm2", messages=[{"role": "user", "content": GUEST_ASK}],
                       format=GUEST, options={"num_predict": 40, **GREEDY})
    assert chat.done_reason == "stop"
    jsonschema.validate(json.loads(chat.message.content or ""), GUEST)
    gen = client.generate(model="smollm2", prompt=GUEST_ASK, format=GUEST,
                          options={"num_predict": 40, **GREEDY})
    assert gen.done_reason == "stop"
    jsonschema.validate(json.loads(gen.response), GUEST)


def test_format_json_is_an_object_and_unsupported_keywords_are_refused(
        client: ollama.Client) -> None:
    out = client.generate(model="smollm2", prompt="Three colours as a JSON list:", format="json",
                          options={"num_predict": 30, **GREEDY})
    assert out.response.startswith("{"), out.response
    if out.done_reason == "stop":  # an open object may run past the limit
        assert isinstance(json.loads(out.response), dict)
    unique = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    with pytest.raises(ollama.ResponseError) as info:  # Ollama's format is always strict
        client.generate(model="smollm2", prompt="x", format=unique,
                        options={"num_predict": 5})
    assert info.value.status_code == 400 and "uniqueItems" in info.value.error
