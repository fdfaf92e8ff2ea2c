"""The runner process: one per loaded model, started and supervised by the daemon.

    python -m llmrun.engine.runner --fd N --model PATH --ctx 4096 --slots 4 --threads 2

It speaks framed JSON (llmrun.ipc) over the inherited socket `--fd`:

    daemon -> runner   {"type": "generate", "id": ..., "request": ChatRequest}
                       {"type": "embed", "id": ..., "inputs": [str], "truncate": bool}
                       {"type": "count", "id": ..., "request": ChatRequest,
                        "detail": bool}  (render only; detail: the prompt and its tokens too)
                       {"type": "tokenize", "id": ..., "text": str, "add_special": bool}
                       {"type": "detokenize", "id": ..., "tokens": [int]}
                       {"type": "cancel", "id": ...}      {"type": "shutdown"}
    runner -> daemon   {"type": "ready", "info": {...}}   {"type": "fatal", "error": ...}
                       {"type": "events", "events": [[id, kind, payload]]}
                       kind: "started" {"prompt_tokens", "cached_tokens", "n_ctx"} (first)
                             | "chunk" {"text", "logprobs"?, "thinking"?, "tool_calls"?,
                                        "prompt_logprobs"?}
                             | "done" Stats | "error" request.error_event (code and fields)
                             | "count" {"prompt_tokens", "n_ctx", "prompt"?, "tokens"?}
                             | "tokens" {"tokens", "pieces"} | "text" {"content"}
                             | "embedding"
                             | "embedding_part" (some vectors of a reply too large for one
                             frame; the closing "embedding" carries the rest)
                       an empty events list is a heartbeat (the engine is busy, not hung)

The request is a ChatRequest already merged with the model's Modelfile by the daemon (its
messages first, its template, options and system prompt).

A crash here (llama.cpp is C++) takes down only this process; the daemon reports it to the
requests in flight. When the daemon goes away the channel closes and the runner exits.
Whatever one request brings ends only that request with an error event; if the engine thread
or the message loop fails anyway, the process exits (ipc.EXIT_*), so the daemon starts a
fresh runner rather than sending requests to a process that can no longer answer them.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import signal
import socket
import sys
from pathlib import Path
from typing import Any

from llmrun import config, ipc
from llmrun.chat import templates, thinking, toolcalls, tools
from llmrun.engine import constraint, images, sandbox
from llmrun.engine.batcher import Engine, Event, SeqParams, image_ids
from llmrun.engine.draft import DRAFT_MODEL_DEFAULT, DraftModel, common_prefix
from llmrun.engine.embed import Embedder
from llmrun.engine.llama import (
    Context,
    ImageChunk,
    LlamaError,
    LoraAdapter,
    Model,
    Projector,
    RpcWorkers,
    list_backends,
    list_devices,
)
from llmrun.engine.promptcache import PromptCache
from llmrun.engine.threads import ThreadGovernor
from llmrun.ipc import ChannelClosed, SyncChannel
from llmrun.request import ChatRequest, error_event

log = logging.getLogger("llmrun.runner")

# Event kinds that end a request (nothing more is sent for its id).
FINAL = frozenset({"done", "error", "embedding", "count", "tokens", "text"})


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


def by_request(events: list[Event]) -> dict[str, list[Event]]:
    """Events grouped by request id, each request's in their order."""
    groups: dict[str, list[Event]] = {}
    for event in events:
        groups.setdefault(event[0], []).append(event)
    return groups


def _stop_on_sigterm(chan: SyncChannel) -> None:
    """SIGTERM ends the message loop as a shutdown message does: the engine stops and the
    prompt states being written are finished (ModelHost.serve). It comes from a service
    manager stopping the daemon's whole cgroup (systemd's default), or from the kernel when
    the daemon dies (_die_with_parent); the default action would kill the runner mid-write.
    The handler only closes the channel's reading side, so the loop sees the end of input
    at its next read, wherever the signal found the main thread."""
    def handler(signum: int, frame: object) -> None:
        with contextlib.suppress(OSError):
            chan.sock.shutdown(socket.SHUT_RD)

    signal.signal(signal.SIGTERM, handler)


def _die_with_parent() -> None:
    """Ask the kernel to SIGTERM this process when the daemon dies (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


class ModelHost:
    """The runner process's side: hosts the model and its engine, answers the daemon's IPC
    messages (server/runners.py's RunnerProcess is the daemon's handle on this process)."""

    def __init__(self, chan: SyncChannel, model: Model, ctx: Context, n_ctx_seq: int,
                 n_slots: int, n_threads: int = 1,
                 governor: ThreadGovernor | None = None,
                 prompt_cache: PromptCache | None = None,
                 step_budget: tuple[float, int] = (0.0, 0),
                 projector: Projector | None = None,
                 drafter: DraftModel | None = None) -> None:
        self.chan = chan
        self.n_threads = n_threads
        self._embedder: Embedder | None = None
        self.model = model
        self.n_ctx_seq = n_ctx_seq
        self.engine = Engine(model, ctx, n_ctx_seq=n_ctx_seq, n_slots=n_slots, emit=self.emit,
                             on_fatal=self._engine_failed, governor=governor,
                             prompt_cache=prompt_cache, step_budget=step_budget,
                             projector=projector, drafter=drafter)
        self.drafter = drafter
        self.prompt_cache = prompt_cache
        self.projector = projector
        self.n_image_rows = min(ctx.n_batch, ctx.n_ubatch)  # most rows of one image (see render)
        self.template = model.chat_template()
        self.bos_text = model.token_text(model.bos) if model.bos >= 0 else ""
        self.eos_text = model.token_text(model.eos) if model.eos >= 0 else ""
        self._tool_streams: dict[str, toolcalls.ToolStream] = {}  # requests that offer tools
        self._think_streams: dict[str, thinking.ThinkStream] = {}  # ... that may think
        self._control_pieces: dict[int, bytes] | None = None
        # Requests sent to the engine or embedder and not finished: failed if the process
        # has to exit. Sets of ids touched from several threads: add/discard are atomic.
        self._inflight: set[str] = set()
        self._dropped: set[str] = set()  # failed here: their further events are not sent
        self._exit = os._exit  # replaceable in tests
        self.sandbox_info: dict[str, Any] = {}  # confinement layers, for info()

    # -- events out -----------------------------------------------------------------------

    def emit(self, events: list[Event]) -> None:
        """Send engine (or embedder) events to the daemon; an empty list is a heartbeat."""
        if self._dropped:
            events = self._without_dropped(events)
        if self._think_streams or self._tool_streams:
            events = self._filter(events)
        for rid, kind, _ in events:
            if kind in FINAL:
                self._inflight.discard(rid)
        self._send_events(events)

    def _without_dropped(self, events: list[Event]) -> list[Event]:
        out = []
        for event in events:
            rid, kind, _ = event
            if rid not in self._dropped:
                out.append(event)
            elif kind in FINAL:
                self._dropped.discard(rid)
        return out

    def _filter(self, events: list[Event]) -> list[Event]:
        """Events through the thinking and tool-call filters, one request at a time, so a
        filter that raises on one request's output fails that request alone."""
        out: list[Event] = []
        for rid, group in by_request(events).items():
            if rid in self._think_streams or rid in self._tool_streams:
                try:
                    if rid in self._think_streams:  # thoughts first: tools see the answer
                        group = thinking.filter_events(self._think_streams, group)
                    if rid in self._tool_streams:
                        group = toolcalls.filter_events(self._tool_streams, group)
                except Exception as exc:
                    log.error("request %s: its output filter failed", rid, exc_info=exc)
                    group = self._abandon(rid, group, error_event(
                        "internal", f"the model's output could not be processed "
                                    f"({type(exc).__name__}); generation was stopped"))
            out += group
        return out

    def _abandon(self, rid: str, group: list[Event], error: dict[str, Any]) -> list[Event]:
        """End request `rid` with `error` in place of `group` (its events of this step): its
        stream state goes, and unless the group already finished it, the engine cancels it
        and whatever it still emits for it is dropped."""
        self._think_streams.pop(rid, None)
        self._tool_streams.pop(rid, None)
        if not any(kind in FINAL for _, kind, _ in group):
            self._dropped.add(rid)
            self.engine.cancel(rid)
        return [(rid, "error", error)]

    def _send_events(self, events: list[Event]) -> None:
        """One events frame, or several when it would exceed ipc.MAX_FRAME (the daemon would
        take a larger one for a broken channel and drop every request on this runner)."""
        try:
            frame: bytes | None = ipc.encode({"type": "events", "events": events})
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
        return self._abandon(rid, [event] if kind in FINAL else [], error_event(
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

    def info(self) -> dict[str, Any]:
        return {
            "n_ctx_seq": self.n_ctx_seq,
            "n_slots": len(self.engine.slots),
            "n_ctx_train": self.model.n_ctx_train,
            "has_template": self.template is not None,
            "vision": self.projector is not None,
            "size": self.model.size,
            **self.sandbox_info,  # which confinement layers hold (main() sets it)
        }

    def source(self, req: ChatRequest) -> str:
        """The chat template `req` renders with, refused before anything (tool and
        thinking markers included) reads it if it is over the size limit."""
        source = req.template or self.template or templates.FALLBACK_TEMPLATE
        templates.check_size(source)
        return source

    def render(self, req: ChatRequest, plan: tools.ToolPlan | None = None,
               media: list[tuple[int, ImageChunk]] | None = None) -> tuple[list[int], str]:
        """The prompt's tokens and the text they came from (`plan`: tools.plan(req, source),
        when the caller has it already). Images in the messages take their positions as
        image_ids; each one's chunk, with the index of its first position, goes to `media`
        when it is given."""
        pictures = [img for m in req.messages for img in m.images]
        if pictures and (req.prompt is not None or req.suffix is not None):
            raise ValueError("images need the chat template: a raw prompt cannot carry them")
        if pictures and self.projector is None:
            raise ValueError("this model has no vision projector: it cannot read images")
        if req.suffix is not None:
            return self._fill_in_the_middle(req.prompt or "", req.suffix), ""
        if req.prompt is not None:
            text = req.prompt
            add_bos = self.model.add_bos
        else:
            source = self.source(req)
            if plan is None:
                plan = tools.plan(req, source)
            marked = [m.model_copy(update={"content": self._with_markers(m.content, m.images)})
                      if m.images else m for m in req.messages]
            messages, extra = tools.chat_inputs(marked, req.system, source, plan)
            if thinking.markers(source):
                extra.update(thinking.template_vars(req.think))
            text = templates.render(source, messages, bos_token=self.bos_text,
                                    eos_token=self.eos_text, **extra)
            # Most templates write the BOS token themselves; adding another hurts quality.
            add_bos = self.model.add_bos and not (self.bos_text and
                                                  text.startswith(self.bos_text))
        if pictures:
            tokens = self._tokenize_images(text, pictures, add_bos, media)
        else:
            tokens = self.model.tokenize(text, add_special=add_bos, parse_special=True)
        if req.context:
            if pictures:
                raise ValueError("images cannot follow a `context` of earlier token ids")
            tokens = self._after_context(req.context, tokens)
        return tokens, text

    def _with_markers(self, content: str, pictures: list[str]) -> str:
        """A message's text with its images before it, as Ollama places them: one marker
        each (the projector's own, which no client can write) on a line of its own."""
        assert self.projector is not None
        marks = "".join(self.projector.marker for _ in pictures)
        return f"{marks}\n{content}" if content else marks

    def _tokenize_images(self, text: str, pictures: list[str], add_bos: bool,
                         media: list[tuple[int, ImageChunk]] | None) -> list[int]:
        """`text` (with a marker per image) as tokens and image positions. The images are
        decoded here, in the sandbox, each bounded before a pixel is read (engine/images.py)."""
        assert self.projector is not None
        if text.count(self.projector.marker) != len(pictures):
            raise ValueError("the chat template dropped or repeated an image's place")
        decoded = [images.decode(b64) for b64 in pictures]
        tokens: list[int] = []
        for part in self.projector.tokenize(text, decoded, add_bos):
            if isinstance(part, ImageChunk):
                if part.n_tokens > self.n_image_rows:
                    raise ValueError(f"an image takes {part.n_tokens} positions; this model "
                                     f"was loaded for at most {self.n_image_rows} (num_batch)")
                if media is not None:
                    media.append((len(tokens), part))
                tokens += image_ids(part.digest, part.n_tokens)
            else:
                tokens += part
        if tokens and tokens[-1] < 0:
            raise ValueError("a prompt cannot end with an image: text must follow it")
        return tokens

    def _truncate(self, req: ChatRequest, plan: tools.ToolPlan | None, prompt: list[int],
                  text: str) -> tuple[ChatRequest, list[int], str, tuple[int, int]]:
        """`req` without its oldest turns, as few as make it fit the context (Ollama's
        `truncate`): system messages and the last user turn always stay; a turn goes whole
        (a user message and what answered it), so no tool result loses its call. Returns
        the request, its prompt and text, and (messages, tokens) dropped; the request as it
        was when dropping every earlier turn is not enough."""
        if req.prompt is not None or req.suffix is not None:
            return req, prompt, text, (0, 0)
        history = [i for i, m in enumerate(req.messages) if m.role != "system"]
        users = [i for i in history if req.messages[i].role == "user"]
        starts = [i for i in users if i > history[0]] if history else []  # turns after the first

        def without(k: int) -> ChatRequest:
            """`req` less every non-system message before the k-th later turn's start."""
            cut = starts[k - 1]
            kept = [m for i, m in enumerate(req.messages) if m.role == "system" or i >= cut]
            return req.model_copy(update={"messages": kept})

        lo, hi = 1, len(starts)  # the fewest turns to drop, by bisection: renders are costly
        best: tuple[ChatRequest, list[int], str] | None = None
        while lo <= hi:
            mid = (lo + hi) // 2
            candidate = without(mid)
            tokens, rendered = self.render(candidate, plan)
            if len(tokens) < self.n_ctx_seq:
                best, hi = (candidate, tokens, rendered), mid - 1
            else:
                lo = mid + 1
        if best is None:
            return req, prompt, text, (0, 0)
        short, tokens, rendered = best
        dropped = len(req.messages) - len(short.messages)
        log.info("truncated the prompt: %d oldest messages (%d tokens) dropped to fit %d",
                 dropped, len(prompt) - len(tokens), self.n_ctx_seq)
        return short, tokens, rendered, (dropped, len(prompt) - len(tokens))

    def _boundary(self, req: ChatRequest, plan: tools.ToolPlan | None, prompt: list[int],
                  min_tokens: int = 1) -> int | None:
        """How many tokens of `prompt` come before the text of its last user message: what a
        new session with the same system prompt and tools, or the next turn, shares with it,
        so where its state is kept (engine/promptcache.py). Found by rendering the request
        with that text left out, not the messages before it: some templates (Gemma's) write
        the system prompt inside the first user turn. None for a raw prompt, or when fewer
        than `min_tokens` come before that message (not worth a state of their own)."""
        if req.prompt is not None or req.suffix is not None or req.context:
            return None
        users = [i for i, m in enumerate(req.messages) if m.role == "user"]
        if not users:
            return None
        messages = list(req.messages)
        messages[users[-1]] = messages[users[-1]].model_copy(update={"content": ""})
        try:
            tokens, _ = self.render(req.model_copy(update={"messages": messages}), plan)
        except Exception:  # a template that refuses an empty message: no boundary
            return None
        n = common_prefix(tokens, prompt)
        # a short head is not worth a state of its own: the whole prompt's is kept instead
        return n if n >= min_tokens else None

    def _fill_in_the_middle(self, prefix: str, suffix: str) -> list[int]:
        """Prefix-suffix-middle order with the model's FIM tokens, as llama-server builds it."""
        fim = self.model.fim_tokens()
        if fim is None:
            raise ValueError("this model does not support insert (fill-in-the-middle with "
                             "'suffix'): its vocabulary has no FIM tokens")
        pre, suf, mid = fim
        head = [self.model.bos] if self.model.add_bos and self.model.bos >= 0 else []
        return [*head, pre, *self.model.tokenize(prefix, add_special=False, parse_special=False),
                suf, *self.model.tokenize(suffix, add_special=False, parse_special=False), mid]

    def _after_context(self, context: list[int], tokens: list[int]) -> list[int]:
        """Ollama's `context`: an earlier exchange's tokens, then the new prompt (whose BOS,
        if any, would be a second one)."""
        if any(not 0 <= t < self.model.n_vocab for t in context):
            raise ValueError(f"context holds token ids outside this model's vocabulary "
                             f"(0..{self.model.n_vocab - 1}); it came from another model?")
        if tokens and tokens[0] == self.model.bos and context[:1] == [self.model.bos]:
            tokens = tokens[1:]
        return [*context, *tokens]

    def generate(self, req_id: str, raw: dict[str, Any]) -> None:
        try:
            self._generate(req_id, raw)
        except Exception as exc:  # templates, schemas, parsers: this request only
            self._think_streams.pop(req_id, None)
            self._tool_streams.pop(req_id, None)
            self.emit([(req_id, "error", request_error(exc))])

    def _generate(self, req_id: str, raw: dict[str, Any]) -> None:
        try:
            req = ChatRequest.model_validate(raw)
            source = self.source(req)
            plan = tools.plan(req, source) if req.suffix is None else None
            media: list[tuple[int, ImageChunk]] = []
            prompt, text = self.render(req, plan, media)
            pair = thinking.markers(source) if req.prompt is None else None
            if req.think and req.think_required and pair is None and req.prompt is None:
                raise ValueError("this model does not support thinking (its chat template "
                                 "has no way to switch it)")
            matcher = self._matcher(req, plan)
            lazy = self._steering(req, plan, pair, text) if matcher is None else None
            truncated = (0, 0)
            if len(prompt) >= self.n_ctx_seq and req.options.truncate:
                req, prompt, text, truncated = self._truncate(req, plan, prompt, text)
                if media and truncated[0]:  # the images left, where they are now
                    media = []
                    prompt, text = self.render(req, plan, media)
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
            pieces=self.control_pieces() if plan is not None or pair is not None else {})
        if matcher is not None and pair is not None:
            # The thought stays free; the constraint starts with the answer: after the end
            # marker when the prompt opened a thought, else from the first token unless that
            # token opens one (thinking not switched off).
            inside = thinking.opens(text, pair)
            if inside or req.think is not False:
                params.constrain_after = pair[1].encode()
                params.think_open = None if inside else pair[0].encode()
        # (not with images: a state holding one is never kept, and the boundary comes after
        # them, so rendering the request again, images decoded again, would buy nothing)
        if self.prompt_cache is not None and not media \
                and len(prompt) >= self.prompt_cache.min_tokens:
            params.save_at = self._boundary(req, plan, prompt, self.prompt_cache.min_tokens)
        if plan is not None:
            self._tool_streams[req_id] = plan.stream()
        if pair is not None:
            self._think_streams[req_id] = thinking.ThinkStream(
                pair, inside=thinking.opens(text, pair), keep=req.think is not False)
        self._inflight.add(req_id)
        self.engine.submit(req_id, prompt, params)

    def _matcher(self, req: ChatRequest, plan: tools.ToolPlan | None) -> Any:
        """The llguidance matcher `req` decodes under (None: unconstrained), built here on the
        message thread, never the engine's: a forced tool call's grammar, else the request's
        raw grammar, else its format. A grammar llguidance refuses is a ValueError (a 400)."""
        forced_call = plan is not None and plan.choice != "auto"
        if not forced_call and req.grammar is None and req.format is None:
            return None
        tok = constraint.tokenizer(self.model)  # built at start-up (serve); cached
        # markers that are one special token are forced as that token, as the model was
        # trained to write them, not spelled out character by character
        forced = plan.grammar(tools.special_markers(tok)) if forced_call and plan else None
        grammar = constraint.compile(req, tok, forced)
        return None if grammar is None else constraint.matcher(tok, grammar)

    def _steering(self, req: ChatRequest, plan: tools.ToolPlan | None,
                  pair: tuple[str, str] | None, text: str) -> constraint.Lazy | None:
        """For tool_choice "auto": the grammar that takes over once the model begins a call
        (tools.steering), built here on the message thread. None when nothing is offered or
        the request is constrained otherwise; a grammar llguidance refuses (a schema it
        cannot read) leaves calls free, as they were before steering, with a log line."""
        if plan is None or req.grammar is not None or req.format is not None:
            return None
        tok = constraint.tokenizer(self.model)
        try:  # ~20 ms for Claude Code's tools; no separate check: the matcher's build is one
            steer = plan.steering(tools.special_markers(tok))
            if steer is None:
                return None
            grammar = constraint.from_grammar(steer.grammar)
            think = (pair[0].encode(), pair[1].encode()) if pair is not None else None
            inside = pair is not None and thinking.opens(text, pair)
            return constraint.Lazy(tok, grammar, steer.triggers, think, inside)
        except ValueError as exc:
            log.warning("tool calls are not steered for this request: %s", exc)
            return None

    def control_pieces(self) -> dict[int, bytes]:
        """Tool-call markers that are control tokens in this vocabulary (rendered as nothing
        by default), as the text the tool parser looks for."""
        if self._control_pieces is None:
            self._control_pieces = {}
            for marker in (*tools.CONTROL_MARKERS, *thinking.CONTROL_MARKERS):
                toks = self.model.tokenize(marker, add_special=False, parse_special=True)
                if len(toks) == 1 and not self.model.piece(toks[0]):
                    self._control_pieces[toks[0]] = marker.encode()
        return self._control_pieces

    def count(self, req_id: str, raw: dict[str, Any], detail: bool = False) -> None:
        """The prompt length a request renders to, exactly as `generate` would see it (with
        `detail`, the rendered prompt and its tokens as well)."""
        try:
            tokens, text = self.render(ChatRequest.model_validate(raw))
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
        self.engine.start()
        self.chan.send({"type": "ready", "info": self.info()})
        try:
            self._serve()
        except Exception as exc:
            log.exception("the message loop failed")
            self._die(ipc.EXIT_SERVE_FAILED, f"its message loop failed ({type(exc).__name__})")
        self.engine.stop()
        if self.prompt_cache is not None:
            self.prompt_cache.close(ipc.STOP_SECONDS)  # the states still being written

    def _serve(self) -> None:
        """Read the daemon's messages until it closes the channel or says shutdown."""
        while True:
            try:
                msg = self.chan.recv()
            except (ChannelClosed, OSError):
                return
            kind = msg.get("type")
            if kind == "generate":
                self.generate(msg["id"], msg["request"])
            elif kind == "count":
                self.count(msg["id"], msg["request"], bool(msg.get("detail")))
            elif kind == "tokenize":
                self.tokenize(msg["id"], msg.get("text", ""), bool(msg.get("add_special")))
            elif kind == "detokenize":
                self.detokenize(msg["id"], msg.get("tokens"))
            elif kind == "cancel":
                self.engine.cancel(msg["id"])
            elif kind == "embed":
                self._inflight.add(msg["id"])
                self.embedder().submit(msg["id"], list(msg["inputs"]), bool(msg.get("truncate")),
                                       int(msg.get("offset", 0)))
            elif kind == "shutdown":
                return


def _piece(raw: bytes) -> str | list[int]:
    """A token's text, or its bytes where they are not whole UTF-8 (part of a character),
    as llama-server's /tokenize gives them."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return list(raw)


def lora_arg(text: str) -> tuple[Path, float]:
    """`PATH` or `PATH:SCALE` (scale 1.0 by default) of a --lora argument."""
    path, sep, scale = text.rpartition(":")
    if sep:
        try:
            return Path(path), float(scale)
        except ValueError:
            pass  # a colon inside the path itself
    return Path(text), 1.0


def _confine(files: list[Path], writable: Path | None = None,
             devices: list[Path] | None = None) -> tuple[dict[str, Any], str]:
    """Confine this process before llama.cpp reads a byte of the model files (`files`, the
    only ones it may still open besides the Python installation and system libraries), the
    prompt-cache directory `writable`, the only place it may write, and the GPU device
    nodes `devices` it uses.

    Returns the sandbox fields of the ready info and, in LLMRUN_SANDBOX=strict mode when a
    layer could not be applied, why the runner must not go on (else "")."""
    mode = config.sandbox_mode()
    if mode == "off":
        log.warning("sandbox: off (LLMRUN_SANDBOX=0): this runner is not confined")
        return {"sandbox": [], "confined": False, "sandbox_missing": ["off (LLMRUN_SANDBOX=0)"]}, ""
    result = sandbox.confine(read=files, read_write=[writable] if writable else [],
                             devices=devices or [])
    if devices:
        log.info("sandbox: GPU device nodes kept: %s", ", ".join(map(str, devices)))
    log.info("sandbox: %s", ", ".join(result.applied))
    for why in (*result.missing, *result.unavailable):
        log.warning("sandbox: not applied: %s", why)
    return result.info(), result.refusal() if mode == "strict" else ""


def _prompt_cache_dir(args: argparse.Namespace) -> Path | None:
    """Where this runner may keep prompt states on disk: the directory it was given, if the
    sandbox can keep its writes inside it (else the states stay in memory)."""
    if args.prompt_cache is None or args.prompt_cache_size <= 0:
        return None
    if config.sandbox_mode() != "off":
        try:
            sandbox.landlock_abi()
        except OSError as exc:
            log.warning("prompt cache: in memory only: without Landlock (%s) the sandbox "
                        "could not keep the runner's writes inside %s", exc.strerror,
                        args.prompt_cache)
            return None
    if not args.prompt_cache.is_dir():
        log.warning("prompt cache: in memory only: %s is not a directory", args.prompt_cache)
        return None
    return args.prompt_cache


def _rpc_workers(endpoints: list[str]) -> RpcWorkers | None:
    """Connect to the RPC workers (None when there are none). Each is first reached with a
    plain connection, so a worker that is down is a clear error rather than llama.cpp's
    abort."""
    if not endpoints:
        return None
    for endpoint in endpoints:
        host, _, port = endpoint.rpartition(":")
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
        except (OSError, ValueError) as exc:
            raise OSError(f"RPC worker {endpoint} does not answer ({exc}); start it with "
                          "`llmrun rpc-worker` or remove it from LLMRUN_RPC_WORKERS") from None
    return RpcWorkers(endpoints)


def _placement(workers: RpcWorkers, model: Model, offload: int,
               split: list[float] | None) -> dict[str, Any]:
    """Where the model's layers live, for `ps`: how many went to the workers (llama.cpp
    divides them by `split`, else by the workers' free memory) and how many stayed here."""
    placed = min(offload, model.n_layer + 1)  # + the output layer
    shares = split or [float(free) for free, _ in workers.memory]
    total = sum(shares) or 1.0
    return {"layers": model.n_layer + 1, "local_layers": model.n_layer + 1 - placed,
            "workers": [{"endpoint": e, "share": round(s / total, 3), "free": free,
                         "total": size}
                        for e, s, (free, size) in zip(workers.endpoints, shares,
                                                      workers.memory, strict=False)]}


def _device_free() -> dict[str, int]:
    """Free bytes of each offloading device, by name."""
    return {d["name"]: d["free"] for d in list_devices() if d["type"] in ("gpu", "igpu")}


def _device_use(free_before: dict[str, int]) -> dict[str, int]:
    """Bytes each device lost since `free_before`: what this runner's model, caches and
    buffers really took there (other processes' allocations meanwhile count too; the CPU's
    share is the daemon's estimate, since mapped weights make free host memory say little)."""
    after = _device_free()
    return {name: max(0, free - after.get(name, free)) for name, free in free_before.items()}


def _drafter(args: argparse.Namespace, model: Model, n_ctx_seq: int) -> DraftModel:
    """The draft model (--draft-model), with a KV sequence for each slot as long as the
    model's; LlamaError when its vocabulary is not the model's."""
    draft = Model(args.draft_model)
    try:
        ctx = Context(draft, n_ctx_seq=n_ctx_seq, n_seq=args.slots, n_batch=args.batch,
                      n_threads=args.threads, kv_type=args.kv_type,
                      flash_attn={"auto": None, "on": True, "off": False}[args.flash_attn])
    except LlamaError:
        draft.close()
        raise
    drafter = DraftModel(draft, ctx, args.slots)
    try:
        drafter.check_vocabulary(model)
    except LlamaError:
        drafter.close()
        raise
    log.info("draft model %s: its guesses are checked in the model's decodes",
             args.draft_model[0].name)
    return drafter


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="llmrun.engine.runner")
    ap.add_argument("--list-devices", action="store_true",
                    help="print the devices llama.cpp can place layers on (JSON) and exit")
    ap.add_argument("--fd", type=int)
    ap.add_argument("--model", type=Path, action="append",
                    help="GGUF file; repeat for each part of a split model, in order")
    ap.add_argument("--ctx", type=int, help="context tokens per sequence")
    ap.add_argument("--slots", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--adaptive-threads", action="store_true",
                    help="decode with fewer threads while other processes keep cores busy "
                         "(--threads is the most)")
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--lora", type=lora_arg, action="append", default=[],
                    metavar="PATH[:SCALE]", help="LoRA adapter GGUF to apply; repeatable")
    ap.add_argument("--mmproj", type=Path, metavar="PATH",
                    help="vision projector GGUF (architecture clip) for images in prompts")
    ap.add_argument("--draft-model", type=Path, action="append", default=[], metavar="PATH",
                    help="a smaller model with the same vocabulary whose guesses are checked "
                         "in the same decode (speculative decoding); repeat for split parts")
    ap.add_argument("--kv-type", choices=["f16", "q8_0", "q4_0"], default="f16",
                    help="KV cache element type")
    ap.add_argument("--flash-attn", choices=["auto", "on", "off"], default="auto")
    ap.add_argument("--prompt-cache", type=Path, metavar="DIR",
                    help="keep the KV state of long prompts in DIR (engine/promptcache.py)")
    ap.add_argument("--prompt-cache-key", default="",
                    help="the model and load settings DIR's states belong to")
    ap.add_argument("--prompt-cache-size", type=int, default=0,
                    help="bytes of states on disk at most (0: no prompt cache)")
    ap.add_argument("--prompt-cache-ram", type=int, default=0,
                    help="bytes of states kept in memory at most")
    ap.add_argument("--prompt-cache-min", type=int, default=1024,
                    help="tokens a prompt must add before its state is kept")
    ap.add_argument("--step-budget", type=config.parse_step_budget,
                    default=config.parse_step_budget(config.default("LLMRUN_STEP_BUDGET")),
                    help="prompt reading per step while others generate: a duration "
                         "(225ms), or tokens")
    ap.add_argument("--rpc", action="append", default=[], metavar="HOST:PORT",
                    help="an RPC worker (llmrun rpc-worker) to place layers on; repeatable")
    ap.add_argument("--rpc-split", type=lambda v: [float(x) for x in v.split(",")],
                    metavar="P1,P2,...", help="the share of the layers each --rpc worker gets "
                    "(default: by their free memory)")
    ap.add_argument("--gpu-layers", type=int, default=-1,
                    help="the last layers placed on the --device GPUs or the --rpc workers "
                         "(-1: all; the rest stay here)")
    ap.add_argument("--device", action="append", default=[], metavar="NAME",
                    help="a device (as --list-devices names it) to place layers on, in "
                         "--tensor-split's order; repeatable (none: the CPU alone)")
    ap.add_argument("--tensor-split", type=lambda v: [float(x) for x in v.split(",")],
                    metavar="P1,P2,...", help="the share of the layers each --device gets")
    ap.add_argument("--main-gpu", type=int, default=0,
                    help="the --device holding every layer when there is no split")
    ap.add_argument("--debug", action="store_true",
                    help="log every engine step (LLMRUN_DEBUG)")
    ap.add_argument("--max-frame", type=int, default=ipc.MAX_FRAME,
                    help="largest IPC message in bytes (the daemon passes its own)")
    args = ap.parse_args(argv)
    if args.list_devices:
        print(json.dumps({"devices": list_devices(), "backends": list_backends()}))
        return 0
    if args.fd is None or not args.model or args.ctx is None:
        ap.error("--fd, --model and --ctx are required (or --list-devices)")
    ipc.MAX_FRAME = args.max_frame
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.INFO, stream=sys.stderr,
                        format="%(asctime)s runner %(levelname)s %(message)s")
    # Stops come from the daemon: the runner has a session of its own (server/runners.py),
    # and an interrupt sent to it anyway is not a reason to drop what it is writing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    chan = SyncChannel(socket.socket(fileno=args.fd))
    # before the sandbox: it reads /proc/stat, which the sandbox closes to new opens
    governor = ThreadGovernor(args.threads) if args.adaptive_threads else None
    cache_dir = _prompt_cache_dir(args)
    try:  # before the sandbox, which allows no new connection
        workers = _rpc_workers(args.rpc)
    except (OSError, LlamaError) as exc:
        chan.send({"type": "fatal", "error": str(exc)})
        return 1
    # before the sandbox: a GPU backend opens its device nodes as it initialises (listing
    # the devices with their free memory creates CUDA's context), and a confined runner
    # keeps exactly those nodes; a runner kept on the CPU keeps none
    free_before = _device_free()
    on_gpu = bool(args.device) and workers is None
    gpu_nodes = sandbox.gpu_nodes() if on_gpu else []
    if args.mmproj is not None:
        images.preload()  # the decoders' modules, while files can still be opened
    confinement, refusal = _confine([*args.model, *(path for path, _ in args.lora),
                                     *([args.mmproj] if args.mmproj else []),
                                     *args.draft_model], cache_dir, gpu_nodes)
    if refusal:
        chan.send({"type": "fatal", "error": refusal})
        return 1
    try:
        offload = args.gpu_layers if args.gpu_layers >= 0 else 10_000
        if workers is not None:
            model = Model(args.model, n_gpu_layers=offload, tensor_split=args.rpc_split)
            confinement["rpc"] = _placement(workers, model, offload, args.rpc_split)
        elif args.device:  # the daemon's fit (server/fit.py) decided the split
            model = Model(args.model, n_gpu_layers=offload, tensor_split=args.tensor_split,
                          main_gpu=args.main_gpu, devices=args.device)
            log.info("%d of %d layers on %s", min(offload, model.n_layer + 1),
                     model.n_layer + 1, ", ".join(args.device))
        else:
            model = Model(args.model)
        n_ctx_seq = min(args.ctx, model.n_ctx_train) if model.n_ctx_train > 0 else args.ctx
        ctx = Context(model, n_ctx_seq=n_ctx_seq, n_seq=args.slots,
                      n_batch=args.batch, n_threads=args.threads, kv_type=args.kv_type,
                      flash_attn={"auto": None, "on": True, "off": False}[args.flash_attn])
        if args.lora:
            loras = [LoraAdapter(model, path) for path, _ in args.lora]
            ctx.set_loras(loras, [scale for _, scale in args.lora])
            log.info("applied LoRA adapters: %s",
                     ", ".join(f"{p.name} x{s:g}" for p, s in args.lora))
        projector = Projector(args.mmproj, model, args.threads) if args.mmproj else None
        drafter = _drafter(args, model, n_ctx_seq) if args.draft_model else None
    except LlamaError as exc:
        chan.send({"type": "fatal", "error": str(exc)})
        return 1
    log.info("loaded %s: ctx %d x %d slots, %s%d threads, KV %s, flash attention %s",
             args.model[0].name, n_ctx_seq, args.slots, "at most " if governor else "",
             args.threads, args.kv_type, args.flash_attn)
    prompt_cache = None
    if args.prompt_cache_size > 0:
        try:
            prompt_cache = PromptCache(cache_dir, args.prompt_cache_key,
                                       max_bytes=args.prompt_cache_size,
                                       ram_bytes=args.prompt_cache_ram,
                                       min_tokens=args.prompt_cache_min, n_vocab=model.n_vocab)
        except OSError as exc:
            log.warning("prompt cache: off (%s)", exc)
    if projector is not None:
        log.info("vision projector %s: images of this model are read here", args.mmproj.name)
    runner = ModelHost(chan, model, ctx, n_ctx_seq, args.slots, args.threads, governor,
                       prompt_cache, step_budget=args.step_budget, projector=projector,
                       drafter=drafter)
    if on_gpu and free_before:
        confinement["devices"] = _device_use(free_before)
    runner.sandbox_info = confinement
    _stop_on_sigterm(chan)  # (until here a SIGTERM ends it at once: nothing to keep yet)
    runner.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
