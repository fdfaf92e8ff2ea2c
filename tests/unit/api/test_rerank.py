"""Reranking's wire shapes and bounds, through the OpenAI dialect's routes on a service with
fake runners (tests/fakes: a longer document scores higher): the answers' shapes, the order,
`top_n`, `return_documents`, and every refusal in OpenAI's error shape before a runner is
leased. Also the Modelfile's rerank parameters, `show`'s capability, the prompt's filling and
the score's arithmetic. Milliseconds, no model."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError

from llmrun import bounds, protocol
from llmrun.api.openai import router, validation_error
from llmrun.engine.rerank import fill, score
from llmrun.request import Options
from llmrun.server.scheduler import Scheduler
from llmrun.server.service import Service
from llmrun.store import Store
from llmrun.store.modelfile import ModelfileError, parse
from tests.fakes.scheduler import Farm
from tests.fakes.tinymodel import write_tiny_llama

DOCS = ["a much longer document than the others", "short", "a medium one"]


@pytest.fixture
def store(tmp_path: Path) -> Store:
    store = Store(tmp_path / "store")
    path = write_tiny_llama(tmp_path / "a.gguf", seed=0)
    store.create("chat", f"FROM {path}\n")
    store.create("ranker", f"FROM {path}\nPARAMETER rerank true\n")
    store.create("far", "FROM http://far.example/v1\nPARAMETER remote_model m\n"
                        "PARAMETER rerank true\n")
    rank = write_tiny_llama(tmp_path / "rank.gguf", seed=1, pooling=4)  # llama.cpp's RANK
    store.create("xenc", f"FROM {rank}\n")  # a reranker by its GGUF, no PARAMETER needed
    return store


Call = Callable[[str, dict[str, Any]], Awaitable[httpx.Response]]


def with_api(store: Store, tmp_path: Path,
             scenario: Callable[[Call, Farm], Awaitable[None]]) -> None:
    async def main() -> None:
        farm = Farm(store)
        sched = Scheduler(store, tmp_path / "logs", runner_factory=farm, free_memory=farm.free)
        app = FastAPI()
        app.include_router(router(Service(store, sched)))

        async def invalid(_: Any, exc: Exception) -> Any:
            assert isinstance(exc, RequestValidationError)
            return validation_error(exc)
        app.add_exception_handler(RequestValidationError, invalid)
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://test") as client:
            async def call(path: str, body: dict[str, Any]) -> httpx.Response:
                return await client.post(path, json=body)
            try:
                await scenario(call, farm)
            finally:
                await sched.shutdown()
    asyncio.run(asyncio.wait_for(main(), 60))


def fake_score(text: str) -> float:
    return len(text) / (1 + len(text))  # tests/fakes/scheduler.py's


def test_v1_rerank_and_its_aliases_answer_sorted_in_llama_servers_shape(
        store: Store, tmp_path: Path) -> None:
    async def scenario(call: Call, _: Farm) -> None:
        for path in ("/v1/rerank", "/rerank", "/v1/reranking"):
            r = await call(path, {"model": "ranker", "query": "q", "documents": DOCS})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["model"] == "ranker" and body["object"] == "list"
            assert [x["index"] for x in body["results"]] == [0, 2, 1]
            assert [x["relevance_score"] for x in body["results"]] == \
                [fake_score(DOCS[i]) for i in (0, 2, 1)]
            assert all("document" not in x for x in body["results"])
            assert body["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    with_api(store, tmp_path, scenario)


def test_a_cross_encoder_is_a_reranker_by_its_gguf(store: Store, tmp_path: Path) -> None:
    async def scenario(call: Call, farm: Farm) -> None:
        r = await call("/v1/rerank", {"model": "xenc", "query": "q", "documents": DOCS})
        assert r.status_code == 200, r.text
        assert [x["index"] for x in r.json()["results"]] == [0, 2, 1]
        assert len(farm.runners) == 1
    with_api(store, tmp_path, scenario)


def test_top_n_and_return_documents_with_documents_as_objects(
        store: Store, tmp_path: Path) -> None:
    async def scenario(call: Call, _: Farm) -> None:
        r = await call("/v1/rerank", {"model": "ranker", "query": "q", "top_n": 2,
                                      "return_documents": True,
                                      "documents": [{"text": d} for d in DOCS]})
        assert r.status_code == 200, r.text
        assert r.json()["results"] == [
            {"index": 0, "relevance_score": fake_score(DOCS[0]), "document": {"text": DOCS[0]}},
            {"index": 2, "relevance_score": fake_score(DOCS[2]), "document": {"text": DOCS[2]}}]
        # top_n past the documents: all of them
        r = await call("/v1/rerank", {"model": "ranker", "query": "q", "top_n": 10,
                                      "documents": DOCS})
        assert len(r.json()["results"]) == 3
    with_api(store, tmp_path, scenario)


def test_v2_rerank_answers_in_cohere_shape(store: Store, tmp_path: Path) -> None:
    async def scenario(call: Call, _: Farm) -> None:
        r = await call("/v2/rerank", {"model": "ranker", "query": "q", "documents": DOCS,
                                      "top_n": 1})
        assert r.status_code == 200, r.text
        body = r.json()
        assert isinstance(body["id"], str) and body["id"]
        assert body["results"] == [{"index": 0, "relevance_score": fake_score(DOCS[0])}]
        assert body["meta"]["api_version"] == {"version": "2"}
        assert body["meta"]["billed_units"] == {"search_units": 1}
    with_api(store, tmp_path, scenario)


@pytest.mark.parametrize(("body", "status", "words", "param"), [
    ({"documents": []}, 400, "at least one document", None),
    ({"query": ""}, 400, "'query' must be a non-empty", None),
    ({"query": "q" * (bounds.MAX_RERANK_QUERY_CHARS + 1)}, 413,
     f"the limit is {bounds.MAX_RERANK_QUERY_CHARS}", None),
    ({"documents": ["d"] * (bounds.MAX_RERANK_DOCUMENTS + 1)}, 413,
     f"too many documents: {bounds.MAX_RERANK_DOCUMENTS + 1}, the limit is "
     f"{bounds.MAX_RERANK_DOCUMENTS}", None),
    ({"documents": ["ok", "x" * (bounds.MAX_RERANK_DOCUMENT_CHARS + 1)]}, 413,
     f"'documents[1]' is {bounds.MAX_RERANK_DOCUMENT_CHARS + 1} characters", None),
    ({"documents": ["ok", 5]}, 400, "'documents[1]' must be a string", "documents.1"),
    ({"documents": [{"title": "no text"}]}, 400, "'documents[0]' must be", "documents.0"),
    ({"model": "nothing"}, 404, "nothing", "model"),
    ({"model": "chat"}, 400, "is not a reranker", None),
    ({"model": "far"}, 400, "served by a remote server", None),
    ({"top_n": 0}, 400, "top_n", "top_n"),
    ({"query": None}, 400, "query", "query"),
])
def test_refusals_come_in_openai_shape_before_a_runner_is_leased(
        store: Store, tmp_path: Path, body: dict[str, Any], status: int, words: str,
        param: str | None) -> None:
    async def scenario(call: Call, farm: Farm) -> None:
        for path in ("/v1/rerank", "/v2/rerank"):
            r = await call(path, {"model": "ranker", "query": "q", "documents": ["d"], **body})
            assert r.status_code == status, r.text
            error = r.json()["error"]
            assert words in error["message"] and error["type"] == "invalid_request_error"
            assert error["param"] == param
        assert farm.runners == []  # nothing was loaded for a request refused
    with_api(store, tmp_path, scenario)


def test_the_modelfile_makes_a_reranker_and_show_lists_it(store: Store) -> None:
    mf = parse('FROM x\nPARAMETER rerank_yes "Yes"\nPARAMETER rerank_no No\n'
               'PARAMETER rerank_instruction """Find the code that does it"""\n'
               'PARAMETER rerank_template "{query} {document}"\n')
    assert mf.options().reranks() and mf.options().rerank_yes == "Yes"
    assert mf.options().rerank_template == "{query} {document}"
    assert parse(mf.render()).parameters == mf.parameters  # show --modelfile round trip
    assert not parse("FROM x\nPARAMETER rerank false\nPARAMETER rerank_yes y\n") \
        .options().reranks()  # said off, off
    assert not Options().reranks()
    with pytest.raises(ModelfileError, match="line 2: invalid value 'maybe'"):
        parse("FROM x\nPARAMETER rerank maybe\n")
    with pytest.raises(ModelfileError, match="line 2: invalid value"):
        parse("FROM x\nPARAMETER rerank_yes " + "y" * 65 + "\n")

    for name, expected in (("ranker", True), ("chat", False)):
        _, manifest = store.get(name)
        assert ("rerank" in store.capabilities(manifest)) is expected
        assert "completion" in store.capabilities(manifest)  # a reranker still chats


def test_the_prompt_is_filled_in_one_pass() -> None:
    values = {"query": "find {document}", "document": "the {query}", "instruction": "i"}
    assert fill("<{instruction}> {query} | {document} {other}", values) == \
        "<i> find {document} | the {query} {other}"


def test_the_score_is_p_yes_over_yes_and_no() -> None:
    for yes, no in ((2.0, -1.0), (-3.5, 0.25), (0.0, 0.0), (800.0, -800.0), (-800.0, 800.0)):
        d = yes - no
        ref = 1 / (1 + math.exp(-d)) if abs(d) < 700 else float(d > 0)
        assert score(yes, no) == pytest.approx(ref, abs=1e-12)
        assert 0.0 <= score(yes, no) <= 1.0
    assert math.isnan(score(float("nan"), 0.0))


def test_the_protocol_carries_rerank_both_ways() -> None:
    msg = protocol.parse_command({"type": "rerank", "id": "k1",
                                  "request": {"model": "m", "messages": []}, "query": "q",
                                  "documents": ["a", "b"], "offset": 4})
    assert isinstance(msg, protocol.Rerank) and msg.documents == ["a", "b"]
    with pytest.raises(protocol.ProtocolError, match=r"rerank.documents\[1\]"):
        protocol.parse_command({"type": "rerank", "id": "k1", "request": {}, "query": "q",
                                "documents": ["a", 2]})
    ok = {"type": "events", "events": [["k1", "rerank", {"scores": [0.5, 1],
                                                          "prompt_tokens": 9}]]}
    assert protocol.parse_reply(ok)
    for bad in ({"scores": [0.5], "prompt_tokens": -1}, {"scores": ["x"], "prompt_tokens": 1},
                {"scores": [0.5]}):
        with pytest.raises(protocol.ProtocolError):
            protocol.parse_reply({"type": "events", "events": [["k1", "rerank", bad]]})
    assert "rerank" in protocol.FINAL
