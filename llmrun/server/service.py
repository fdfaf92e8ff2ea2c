"""What every dialect calls: run a ChatRequest on the right model and stream the result.

Dialects translate to `ChatRequest` and from `Started`/`Chunk`/`Done`; this module merges the
model's Modelfile defaults into the request, holds the model through the scheduler for the
whole stream (one lease, one runner request per call), and stamps load and total durations on
the final statistics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from llmrun import bounds, config
from llmrun.request import (
    DEFAULT_OPTIONS,
    ChatRequest,
    Chunk,
    Done,
    EngineError,
    Progress,
    Started,
    Stats,
)
from llmrun.server.metrics import Metrics
from llmrun.server.scheduler import Lease, ModelState, Scheduler
from llmrun.server.upstream import Upstream
from llmrun.store import Manifest, Store, StoreError

log = logging.getLogger(__name__)

# Inputs one embedding request may carry (OpenAI's limit too). The runner gets them in pieces
# (server/runners.py), so this bounds the work and the answer's size, not a frame.
MAX_EMBED_INPUTS = 2048


def merged(req: ChatRequest, manifest: Manifest) -> ChatRequest:
    """`req` as the runner gets it: request options over the Modelfile's over llmrun's
    defaults; the Modelfile's MESSAGEs before the conversation, its template unless the
    request brings one, its SYSTEM as the default system prompt."""
    return req.model_copy(update={
        "messages": [*manifest.messages, *req.messages],
        "template": req.template or manifest.template,
        "system": manifest.system,
        "options": req.options.merged_over(manifest.options().merged_over(DEFAULT_OPTIONS)),
    })


def _log_done(model: str, s: Stats) -> None:
    """One line per answer: what an operator needs to see whether the prefix cache works."""
    rate = s.completion_tokens / (s.generate_ns / 1e9) if s.generate_ns else 0.0
    log.info("%s: prompt %d tokens (%d from cache) in %.2fs, %d generated at %.1f tok/s, "
             "%s, total %.2fs", model, s.prompt_tokens, s.cached_tokens, s.prompt_ns / 1e9,
             s.completion_tokens, rate, s.finish_reason, s.total_ns / 1e9)
    if s.draft_tokens:
        log.info("%s: %d of %d drafted tokens came true", model, s.draft_accepted,
                 s.draft_tokens)


class Service:
    def __init__(self, store: Store, scheduler: Scheduler,
                 metrics: Metrics | None = None) -> None:
        self.store = store
        self.scheduler = scheduler
        self.metrics = metrics
        self.max_embed_inputs = MAX_EMBED_INPUTS
        self.upstreams: dict[str, Upstream] = {}  # remote models by manifest digest

    def _upstream(self, req: ChatRequest) -> tuple[Manifest, Upstream] | None:
        """The remote server `req`'s model runs on (FROM http(s)://), or None for a local
        model (or an unknown one: the lease reports it)."""
        try:
            _, manifest = self.store.get(req.model)
        except StoreError:
            return None
        if manifest.remote is None:
            return None
        upstream = self.upstreams.get(manifest.digest)
        if upstream is None:
            upstream = self.upstreams[manifest.digest] = Upstream(manifest.name, manifest.remote)
        return manifest, upstream

    def _local_only(self, req: ChatRequest, what: str) -> None:
        if self._upstream(req) is not None:
            raise EngineError(f"{req.model} is served by a remote server: {what} is not "
                              "available for it", status=400)

    def check(self, req: ChatRequest) -> None:
        """The request's bounds (llmrun/bounds.py), before a runner is leased: what the
        engine cannot afford is answered 400 here and never reaches the shared runner."""
        bounds.check_request(req, self._model_stops(req))
        if any(m.images for m in req.messages):
            self._check_vision(req)

    def _check_vision(self, req: ChatRequest) -> None:
        """Images go only to a model with a vision projector: any other answers 400 here,
        before it is loaded for nothing."""
        try:
            _, manifest = self.store.get(req.model)
        except StoreError:
            return  # the lease reports the unknown model
        if manifest.remote is not None:
            raise EngineError(f"model '{req.model}' is served by a remote server; images are "
                              "not forwarded to remote models", status=400)
        if manifest.projector is None:
            raise EngineError(f"model '{req.model}' does not accept images: it has no vision "
                              "projector (a Modelfile's second FROM names one)", status=400)

    def _model_stops(self, req: ChatRequest) -> frozenset[str]:
        """The model's own stop strings, which a dialect may add to the client's (they do
        not count against LLMRUN_MAX_STOP); looked up only when the count matters."""
        if len(req.options.stop or []) <= config.max_stop():
            return frozenset()
        try:
            _, manifest = self.store.get(req.model)
        except StoreError:
            return frozenset()  # the lease reports the unknown model
        return frozenset(manifest.options().stop or [])

    @contextlib.asynccontextmanager
    async def _lease(self, req: ChatRequest) -> AsyncIterator[Lease]:
        """The model `req` names, held through the scheduler for the block (counted)."""
        async with self.scheduler.use(req.model, req.options, req.keep_alive) as lease:
            if self.metrics is not None:
                self.metrics.leases.labels(lease.manifest.name).inc()
            yield lease

    def _runner_request(self, lease: Lease, kind: str) -> None:
        """Count one request sent to a runner (generate, count or embed)."""
        if self.metrics is not None:
            self.metrics.runner_requests.labels(lease.manifest.name, kind).inc()

    async def chat(self, req: ChatRequest, leased: asyncio.Event | None = None
                   ) -> AsyncGenerator[Started | Progress | Chunk | Done, None]:
        """The request's events: Started (the prompt's size, once it has a slot), Progress
        (only if `req.progress`), Chunks, Done; an EngineError before Started means nothing
        was generated. `leased` is set
        once the model is loaded and the request is on its way to the runner (a dialect
        that must answer before the first token can tell a load from a queue)."""
        t0 = time.perf_counter()
        self.check(req)
        event: Started | Progress | Chunk | Done  # (an upstream's has no Progress)
        remote = self._upstream(req)
        if remote is not None:
            manifest, upstream = remote
            if leased is not None:
                leased.set()
            async for event in upstream.chat(merged(req, manifest)):
                if isinstance(event, Done):
                    event.stats.total_ns = int((time.perf_counter() - t0) * 1e9)
                    _log_done(req.model, event.stats)
                    if self.metrics is not None:
                        self.metrics.observe(manifest.name, event.stats)
                yield event
            return
        async with self._lease(req) as lease:
            if leased is not None:
                leased.set()
            self._runner_request(lease, "generate")
            async for event in lease.runner.generate(merged(req, lease.manifest)):
                if isinstance(event, Done):
                    event.stats.load_ns = int(lease.load_seconds * 1e9)
                    event.stats.total_ns = int((time.perf_counter() - t0) * 1e9)
                    _log_done(req.model, event.stats)
                    if self.metrics is not None:
                        self.metrics.observe(lease.manifest.name, event.stats)
                yield event

    async def count_tokens(self, req: ChatRequest) -> int:
        """The number of prompt tokens `req` renders to on its model (nothing is generated);
        the same request `chat` would send, so the count matches its `prompt_tokens`."""
        self.check(req)
        self._local_only(req, "counting tokens")
        async with self._lease(req) as lease:
            self._runner_request(lease, "count")
            return await lease.runner.count(merged(req, lease.manifest))

    async def tokens(self, req: ChatRequest, msg: dict[str, Any], answer: str
                     ) -> dict[str, Any]:
        """A token utility on `req`'s model (loaded if need be): `msg` is the runner message
        (count with detail, tokenize, detokenize), `answer` the event it replies with."""
        self.check(req)
        self._local_only(req, str(msg["type"]))
        async with self._lease(req) as lease:
            self._runner_request(lease, str(msg["type"]))
            if msg["type"] == "count":
                msg = {**msg, "request": merged(req, lease.manifest).model_dump()}
            return await lease.runner.ask(msg, answer)

    async def embed(self, req: ChatRequest, inputs: list[str],
                    truncate: bool) -> tuple[list[list[float]], int, int, int]:
        """(vectors, prompt tokens, load ns, total ns) for `inputs` on `req.model`."""
        if len(inputs) > self.max_embed_inputs:
            raise EngineError(f"too many inputs: {len(inputs)}; at most "
                              f"{self.max_embed_inputs} can be embedded in one request",
                              status=413, kind="request_too_large")
        t0 = time.perf_counter()
        self._local_only(req, "embedding")
        async with self._lease(req) as lease:
            self._runner_request(lease, "embed")
            vectors, n_tokens = await lease.runner.embed(inputs, truncate)
            return (vectors, n_tokens, int(lease.load_seconds * 1e9),
                    int((time.perf_counter() - t0) * 1e9))

    def ps(self) -> list[ModelState]:
        """The loaded models, as /api/ps shows them."""
        return self.scheduler.models()

    def remotes(self) -> list[tuple[str, str, list[dict[str, Any]]]]:
        """The remote models used since the daemon started: (name, manifest digest, their
        replicas' health)."""
        return [(u.name, digest, u.health()) for digest, u in self.upstreams.items()]

    async def close(self) -> None:
        for upstream in self.upstreams.values():
            await upstream.close()

    async def unload(self, model: str) -> bool:
        """Unload `model` now if it is loaded and idle (or once its requests finish)."""
        return await self.scheduler.unload_name(model)

    async def load(self, req: ChatRequest) -> float:
        """Load (or keep) the model without generating; returns seconds spent loading (none
        for a remote model: its server holds it)."""
        if self._upstream(req) is not None:
            return 0.0
        async with self._lease(req) as lease:
            return lease.load_seconds
