"""The Responses API's answer: output items (reasoning, message, function calls) whole, or
as its numbered event stream."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from llmrun import jsonio
from llmrun.api.events import OutputStream
from llmrun.api.openai.errors import ApiError, engine_error_fields
from llmrun.api.openai.responses.wire import ResponsesBody, ToolMap
from llmrun.request import (
    Chunk,
    Done,
    EngineError,
    PartialCall,
    Stats,
    ToolCall,
)
from llmrun.server.responsestore import new_id

KEEPALIVE_SECONDS = 10.0  # an SSE comment this often while a long prompt is read
_KEEPALIVE = b": waiting for the model\n\n"

def usage(stats: Stats) -> dict[str, Any]:
    return {"input_tokens": stats.prompt_tokens,
            "input_tokens_details": {"cached_tokens": stats.cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens": stats.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": stats.prompt_tokens + stats.completion_tokens,
            **stats.context_notes()}


@dataclass
class Answer:
    """A response being built: its object, and the output items as they complete."""

    body: ResponsesBody
    tools: ToolMap
    id: str = field(default_factory=new_id)
    created: int = field(default_factory=lambda: int(time.time()))
    output: list[dict[str, Any]] = field(default_factory=list)

    def response(self, status: str, stats: Stats | None = None,
                 failure: dict[str, Any] | None = None) -> dict[str, Any]:
        b = self.body
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status, "error": failure, "incomplete_details": incomplete,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
            "model": b.model, "output": list(self.output),
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id,
            "reasoning": {"effort": (b.reasoning or {}).get("effort"),
                          "summary": (b.reasoning or {}).get("summary")},
            "store": b.store is not False, "temperature": b.temperature,
            "text": b.text or {"format": {"type": "text"}},
            "tool_choice": b.tool_choice or "auto", "tools": b.tools or [],
            "top_p": b.top_p, "truncation": b.truncation or "disabled",
            "usage": usage(stats) if stats is not None else None,
            "user": b.user, "metadata": b.metadata or {},
        }


def _status(stats: Stats) -> str:
    return "incomplete" if stats.finish_reason == "length" else "completed"


def reasoning_item(thought: str, summary: bool) -> dict[str, Any]:
    return {"id": f"rs_{secrets.token_hex(12)}", "type": "reasoning",
            "summary": [{"type": "summary_text", "text": thought}] if summary else [],
            "content": [{"type": "reasoning_text", "text": thought}]}


def message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": f"msg_{secrets.token_hex(12)}", "type": "message", "role": "assistant",
            "status": status, "content": [] if status != "completed" else
            [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _summary(body: ResponsesBody) -> bool:
    return bool((body.reasoning or {}).get("summary"))


async def collect(answer: Answer, first: Chunk | Done,
                  rest: AsyncIterator[Chunk | Done]) -> tuple[dict[str, Any], Stats]:
    thought: list[str] = []
    text: list[str] = []
    calls: list[ToolCall | PartialCall] = []
    event: Chunk | Done | None = first
    while isinstance(event, Chunk):
        thought.append(event.thinking or "")
        text.append(event.text)
        calls += event.tool_calls or []
        calls += [event.partial_call] if event.partial_call is not None else []
        event = await anext(rest, None)
    stats = event.stats if isinstance(event, Done) else Stats(finish_reason="error")
    if any(thought):
        answer.output.append(reasoning_item("".join(thought), _summary(answer.body)))
    if "".join(text) or not (calls or any(thought)):  # (cut short while thinking: none)
        answer.output.append(message_item("".join(text)))
    answer.output += [answer.tools.item(c) for c in calls]
    return answer.response(_status(stats), stats), stats


class Events:
    """The Responses event stream's frames, numbered in order."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, kind: str, data: dict[str, Any]) -> bytes:
        frame = b"event: " + kind.encode() + b"\ndata: " + jsonio.dumps(
            {"type": kind, "sequence_number": self.n, **data}) + b"\n\n"
        self.n += 1
        return frame


async def stream(answer: Answer, first: asyncio.Future[Chunk | Done], rest: OutputStream,
                 on_done: Callable[[dict[str, Any]], None] | None = None
                 ) -> AsyncIterator[bytes]:
    """response.created, in_progress, then per output item: output_item.added, its parts and
    deltas, output_item.done; then response.completed (or .incomplete, or .failed)."""
    ev = Events()
    summary = _summary(answer.body)
    open_item: dict[str, Any] | None = None  # the reasoning or message item being written
    parts: list[str] = []
    stats: Stats | None = None

    def close() -> list[bytes]:
        nonlocal open_item, parts
        if open_item is None:
            return []
        item, index, text = open_item, len(answer.output), "".join(parts)
        frames: list[bytes] = []
        if item["type"] == "reasoning":
            item = reasoning_item(text, summary) | {"id": item["id"]}
            if summary:
                frames += [
                    ev("response.reasoning_summary_text.done", {
                        "item_id": item["id"], "output_index": index, "summary_index": 0,
                        "text": text}),
                    ev("response.reasoning_summary_part.done", {
                        "item_id": item["id"], "output_index": index, "summary_index": 0,
                        "part": {"type": "summary_text", "text": text}})]
            frames.append(ev("response.reasoning_text.done", {
                "item_id": item["id"], "output_index": index, "content_index": 0,
                "text": text}))
        else:
            item = message_item(text) | {"id": item["id"]}
            part = item["content"][0]
            frames += [
                ev("response.output_text.done", {
                    "item_id": item["id"], "output_index": index, "content_index": 0,
                    "text": text, "logprobs": []}),
                ev("response.content_part.done", {
                    "item_id": item["id"], "output_index": index, "content_index": 0,
                    "part": part})]
        frames.append(ev("response.output_item.done", {"output_index": index, "item": item}))
        answer.output.append(item)
        open_item, parts = None, []
        return frames

    def start(kind: str) -> list[bytes]:
        nonlocal open_item
        index = len(answer.output)
        if kind == "reasoning":
            open_item = {"id": f"rs_{secrets.token_hex(12)}", "type": "reasoning",
                         "summary": [], "content": []}
            frames = [ev("response.output_item.added", {"output_index": index,
                                                        "item": open_item})]
            if summary:
                frames.append(ev("response.reasoning_summary_part.added", {
                    "item_id": open_item["id"], "output_index": index, "summary_index": 0,
                    "part": {"type": "summary_text", "text": ""}}))
            return frames
        open_item = message_item("", "in_progress")
        return [ev("response.output_item.added", {"output_index": index, "item": open_item}),
                ev("response.content_part.added", {
                    "item_id": open_item["id"], "output_index": index, "content_index": 0,
                    "part": {"type": "output_text", "text": "", "annotations": [],
                             "logprobs": []}})]

    try:
        yield ev("response.created", {"response": answer.response("in_progress")})
        yield ev("response.in_progress", {"response": answer.response("in_progress")})
        while not (await asyncio.wait({first}, timeout=KEEPALIVE_SECONDS))[0]:
            yield _KEEPALIVE  # a comment: the prompt is still being read
        event: Chunk | Done | None = first.result()
        while isinstance(event, Chunk):
            index = len(answer.output)
            if event.thinking:
                if open_item is None or open_item["type"] != "reasoning":
                    for frame in [*close(), *start("reasoning")]:
                        yield frame
                    index = len(answer.output)
                parts.append(event.thinking)
                assert open_item is not None
                if summary:
                    yield ev("response.reasoning_summary_text.delta", {
                        "item_id": open_item["id"], "output_index": index,
                        "summary_index": 0, "delta": event.thinking})
                yield ev("response.reasoning_text.delta", {
                    "item_id": open_item["id"], "output_index": index, "content_index": 0,
                    "delta": event.thinking})
            if event.text:
                if open_item is None or open_item["type"] != "message":
                    for frame in [*close(), *start("message")]:
                        yield frame
                    index = len(answer.output)
                parts.append(event.text)
                assert open_item is not None
                yield ev("response.output_text.delta", {
                    "item_id": open_item["id"], "output_index": index, "content_index": 0,
                    "delta": event.text, "logprobs": []})
            calls: list[ToolCall | PartialCall] = [
                *(event.tool_calls or []), *([event.partial_call] if event.partial_call else [])]
            for call in calls:
                for frame in close():
                    yield frame
                item = answer.tools.item(call)
                index = len(answer.output)
                key = "input" if item["type"] == "custom_tool_call" else "arguments"
                yield ev("response.output_item.added", {
                    "output_index": index, "item": {**item, key: "", "status": "in_progress"}})
                kind = "custom_tool_call_input" if key == "input" else "function_call_arguments"
                yield ev(f"response.{kind}.delta", {"item_id": item["id"],
                                                    "output_index": index,
                                                    "delta": item[key]})
                if item["status"] == "completed":  # a call cut off has no whole arguments
                    yield ev(f"response.{kind}.done", {
                        "item_id": item["id"], "output_index": index, key: item[key],
                        "name": item["name"]})
                yield ev("response.output_item.done", {"output_index": index, "item": item})
                answer.output.append(item)
            event = await anext(rest, None)
        if open_item is None and not answer.output:  # nothing generated: one empty message
            for frame in start("message"):
                yield frame
        for frame in close():
            yield frame
        stats = event.stats if isinstance(event, Done) else Stats(finish_reason="error")
        status = _status(stats)
        final = answer.response(status, stats)
        if on_done is not None:
            on_done(final)
        yield ev(f"response.{status}", {"response": final})
    except (EngineError, ApiError) as exc:
        if isinstance(exc, EngineError):
            status_code, message, _, code, _ = engine_error_fields(exc)
        else:
            status_code, message, code = exc.status, exc.message, exc.code
        failure = {"code": code or ("server_error" if status_code >= 500 else
                                    "invalid_request_error"), "message": message}
        yield ev("response.failed", {"response": answer.response("failed", stats, failure)})
    finally:
        if not first.done():  # the client left while the prompt was read: cancel it
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await first
        await rest.aclose()
