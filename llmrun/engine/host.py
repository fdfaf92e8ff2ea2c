"""The runner's side of the channel: ModelHost reads the daemon's messages (llmrun.protocol),
hands each request to the engine, the embedder or the reranker, and sends their events back,
through the thinking and tool-call filters, in frames that fit ipc.MAX_FRAME.

An encoder-only model (BERT and kin: Model.encoder_only) has no engine: it embeds, or with
rank pooling reranks (engine/crossencoder.py), and a generation request gets an error event.

Whatever one request brings ends only that request with an error event; if the engine thread
or the message loop fails anyway, the process exits (ipc.EXIT_*), so the daemon starts a
fresh runner rather than sending requests to a process that can no longer answer them.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any, cast

from llmrun import ipc, protocol
from llmrun.chat import formats, thinking, tools
from llmrun.engine.batcher import Engine, Event, SeqParams
from llmrun.engine.budget import ThoughtBudget
from llmrun.engine.crossencoder import CrossEncoder
from llmrun.engine.draft import DRAFT_MODEL_DEFAULT, DraftModel
from llmrun.engine.embed import Embedder
from llmrun.engine.llama import Context, ImageChunk, LlamaError, Model, Projector
from llmrun.engine.outputs import OutputFilters, grammar_matcher, tool_steering
from llmrun.engine.prompt import Prompter
from llmrun.engine.promptcache import PromptCache
from llmrun.engine.rerank import Reranker
from llmrun.engine.threads import ThreadGovernor
from llmrun.ipc import ChannelClosed, SyncChannel
from llmrun.protocol import (
    FINAL,
    Cancel,
    Count,
    Detokenize,
    Embed,
    Generate,
    Load,
    ProtocolError,
    RefusedRequest,
    Rerank,
    Shutdown,
    Tokenize,
)
from llmrun.request import ChatRequest, error_event

log = logging.getLogger("llmrun.runner")


def request_error(exc: BaseException) -> dict[str, Any]:
    """The error event payload for a request that could not be prepared: 400 when the
    request itself is at fault (a template, schema, option or nesting it brought), 500 for
    anything else, which is logged."""
    if isinstance(exc, RecursionError):
        return error_event("invalid_request", "the request is nested too deeply to process")
    if isinstance(exc, ValueError | LlamaError):
        return error_event("invalid_request", str(exc) or type(exc).__name__)
    log.error("request failed", exc_info=exc)
    if isinstance(exc, MemoryError):
        return error_event("internal", "the model runner ran out of memory preparing this "
                                       "request")
    return error_event("internal", f"the model runner could not prepare this request: "
                                   f"{type(exc).__name__}: {exc}")


class ModelHost:
    """The runner process's side: hosts the model and its engine, answers the daemon's IPC
    messages (server/runners.py's RunnerProcess is the daemon's handle on this process)."""

    def __init__(self, chan: SyncChannel, model: Model, ctx: Context | None, n_ctx_seq: int,
                 n_slots: int, n_threads: int = 1,
                 governor: ThreadGovernor | None = None,
                 prompt_cache: PromptCache | None = None,
                 step_budget: tuple[float, int] = (0.0, 0),
                 projector: Projector | None = None,
                 drafter: DraftModel | None = None) -> None:
        self.chan = chan
        self.n_threads = n_threads
        self._embedder: Embedder | None = None
        self._reranker: Reranker | None = None
        self.model = model
        self.n_ctx_seq = n_ctx_seq
        self.n_slots = n_slots
        # None: an encoder-only model, which boot gives no generation context
        self.engine = None if ctx is None else Engine(
            model, ctx, n_ctx_seq=n_ctx_seq, n_slots=n_slots, emit=self.emit,
            on_fatal=self._engine_failed, governor=governor, prompt_cache=prompt_cache,
            step_budget=step_budget, projector=projector, drafter=drafter)
        self.drafter = drafter
        self.prompt_cache = prompt_cache
        self.projector = projector
        # most rows of one image: a decode of its own reads it whole
        self.prompt = Prompter(model, n_ctx_seq,
                               n_ctx_seq if ctx is None else min(ctx.n_batch, ctx.n_ubatch),
                               projector)
        self.outputs = OutputFilters(self.cancel)  # thinking and tool-call filters
        # Requests sent to the engine or embedder and not finished: failed if the process
        # has to exit. Sets of ids touched from several threads: add/discard are atomic.
        self._inflight: set[str] = set()
        self._exit = os._exit  # replaceable in tests
        self.sandbox_info: dict[str, Any] = {}  # confinement layers, for info()

    # -- events out -----------------------------------------------------------------------

    def emit(self, events: list[Event]) -> None:
        """Send engine (or embedder) events to the daemon; an empty list is a heartbeat."""
        events = self.outputs.apply(events)
        for rid, kind, _ in events:
            if kind in FINAL:
                self._inflight.discard(rid)
        self._send_events(events)

    def _send_events(self, events: list[Event]) -> None:
        """One events frame, or several when it would exceed ipc.MAX_FRAME (the daemon would
        take a larger one for a broken channel and drop every request on this runner)."""
        try:
            frame: bytes | None = ipc.encode(protocol.Events(events=events))
        except (ValueError, RecursionError):  # a payload JSON cannot carry
            frame = None
        if frame is not None and ipc.body_size(frame) <= ipc.MAX_FRAME:
            # OSError: the daemon is gone; the main loop notices and exits
            with contextlib.suppress(OSError):
                self.chan.send_frame(frame)
        elif len(events) > 1:
            half = len(events) // 2
            self._send_events(events[:half])
            self._send_events(events[half:])
        elif events:
            self._send_events(self._split(events[0]))

    def _split(self, event: Event) -> list[Event]:
        """One event too large for a frame: an embedding reply in two parts, else an error."""
        rid, kind, payload = event
        if kind in ("embedding", "embedding_part") and len(payload["embeddings"]) > 1:
            vectors = payload["embeddings"]
            half = len(vectors) // 2
            return [(rid, "embedding_part", {"embeddings": vectors[:half]}),
                    (rid, kind, {**payload, "embeddings": vectors[half:]})]
        log.error("request %s: a %s event does not fit an IPC frame", rid, kind)
        return self.outputs.abandon(rid, [event] if kind in FINAL else [], error_event(
            "too_large", f"the reply is larger than the IPC frame limit ({ipc.MAX_FRAME} "
                         f"bytes)", limit=ipc.MAX_FRAME))

    # -- when this process can no longer serve --------------------------------------------

    def _engine_failed(self, exc: BaseException) -> None:
        self._die(ipc.EXIT_ENGINE_FAILED, f"the engine thread failed ({type(exc).__name__})")

    def _die(self, status: int, why: str) -> None:
        """Fail every request in flight, then exit: the daemon sees the runner gone and starts
        a fresh one for the next request (a live process whose engine is gone would leave
        every later request waiting forever)."""
        log.critical("%s; exiting with status %d", why, status)
        error = error_event("runner_failed", f"the model runner failed ({why}) and will be "
                                             f"restarted")
        with contextlib.suppress(Exception):
            self._send_events([(rid, "error", error) for rid in list(self._inflight)])
        for handler in logging.getLogger().handlers:
            with contextlib.suppress(Exception):
                handler.flush()
        self._exit(status)

    def embedder(self) -> Embedder:
        if self._embedder is None:
            self._embedder = Embedder(self.model, self.n_ctx_seq, self.n_threads,
                                      lambda rid, kind, payload: self.emit([(rid, kind, payload)]),
                                      heartbeat=lambda: self.emit([]))
        return self._embedder

    def reranker(self) -> Reranker:
        """The LLM reranker, or the cross-encoder for a model with rank pooling."""
        if self._reranker is None:
            worker = CrossEncoder if self.model.rank_pooling else Reranker
            self._reranker = worker(self.model, self.prompt.render, self.n_ctx_seq,
                                    self.n_threads,
                                    lambda rid, kind, payload: self.emit([(rid, kind, payload)]),
                                    heartbeat=lambda: self.emit([]))
        return self._reranker

    def cancel(self, req_id: str) -> None:
        """Stop a generation (side work runs to its end: its jobs are short)."""
        if self.engine is not None:
            self.engine.cancel(req_id)

    def rerank(self, msg: Rerank) -> None:
        self._inflight.add(msg.id)
        self.reranker().submit(msg.id, msg.request, msg.query, msg.documents, msg.offset)

    def embed(self, msg: Embed) -> None:
        self._inflight.add(msg.id)
        self.embedder().submit(msg.id, msg.inputs, msg.truncate, msg.offset)

    def info(self) -> protocol.Info:
        return cast(protocol.Info, {
            "n_ctx_seq": self.n_ctx_seq,
            "n_slots": self.n_slots,
            "n_ctx_train": self.model.n_ctx_train,
            "has_template": self.prompt.template is not None,
            "vision": self.projector is not None and self.projector.vision,
            "audio": self.projector is not None and self.projector.audio,
            "size": self.model.size,
            **self.sandbox_info,  # which confinement layers hold (engine/boot.py sets it)
        })

    def generate(self, req_id: str, req: ChatRequest) -> None:
        try:
            self._generate(req_id, req)
        except Exception as exc:  # templates, schemas, parsers: this request only
            self.outputs.forget(req_id)
            self.emit([(req_id, "error", request_error(exc))])

    def _generate(self, req_id: str, req: ChatRequest) -> None:
        if self.engine is None:
            self.emit([(req_id, "error", error_event(
                "invalid_request", "this model only encodes text (an embedding model or a "
                                   "cross-encoder reranker): it cannot generate; use it for "
                                   "embeddings or reranking"))])
            return
        try:
            source = self.prompt.source(req)
            plan = tools.plan(req, source) if req.suffix is None else None
            media: list[tuple[int, ImageChunk]] = []
            prompt, text = self.prompt.render(req, plan, media)
            # the family's format: how its output is read, its calls steered and forced
            fmt = formats.detect(source) if req.prompt is None else formats.DEFAULT
            pair = fmt.think_pair(source) if req.prompt is None else None
            if req.think and req.think_required and pair is None and req.prompt is None:
                raise ValueError("this model does not support thinking (its chat template "
                                 "has no way to switch it)")
            matcher = grammar_matcher(self.model, req, plan, fmt)
            lazy = tool_steering(self.model, req, plan, pair, text, fmt) \
                if matcher is None else None
            truncated = (0, 0)
            if len(prompt) >= self.n_ctx_seq and req.options.truncate:
                req, prompt, text, truncated = self.prompt.truncate(req, plan, prompt, text)
                if media and truncated[0]:  # the images left, where they are now
                    media = []
                    prompt, text = self.prompt.render(req, plan, media)
            if media and req.prompt_logprobs is not None:
                raise ValueError("prompt logprobs (echo) cannot score a prompt with images")
        except Exception as exc:
            self.emit([(req_id, "error", request_error(exc))])
            return
        if len(prompt) >= self.n_ctx_seq:
            self.emit([(req_id, "error", error_event(
                "prompt_too_long", f"the prompt is {len(prompt)} tokens but the model's "
                                   f"context is {self.n_ctx_seq} tokens (num_ctx); shorten it "
                                   f"or raise num_ctx",
                prompt_tokens=len(prompt), n_ctx=self.n_ctx_seq))])
            return
        if self.drafter is not None and req.options.num_draft is None:
            req.options.num_draft = DRAFT_MODEL_DEFAULT
        params = SeqParams.of(
            req, matcher=matcher, lazy=lazy, truncated=truncated, images=media,
            pieces=self.prompt.control_pieces() if plan is not None or pair is not None else {})
        if matcher is not None and pair is not None and not fmt.grammar_thinks \
                and req.grammar is None:
            # The thought stays free; the constraint starts with the answer: after the end
            # marker when the prompt opened a thought, else from the first token unless that
            # token opens one (thinking not switched off). A client's raw grammar is the
            # whole output's, a thought included, as llama-server applies its `grammar`.
            inside = thinking.opens(text, pair)
            if inside or req.think is not False:
                params.constrain_after = pair[1].encode()
                params.think_open = None if inside else pair[0].encode()
        # (not with images: a state holding one is never kept, and the boundary comes after
        # them, so rendering the request again, images decoded again, would buy nothing)
        if self.prompt_cache is not None and not media \
                and len(prompt) >= self.prompt_cache.min_tokens:
            params.save_at = self.prompt.boundary(req, plan, prompt, self.prompt_cache.min_tokens)
        opened = pair is not None and thinking.opens(text, pair)
        if req.think_budget and pair is not None and req.think is not False:
            params.budget = self._budget(req.think_budget, fmt, pair, opened)
        self.outputs.watch(req_id, plan, pair, opened=opened, keep=req.think is not False,
                           fmt=fmt)
        self._inflight.add(req_id)
        self.engine.submit(req_id, prompt, params)

    def _budget(self, limit: int, fmt: formats.Format, pair: tuple[str, str],
                opened: bool) -> ThoughtBudget | None:
        """A thinking budget of `limit` tokens: the family's end of a thought as tokens
        (a marker that is a special token as that token, as the model writes it)."""
        close = self.model.tokenize(fmt.think_end(pair), add_special=False, parse_special=True)
        if not close:
            return None
        return ThoughtBudget(limit, close, pair[1].encode(),
                             None if opened else pair[0].encode())

    def count(self, req_id: str, req: ChatRequest, detail: bool = False) -> None:
        """The prompt length a request renders to, exactly as `generate` would see it (with
        `detail`, the rendered prompt and its tokens as well)."""
        try:
            tokens, text = self.prompt.render(req)
        except Exception as exc:
            self.emit([(req_id, "error", request_error(exc))])
            return
        extra = {"prompt": text, "tokens": tokens} if detail else {}
        self.emit([(req_id, "count", {"prompt_tokens": len(tokens), "n_ctx": self.n_ctx_seq,
                                      **extra})])

    def tokenize(self, req_id: str, text: str, add_special: bool) -> None:
        """`text`'s tokens (special tokens written in it are parsed as such, as the chat
        template's are) and each one's text."""
        try:
            tokens = self.model.tokenize(str(text), add_special=bool(add_special))
            pieces = [_piece(self.model.piece(t)) for t in tokens]
        except Exception as exc:
            self.emit([(req_id, "error", request_error(exc))])
            return
        self.emit([(req_id, "tokens", {"tokens": tokens, "pieces": pieces})])

    def detokenize(self, req_id: str, tokens: object) -> None:
        """The text of `tokens` (special tokens add nothing, as in generated text)."""
        n_vocab = self.model.n_vocab
        bad = next((t for t in tokens if not isinstance(t, int) or isinstance(t, bool)
                    or not 0 <= t < n_vocab), None) if isinstance(tokens, list) else tokens
        if bad is not None or not isinstance(tokens, list):
            self.emit([(req_id, "error", error_event(
                "invalid_request", f"not a token of this model (0 to {n_vocab - 1}): {bad!r}"))])
            return
        text = b"".join(self.model.piece(t) for t in tokens).decode("utf-8", "replace")
        self.emit([(req_id, "text", {"content": text})])

    def serve(self) -> None:
        if self.engine is not None:
            self.engine.start()
        self.chan.send(protocol.Ready(info=self.info()))
        try:
            self._serve()
        except Exception as exc:
            log.exception("the message loop failed")
            self._die(ipc.EXIT_SERVE_FAILED, f"its message loop failed ({type(exc).__name__})")
        if self.engine is not None:
            self.engine.stop()
        if self.prompt_cache is not None:
            self.prompt_cache.close(ipc.STOP_SECONDS)  # the states still being written

    def _serve(self) -> None:
        """Read the daemon's messages until it closes the channel or says shutdown. A frame
        that is no message of the protocol raises ProtocolError: the daemon is broken, and
        the process exits (see serve)."""
        while True:
            try:
                frame = self.chan.recv()
            except (ChannelClosed, OSError):
                return
            try:
                msg = protocol.parse_command(frame)
            except RefusedRequest as refused:  # that request only: an error event for it
                self.emit([(refused.id, "error", request_error(refused.cause))])
                continue
            handler = HANDLERS.get(type(msg))
            if handler is not None:
                handler(self, msg)
                continue
            match msg:
                case Cancel(id=rid):
                    self.cancel(rid)
                case Shutdown():
                    return
                case Load():
                    raise ProtocolError("a second load message: a runner loads one model")


# Each kind of work's handler (protocol.KINDS): its message in, its events out through emit.
HANDLERS: dict[type, Callable[[ModelHost, Any], None]] = {
    Generate: lambda host, m: host.generate(m.id, m.request),
    Count: lambda host, m: host.count(m.id, m.request, m.detail),
    Tokenize: lambda host, m: host.tokenize(m.id, m.text, m.add_special),
    Detokenize: lambda host, m: host.detokenize(m.id, m.tokens),
    Embed: ModelHost.embed,
    Rerank: ModelHost.rerank,
}
assert {m.message for m in protocol.KINDS.values()} == set(HANDLERS), "a kind without handler"


def _piece(raw: bytes) -> str | list[int]:
    """A token's text, or its bytes where they are not whole UTF-8 (part of a character),
    as llama-server's /tokenize gives them."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)

