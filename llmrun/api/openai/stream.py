"""The n choices of a request run concurrently and answered whole or as server-sent events
(`data: {...}` frames ending with `data: [DONE]`), for chat and for legacy completions."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from fastapi.responses import JSONResponse, Response

from llmrun import __version__, jsonio
from llmrun.api.events import EventStream, OutputStream, first_event, first_output
from llmrun.api.openai.errors import ApiError, api_error, engine_error_fields, error_body
from llmrun.api.openai.wire import ChatCompletionBody, CompletionBody
from llmrun.request import (
    ChatRequest,
    Chunk,
    Done,
    EngineError,
    PartialCall,
    Stats,
    TokenLogprob,
    ToolCall,
)
from llmrun.server.service import Service

log = logging.getLogger(__name__)

FINISH_REASONS = {"stop": "stop", "length": "length", "tool_calls": "tool_calls",
                  "cancel": "stop", "error": "stop"}
FINGERPRINT = f"llmrun-{__version__}"


# -- running n choices ----------------------------------------------------------------------


@dataclass
class Choices:
    """n requests running concurrently; their events arrive on one queue, tagged with the
    choice's index. `start()` returns once every choice produced its first event, so errors
    that come before any output can still be HTTP errors. A single choice (nearly every
    request) is read straight from its stream: no task and no queue between the runner's
    events and the response, which would cost a task switch per token."""

    service: Service
    reqs: list[ChatRequest]
    queue: asyncio.Queue[tuple[int, Chunk | Done | Exception]] = field(
        default_factory=asyncio.Queue)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    buffered: list[tuple[int, Chunk | Done]] = field(default_factory=list)
    single: EventStream | None = None  # the one choice's stream

    async def _pump(self, index: int) -> None:
        events = self.service.chat(self.reqs[index])
        try:
            # usage comes from Done: Started (the prompt's size, up front) is not reported
            self.queue.put_nowait((index, await first_output(events)))
            async for event in cast(OutputStream, events):
                self.queue.put_nowait((index, event))
        except Exception as exc:  # reported to the reader, which fails the response
            self.queue.put_nowait((index, exc))
        finally:
            await events.aclose()

    async def start(self) -> None:
        if len(self.reqs) == 1:
            self.single = self.service.chat(self.reqs[0])
            try:
                self.buffered.append((0, await first_output(self.single)))
            except BaseException:
                await self.close()
                raise
            return
        self.tasks = [asyncio.create_task(self._pump(i)) for i in range(len(self.reqs))]
        waiting = set(range(len(self.reqs)))
        try:
            while waiting:
                index, event = await self.queue.get()
                if isinstance(event, Exception):
                    raise event
                waiting.discard(index)
                self.buffered.append((index, event))
        except BaseException:
            await self.close()
            raise

    async def events(self) -> AsyncIterator[tuple[int, Chunk | Done]]:
        """Every event until each choice is done; raises the first error."""
        done = sum(isinstance(e, Done) for _, e in self.buffered)
        event: Chunk | Done | Exception
        for item in self.buffered:
            yield item
        self.buffered = []
        if self.single is not None:
            if not done:
                async for event in cast(OutputStream, self.single):
                    yield 0, event  # (Started came before the first output)
            return
        while done < len(self.reqs):
            index, event = await self.queue.get()
            if isinstance(event, Exception):
                raise event
            done += isinstance(event, Done)
            yield index, event

    async def close(self) -> None:
        """Cancel what still runs (each choice's request is cancelled in the runner)."""
        if self.single is not None:
            await self.single.aclose()
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def _stats_total(stats: Sequence[Stats]) -> dict[str, Any]:
    """OpenAI's usage: the prompt counted once, completions of every choice added up."""
    prompt = stats[0].prompt_tokens if stats else 0
    completion = sum(s.completion_tokens for s in stats)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": stats[0].cached_tokens if stats else 0},
            **(stats[0].context_notes() if stats else {})}


def sse(obj: dict[str, Any] | str) -> bytes:
    data = obj.encode() if isinstance(obj, str) else jsonio.dumps(obj)
    return b"data: " + data + b"\n\n"


async def start_choices(service: Service, reqs: list[ChatRequest]) -> Choices | Response:
    choices = Choices(service, reqs)
    started = await first_event(choices.start(), choices.close, (EngineError, ApiError),
                                api_error)
    return started if isinstance(started, Response) else choices


def _stream_error(exc: Exception) -> bytes:
    if isinstance(exc, EngineError):
        status, message, param, code, _ = engine_error_fields(exc)
        return sse(error_body(status, message, param, code))
    log.exception("stream failed", exc_info=exc)
    return sse(error_body(500, f"internal error: {type(exc).__name__}"))


# -- chat completions -----------------------------------------------------------------------


def _chat_logprobs(entries: list[TokenLogprob]) -> list[dict[str, Any]]:
    return [{"token": e.token, "logprob": e.logprob, "bytes": e.bytes,
             "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                              for t, lp in e.top]} for e in entries]


def _tool_call_out(call: ToolCall | PartialCall) -> dict[str, Any]:
    """A call as OpenAI writes it; one the token limit cut off (finish_reason "length")
    with its arguments' text as far as it got, as OpenAI returns a call cut short."""
    args = call.arguments if isinstance(call, PartialCall) else \
        json.dumps(call.arguments, ensure_ascii=False)
    return {"id": call.id, "type": "function", "function": {"name": call.name,
                                                            "arguments": args}}


@dataclass
class ChatChoice:
    text: list[str] = field(default_factory=list)
    thinking: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    calls: list[ToolCall | PartialCall] = field(default_factory=list)
    stats: Stats | None = None


async def chat_collect(body: ChatCompletionBody, reqs: list[ChatRequest],
                        choices: Choices, cid: str, created: int) -> Response:
    acc = [ChatChoice() for _ in reqs]
    try:
        async for index, event in choices.events():
            c = acc[index]
            if isinstance(event, Done):
                c.stats = event.stats
                continue
            c.text.append(event.text)
            c.thinking.append(event.thinking or "")
            if not (event.tool_calls or event.partial_call):  # a call's tokens: not content
                c.logprobs += _chat_logprobs(event.logprobs or [])
            c.calls += event.tool_calls or []
            if event.partial_call is not None:
                c.calls.append(event.partial_call)
    except (EngineError, ApiError) as exc:
        return api_error(exc)
    finally:
        await choices.close()
    out = []
    for i, c in enumerate(acc):
        stats = c.stats or Stats(finish_reason="error")
        content = "".join(c.text)
        message: dict[str, Any] = {"role": "assistant",
                                   "content": content if content or not c.calls else None,
                                   "refusal": None}
        if c.calls:
            message["tool_calls"] = [_tool_call_out(t) for t in c.calls]
        if any(c.thinking):  # the field llama-server, vLLM and DeepSeek use
            message["reasoning_content"] = "".join(c.thinking)
        out.append({"index": i, "message": message,
                    "logprobs": {"content": c.logprobs, "refusal": None}
                    if reqs[i].logprobs is not None else None,
                    "finish_reason": FINISH_REASONS.get(stats.finish_reason, "stop")})
    return JSONResponse({
        "id": cid, "object": "chat.completion", "created": created, "model": body.model,
        "system_fingerprint": FINGERPRINT, "choices": out,
        "usage": _stats_total([c.stats for c in acc if c.stats is not None]),
    })


async def chat_stream(body: ChatCompletionBody, reqs: list[ChatRequest], choices: Choices,
                       cid: str, created: int) -> AsyncIterator[bytes]:
    usage = bool(body.stream_options and body.stream_options.include_usage)

    def frame(index: int, delta: dict[str, Any], finish: str | None = None,
              logprobs: list[dict[str, Any]] | None = None) -> bytes:
        obj: dict[str, Any] = {
            "id": cid, "object": "chat.completion.chunk", "created": created,
            "model": body.model, "system_fingerprint": FINGERPRINT,
            "choices": [{"index": index, "delta": delta,
                         "logprobs": {"content": logprobs, "refusal": None}
                         if logprobs is not None else None,
                         "finish_reason": finish}],
        }
        if usage:
            obj["usage"] = None
        return sse(obj)

    stats: list[Stats | None] = [None] * len(reqs)
    n_calls = [0] * len(reqs)
    try:
        for i in range(len(reqs)):
            yield frame(i, {"role": "assistant", "content": ""})
        async for index, event in choices.events():
            if isinstance(event, Done):
                stats[index] = event.stats
                yield frame(index, {}, FINISH_REASONS.get(event.stats.finish_reason, "stop"))
                continue
            if event.thinking:
                yield frame(index, {"reasoning_content": event.thinking})
            lps = _chat_logprobs(event.logprobs) if event.logprobs is not None else None
            calls: list[ToolCall | PartialCall] = [
                *(event.tool_calls or []), *([event.partial_call] if event.partial_call else [])]
            if event.text or (lps and not calls):
                yield frame(index, {"content": event.text}, logprobs=lps)
            if calls:
                deltas = []
                for call in calls:
                    deltas.append({"index": n_calls[index], **_tool_call_out(call)})
                    n_calls[index] += 1
                yield frame(index, {"tool_calls": deltas})
        if usage:
            yield sse({"id": cid, "object": "chat.completion.chunk", "created": created,
                       "model": body.model, "system_fingerprint": FINGERPRINT, "choices": [],
                       "usage": _stats_total([s for s in stats if s is not None])})
        yield sse("[DONE]")
    except Exception as exc:
        yield _stream_error(exc)
    finally:
        await choices.close()


# -- completions ----------------------------------------------------------------------------


class LegacyLogprobs:
    """The completions API's logprobs: parallel lists, offsets into the choice's text."""

    def __init__(self, offset: int) -> None:
        self.offset = offset

    def add(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                               "text_offset": []}
        for e in entries:
            out["tokens"].append(e.token)
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append(dict(e.top))
            out["text_offset"].append(self.offset)
            self.offset += len(e.token)
        return out


async def completion_collect(body: CompletionBody, prompts: list[str],
                              reqs: list[ChatRequest], choices: Choices, cid: str,
                              created: int) -> Response:
    texts = [[p] if body.echo else [] for p in prompts]
    lps = [LegacyLogprobs(len(p) if body.echo else 0) for p in prompts]
    merged: list[dict[str, list[Any]]] = [
        {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for _ in prompts]
    stats: list[Stats | None] = [None] * len(reqs)
    try:
        async for index, event in choices.events():
            if isinstance(event, Done):
                stats[index] = event.stats
                continue
            texts[index].append(event.text)
            for entries, log in ((event.prompt_logprobs, LegacyLogprobs(0)),
                                 (event.logprobs, lps[index])):
                if entries is not None:
                    for k, v in log.add(entries).items():
                        merged[index][k] += v
    except (EngineError, ApiError) as exc:
        return api_error(exc)
    finally:
        await choices.close()
    out = [{"text": "".join(texts[i]), "index": i,
            "logprobs": merged[i] if body.logprobs is not None else None,
            "finish_reason": FINISH_REASONS.get((s or Stats()).finish_reason, "stop")}
           for i, s in enumerate(stats)]
    done = [s for s in stats if s is not None]
    return JSONResponse({
        "id": cid, "object": "text_completion", "created": created, "model": body.model,
        "system_fingerprint": FINGERPRINT, "choices": out, "usage": _usage_per_prompt(done,
                                                                                    body.n)})


def _usage_per_prompt(stats: list[Stats], n: int) -> dict[str, Any]:
    """Each distinct prompt counted once, every completion counted."""
    prompt = sum(s.prompt_tokens for s in stats[::n])
    completion = sum(s.completion_tokens for s in stats)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


async def completion_stream(body: CompletionBody, prompts: list[str], reqs: list[ChatRequest],
                             choices: Choices, cid: str, created: int) -> AsyncIterator[bytes]:
    usage = bool(body.stream_options and body.stream_options.include_usage)

    def frame(index: int, text: str, finish: str | None = None,
              logprobs: dict[str, Any] | None = None) -> bytes:
        obj: dict[str, Any] = {
            "id": cid, "object": "text_completion", "created": created, "model": body.model,
            "system_fingerprint": FINGERPRINT,
            "choices": [{"text": text, "index": index, "logprobs": logprobs,
                         "finish_reason": finish}]}
        if usage:
            obj["usage"] = None
        return sse(obj)

    lps = [LegacyLogprobs(len(p) if body.echo else 0) for p in prompts]
    stats: list[Stats | None] = [None] * len(reqs)
    scoring = body.echo and body.logprobs is not None
    try:
        if body.echo and not scoring:
            for i, p in enumerate(prompts):
                yield frame(i, p)
        async for index, event in choices.events():
            if isinstance(event, Chunk) and event.prompt_logprobs is not None:
                # echo with logprobs: the prompt, scored
                yield frame(index, prompts[index],
                            logprobs=LegacyLogprobs(0).add(event.prompt_logprobs))
                continue
            if isinstance(event, Done):
                stats[index] = event.stats
                yield frame(index, "", FINISH_REASONS.get(event.stats.finish_reason, "stop"))
                continue
            yield frame(index, event.text, logprobs=lps[index].add(event.logprobs)
                        if event.logprobs is not None else None)
        if usage:
            yield sse({"id": cid, "object": "text_completion", "created": created,
                       "model": body.model, "system_fingerprint": FINGERPRINT, "choices": [],
                       "usage": _usage_per_prompt([s for s in stats if s is not None],
                                                  body.n)})
        yield sse("[DONE]")
    except Exception as exc:
        yield _stream_error(exc)
    finally:
        await choices.close()
