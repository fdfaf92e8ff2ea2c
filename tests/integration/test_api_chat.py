"""/api/chat against the real daemon and the real SmolLM2 model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import httpx
import ollama
import pytest

from llmrun.chat import templates

QUESTION = [{"role": "user", "content": "Why is the sky blue?"}]
GREEDY = {"temperature": 0, "repeat_penalty": 1.0, "seed": 1}


def chat(api: httpx.Client, **body: object) -> dict:
    r = api.post("/api/chat", json={"model": "smollm2", "messages": QUESTION, "stream": False,
                                    **body})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def reference(smollm2_path: Path) -> tuple[str, int]:
    """Greedy continuation from plain llama-cpp-python: (text of 24 tokens, prompt tokens)."""
    from llama_cpp import Llama

    # flash attention on, as the engine runs it (llama.cpp's "auto" picks it on CPU)
    llm = Llama(model_path=str(smollm2_path), n_ctx=512, n_threads=1, flash_attn=True,
                verbose=False)
    text = templates.render(llm.metadata["tokenizer.chat_template"], QUESTION)
    prompt = llm.tokenize(text.encode(), add_bos=False, special=True)
    out: list[int] = []
    for tok in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0):
        if tok == llm.token_eos() or len(out) == 24:
            break
        out.append(tok)
    return llm.detokenize(out).decode(), len(prompt)


def test_stream_shape_and_stats(api: httpx.Client) -> None:
    body = {"model": "smollm2", "messages": QUESTION, "options": {"num_predict": 16, **GREEDY}}
    with api.stream("POST", "/api/chat", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines() if line]
    *chunks, final = lines
    assert chunks, "expected streamed chunks before the final object"
    for c in chunks:
        assert c["done"] is False
        assert c["model"] == "smollm2"
        assert c["message"]["role"] == "assistant"
        assert isinstance(c["message"]["content"], str)
        assert c["created_at"].endswith("Z")
    assert final["done"] is True
    assert final["done_reason"] == "length"
    assert final["message"] == {"role": "assistant", "content": ""}
    assert final["eval_count"] == 16
    assert final["prompt_eval_count"] > 10
    for key in ("total_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(final[key], int) and final[key] > 0, key
    assert isinstance(final["load_duration"], int) and final["load_duration"] >= 0
    assert final["total_duration"] >= final["eval_duration"]
    assert "".join(c["message"]["content"] for c in chunks).strip()


def test_greedy_matches_plain_llama_cpp(api: httpx.Client, reference: tuple[str, int]) -> None:
    text, n_prompt = reference
    # A fresh runner: no cached prefix. With flash attention, llama.cpp's CPU kernel rounds
    # a sequence's rows differently in batches of 64 or more than in smaller ones, so cells
    # another request wrote can shift the logits (by up to 0.8 on this model) and the greedy
    # answer with them (docs/benchmarks.md, "Prefix reuse and flash attention").
    r = api.post("/api/generate", json={"model": "smollm2", "keep_alive": 0})
    assert r.status_code == 200, r.text
    got = chat(api, options={"num_predict": 24, **GREEDY})
    assert got["message"]["content"] == text
    assert got["prompt_eval_count"] == n_prompt
    assert got["eval_count"] == 24
    assert got["done_reason"] == "length"


def test_seeded_sampling_is_reproducible(api: httpx.Client) -> None:
    opts = {"num_predict": 20, "temperature": 1.0, "seed": 1234}
    a = chat(api, options=opts)["message"]["content"]
    b = chat(api, options=opts)["message"]["content"]
    c = chat(api, options={**opts, "seed": 99})["message"]["content"]
    assert a == b
    assert a != c


def test_stop_string_cuts_output(api: httpx.Client, reference: tuple[str, int]) -> None:
    text, _ = reference
    words = text.split()
    stop = words[len(words) // 2]
    got = chat(api, options={"num_predict": 24, "stop": [stop], **GREEDY})
    assert got["done_reason"] == "stop"
    assert got["message"]["content"] == text[: text.index(stop)]
    assert stop not in got["message"]["content"]


def test_empty_messages_loads_model(api: httpx.Client) -> None:
    r = api.post("/api/chat", json={"model": "smollm2", "messages": []})
    assert r.status_code == 200
    assert r.json()["done_reason"] == "load"
    assert r.json()["done"] is True


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"model": "nope", "messages": QUESTION}, 404,
         "model 'nope' not found, try pulling it first"),
        ({"messages": QUESTION}, 400, "'model'"),
        ({"model": "smollm2", "messages": "hi"}, 400, "'messages'"),
        ({"model": "smollm2", "messages": [{"role": "wizard", "content": "x"}]}, 400,
         "'messages.0.role'"),
        ({"model": "smollm2", "messages": QUESTION, "options": {"temperature": "hot"}}, 400,
         "options.temperature"),
        ({"model": "smollm2", "messages": QUESTION, "options": {"top_p": 3}}, 400,
         "options.top_p"),
        ({"model": "smollm2", "messages": QUESTION, "stream": "maybe"}, 400, "'stream'"),
        ({"model": "smollm2", "messages": QUESTION, "keep_alive": "soon"}, 400, "keep_alive"),
        ({"model": "../../etc/passwd", "messages": QUESTION}, 400, ".."),
    ],
)
def test_bad_input_is_answered_clearly(api: httpx.Client, body: dict, status: int,
                                       needle: str) -> None:
    r = api.post("/api/chat", json=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["error"]


def test_malformed_json(api: httpx.Client) -> None:
    r = api.post("/api/chat", content=b'{"model": "smollm2", "messages": [',
                 headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert "invalid JSON" in r.json()["error"]


def test_prompt_longer_than_context(api: httpx.Client) -> None:
    long = "blue sky " * 1500  # ~3000 tokens; the daemon runs with num_ctx 2048
    r = api.post("/api/chat", json={"model": "smollm2", "stream": False,
                                    "messages": [{"role": "user", "content": long}]})
    assert r.status_code == 400
    assert "context is 2048 tokens" in r.json()["error"]


def test_root_version_tags(api: httpx.Client) -> None:
    assert api.get("/").text == "llmrun is running"
    assert api.head("/").status_code == 200
    assert api.get("/api/version").json()["version"]
    models = api.get("/api/tags").json()["models"]
    assert [m["name"] for m in models] == ["smollm2:latest"]
    m = models[0]
    assert m["size"] > 90_000_000
    assert m["details"]["family"] == "llama"
    assert m["details"]["quantization_level"] == "Q4_1"


def test_official_ollama_client(daemon) -> None:
    client = ollama.Client(host=daemon.url)
    resp = client.chat(model="smollm2", messages=QUESTION, options={"num_predict": 8, **GREEDY})
    assert resp.message.role == "assistant"
    assert resp.message.content
    assert resp.done and resp.eval_count == 8
    parts = list(client.chat(model="smollm2", messages=QUESTION, stream=True,
                             options={"num_predict": 8, **GREEDY}))
    assert parts[-1].done and parts[-1].done_reason == "length"
    assert "".join(p.message.content for p in parts) == resp.message.content
    assert [m.model for m in client.list().models] == ["smollm2:latest"]
    with pytest.raises(ollama.ResponseError) as err:
        client.chat(model="missing", messages=QUESTION)
    assert err.value.status_code == 404


def _runner_pids(daemon_pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(daemon_pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def test_runner_crash_mid_stream_is_reported_and_recovered(daemon, api: httpx.Client) -> None:
    body = {"model": "smollm2", "messages": QUESTION, "options": {"num_predict": 2000}}
    with api.stream("POST", "/api/chat", json=body) as r:
        lines = r.iter_lines()
        first = json.loads(next(lines))
        assert first["done"] is False
        pids = _runner_pids(daemon.proc.pid)
        assert pids, "expected a runner process under the daemon"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        rest = [json.loads(line) for line in lines if line]
    assert "error" in rest[-1]
    assert "SIGKILL" in rest[-1]["error"]
    # the daemon survived and starts a fresh runner for the next request
    again = chat(api, options={"num_predict": 4, **GREEDY})
    assert again["eval_count"] == 4


def test_format_json_and_schema(api: httpx.Client) -> None:
    got = chat(api, format="json", options={"num_predict": 300, "temperature": 0.7, "seed": 1},
               messages=[{"role": "user",
                          "content": "Reply in JSON with keys name and age for a cat."}])
    assert got["done_reason"] == "stop"
    json.loads(got["message"]["content"])  # JSON mode: always parses
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}
    for question in ("Describe a person.", "Who wrote Hamlet?", "Invent a pet."):
        got = chat(api, format=schema, options={"num_predict": 80, "temperature": 0.7,
                                                "seed": 3},
                   messages=[{"role": "user", "content": question}])
        obj = json.loads(got["message"]["content"])
        assert set(obj) == {"name", "age"}
        assert isinstance(obj["name"], str) and isinstance(obj["age"], int)
    r = api.post("/api/chat", json={"model": "smollm2", "messages": QUESTION, "format": "xml"})
    assert r.status_code == 400 and "format" in r.json()["error"]


def test_logprobs_match_plain_llama_cpp(api: httpx.Client, smollm2_path: Path) -> None:
    from llama_cpp import Llama

    got = chat(api, logprobs=True, top_logprobs=3, options={"num_predict": 24, **GREEDY})
    entries = got["logprobs"]
    assert len(entries) == 24
    assert "".join(e["token"] for e in entries) == got["message"]["content"]
    for e in entries:
        assert len(e["top_logprobs"]) == 3
        # greedy: the sampled token is the most likely one
        assert e["top_logprobs"][0]["token"] == e["token"]
        assert e["top_logprobs"][0]["logprob"] == pytest.approx(e["logprob"])
    llm = Llama(model_path=str(smollm2_path), n_ctx=512, n_threads=1, logits_all=True,
                flash_attn=True, verbose=False)
    text = templates.render(llm.metadata["tokenizer.chat_template"], QUESTION)
    prompt = llm.tokenize(text.encode(), add_bos=False, special=True)
    ref = llm.create_completion(prompt, max_tokens=24, temperature=0.0, top_k=1,
                                repeat_penalty=1.0, logprobs=1)
    ref_lp = ref["choices"][0]["logprobs"]["token_logprobs"]
    assert ref["choices"][0]["logprobs"]["tokens"] == [e["token"] for e in entries]
    ours = sum(e["logprob"] for e in entries) / len(entries)
    theirs = sum(ref_lp) / len(ref_lp)
    assert ours == pytest.approx(theirs, rel=1e-3)
    for e, lp in zip(entries, ref_lp, strict=True):
        assert e["logprob"] == pytest.approx(lp, abs=1e-4)


def test_body_without_json_content_type(api: httpx.Client) -> None:
    # `curl -d '{...}'`, as in Ollama's docs, sends a form content type
    body = json.dumps({"model": "smollm2", "messages": QUESTION, "stream": False,
                       "options": {"num_predict": 2}})
    r = api.post("/api/chat", content=body,
                 headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200, r.text
    assert r.json()["eval_count"] == 2
