"""The embedding and rerank benchmark (llmrun/bench/retrieval.py) against fake servers: what
it sends, how it counts, the turns and their medians, the table. No model, no speed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest

from llmrun.bench import retrieval
from llmrun.bench.report import RetrievalResult, median_run
from llmrun.bench.servers import Server, turn_order
from tests.fakes.httpserve import serving


class _Fake(BaseHTTPRequestHandler):
    """Answers /v1/embeddings and /v1/rerank as llama-server and llmrun do: an item per input
    (or `short` fewer), usage with one token per word; `refuse`: a 501 as llama-server gives
    when started without the mode."""

    seen: list[tuple[str, dict[str, Any]]]
    short = 0
    refuse = False

    def do_POST(self) -> None:  # (http.server's name for it)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.seen.append((self.path, body))
        if self.refuse:
            out: dict[str, Any] = {"error": {"code": 501, "message": "start it with --rerank"}}
            status = 501
        elif self.path == "/v1/embeddings":
            items = body["input"][: len(body["input"]) - self.short]
            out = {"data": [{"index": i, "embedding": [0.5]} for i in range(len(items))],
                   "usage": {"prompt_tokens": sum(len(x.split()) for x in items)}}
            status = 200
        else:
            docs = body["documents"][: len(body["documents"]) - self.short]
            out = {"results": [{"index": i, "relevance_score": 0.1} for i in range(len(docs))],
                   "usage": {"prompt_tokens": sum(len(x.split()) for x in docs)}}
            status = 200
        data = json.dumps(out).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


def _serve(**behaviour: Any) -> Iterator[tuple[str, list[tuple[str, dict[str, Any]]]]]:
    seen: list[tuple[str, dict[str, Any]]] = []
    with serving(type("Handler", (_Fake,), {"seen": seen, **behaviour})) as url:
        yield url, seen


@pytest.fixture
def fake() -> Iterator[tuple[str, list[tuple[str, dict[str, Any]]]]]:
    yield from _serve()


def test_texts_are_fixed_distinct_and_tagged() -> None:
    a, b = retrieval.texts(40), retrieval.texts(40)
    assert a == b and len(set(a)) == 40  # the same workload every run, no two inputs alike
    assert all(t.startswith("Day 3. Text ") for t in retrieval.texts(5, "Day 3. "))
    words = [len(t.split()) for t in a]
    assert 35 <= sum(words) / len(words) <= 60  # ~60 tokens: a word and a bit each


def test_embedding_requests_cover_the_inputs_in_batches_with_a_tag_per_level() -> None:
    work = retrieval.Workload("embedding", inputs=20, batch=8)
    first = work.bodies("m", 4)
    assert [(path, n) for path, _, n in first] == [("/v1/embeddings", 8)] * 2 + [
        ("/v1/embeddings", 4)]
    inputs = [x for _, body, _ in first for x in body["input"]]
    assert len(set(inputs)) == 20 and {body["model"] for _, body, _ in first} == {"m"}
    second = [x for _, body, _ in work.bodies("m", 4) for x in body["input"]]
    # the next level's inputs open differently: no prompt cache can answer them
    assert not set(second) & set(inputs)
    assert work.bodies("m", 1) and len(work.bodies("m", 1)) == 3  # whatever the concurrency


def test_rerank_sends_a_request_per_client_each_with_its_own_tag() -> None:
    work = retrieval.Workload("rerank", docs=5)
    bodies = work.bodies("r", 3)
    assert [(path, n) for path, _, n in bodies] == [("/v1/rerank", 5)] * 3
    queries = [body["query"] for _, body, _ in bodies]
    assert len(set(queries)) == 3 and all(q.endswith(retrieval.QUERY) for q in queries)
    assert all(len(body["documents"]) == 5 for _, body, _ in bodies)
    assert "documents" in work.describe() and work.items() == "documents"


@pytest.mark.parametrize(("kind", "concurrency"), [("embedding", 1), ("embedding", 3),
                                                   ("rerank", 1), ("rerank", 2)])
def test_a_level_counts_every_item_once(fake: tuple[str, list[Any]], kind: retrieval.Kind,
                                        concurrency: int) -> None:
    url, seen = fake
    work = retrieval.Workload(kind, inputs=10, batch=4, docs=6)
    r = asyncio.run(retrieval.level(Server("x", url, "m", "openai"), work, concurrency))
    sent = sum(len(b["input"] if kind == "embedding" else b["documents"]) for _, b in seen)
    assert sent == (10 if kind == "embedding" else 6 * concurrency)
    assert len(seen) == (3 if kind == "embedding" else concurrency)
    assert r["items_s"] > 0 and r["tokens_s"] > 0 and 0 < r["p50"] <= r["p95"]


def test_a_server_that_answers_fewer_items_stops_the_level() -> None:
    for url, _ in _serve(short=1):
        work = retrieval.Workload("embedding", inputs=4, batch=4)
        with pytest.raises(RuntimeError, match="4 embedding items sent, 3 answered"):
            asyncio.run(retrieval.level(Server("x", url, "m", "openai"), work, 1))


def test_probe_says_why_a_server_refuses() -> None:
    work = retrieval.Workload("rerank", docs=4)
    for url, seen in _serve(refuse=True):
        reason = asyncio.run(retrieval.probe(Server("x", url, "m", "openai"), work))
        assert reason is not None and "501" in reason and "--rerank" in reason
        assert len(seen[0][1]["documents"]) == 2  # a small request, not the workload
    for url, _ in _serve():
        assert asyncio.run(retrieval.probe(Server("x", url, "m", "openai"), work)) is None


def test_a_run_alternates_the_servers_and_pairs_their_turns(
        fake: tuple[str, list[tuple[str, dict[str, Any]]]]) -> None:
    url, seen = fake
    for other, _ in _serve(refuse=True):
        servers = [Server("llmrun /v1", url, "m", "openai"),
                   Server("b /v1", url, "n", "openai"),
                   Server("refuser /v1", other, "m", "openai")]
        work = retrieval.Workload("embedding", inputs=4, batch=2)
        result = retrieval.run(work, Path("/nowhere.gguf"), 2, [1, 2], 3, servers,
                               baselines=False)
    assert result.refused.keys() == {"refuser /v1"}
    models = [body["model"] for _, body in seen][2:]  # after the two servers' probes
    # per turn and level, two requests to each server; the order flips every level and turn
    order = [models[i] for i in range(0, len(models), 2)]
    assert order == ["m", "n", "n", "m", "n", "m", "m", "n", "m", "n", "n", "m"]
    assert set(result.served) == {"llmrun /v1", "b /v1"}
    assert "first_over" in result.served["b /v1"][2]
    # both rates over the same turns: their quotient is the tokens (here words) per input
    words = sum(len(t.split()) for t in retrieval.texts(4, "Day 1. ")) / 4
    b = result.served["b /v1"][1]
    assert b["tokens_s"] / b["items_s"] == pytest.approx(words)
    assert "first_over" not in result.served["llmrun /v1"][2]
    assert result.raw == {}
    table = result.table()
    assert "refuser /v1 refused this work" in table and "| 2 | b /v1 |" in table


def test_raw_loop_ratios_are_per_turn(monkeypatch: pytest.MonkeyPatch,
                                      fake: tuple[str, list[Any]]) -> None:
    url, _ = fake
    raws = iter([(10.0, 600.0), (20.0, 1200.0), (30.0, 1800.0)])
    monkeypatch.setattr(retrieval, "raw_rerank", lambda *a: next(raws))
    result = retrieval.run(retrieval.Workload("rerank", docs=3), Path("/x.gguf"), 2, [1], 3,
                           [Server("llmrun /v1", url, "m", "openai")])
    assert result.raw == {1: (20.0, 1200.0)}  # the median turn's
    assert result.served["llmrun /v1"][1]["raw_ratio"] > 0


def test_table_marks_what_was_not_measured() -> None:
    row = {"items_s": 12.34, "tokens_s": 740.4, "p50": 0.5, "p95": 0.9}
    result = RetrievalResult("embedding", "8 inputs", "inputs", Path("/m/bert.gguf"), 2,
                             ["llmrun /v1", "other /v1"],
                             served={"llmrun /v1": {1: dict(row, raw_ratio=0.95)},
                                     "other /v1": {1: dict(row, first_over=1.1)}},
                             raw={1: (13.0, 780.0)})
    lines = result.table().splitlines()
    assert lines[0].startswith("embedding: bert.gguf, 8 inputs, 2 threads")
    assert lines[1] == ""  # (markdown: a table after a paragraph needs a blank line)
    header = [c.strip() for c in lines[2].split("|")[1:-1]]
    assert header[2] == "inputs/s" and header[-1] == "llmrun /v1 / this"
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in lines[4:]]
    assert rows[0] == ["1", "llmrun /v1", "12.34", "740", "0.50", "0.90", "13.00", "780", "0.95",
                       "-"]
    assert rows[1][-2:] == ["-", "1.10"]


def test_median_run_and_turn_order() -> None:
    runs = [{"x": 3.0, "p": 1.0}, {"x": 1.0, "p": 2.0}, {"x": 2.0, "p": 3.0}]
    assert median_run(runs, "x") == {"x": 2.0, "p": 3.0}
    assert turn_order(0, [1, 2, 3]) == [1, 2, 3] and turn_order(1, [1, 2, 3]) == [3, 2, 1]
