"""The load's HTTP client: one streamed chat request to llmrun (/api/chat or /v1) or another
OpenAI-compatible server, timed token by token, on a small client of its own (`post_lines`,
on httptools): it runs on the machine it measures, and httpx's streaming costs several times
its CPU per token."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import statistics
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import httptools

from llmrun import jsonio

Api = Literal["chat", "openai"]
T = TypeVar("T")


@dataclass(frozen=True)
class Server:
    """A server under the load: llmrun over /api/chat or /v1, or another OpenAI-compatible
    server (`--against`)."""
    label: str
    url: str
    model: str
    api: Api = "chat"


def openai_base(url: str) -> str:
    """`http://host:port` from a server's address as users write it (with or without /v1)."""
    url = url.strip().rstrip("/")
    return url[:-3].rstrip("/") if url.endswith("/v1") else url


class _Response:
    """httptools' callbacks for one response: its status, and its body as it arrives (with
    the chunked transfer encoding already taken off)."""

    def __init__(self) -> None:
        self.parser: httptools.HttpResponseParser | None = None
        self.status = 0
        self.body = bytearray()
        self.complete = False

    def on_headers_complete(self) -> None:
        assert self.parser is not None
        self.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete = True


async def post_lines(url: str, path: str, body: dict[str, Any]) -> AsyncGenerator[bytes, None]:
    """POST `body` as JSON and yield the streamed answer line by line as it arrives.

    The load generator runs on the machine it measures, so its own CPU per token is taken
    from the servers' decode threads: httpx's streaming layers cost ~0.4 ms of CPU per
    token on a 2-core machine, several percent of the decode rate at concurrency 4. This is
    one socket read and httptools' C parser (a dependency already, uvicorn's) per arrival,
    the same client for every server. A status of 400 or more raises with the body."""
    parts = urlsplit(url)
    tls = parts.scheme == "https"
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n"
            f"Connection: close\r\n\r\n").encode()
    try:
        reader, writer = await asyncio.open_connection(
            parts.hostname, parts.port or (443 if tls else 80), ssl=tls or None)
    except OSError as exc:
        raise RuntimeError(f"{url}: cannot connect ({exc})") from exc
    response = _Response()
    parser = response.parser = httptools.HttpResponseParser(response)
    try:
        writer.write(head + payload)
        pending = b""
        while not response.complete:
            data = await reader.read(1 << 16)
            if not data:
                break
            parser.feed_data(data)
            if response.status >= 400:
                continue  # the whole error body, then raise
            if response.body:
                *lines, pending = (pending + bytes(response.body)).split(b"\n")
                response.body.clear()
                for line in lines:
                    yield line.rstrip(b"\r")
        if response.status >= 400 or not response.status:
            text = bytes(response.body).decode(errors="replace")[:200]
            raise RuntimeError(f"{url}{path}: {response.status or 'no answer'} {text}")
        if not response.complete:
            raise RuntimeError(f"{url}{path}: the answer ended before its end")
        if pending:
            yield pending
    except (OSError, httptools.HttpParserError) as exc:
        raise RuntimeError(f"{url}{path}: {exc}") from exc
    finally:
        writer.close()


async def one_request(url: str, model: str, prompt: str,
                      tokens: int, messages: list[dict[str, str]] | None = None,
                      fmt: dict[str, Any] | None = None,
                      api: Api = "chat", options: dict[str, Any] | None = None) -> dict[str, Any]:
    """One streamed request; its TTFT, tokens, mean inter-token latency, the times of its
    first and last token (perf_counter), and its text."""
    messages = messages or [{"role": "user", "content": prompt}]
    if api == "openai":
        body: dict[str, Any] = {
            "model": model, "stream": True, "messages": messages, "max_tokens": tokens,
            "temperature": 0, "repeat_penalty": 1.0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
        path = "/v1/chat/completions"
    else:
        body = {"model": model, "stream": True, "messages": messages,
                "options": {"temperature": 0, "num_predict": tokens, "repeat_penalty": 1.0,
                            **(options or {})}}
        path = "/api/chat"
    if fmt is not None:
        body["format"] = fmt
    t0 = time.perf_counter()
    stamps: list[float] = []
    count: float | None = None  # the server's own count of generated tokens
    prompt_tokens = 0  # and of the prompt's (/api/chat)
    text = []
    async with contextlib.aclosing(post_lines(url, path, body)) as lines:
        async for line in lines:
            now = time.perf_counter()
            if api == "openai":
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                obj = jsonio.loads(data)
                if "error" in obj:
                    raise RuntimeError(str(obj["error"]))
                if obj.get("usage"):
                    count = float(obj["usage"].get("completion_tokens", 0))
                choices = obj.get("choices") or [{}]
                piece = (choices[0].get("delta") or {}).get("content") or ""
            else:
                if not line:
                    continue
                obj = jsonio.loads(line)
                if "error" in obj:
                    raise RuntimeError(obj["error"])
                if obj.get("done"):
                    count = float(obj.get("eval_count", 0))
                    prompt_tokens = int(obj.get("prompt_eval_count", 0))
                    break
                piece = obj["message"]["content"]
            if piece:
                text.append(piece)
                stamps.append(now)
    itl = [b - a for a, b in itertools.pairwise(stamps)]
    return {"ttft": stamps[0] - t0 if stamps else float("nan"),
            # a server that gives no count: one token per chunk, as llama-server streams them
            "tokens": count if count is not None else float(len(stamps)),
            "itl": statistics.mean(itl) if itl else float("nan"),
            "first": stamps[0] if stamps else t0, "last": stamps[-1] if stamps else t0,
            "stamps": stamps,
            "elapsed": time.perf_counter() - t0, "text": "".join(text),
            "prompt_tokens": prompt_tokens}


def against_servers(urls: list[str], model: str) -> list[Server]:
    """Servers from `--against` values (each repeatable or a comma list), asked for `model`
    over their OpenAI API; labelled by address."""
    out: list[Server] = []
    for value in urls:
        for url in (u.strip() for u in value.split(",")):
            if not url:
                continue
            if "://" not in url:
                url = f"http://{url}"
            base = openai_base(url)
            out.append(Server(label=f"{base.split('://', 1)[1]} /v1", url=base, model=model,
                              api="openai"))
    labels = [s.label for s in out]
    if len(set(labels)) != len(labels):
        raise ValueError("--against: the same server twice")
    return out


def turn_order(turn: int, servers: list[T]) -> list[T]:
    """The order the servers take in a turn: as given in even turns, reversed in odd ones,
    so none always follows the raw loop (or another server) while the machine's speed
    drifts."""
    return list(servers) if turn % 2 == 0 else list(reversed(servers))
