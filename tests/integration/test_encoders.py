"""Encoder-only models through the real daemon: the synthetic BERT (tests/fakes/
encodermodel.py) embeds with its GGUF's pooling (mean, CLS) and the cross-encoder reranks with
its head, every number held to plain llama-cpp-python's on the same model (its arithmetic,
not a random model's notion of relevance, is what can be asserted); a runner on an encoder
refuses generation with a 4xx and goes on serving; concurrent requests get each the answer
they get alone, to the bit."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf as gg
import httpx
import numpy as np
import pytest

from llmrun.store import Store
from tests.conftest import Daemon
from tests.fakes.encodermodel import SEP, write_tiny_bert

# on, as the engine decodes encoders (engine/sidework.py: llama.cpp's choice on the CPU), so
# the reference takes the same attention path: the two paths differ in the last bits (up to
# 1.1e-4 in a normalised vector of the synthetic BERT, which holds F16 weights)
FLASH_ATTN = True
SENTENCES = ["The cat sat on the mat.", "Paris is the capital of France!",
             "A quick brown fox jumps over the lazy dog", "zebra"]


def plain_embeddings(path: Path, pooling: int, texts: list[str]) -> np.ndarray:
    """What llama-cpp-python's own high-level API gives for the list: normalised, one row
    per text, the texts packed into decodes in order as its Llama.embed packs them (and as
    the engine packs one request's inputs for an encoder: engine/sidework.py's _packed)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), embedding=True, pooling_type=pooling, n_threads=1,
                          flash_attn=FLASH_ATTN, verbose=False)
    return np.array(llm.embed(texts, normalize=True), dtype=np.float64)


def plain_rank_logits(path: Path, pairs: list[tuple[str, str]]) -> list[float]:
    """The head's output for each (query, document), all pairs in one decode (sequences
    0, 1, ... in order, as the engine packs one request's pairs for an encoder), each pair
    built as llama-server's format_prompt_rerank builds it for this vocabulary (add_bos,
    add_sep, no add_eos): [CLS] query [SEP] document. Written out here, not taken from
    llmrun, so a change to the engine's pair shows as a mismatch."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), embedding=True, pooling_type=llama_cpp.LLAMA_POOLING_TYPE_RANK,
                          n_threads=1, flash_attn=FLASH_ATTN, verbose=False)
    llm._batch.reset()
    for seq, (query, doc) in enumerate(pairs):
        tokens = [llm.token_bos(), *llm.tokenize(query.encode(), add_bos=False), SEP,
                  *llm.tokenize(doc.encode(), add_bos=False)]
        llm._batch.add_sequence(tokens, seq, True)
    llm._ctx.decode(llm._batch)
    return [float(llama_cpp.llama_get_embeddings_seq(llm._ctx.ctx, seq)[0])
            for seq in range(len(pairs))]


def sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("encoders")
    return {"mean": write_tiny_bert(root / "bert-mean.gguf"),
            "cls": write_tiny_bert(root / "bert-cls.gguf", pooling=gg.PoolingType.CLS),
            "last": write_tiny_bert(root / "bert-last.gguf", pooling=gg.PoolingType.LAST),
            "rank": write_tiny_bert(root / "bert-rank.gguf", rank_head=True),
            "nomic": write_tiny_bert(root / "nomic-bert.gguf", arch="nomic-bert")}


def test_llama_cpp_loads_and_runs_the_synthetic_bert(models: dict[str, Path]) -> None:
    import llama_cpp

    mean = plain_embeddings(models["mean"], llama_cpp.LLAMA_POOLING_TYPE_MEAN, SENTENCES)
    cls = plain_embeddings(models["cls"], llama_cpp.LLAMA_POOLING_TYPE_CLS, SENTENCES)
    assert mean.shape == cls.shape == (4, 128)
    assert np.allclose(np.linalg.norm(mean, axis=1), 1)
    # distinct texts, distinct vectors; the two poolings differ
    assert len({tuple(np.round(v, 4)) for v in mean}) == 4
    assert not np.allclose(mean, cls, atol=1e-2)
    llm = llama_cpp.Llama(str(models["mean"]), vocab_only=True, verbose=False)
    # every word of the test sentences is a piece of the vocabulary, not [UNK] (id 1)
    assert 1 not in llm.tokenize(" ".join(SENTENCES[:3]).encode())


def test_llama_cpp_scores_pairs_with_the_rank_head(models: dict[str, Path]) -> None:
    logits = plain_rank_logits(models["rank"], [("capital of france", s) for s in SENTENCES])
    assert all(math.isfinite(x) for x in logits)
    # a head that spreads its outputs, so scores mean something to compare
    assert max(logits) - min(logits) > 0.1, logits


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory,
        models: dict[str, Path]) -> Iterator[httpx.Client]:
    """A daemon whose store holds each of `models` as bert-<key>."""
    home = tmp_path_factory.mktemp("encoders-home")
    store = Store(home)
    for name, path in models.items():
        store.create(f"bert-{name}", f"FROM {path}\n")
    d = Daemon(home).start()
    try:
        with httpx.Client(base_url=d.url, timeout=300) as client:
            yield client
    finally:
        d.stop()


def ollama_embed(api: httpx.Client, model: str, inputs: list[str], **extra: Any) -> np.ndarray:
    r = api.post("/api/embed", json={"model": model, "input": inputs, **extra})
    assert r.status_code == 200, r.text
    return np.array(r.json()["embeddings"], dtype=np.float64)


@pytest.mark.parametrize("pooling", ["mean", "cls", "last", "nomic"])
def test_embeddings_are_plain_llama_cpps_with_the_ggufs_pooling(
        api: httpx.Client, models: dict[str, Path], pooling: str) -> None:
    # (nomic: nomic-bert, mean pooling, rotary positions)
    kind = {"mean": gg.PoolingType.MEAN, "cls": gg.PoolingType.CLS,
            "last": gg.PoolingType.LAST, "nomic": gg.PoolingType.MEAN}[pooling]
    ref = plain_embeddings(models[pooling], int(kind), SENTENCES)
    got = ollama_embed(api, f"bert-{pooling}", SENTENCES)
    assert np.abs(got - ref).max() < 1e-4
    assert np.allclose(np.linalg.norm(got, axis=1), 1)
    r = api.post("/v1/embeddings", json={"model": f"bert-{pooling}", "input": SENTENCES})
    assert r.status_code == 200, r.text
    data = sorted(r.json()["data"], key=lambda x: x["index"])
    assert np.abs(np.array([d["embedding"] for d in data]) - ref).max() < 1e-4


def test_truncate_or_a_clear_400_past_the_context(api: httpx.Client,
                                                  models: dict[str, Path]) -> None:
    import llama_cpp

    long = " ".join(["cat"] * 700)  # 702 tokens with [CLS] and [SEP]; the context is 512
    r = api.post("/api/embed", json={"model": "bert-mean", "input": [long], "truncate": False})
    assert r.status_code == 400, r.text
    assert "512" in r.text and "truncate" in r.text
    got = ollama_embed(api, "bert-mean", [long], truncate=True)
    # the first 512 tokens, as plain llama-cpp-python embeds them with truncate
    llm = llama_cpp.Llama(str(models["mean"]), embedding=True, n_ctx=512, n_batch=512,
                          n_ubatch=512, n_threads=1, flash_attn=FLASH_ATTN, verbose=False)
    ref = np.array(llm.embed(long, normalize=True, truncate=True), dtype=np.float64)
    assert np.abs(got[0] - ref).max() < 1e-4


QUERY = "what is the capital of france?"
DOCS = ["Paris is the capital of France.", "The cat sat on the mat.",
        "Berlin is the capital of Germany.", "fish", "A quick brown fox jumps over the lazy dog"]


def test_cross_encoder_scores_are_sigmoid_of_plain_llama_cpps_head(
        api: httpx.Client, models: dict[str, Path]) -> None:
    r = api.post("/v1/rerank", json={"model": "bert-rank", "query": QUERY, "documents": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    got = {x["index"]: x["relevance_score"] for x in body["results"]}
    ref = [sigmoid(x) for x in plain_rank_logits(models["rank"], [(QUERY, d) for d in DOCS])]
    assert max(abs(got[i] - ref[i]) for i in range(len(DOCS))) < 1e-4
    scores = [x["relevance_score"] for x in body["results"]]
    assert scores == sorted(scores, reverse=True)
    # a cross-encoder has no embeddings: a clear 400, not the head's output as a vector
    r = api.post("/api/embed", json={"model": "bert-rank", "input": ["x"]})
    assert r.status_code == 400 and "rerank" in r.text, r.text
    # an embedding model with no head is no reranker
    r = api.post("/v1/rerank", json={"model": "bert-mean", "query": QUERY, "documents": DOCS})
    assert r.status_code == 400, r.text


def concurrently(*calls: Any) -> list[Any]:
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        results[i] = calls[i]()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_concurrent_requests_get_what_they_get_alone(api: httpx.Client) -> None:
    # inputs of one length in both requests: those are what a shared decode would change
    # (an encoder's numbers depend on the rows beside them, engine/sidework.py)
    a = [f"the {w} sat on the mat" for w in ("cat", "dog", "bird", "fish", "man")] * 3
    b = [f"the {w} sat on a car" for w in ("sun", "moon", "sea", "tree")] * 3 + ["hello"]
    alone = [ollama_embed(api, "bert-cls", a), ollama_embed(api, "bert-cls", b)]
    for _ in range(3):
        together = concurrently(lambda: ollama_embed(api, "bert-cls", a),
                                lambda: ollama_embed(api, "bert-cls", b))
        assert np.array_equal(together[0], alone[0])
        assert np.array_equal(together[1], alone[1])
    rank_alone = api.post("/v1/rerank", json={"model": "bert-rank", "query": QUERY,
                                              "documents": DOCS}).json()
    both = concurrently(*[lambda: api.post("/v1/rerank", json={
        "model": "bert-rank", "query": QUERY, "documents": DOCS}).json()] * 2)
    assert both[0]["results"] == both[1]["results"] == rank_alone["results"]


def test_generation_on_an_encoder_is_a_4xx_and_the_runner_serves_on(
        api: httpx.Client, models: dict[str, Path]) -> None:
    before = ollama_embed(api, "bert-mean", SENTENCES[:1])
    r = api.post("/api/chat", json={"model": "bert-mean", "stream": False,
                                    "messages": [{"role": "user", "content": "hello"}]})
    assert 400 <= r.status_code < 500, r.text
    r = api.post("/v1/chat/completions", json={
        "model": "bert-mean", "messages": [{"role": "user", "content": "hello"}]})
    assert 400 <= r.status_code < 500, r.text
    r = api.post("/api/generate", json={"model": "bert-rank", "prompt": "hello",
                                        "stream": False})
    assert 400 <= r.status_code < 500, r.text
    assert np.array_equal(ollama_embed(api, "bert-mean", SENTENCES[:1]), before)
