"""The service between the dialects and the runners, with fake runners (tests/fakes) and a
remote server played by httpx's MockTransport: a request's model is looked up once, local and
remote models take one path (stats stamped, metrics counted alike), and the stop-string rule
is the service's. Milliseconds, no model."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest

from llmrun.request import ChatRequest, Done, EngineError, Message, ModelRequest, Options
from llmrun.server.metrics import Metrics
from llmrun.server.scheduler import Scheduler
from llmrun.server.service import Service, merged
from llmrun.server.upstream import Upstream
from llmrun.store import Store
from tests.fakes.scheduler import Farm
from tests.fakes.tinymodel import write_tiny_llama

T = TypeVar("T")
SSE = ('data: {"choices": [{"delta": {"content": "hi"}}]}\n\n'
       'data: {"choices": [{"delta": {}, "finish_reason": "stop"}], '
       '"usage": {"prompt_tokens": 3, "completion_tokens": 1}}\n\ndata: [DONE]\n\n')


def run(test: Awaitable[T]) -> T:
    return asyncio.run(asyncio.wait_for(test, 60))  # type: ignore[arg-type]


@pytest.fixture
def store(tmp_path: Path) -> Store:
    store = Store(tmp_path / "store")
    path = write_tiny_llama(tmp_path / "a.gguf", seed=0)
    store.create("a", f'FROM {path}\nPARAMETER stop "<END>"\n')
    store.create("far", "FROM http://far.example/v1\nPARAMETER remote_model m\n")
    return store


class CountingStore:
    """The store, counting how often a model is looked up."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self.gets = 0

    def get(self, name: str) -> Any:
        self.gets += 1
        return self.store.get(name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)


def ask(model: str, **fields: Any) -> ChatRequest:
    return ChatRequest(model=model, messages=[Message(role="user", content="hello")], **fields)


async def events(service: Service, req: ChatRequest) -> list[Any]:
    return [e async for e in service.chat(req)]


def test_a_request_looks_its_model_up_once(store: Store, tmp_path: Path) -> None:
    counting = CountingStore(store)

    async def scenario() -> None:
        farm = Farm(store)
        sched = Scheduler(counting, tmp_path / "logs",  # type: ignore[arg-type]
                          runner_factory=farm, free_memory=farm.free)
        service = Service(counting, sched)  # type: ignore[arg-type]
        try:
            counting.gets = 0
            done = (await events(service, ask("a")))[-1]
            assert isinstance(done, Done) and done.stats.total_ns > 0
            assert counting.gets == 1  # not again in the bounds, the vision check, the lease
            counting.gets = 0
            assert await service.count_tokens(ask("a")) == 3
            assert counting.gets == 1
        finally:
            await sched.shutdown()

    run(scenario())


def test_an_unknown_model_is_told_after_the_bounds(store: Store, tmp_path: Path) -> None:
    """A request both malformed and for an unknown model hears what is malformed (as before
    the lookup moved first); a well-formed one hears 404."""
    service = Service(store, Scheduler(store, tmp_path / "logs"))
    with pytest.raises(EngineError) as err:
        service.prepare(ask("nope", options=Options(stop=[f"s{i}" for i in range(99)])))
    assert err.value.code == "invalid_request" and "too many stop strings" in err.value.message
    with pytest.raises(EngineError) as err:
        service.prepare(ask("nope"))
    assert err.value.code == "not_found"
    with pytest.raises(EngineError) as err:
        service.prepare(ask("bad name!"))
    assert err.value.code == "invalid_request"


def test_a_remote_model_takes_the_local_path(store: Store, tmp_path: Path) -> None:
    """Stats stamped, leases and runner requests counted, and what only a local engine can
    do refused with a clear 400, through the same code as a local model."""
    seen: list[dict[str, Any]] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return httpx.Response(200, text=SSE, headers={"content-type": "text/event-stream"})

    async def scenario() -> None:
        sched = Scheduler(store, tmp_path / "logs")
        metrics = Metrics(sched)
        service = Service(store, sched, metrics)
        _, manifest = store.get("far")
        assert manifest.remote is not None
        service.upstreams[manifest.digest] = Upstream("far", manifest.remote,
                                                      transport=httpx.MockTransport(handle))
        try:
            out = await events(service, ask("far", stop_adds=True,
                                            options=Options(stop=["x"])))
            done = out[-1]
            assert isinstance(done, Done) and done.stats.total_ns > 0
            assert done.stats.load_ns == 0
            assert seen[0]["model"] == "m" and seen[0]["stop"] == ["x"]
            assert metrics.runner_requests.labels(manifest.name, "generate")._value.get() == 1
            with pytest.raises(EngineError) as err:
                await service.count_tokens(ask("far"))
            assert err.value.code == "invalid_request"
            assert "served by a remote server" in err.value.message
            with pytest.raises(EngineError) as err:
                await service.embed(ModelRequest(model="far"), ["x"], True)
            assert err.value.code == "invalid_request" and "embedding" in err.value.message
            assert await service.load(ask("far")) == 0.0
        finally:
            await service.close()
            await sched.shutdown()

    run(scenario())


def test_client_stops_replace_or_follow_the_models(store: Store) -> None:
    """Ollama's and OpenAI's stop list replaces the Modelfile's; Anthropic's stop_sequences
    (stop_adds) come after the model's own, which they never turn off."""
    _, manifest = store.get("a")
    assert merged(ask("a"), manifest).options.stop == ["<END>"]
    assert merged(ask("a", options=Options(stop=["x"])), manifest).options.stop == ["x"]
    added = merged(ask("a", stop_adds=True, options=Options(stop=["x", "<END>"])), manifest)
    assert added.options.stop == ["x", "<END>"]  # (the model's, once)
    added = merged(ask("a", stop_adds=True, options=Options(stop=["x"])), manifest)
    assert added.options.stop == ["<END>", "x"]
    assert merged(ask("a", stop_adds=True), manifest).options.stop == ["<END>"]


def test_modelfile_load_parameters_reach_the_runner(store: Store, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Every load option a Modelfile sets is the runner's unless the request names its own:
    request over Modelfile over defaults, merged once."""
    # without LLMRUN_NUM_THREADS the runner's threads adapt, unless num_thread fixes them
    monkeypatch.delenv("LLMRUN_NUM_THREADS", raising=False)
    path = write_tiny_llama(tmp_path / "b.gguf", seed=1)
    store.create("tuned", f"FROM {path}\nPARAMETER num_batch 64\nPARAMETER num_thread 1\n"
                 "PARAMETER num_ctx 96\nPARAMETER kv_cache_type q8_0\n"
                 "PARAMETER flash_attention on\nPARAMETER use_mmap false\n")

    async def scenario() -> None:
        farm = Farm(store)
        sched = Scheduler(store, tmp_path / "logs", runner_factory=farm, free_memory=farm.free)
        service = Service(store, sched)
        try:
            await events(service, ask("tuned"))
            spec = farm.runners[-1].spec
            assert (spec.n_batch, spec.n_threads, spec.adaptive_threads) == (64, 1, False)
            assert (spec.n_ctx, spec.kv_type, spec.flash_attention) == (96, "q8_0", "on")
            assert not spec.use_mmap
            # the request's own values win, and a change of them is another runner
            await events(service, ask("tuned", options=Options(num_batch=32, num_ctx=80)))
            spec = farm.runners[-1].spec
            assert (spec.n_batch, spec.n_threads, spec.n_ctx) == (32, 1, 80)
        finally:
            await sched.shutdown()

    run(scenario())
