"""Reranking through the real daemon, with SmolLM2 made a reranker by a Modelfile: the
endpoints and their aliases answer in their shapes, sorted, with `top_n` and
`return_documents`; every score is what plain llama-cpp-python computes as
p(yes) / (p(yes) + p(no)) on the same prompt (a 135M model's notion of relevance is no safe
assertion; its arithmetic is); bad input gets a clear 400 or 413 in OpenAI's shape and the
runner goes on serving; a long rerank beside a streaming chat leaves that stream whole."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from llmrun import bounds
from llmrun.store import Store
from tests.conftest import Daemon, make_home

# Qwen3-Reranker's published prompt (its model card), written out here independently of
# engine/rerank.py, so a change to the defaults there shows as a score mismatch here.
SYSTEM = ('Judge whether the Document meets the requirements based on the Query and the '
          'Instruct provided. Note that the answer can only be "yes" or "no".')
INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
RAW = ("<|im_start|>user\nTask: {instruction}\nQuestion: {query}\nPassage: {document}\n"
       "Does the passage answer the question?<|im_end|>\n<|im_start|>assistant\n")
RAW_INSTRUCTION = "Judge relevance"

QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital and largest city of France.",
        "Bananas are rich in potassium.",
        "The Eiffel Tower stands in Paris, on the Seine.",
        "France is a country in Western Europe.",
        "{query} is not filled in a document."]


@pytest.fixture(scope="module")
def rr(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[Daemon]:
    home = make_home(tmp_path_factory.mktemp("rerank-home"), smollm2_path)
    Store(home).create("smol-raw", f'FROM smollm2\nPARAMETER rerank_template """{RAW}"""\n'
                                   f'PARAMETER rerank_instruction "{RAW_INSTRUCTION}"\n'
                                   "PARAMETER rerank_yes Yes\nPARAMETER rerank_no No\n")
    # a fixed thread count: under 256 tokens of context a decode's last bits depend on it,
    # and the stream beside a rerank is compared token for token with the same stream alone
    d = Daemon(home, env={"LLMRUN_NUM_THREADS": "2"}).start()
    # the way a user makes one over HTTP: a model of the store, and a parameter
    r = httpx.post(f"{d.url}/api/create", json={"model": "smol-rank", "from": "smollm2",
                                                "parameters": {"rerank": True},
                                                "stream": False}, timeout=120)
    assert r.status_code == 200, r.text
    yield d
    d.stop()


@pytest.fixture(scope="module")
def api(rr: Daemon) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=rr.url, timeout=300) as client:
        yield client


@pytest.fixture(scope="module")
def reference(smollm2_path: Path) -> Any:
    """p(yes) / (p(yes) + p(no)) by plain llama-cpp-python, on a prompt's text: (score,
    tokens)."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=str(smollm2_path), n_ctx=2048, n_threads=1, logits_all=True,
                flash_attn=True, verbose=False)
    add_bos = llm.metadata.get("tokenizer.ggml.add_bos_token") == "true"

    def score(text: str, yes: str, no: str) -> tuple[float, int]:
        tokens = llm.tokenize(text.encode(), add_bos=add_bos, special=True)
        (y,) = llm.tokenize(yes.encode(), add_bos=False, special=True)
        (n,) = llm.tokenize(no.encode(), add_bos=False, special=True)
        llm.reset()
        llm.eval(tokens)
        logits = np.array(llm.scores[len(tokens) - 1], dtype=np.float64)
        p = np.exp(logits - logits.max())
        return float(p[y] / (p[y] + p[n])), len(tokens)
    return score


def chat_prompt(api: httpx.Client, model: str, document: str) -> str:
    """The default prompt as the model's chat template writes it (llama-server's
    /apply-template, which renders exactly what a chat request reads)."""
    user = f"<Instruct>: {INSTRUCTION}\n<Query>: {QUERY}\n<Document>: {document}"
    r = api.post("/apply-template", json={"model": model, "messages": [
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]})
    assert r.status_code == 200, r.text
    return str(r.json()["prompt"])


def test_scores_are_plain_llama_cpps_p_yes_on_the_same_prompt(api: httpx.Client,
                                                             reference: Any) -> None:
    r = api.post("/v1/rerank", json={"model": "smol-rank", "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    got = {x["index"]: x["relevance_score"] for x in body["results"]}
    refs = [reference(chat_prompt(api, "smol-rank", d), "yes", "no") for d in DOCS]
    for i, (ref, _) in enumerate(refs):
        assert got[i] == pytest.approx(ref, abs=1e-4), DOCS[i]
    assert body["usage"]["prompt_tokens"] == sum(n for _, n in refs)  # the same tokens

    # a Modelfile's own template (raw: {query}, {document}, {instruction}) and answer tokens
    r = api.post("/v1/rerank", json={"model": "smol-raw", "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    got = {x["index"]: x["relevance_score"] for x in r.json()["results"]}
    for i, doc in enumerate(DOCS):
        text = RAW.replace("{instruction}", RAW_INSTRUCTION).replace("{query}", QUERY) \
            .replace("{document}", doc)
        assert got[i] == pytest.approx(reference(text, "Yes", "No")[0], abs=1e-4), doc


def test_endpoints_and_aliases_answer_in_their_shapes(api: httpx.Client) -> None:
    first = None
    for path in ("/v1/rerank", "/rerank", "/v1/reranking"):
        r = api.post(path, json={"model": "smol-rank", "query": QUERY, "documents": DOCS})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == "smol-rank" and body["object"] == "list"
        assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] > 0
        results = body["results"]
        assert sorted(x["index"] for x in results) == list(range(len(DOCS)))
        scores = [x["relevance_score"] for x in results]
        assert scores == sorted(scores, reverse=True) and all(0 < s < 1 for s in scores)
        assert all(set(x) == {"index", "relevance_score"} for x in results)
        first = first or results
        assert results == first  # the same documents score the same by any path

    r = api.post("/v1/rerank", json={"model": "smol-rank", "query": QUERY, "top_n": 2,
                                     "return_documents": True,
                                     "documents": [{"text": d} for d in DOCS]})
    assert r.status_code == 200, r.text
    top = r.json()["results"]
    assert [x["index"] for x in top] == [x["index"] for x in first[:2]]
    assert [x["document"] for x in top] == [{"text": DOCS[x["index"]]} for x in top]

    r = api.post("/v2/rerank", json={"model": "smol-rank", "query": QUERY, "documents": DOCS,
                                     "top_n": 3})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["id"] and body["meta"]["api_version"] == {"version": "2"}
    assert body["results"] == first[:3]


def test_show_lists_rerank_for_a_reranker_only(api: httpx.Client) -> None:
    caps = api.post("/api/show", json={"model": "smol-rank"}).json()["capabilities"]
    assert "rerank" in caps and "completion" in caps
    assert "rerank" not in api.post("/api/show", json={"model": "smollm2"}).json()["capabilities"]
    params = api.post("/api/show", json={"model": "smol-raw"}).json()["parameters"]
    assert "rerank_yes" in params and "rerank_template" in params


@pytest.mark.parametrize(("body", "status", "words"), [
    ({"documents": []}, 400, "at least one document"),
    ({"query": ""}, 400, "'query' must be a non-empty string"),
    ({"documents": ["d"] * 10_000}, 413, f"the limit is {bounds.MAX_RERANK_DOCUMENTS}"),
    ({"documents": ["x" * (1 << 20)]}, 413,
     f"'documents[0]' is {1 << 20} characters, the limit is "
     f"{bounds.MAX_RERANK_DOCUMENT_CHARS}"),
    ({"documents": ["ok", {"text": 3}]}, 400, "'documents[1]' must be a string"),
    ({"documents": ["ok", ["a"]]}, 400, "'documents[1]' must be a string"),
    ({"model": "no-such-model"}, 404, "no-such-model"),
    # a chat model is not asked unless its Modelfile says how: a model not trained for it
    # would answer by chance, and the client should know it asked the wrong model
    ({"model": "smollm2"}, 400, "is not a reranker"),
    # past the context (num_ctx 2048) though within the characters' bound: the runner says so
    ({"documents": ["ok", "word " * 6000]}, 400, "document 1: its prompt is"),
    ({"model": "smol-raw", "documents": ["ok"], "query": "q"}, 200, ""),
])
def test_bad_input_gets_a_clear_error_and_nothing_crashes(
        api: httpx.Client, rr: Daemon, body: dict[str, Any], status: int, words: str) -> None:
    for path in ("/v1/rerank", "/v2/rerank"):
        r = api.post(path, json={"model": "smol-rank", "query": QUERY, "documents": DOCS,
                                 **body})
        assert r.status_code == status, r.text
        if status != 200:
            error = r.json()["error"]
            assert words in error["message"], error
            assert error["type"] == "invalid_request_error"
    # the daemon and the runner still serve
    r = api.post("/v1/rerank", json={"model": "smol-rank", "query": QUERY, "documents": ["a"]})
    assert r.status_code == 200 and len(r.json()["results"]) == 1
    assert rr.proc is not None and rr.proc.poll() is None


def _stream(url: str, out: dict[str, Any]) -> None:
    """A greedy streamed chat: its text, whether it ended properly, its largest gap."""
    parts, gaps, last = [], [], time.monotonic()
    with httpx.stream("POST", f"{url}/v1/chat/completions", timeout=300, json={
            "model": "smol-rank", "stream": True, "temperature": 0, "max_tokens": 120,
            "messages": [{"role": "user", "content": "Tell me about Paris."}]}) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            if line == "data: [DONE]":
                out["done"] = True
                break
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            parts.append(chunk["choices"][0]["delta"].get("content") or "")
    out["text"] = "".join(parts)
    out["gap"] = max(gaps[1:], default=0.0)


def test_a_long_rerank_beside_a_streaming_chat_leaves_the_stream_whole(rr: Daemon) -> None:
    # once to fill the slot's prefix cache, so the two compared below read the prompt alike
    _stream(rr.url, {})
    alone: dict[str, Any] = {}
    _stream(rr.url, alone)
    assert alone.get("done") and alone["text"]

    docs = [f"Document {i}: " + " ".join(["Paris", "bananas", "rivers", "towers"][i % 4:])
            for i in range(200)]
    answer: dict[str, Any] = {}

    def rerank() -> None:
        answer["r"] = httpx.post(f"{rr.url}/v1/rerank", timeout=300, json={
            "model": "smol-rank", "query": QUERY, "documents": docs})

    t = threading.Thread(target=rerank)
    t.start()
    time.sleep(0.5)  # (the rerank under way: its documents take seconds)
    beside: dict[str, Any] = {}
    _stream(rr.url, beside)
    still_reranking = t.is_alive()
    t.join(300)
    r = answer["r"]
    assert r.status_code == 200, r.text
    assert len(r.json()["results"]) == 200
    # the reranker reads on a context and thread of its own: the chat's greedy answer is the
    # same token for token, and it ended as it should
    assert beside.get("done") and beside["text"] == alone["text"]
    print(f"largest gap in the stream: alone {alone['gap']:.3f}s, beside a 200-document "
          f"rerank {beside['gap']:.3f}s (rerank still running at the stream's end: "
          f"{still_reranking})")


def test_the_cli_prints_a_ranked_table(rr: Daemon) -> None:
    env = {**os.environ, "LLMRUN_HOME": str(rr.home), "LLMRUN_HOST": f"127.0.0.1:{rr.port}"}
    out = subprocess.run([sys.executable, "-m", "llmrun", "rerank", "smol-rank", QUERY,
                          *DOCS[:3], "--top-n", "2"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].split() == ["RANK", "SCORE", "INDEX", "DOCUMENT"] and len(lines) == 3
    scores = [float(line.split()[1]) for line in lines[1:]]
    assert scores == sorted(scores, reverse=True) and all(0 < s < 1 for s in scores)
    assert {line.split(None, 3)[3] for line in lines[1:]} <= set(DOCS[:3])

    bad = subprocess.run([sys.executable, "-m", "llmrun", "rerank", "smollm2", QUERY, "doc"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "is not a reranker" in bad.stderr
    assert math.isfinite(scores[0])
