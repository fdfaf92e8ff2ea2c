"""Reranking through the real daemon, with SmolLM2 made a reranker by a Modelfile: the
endpoints and their aliases answer in their shapes, sorted, with `top_n` and
`return_documents`; every score is what plain llama-cpp-python computes as
p(yes) / (p(yes) + p(no)) on the same prompt (a 135M model's notion of relevance is no safe
assertion; its arithmetic is); bad input gets a clear 400 or 413 in OpenAI's shape and the
runner goes on serving; a long rerank, or hostile requests, beside a streaming chat leave that
stream whole; the bodies Cohere's v2 client and Jina's send are answered in the shapes they
parse. Embedding beside it: `llmrun embed` and a Modelfile's embed_prefix."""

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
    Store(home).create("smol-query", 'FROM smollm2\nPARAMETER embed_prefix "search_query: "\n')
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


# what a hostile or careless client sends: each refused before a runner is leased
HOSTILE: list[tuple[dict[str, Any], int, str]] = [
    ({"query": ""}, 400, "'query' must be a non-empty string"),
    ({"documents": ["d"] * 10_000}, 413, f"the limit is {bounds.MAX_RERANK_DOCUMENTS}"),
    ({"documents": ["x" * (1 << 20)]}, 413,
     f"'documents[0]' is {1 << 20} characters, the limit is "
     f"{bounds.MAX_RERANK_DOCUMENT_CHARS}"),
    # a chat model is not asked unless its Modelfile says how: a model not trained for it
    # would answer by chance, and the client should know it asked the wrong model
    ({"model": "smollm2"}, 400, "is not a reranker"),
]


def refused(api: httpx.Client, body: dict[str, Any], status: int, words: str) -> None:
    """`body` over the defaults, on the llama-server/Jina route and Cohere's: `status`, and
    an OpenAI-shaped error saying `words`."""
    for path in ("/v1/rerank", "/v2/rerank"):
        r = api.post(path, json={"model": "smol-rank", "query": QUERY, "documents": DOCS,
                                 **body})
        assert r.status_code == status, r.text
        if status != 200:
            error = r.json()["error"]
            assert words in error["message"], error
            assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(("body", "status", "words"), [
    *HOSTILE,
    ({"documents": []}, 400, "at least one document"),
    ({"documents": ["ok", {"text": 3}]}, 400, "'documents[1]' must be a string"),
    ({"documents": ["ok", ["a"]]}, 400, "'documents[1]' must be a string"),
    ({"model": "no-such-model"}, 404, "no-such-model"),
    # past the context (num_ctx 2048) though within the characters' bound: the runner says so
    ({"documents": ["ok", "word " * 6000]}, 400, "document 1: its prompt is"),
    ({"model": "smol-raw", "documents": ["ok"], "query": "q"}, 200, ""),
])
def test_bad_input_gets_a_clear_error_and_nothing_crashes(
        api: httpx.Client, rr: Daemon, body: dict[str, Any], status: int, words: str) -> None:
    refused(api, body, status, words)
    # the daemon and the runner still serve
    r = api.post("/v1/rerank", json={"model": "smol-rank", "query": QUERY, "documents": ["a"]})
    assert r.status_code == 200 and len(r.json()["results"]) == 1
    assert rr.proc is not None and rr.proc.poll() is None


def _stream(url: str, out: dict[str, Any], started: threading.Event | None = None) -> None:
    """A greedy streamed chat: its text, whether it ended properly, its largest gap;
    `started` is set once its first token is in."""
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
            if started is not None and parts[-1]:
                started.set()
    out["text"] = "".join(parts)
    out["gap"] = max(gaps[1:], default=0.0)


@pytest.fixture(scope="module")
def alone(rr: Daemon) -> dict[str, Any]:
    """The greedy stream with nothing beside it, what the streams beside others must equal."""
    # once to fill the slot's prefix cache, so the streams compared read the prompt alike
    _stream(rr.url, {})
    out: dict[str, Any] = {}
    _stream(rr.url, out)
    assert out.get("done") and out["text"]
    return out


def test_a_long_rerank_beside_a_streaming_chat_leaves_the_stream_whole(
        rr: Daemon, alone: dict[str, Any]) -> None:

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


def test_hostile_reranks_beside_a_streaming_chat_leave_the_stream_whole(
        api: httpx.Client, rr: Daemon, alone: dict[str, Any]) -> None:
    started = threading.Event()
    beside: dict[str, Any] = {}
    t = threading.Thread(target=_stream, args=(rr.url, beside, started))
    t.start()
    assert started.wait(300), "the stream never started"
    for body, status, words in HOSTILE:
        refused(api, body, status, words)
    t.join(300)
    assert beside.get("done") and beside["text"] == alone["text"]
    assert rr.proc is not None and rr.proc.poll() is None


def test_cohere_and_jina_clients_bodies_are_answered_in_their_shapes(
        api: httpx.Client) -> None:
    ref = api.post("/v1/rerank", json={"model": "smol-rank", "query": QUERY,
                                       "documents": DOCS}).json()["results"]
    # Cohere's v2 client (cohere.ClientV2.rerank): strings, top_n, max_tokens_per_doc, its
    # Fern headers; it parses `id`, `results` (index, relevance_score) and `meta`
    r = api.post("/v2/rerank", headers={"Authorization": "Bearer co-key",
                                        "X-Fern-Language": "Python",
                                        "X-Client-Name": "llmrun-test"},
                 json={"model": "smol-rank", "query": QUERY, "documents": DOCS, "top_n": 3,
                       "max_tokens_per_doc": 4096})
    assert r.status_code == 200, r.text
    body = r.json()
    assert isinstance(body["id"], str) and body["meta"]["api_version"]["version"] == "2"
    assert body["results"] == ref[:3]
    assert all(isinstance(x["index"], int) and isinstance(x["relevance_score"], float)
               for x in body["results"])

    # Jina's reranker API body: documents as strings or {"text"}, top_n, return_documents;
    # its clients read `results` (index, relevance_score, document.text) and
    # `usage.total_tokens`
    for documents in (DOCS, [{"text": d} for d in DOCS]):
        r = api.post("/v1/rerank", json={"model": "smol-rank", "query": QUERY,
                                         "documents": documents, "top_n": 2,
                                         "return_documents": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert [(x["index"], x["relevance_score"]) for x in body["results"]] == \
            [(x["index"], x["relevance_score"]) for x in ref[:2]]
        assert [x["document"]["text"] for x in body["results"]] == \
            [DOCS[x["index"]] for x in ref[:2]]
        assert isinstance(body["usage"]["total_tokens"], int) and body["usage"]["total_tokens"]


def test_the_embed_prefix_is_embedded_before_every_text(api: httpx.Client) -> None:
    def embed(model: str, texts: list[str]) -> tuple[list[list[float]], int]:
        r = api.post("/api/embed", json={"model": model, "input": texts})
        assert r.status_code == 200, r.text
        return r.json()["embeddings"], r.json()["prompt_eval_count"]
    prefixed, n_prefixed = embed("smol-query", ["Paris", "bananas"])
    written, n_written = embed("smollm2", ["search_query: Paris", "search_query: bananas"])
    bare, n_bare = embed("smollm2", ["Paris", "bananas"])
    assert prefixed == written and n_prefixed == n_written > n_bare
    assert prefixed != bare
    # OpenAI's route too (one text alone: a batch's shape moves the last bits)
    one = [api.post("/v1/embeddings", json={"model": model, "input": text}).json()
           for model, text in (("smol-query", "Paris"), ("smollm2", "search_query: Paris"))]
    assert one[0]["data"][0]["embedding"] == one[1]["data"][0]["embedding"]
    assert one[0]["usage"]["prompt_tokens"] == one[1]["usage"]["prompt_tokens"]


def test_the_cli_prints_one_vector_per_text(rr: Daemon, api: httpx.Client) -> None:
    env = {**os.environ, "LLMRUN_HOME": str(rr.home), "LLMRUN_HOST": f"127.0.0.1:{rr.port}"}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "llmrun", "embed", *args], env=env,
                              capture_output=True, text=True, timeout=120)
    out = cli("smollm2", "Paris", "bananas")
    assert out.returncode == 0, out.stderr
    vectors = [json.loads(line) for line in out.stdout.splitlines()]
    want = api.post("/api/embed", json={"model": "smollm2", "input": ["Paris", "bananas"]})
    assert vectors == want.json()["embeddings"]

    out = cli("smollm2", "Paris", "--dimensions", "8")
    assert out.returncode == 0, out.stderr
    (short,) = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(short) == 8 and math.isclose(sum(x * x for x in short), 1.0, rel_tol=1e-6)

    bad = cli("no-such-model", "x")
    assert bad.returncode == 1 and "no-such-model" in bad.stderr and not bad.stdout
    bad = cli("smollm2", "x", "--dimensions", "0")
    assert bad.returncode != 0 and not bad.stdout


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
