"""What every dialect calls: run a ChatRequest on the right model and stream the result.

Dialects translate to `ChatRequest` and from `Chunk`/`Done`; this module merges the model's
Modelfile defaults, holds the model through the scheduler for the whole stream, and stamps
load and total durations on the final statistics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from llmrun import bounds, config
from llmrun.request import (
    DEFAULT_OPTIONS,
    ChatRequest,
    Chunk,
    Done,
    EngineError,
    GenerateJob,
    Stats,
)
from llmrun.server.metrics import Metrics
from llmrun.server.scheduler import Scheduler
from llmrun.store import Manifest, Store, StoreError

log = logging.getLogger(__name__)

# Inputs one embedding request may carry (OpenAI's limit too). The runner gets them in pieces
# (server/runners.py), so this bounds the work and the answer's size, not a frame.
MAX_EMBED_INPUTS = 2048


def build_job(req: ChatRequest, manifest: Manifest) -> GenerateJob:
    """The runner's job for `req`: request options over the Modelfile's over llmrun's
    defaults; the Modelfile's MESSAGEs before the conversation."""
    return GenerateJob(
        messages=[*manifest.messages, *req.messages],
        prompt=req.prompt,
        template=req.template or manifest.template,
        system=manifest.system,
        options=req.options.merged_over(manifest.options().merged_over(DEFAULT_OPTIONS)),
        format=req.format,
        format_strict=req.format_strict,
        grammar=req.grammar,
        logprobs=req.logprobs,
        tools=req.tools,
        tool_choice=req.tool_choice,
        parallel_tool_calls=req.parallel_tool_calls,
        think=req.think,
        think_required=req.think_required,
        suffix=req.suffix,
        context=req.context,
        return_context=req.return_context,
        prompt_logprobs=req.prompt_logprobs,
    )


def _log_done(model: str, s: Stats) -> None:
    """One line per answer: what an operator needs to see whether the prefix cache works."""
    rate = s.completion_tokens / (s.generate_ns / 1e9) if s.generate_ns else 0.0
    log.info("%s: prompt %d tokens (%d from cache) in %.2fs, %d generated at %.1f tok/s, "
             "%s, total %.2fs", model, s.prompt_tokens, s.cached_tokens, s.prompt_ns / 1e9,
             s.completion_tokens, rate, s.finish_reason, s.total_ns / 1e9)


class Service:
    def __init__(self, store: Store, scheduler: Scheduler,
                 metrics: Metrics | None = None) -> None:
        self.store = store
        self.scheduler = scheduler
        self.metrics = metrics
        self.max_embed_inputs = MAX_EMBED_INPUTS

    def check(self, req: ChatRequest) -> None:
        """The request's bounds (llmrun/bounds.py), before a runner is leased: what the
        engine cannot afford is answered 400 here and never reaches the shared runner."""
        bounds.check_request(req, self._model_stops(req))

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

    async def chat(self, req: ChatRequest) -> AsyncIterator[Chunk | Done]:
        t0 = time.perf_counter()
        self.check(req)
        async with self.scheduler.use(req.model, req.options, req.keep_alive) as lease:
            job = build_job(req, lease.manifest)
            async for event in lease.loaded.runner.generate(job):
                if isinstance(event, Done):
                    event.stats.load_ns = int(lease.load_seconds * 1e9)
                    event.stats.total_ns = int((time.perf_counter() - t0) * 1e9)
                    _log_done(req.model, event.stats)
                    if self.metrics is not None:
                        self.metrics.observe(lease.manifest.name, event.stats)
                yield event

    async def count_tokens(self, req: ChatRequest) -> int:
        """The number of prompt tokens `req` renders to on its model (nothing is generated);
        the same job `chat` would send, so the count matches its `prompt_tokens`."""
        self.check(req)
        async with self.scheduler.use(req.model, req.options, req.keep_alive) as lease:
            return await lease.loaded.runner.count(build_job(req, lease.manifest))

    async def embed(self, req: ChatRequest, inputs: list[str],
                    truncate: bool) -> tuple[list[list[float]], int, int, int]:
        """(vectors, prompt tokens, load ns, total ns) for `inputs` on `req.model`."""
        if len(inputs) > self.max_embed_inputs:
            raise EngineError(f"too many inputs: {len(inputs)}; at most "
                              f"{self.max_embed_inputs} can be embedded in one request",
                              status=413, kind="request_too_large")
        t0 = time.perf_counter()
        async with self.scheduler.use(req.model, req.options, req.keep_alive) as lease:
            vectors, n_tokens = await lease.loaded.runner.embed(inputs, truncate)
            return (vectors, n_tokens, int(lease.load_seconds * 1e9),
                    int((time.perf_counter() - t0) * 1e9))

    async def unload(self, model: str) -> bool:
        """Unload `model` now if it is loaded and idle (or once its requests finish)."""
        return await self.scheduler.unload_name(model)

    async def load(self, req: ChatRequest) -> float:
        """Load (or keep) the model without generating; returns seconds spent loading."""
        async with self.scheduler.use(req.model, req.options, req.keep_alive) as lease:
            return lease.load_seconds
