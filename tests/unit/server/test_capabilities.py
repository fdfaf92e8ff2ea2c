"""What a model can do, read from its GGUF: an encoder-only (BERT-family) or pooled model
embeds and does not chat, a rank-pooled one only reranks, a Modelfile-made LLM reranker still
chats. A chat to a model that cannot chat is a 400 in each dialect's own shape before a runner
is leased; an embedding from a cross-encoder too. A Modelfile's `embed_prefix` is written
before every text embedded. Tiny GGUFs, never loaded (fake runners), milliseconds."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import pytest
from fastapi.testclient import TestClient

from llmrun.daemon.app import create_app
from llmrun.request import ChatRequest, EngineError, ModelRequest
from llmrun.server import work
from llmrun.server.scheduler import Scheduler
from llmrun.server.service import Service
from llmrun.store import Store
from llmrun.store.describe import ENCODER_ARCHITECTURES
from tests.fakes.encodermodel import write_tiny_bert
from tests.fakes.scheduler import ANSWERS, Farm
from tests.fakes.tinymodel import write_tiny_llama
from tests.unit.store.test_gguf import write_gguf

CHAT = {"model": "bge", "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture
def store(tmp_path: Path) -> Store:
    store = Store(tmp_path / "store")
    llama = write_tiny_llama(tmp_path / "a.gguf", seed=0)
    store.create("chat", f"FROM {llama}\n")
    store.create("llm-ranker", f"FROM {llama}\nPARAMETER rerank true\n")
    bge = write_tiny_bert(tmp_path / "bge.gguf", pooling=gguf.PoolingType.CLS)
    store.create("bge", f"FROM {bge}\n")
    # an encoder-only architecture says it without a pooling type in its header too
    # (tests/fakes/encodermodel.py always writes one); a header alone, never loaded
    nomic = write_gguf(tmp_path / "n.gguf", arch="nomic-bert", chat_template=None)
    store.create("nomic", f"FROM {nomic}\n"
                          'PARAMETER embed_prefix "search_query: "\n')
    # a decoder declaring `last` pooling (Qwen3-Embedding as llama.cpp converts it)
    store.create("qwen-embed", f"FROM {write_tiny_llama(tmp_path / 'e.gguf', pooling=3)}\n")
    store.create("xenc", f"FROM {write_tiny_bert(tmp_path / 'x.gguf', rank_head=True)}\n")
    store.create("qwen-rank", f"FROM {write_tiny_llama(tmp_path / 'r.gguf', pooling=4)}\n")
    return store


def test_capabilities_come_from_the_gguf(store: Store) -> None:
    def caps(name: str) -> list[str]:
        return store.capabilities(store.get(name)[1])
    assert caps("chat") == ["completion", "tools"]
    assert caps("llm-ranker") == ["completion", "tools", "rerank"]  # still chats
    for name in ("bge", "nomic", "qwen-embed"):
        assert caps(name) == ["embedding"], name
    for name in ("xenc", "qwen-rank"):
        assert caps(name) == ["rerank"], name
    # the list is llama.cpp's BERT family as its src/llama-arch.cpp names them
    assert {"bert", "nomic-bert", "jina-bert-v2", "modern-bert"} <= ENCODER_ARCHITECTURES


@pytest.fixture
def app(store: Store, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[TestClient, list[str]]]:
    application = create_app(store)
    leased: list[str] = []

    def use(target: Any, *_: Any) -> Any:
        leased.append(target[0])
        raise AssertionError("a refused request reached the scheduler")
    monkeypatch.setattr(application.state.service.scheduler, "use", use)
    yield TestClient(application, base_url="http://127.0.0.1"), leased


@pytest.mark.parametrize(("path", "body"), [
    ("/api/chat", CHAT),
    ("/api/chat", {**CHAT, "stream": False}),
    ("/api/generate", {"model": "bge", "prompt": "hi"}),
    ("/v1/chat/completions", CHAT),
    ("/v1/chat/completions", {**CHAT, "stream": True}),
    ("/v1/completions", {"model": "bge", "prompt": "hi"}),
    ("/v1/responses", {"model": "bge", "input": "hi"}),
    ("/v1/responses", {"model": "bge", "input": "hi", "stream": True}),
    ("/v1/messages", {**CHAT, "max_tokens": 10}),
    ("/v1/messages", {**CHAT, "max_tokens": 10, "stream": True}),
    ("/v1/messages/count_tokens", CHAT),
])
def test_a_chat_to_an_embedding_model_is_a_400_in_the_dialects_shape(
        app: tuple[TestClient, list[str]], path: str, body: dict[str, Any]) -> None:
    client, leased = app
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    words = "model 'bge' is an embedding model: it can embed (/api/embed, /v1/embeddings), " \
            "not chat"
    got = r.json()
    if path.startswith("/api/"):
        assert got == {"error": words}
    elif path.startswith("/v1/messages"):
        assert got["type"] == "error" and got["error"]["type"] == "invalid_request_error"
        assert got["error"]["message"] == words
    else:
        assert got["error"]["type"] == "invalid_request_error"
        assert got["error"]["message"] == words
    assert leased == []


def test_a_cross_encoder_neither_chats_nor_embeds(app: tuple[TestClient, list[str]]) -> None:
    client, leased = app
    r = client.post("/v1/chat/completions", json={**CHAT, "model": "qwen-rank"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == ("model 'qwen-rank' is a reranker: it can rerank "
                                            "(/v1/rerank, /v2/rerank), not chat")
    r = client.post("/api/embed", json={"model": "xenc", "input": ["a"]})
    assert r.status_code == 400
    assert r.json() == {"error": "model 'xenc' is a reranker: it can rerank (/v1/rerank, "
                                 "/v2/rerank), not embed"}
    r = client.post("/v1/embeddings", json={"model": "xenc", "input": "a"})
    assert r.status_code == 400 and "not embed" in r.json()["error"]["message"]
    # and an embedding model does not rerank
    r = client.post("/v1/rerank", json={"model": "bge", "query": "q", "documents": ["d"]})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == ("model 'bge' is an embedding model: it can embed "
                                            "(/api/embed, /v1/embeddings), not rerank")
    # what it can do is in `show`, as Ollama's clients read it
    assert client.post("/api/show", json={"model": "xenc"}).json()["capabilities"] == ["rerank"]
    assert leased == []


def test_the_embed_prefix_goes_before_every_text(store: Store, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def embed(job: work.Embedding) -> tuple[list[list[float]], int]:
        seen.append(job.inputs)
        return [[1.0] for _ in job.inputs], len(job.inputs)
    monkeypatch.setitem(ANSWERS, work.Embedding, embed)

    async def main() -> None:
        farm = Farm(store)
        sched = Scheduler(store, tmp_path / "logs", runner_factory=farm, free_memory=farm.free)
        service = Service(store, sched)
        try:
            await service.embed(ModelRequest(model="nomic"), ["a", "b"], True)
            await service.embed(ModelRequest(model="bge"), ["a"], True)
            # a request's own option is taken over the Modelfile's, as every option is
            req = ModelRequest.model_validate({"model": "nomic",
                                               "options": {"embed_prefix": "search_document: "}})
            await service.embed(req, ["c"], True)
        finally:
            await sched.shutdown()
    asyncio.run(asyncio.wait_for(main(), 60))
    assert seen == [["search_query: a", "search_query: b"], ["a"], ["search_document: c"]]


def test_an_unreadable_model_is_a_clear_error_not_a_crash(store: Store, tmp_path: Path) -> None:
    _, manifest = store.get("bge")
    store.blobs.path(manifest.model.digest).write_bytes(b"not a gguf")

    async def main() -> None:
        farm = Farm(store)
        sched = Scheduler(store, tmp_path / "logs", runner_factory=farm, free_memory=farm.free)
        try:
            chat = ChatRequest.model_validate(CHAT)
            # what is not read for the check is left to the load, which says what to do
            with pytest.raises(EngineError, match=r"model 'bge' cannot be loaded: .*modified "
                                                  r"on disk .*pull or create the model again"):
                async for _ in Service(store, sched).chat(chat):
                    pass
        finally:
            await sched.shutdown()
    asyncio.run(asyncio.wait_for(main(), 60))


@pytest.mark.parametrize(("template", "thinks"), [
    ("openai-gpt-oss-120b.jinja", True),  # harmony: thoughts in the analysis channel
    ("Qwen-Qwen3-0.6B.jinja", True),
    ("GLM-4.6.jinja", True),
    ("Qwen-Qwen2.5-7B-Instruct.jinja", False),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", False),
])
def test_thinking_is_read_with_the_templates_chat_format(template: str, thinks: bool) -> None:
    from llmrun.store.describe import capabilities

    source = (Path(__file__).parents[2] / "fakes" / "templates" / template).read_text()
    assert ("thinking" in capabilities(source, {})) is thinks
