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
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, TypeVar

from llmrun import bounds
from llmrun.request import (
    DEFAULT_OPTIONS,
    ChatRequest,
    Chunk,
    Done,
    EngineError,
    ModelRequest,
    Options,
    Progress,
    Started,
    Stats,
)
from llmrun.server import work
from llmrun.server.fit import Placement
from llmrun.server.metrics import Metrics
from llmrun.server.scheduler import ModelState, Runner, Scheduler
from llmrun.server.upstream import Upstream
from llmrun.store import Manifest, Store, StoreError
from llmrun.store.gguf import GGUFError
from llmrun.store.names import ModelName

log = logging.getLogger(__name__)
T = TypeVar("T")

# The context the client asks its requests be loaded with where a request names none: set
# per HTTP request from `X-Llmrun-Num-Ctx` (daemon/intake.ClientContext), which `llmrun
# launch` has each agent send, as no agent can put Ollama's `num_ctx` in its own bodies.
CLIENT_NUM_CTX: ContextVar[int | None] = ContextVar("client_num_ctx", default=None)

# Inputs one embedding request may carry (OpenAI's limit too). The runner gets them in pieces
# (server/runners.py), so this bounds the work and the answer's size, not a frame.
MAX_EMBED_INPUTS = 2048


def merged_options(options: Options, manifest: Manifest) -> Options:
    """Request options over the client's context (X-Llmrun-Num-Ctx, for num_ctx alone) over
    the Modelfile's over llmrun's defaults: what a runner is started with (`.runner()`) and
    what it works with, from this one merge."""
    if options.num_ctx is None and CLIENT_NUM_CTX.get() is not None:
        options = options.model_copy(update={"num_ctx": CLIENT_NUM_CTX.get()})
    return options.merged_over(manifest.options().merged_over(DEFAULT_OPTIONS))


def merged_model(req: ModelRequest, manifest: Manifest) -> ModelRequest:
    """A request that needs only a model, with its options merged (merged_options)."""
    return req.model_copy(update={"options": merged_options(req.options, manifest)})


def merged(req: ChatRequest, manifest: Manifest) -> ChatRequest:
    """`req` as the runner gets it: request options over the Modelfile's over llmrun's
    defaults; the Modelfile's MESSAGEs before the conversation, its template unless the
    request brings one, its SYSTEM as the default system prompt. The client's stop strings
    replace the Modelfile's (as Ollama's and OpenAI's options do), or with `stop_adds`
    (Anthropic's stop_sequences, which never turn a model's own end markers off) come after
    them. The options: merged_options."""
    options = req.options
    if req.stop_adds and options.stop:
        own = [s for s in manifest.options().stop or [] if s not in options.stop]
        options = options.model_copy(update={"stop": [*own, *options.stop]})
    return req.model_copy(update={
        "messages": [*manifest.messages, *req.messages],
        "template": req.template or manifest.template,
        "system": manifest.system,
        "options": merged_options(options, manifest),
    })


# what a model that cannot chat is, and what it can be asked instead (_require)
_KINDS = {"embedding": ("an embedding model", "embed (/api/embed, /v1/embeddings)"),
          "rerank": ("a reranker", "rerank (/v1/rerank, /v2/rerank)")}


@dataclass(frozen=True)
class Target:
    """The model a request names, looked up once per request: its name and manifest, and
    the remote server that runs it (None: a runner the scheduler leases runs it)."""

    name: ModelName
    manifest: Manifest
    upstream: Upstream | None = None


class RemoteRunner:
    """A remote model as the scheduler's runners are seen (scheduler.Runner): generating goes
    to its server; what only a local engine can do (counting, tokenizing, embedding) is a 400.
    It is always loaded: its server holds the model."""

    load_seconds = 0.0
    alive = True

    def __init__(self, upstream: Upstream, model: str) -> None:
        self.upstream = upstream
        self.model = model
        self.info: dict[str, Any] = {}
        self.placement: Placement | None = None
        self.memory = 0  # (nothing of it is on this machine)
        self.engine_stats: dict[str, Any] = {}

    @property
    def busy(self) -> int:
        return 0

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        return None

    def generate(self, req: ChatRequest) -> AsyncIterator[Started | Progress | Chunk | Done]:
        return self.upstream.chat(req)

    async def run(self, job: work.Work[T]) -> T:
        raise EngineError(f"{self.model} is served by a remote server: {job.what} is not "
                          "available for it", code="invalid_request")


@dataclass(frozen=True)
class Held:
    """A model held for one request: the runner to send it to, the manifest whose Modelfile
    applies, and the seconds the request waited for a load."""

    runner: Runner
    manifest: Manifest
    load_seconds: float


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
        # what a model (by manifest digest) can do, as show lists it: its GGUF's header read
        # once (0.1 s for SmolLM2's, most of it the vocabulary), not on every request
        self._capabilities: dict[str, list[str]] = {}

    def resolve(self, model: str) -> Target:
        """The model `model` names, looked up once: a 404 or 400 if there is none."""
        name, manifest = self.scheduler.lookup(model)
        if manifest.remote is None:
            return Target(name, manifest)
        upstream = self.upstreams.get(manifest.digest)
        if upstream is None:
            upstream = self.upstreams[manifest.digest] = Upstream(manifest.name, manifest.remote)
        return Target(name, manifest, upstream)

    def prepare(self, req: ChatRequest) -> Target:
        """`req`'s model, looked up, and the request checked against its bounds
        (llmrun/bounds.py) before a runner is leased: what the engine cannot afford is
        answered 400 here and never reaches the shared runner. The bounds come first, so a
        request both malformed and for an unknown model is told what is malformed."""
        try:
            target = self.resolve(req.model)
        except EngineError:
            self.check(req)
            raise
        self.check(req)
        if any(m.images or m.audio for m in req.messages):
            self._check_media(req, target)
        return target

    async def prepare_chat(self, req: ChatRequest) -> Target:
        """`prepare`, and the model checked to be one that chats: an embedding model or a
        cross-encoder gets a 400 naming what it can do, in every dialect alike, before a
        runner is leased (it would load for nothing and fail in the engine)."""
        target = self.prepare(req)
        await self._require(req.model, target, ("completion",), "chat")
        return target

    @staticmethod
    def check(req: ChatRequest) -> None:
        """The bounds a request is held to whatever its model (llmrun/bounds.py)."""
        bounds.check_request(req)

    def _check_media(self, req: ChatRequest, target: Target) -> None:
        """Images go only to a model whose projector encodes them, sound only to one whose
        projector hears (what its GGUF says): any other answers 400 here, before it is
        loaded for nothing."""
        if target.upstream is not None:
            raise EngineError(f"model '{req.model}' is served by a remote server; images and "
                              "sound are not forwarded to remote models",
                              code="invalid_request")
        modalities = self.store.projector_modalities(target.manifest)
        for kind, noun, sent in (("vision", "images", any(m.images for m in req.messages)),
                                 ("audio", "audio", any(m.audio for m in req.messages))):
            if sent and kind not in modalities:
                raise EngineError(f"model '{req.model}' does not accept {noun}: it has no "
                                  f"{kind} projector (a Modelfile's second FROM names one)",
                                  code="invalid_request")

    @contextlib.asynccontextmanager
    async def _hold(self, req: ChatRequest | ModelRequest, target: Target,
                    kind: str | None) -> AsyncIterator[Held]:
        """`target` held for the block: a local model through the scheduler (loaded if need
        be, with the runner options of `req`, merged already), a remote one as its server;
        each counted, with the runner request (`kind`: generate, count, embed, tokenize...;
        None for a load alone) it is held for."""
        if target.upstream is not None:
            yield self._counted(Held(RemoteRunner(target.upstream, req.model), target.manifest,
                                     0.0), kind)
            return
        async with self.scheduler.use((target.name, target.manifest), req.options.runner(),
                                      req.keep_alive) as lease:
            yield self._counted(Held(lease.runner, lease.manifest, lease.load_seconds), kind)

    def _counted(self, held: Held, kind: str | None) -> Held:
        if self.metrics is not None:
            self.metrics.leases.labels(held.manifest.name).inc()
            if kind is not None:
                self.metrics.runner_requests.labels(held.manifest.name, kind).inc()
        return held

    async def chat(self, req: ChatRequest, leased: asyncio.Event | None = None
                   ) -> AsyncGenerator[Started | Progress | Chunk | Done, None]:
        """The request's events: Started (the prompt's size, once it has a slot), Progress
        (only if `req.progress`), Chunks, Done; an EngineError before Started means nothing
        was generated. `leased` is set once the model is loaded and the request is on its
        way to the runner (a dialect that must answer before the first token can tell a
        load from a queue)."""
        t0 = time.perf_counter()
        target = await self.prepare_chat(req)
        req = merged(req, target.manifest)
        async with self._hold(req, target, "generate") as held:
            if leased is not None:
                leased.set()
            async for event in held.runner.generate(req):
                if isinstance(event, Done):
                    event.stats.load_ns = int(held.load_seconds * 1e9)
                    event.stats.total_ns = int((time.perf_counter() - t0) * 1e9)
                    _log_done(req.model, event.stats)
                    if self.metrics is not None:
                        self.metrics.observe(held.manifest.name, event.stats)
                yield event

    async def count_tokens(self, req: ChatRequest) -> int:
        """The number of prompt tokens `req` renders to on its model (nothing is generated);
        the same request `chat` would send, so the count matches its `prompt_tokens`."""
        target = await self.prepare_chat(req)
        req = merged(req, target.manifest)
        async with self._hold(req, target, "count") as held:
            reply = await held.runner.run(work.Counting(req))
            return int(reply["prompt_tokens"])

    async def rendered(self, req: ChatRequest) -> dict[str, Any]:
        """`req`'s prompt as its model reads it, and its tokens (protocol.CountReply)."""
        # counting renders the chat template: a chat's, which a model that cannot chat lacks
        target = await self.prepare_chat(req)
        req = merged(req, target.manifest)
        async with self._hold(req, target, "count") as held:
            return await held.runner.run(work.Counting(req, detail=True))

    async def tokens(self, req: ModelRequest, job: work.Tokenizing | work.Detokenizing
                     ) -> dict[str, Any]:
        """A token utility (tokenize, detokenize) on `req`'s model, loaded if need be: its
        reply (protocol.TokensReply, TextReply)."""
        target = self.prepare(req.stand_in())
        async with self._hold(merged_model(req, target.manifest), target, job.kind) as held:
            return await held.runner.run(job)

    async def embed(self, req: ModelRequest, inputs: list[str],
                    truncate: bool) -> tuple[list[list[float]], int, int, int]:
        """(vectors, prompt tokens, load ns, total ns) for `inputs` on `req.model`, each
        after the model's `embed_prefix` (PARAMETER embed_prefix, or the request's option)."""
        if len(inputs) > self.max_embed_inputs:
            raise EngineError(f"too many inputs: {len(inputs)}; at most "
                              f"{self.max_embed_inputs} can be embedded in one request",
                              code="too_large")
        t0 = time.perf_counter()
        target = self.resolve(req.model)
        # a chat model embeds too (its last layer pooled), as Ollama lets it; a cross-encoder's
        # output is a score, no vector
        await self._require(req.model, target, ("embedding", "completion"), "embed")
        req = merged_model(req, target.manifest)
        prefix = req.options.embed_prefix
        if prefix:
            inputs = [prefix + text for text in inputs]
        async with self._hold(req, target, "embed") as held:
            vectors, n_tokens = await held.runner.run(work.Embedding(inputs, truncate))
            return (vectors, n_tokens, int(held.load_seconds * 1e9),
                    int((time.perf_counter() - t0) * 1e9))

    async def rerank(self, req: ModelRequest, query: str,
                     documents: list[str]) -> tuple[list[float], int, int, int]:
        """(each document's score in order, prompt tokens, load ns, total ns) for `query` on
        `req.model`, a cross-encoder (its GGUF declares rank pooling) or a model its
        Modelfile makes a reranker: a chat model is not asked whether a document is relevant
        unless its Modelfile says how (PARAMETER rerank ...), since a model not trained for
        it answers by chance. Bounds and that check come before a runner is leased."""
        t0 = time.perf_counter()
        bounds.check_rerank(query, documents)
        chat = req.stand_in()
        target = self.resolve(req.model)
        await self._require(req.model, target, ("rerank", "completion"), "rerank")  # (embedder)
        if target.upstream is not None:
            raise EngineError(f"{req.model} is served by a remote server: reranking is not "
                              "available for it", code="invalid_request")
        # a cross-encoder (rank pooling) is a reranker by its GGUF: the runner scores with
        # its classification head (engine/crossencoder.py), whatever the Modelfile says
        chat = merged(chat, target.manifest)
        if not await self._cross_encoder(target.manifest) and not chat.options.reranks():
            raise EngineError(f"model '{req.model}' is not a reranker: its Modelfile makes a "
                              "chat model one with PARAMETER rerank true (and rerank_yes, "
                              "rerank_no, rerank_instruction or rerank_template)",
                              code="invalid_request")
        async with self._hold(chat, target, "rerank") as held:
            scores, n_tokens = await held.runner.run(work.Reranking(chat, query, documents))
            return (scores, n_tokens, int(held.load_seconds * 1e9),
                    int((time.perf_counter() - t0) * 1e9))

    async def capabilities(self, manifest: Manifest) -> list[str]:
        """What the model can do (Store.capabilities: completion, embedding, rerank...),
        read once per manifest, off the event loop (a large vocabulary takes a while)."""
        known = self._capabilities.get(manifest.digest)
        if known is None:
            try:
                known = await asyncio.to_thread(self.store.capabilities, manifest)
            except (OSError, StoreError, GGUFError) as exc:  # as a load would say (memory.py)
                raise EngineError(f"model '{manifest.name}' cannot be loaded: {exc}") from None
            self._capabilities[manifest.digest] = known
        return known

    async def _cross_encoder(self, manifest: Manifest) -> bool:
        """Whether the GGUF declares rank pooling (describe.cross_encoder): it only reranks."""
        return await self.capabilities(manifest) == ["rerank"]

    async def _require(self, model: str, target: Target, can: tuple[str, ...],
                       doing: str) -> None:
        """A 400 before any runner is leased when the model can do none of `can` (an
        embedding model asked to chat, a reranker to embed), saying what it can do."""
        try:
            caps = await self.capabilities(target.manifest)
        except EngineError:
            return  # a model file unreadable: the lease says so in the load's own words
        if any(c in caps for c in can):
            return
        # (what cannot chat or embed lists one thing: describe.capabilities)
        kind, use = _KINDS.get(caps[0], ("a model", " and ".join(caps)))
        raise EngineError(f"model '{model}' is {kind}: it can {use}, not {doing}",
                          code="invalid_request")

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

    async def remove(self, model: str) -> None:
        """Delete `model` from the store, and the runner loaded under its name (once its
        requests end), as `ollama rm` stops a running model. Left loaded, `ps` and the
        metrics would go on naming a model the store no longer has, and the requests of
        the same weights' other names would lease it under that name."""
        parsed, _ = self.store.get(model)
        self.store.remove(model)
        await self.scheduler.forget(str(parsed))

    async def unload(self, model: str) -> bool:
        """Unload `model` now if it is loaded and idle (or once its requests finish)."""
        return await self.scheduler.unload_name(model)

    async def load(self, req: ChatRequest) -> float:
        """Load (or keep) the model without generating; returns seconds spent loading (none
        for a remote model: its server holds it)."""
        target = self.resolve(req.model)
        async with self._hold(merged(req, target.manifest), target, None) as held:
            return held.load_seconds
