"""Models another server runs: a Modelfile `FROM http(s)://host/v1` names an OpenAI-compatible
API (vLLM, SGLang, llama-server, another llmrun) that serves the model, so llmrun's store, CLI
and three dialects front an engine that spreads a model over machines.

Each request is translated from the internal `ChatRequest` into a streamed chat completion
(or a completion, for a raw prompt) and its events back into `Started`/`Chunk`/`Done`, as a
runner's would be. An `Upstream` holds one remote model's replicas:

- **Failover.** A replica that refuses the connection (or answers 502/503/504 before any
  output) is marked down and the next one is tried; a down replica is tried again after
  `RETRY_DOWN` seconds, or first when all are down. Once output has begun, a failure ends
  that answer with an error (nothing is replayed).
- **Health checks.** From its first request on, every `PROBE_INTERVAL` seconds each
  replica that is down is asked for `/models`; one that answers is up again.
- **Limits.** At most `LLMRUN_UPSTREAM_PARALLEL` requests run on an upstream at once (the
  rest wait, up to LLMRUN_MAX_QUEUE, then 503 "busy" as for local models); connecting has
  a 10 s timeout and each read of the stream `LLMRUN_UPSTREAM_TIMEOUT`.
- **Keys.** `PARAMETER remote_key NAME` names one of the keys the daemon's owner
  configured (`LLMRUN_REMOTE_KEYS=NAME=ENV_VAR,...`); the variable is looked up and read per
  request (store/references.key_variable) and its value sent as a bearer token, never
  stored, logged or shown. A manifest naming a key that is not configured, or (written by
  an older version) a raw variable no configured key reads, sends nothing: its requests fail
  before any connection. Whoever writes a Modelfile never picks which of the daemon's
  variables leave it (HF_TOKEN, LLMRUN_API_KEYS would otherwise go to any URL).
- **Where it connects.** Every connection goes through `GuardedTransport`: the host is
  resolved here, each address it resolves to is checked (store/remoteaddr.py: no link-local
  address, no cloud metadata service, in any spelling or IPv6 wrapping, unless
  `LLMRUN_REMOTE_LINK_LOCAL=1`), and the connection is made to a checked address, so a name
  that resolves to 169.254.169.254 (or is made to, between the check and the connection)
  reaches nothing. Redirects are not followed: a 3xx is the remote server's error. Proxies
  from the environment are not used (the address checked would be the proxy's).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import socket
import time
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

import anyio
import httpcore
import httpx

from llmrun import config
from llmrun.request import (
    ChatRequest,
    Chunk,
    Done,
    EngineError,
    NamedTool,
    Started,
    Stats,
    ToolCall,
)
from llmrun.store import remoteaddr
from llmrun.store.manifests import Remote
from llmrun.store.references import RemoteKeyError, key_variable

log = logging.getLogger(__name__)

RETRY_DOWN = 10.0  # seconds before a replica that failed is tried again in its turn
PROBE_INTERVAL = 15.0  # seconds between health checks of the replicas that are down
PROBE_TIMEOUT = 5.0
CONNECT_TIMEOUT = 10.0
FAILOVER_STATUS = (502, 503, 504)
FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls",
          "function_call": "tool_calls", "content_filter": "stop"}


@dataclass
class Replica:
    url: str
    down_since: float | None = None  # monotonic time of the last failure; None: up
    last_error: str = ""

    @property
    def state(self) -> str:
        return "up" if self.down_since is None else "down"


def _message(m: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.role == "assistant" and m.tool_calls:
        out["content"] = m.content or None
        out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)}}
            for c in m.tool_calls]
    if m.role == "tool":
        out["tool_call_id"] = m.tool_call_id or ""
        if m.name:
            out["name"] = m.name
    return out


def request_body(req: ChatRequest, model: str) -> tuple[str, dict[str, Any]]:
    """(path, body): `req` as an OpenAI-compatible server takes it, streamed with usage. What
    that API cannot say (a raw grammar, Ollama's `context`, fill-in-the-middle) is a 400."""
    if req.grammar is not None:
        raise EngineError("a remote model takes no raw grammar; use a JSON schema format",
                          code="invalid_request")
    if req.suffix is not None or req.context:
        raise EngineError("a remote model takes no suffix (fill-in-the-middle) and no "
                          "context token ids", code="invalid_request")
    o = req.options
    body: dict[str, Any] = {"model": model, "stream": True,
                            "stream_options": {"include_usage": True}}
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("seed", "seed"),
                         ("presence_penalty", "presence_penalty"),
                         ("frequency_penalty", "frequency_penalty"),
                         ("top_k", "top_k"), ("min_p", "min_p")):  # the last two: extras
        value = getattr(o, ours)
        if value is not None:
            body[theirs] = value
    if o.num_predict is not None and o.num_predict > 0:
        body["max_tokens"] = o.num_predict
    if o.stop:
        body["stop"] = list(o.stop)
    if req.logprobs is not None:
        body["logprobs"] = True
        if req.logprobs:
            body["top_logprobs"] = req.logprobs
    if req.prompt is not None:
        return "/completions", {**body, "prompt": req.prompt}
    messages = [_message(m) for m in req.messages]
    if req.system and not any(m["role"] == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": req.system})
    body["messages"] = messages
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "description": t.description, "parameters": t.parameters}}
            for t in req.tools]
        choice = req.tool_choice
        body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}}
                               if isinstance(choice, NamedTool) else choice)
        body["parallel_tool_calls"] = req.parallel_tool_calls
    if req.format == "json":
        body["response_format"] = {"type": "json_object"}
    elif isinstance(req.format, dict):
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": req.format, "strict": req.format_strict}}
    if isinstance(req.think, str):
        body["reasoning_effort"] = req.think
    return "/chat/completions", body


class _Reader:
    """One streamed answer: SSE chunks in, Chunks out, the calls and usage kept for the
    end."""

    def __init__(self) -> None:
        self.calls: dict[int, dict[str, str]] = {}
        self.finish = "stop"
        self.usage: dict[str, Any] = {}
        self.completion_tokens = 0

    def read(self, data: dict[str, Any]) -> list[Chunk]:
        if isinstance(data.get("usage"), dict):
            self.usage = data["usage"]
        if "error" in data:
            error = data["error"]
            message = error.get("message") if isinstance(error, dict) else str(error)
            raise EngineError(f"the remote server failed: {message}", code="upstream_failed")
        out: list[Chunk] = []
        for choice in data.get("choices") or []:
            if choice.get("finish_reason"):
                self.finish = FINISH.get(choice["finish_reason"], "stop")
            delta = choice.get("delta")
            if delta is None:  # /completions
                if choice.get("text"):
                    self.completion_tokens += 1
                    out.append(Chunk(text=choice["text"]))
                continue
            thought = delta.get("reasoning_content") or delta.get("reasoning")
            if thought:
                out.append(Chunk(text="", thinking=thought))
            if delta.get("content"):
                self.completion_tokens += 1
                out.append(Chunk(text=delta["content"]))
            for tc in delta.get("tool_calls") or []:
                part = self.calls.setdefault(int(tc.get("index", 0)),
                                             {"id": "", "name": "", "arguments": ""})
                fn = tc.get("function") or {}
                part["id"] = tc.get("id") or part["id"]
                part["name"] += fn.get("name") or ""
                part["arguments"] += fn.get("arguments") or ""
        return out

    def tool_calls(self) -> list[ToolCall]:
        out = []
        for i, part in sorted(self.calls.items()):
            try:
                args = json.loads(part["arguments"]) if part["arguments"].strip() else {}
            except ValueError:
                raise EngineError(f"the remote server sent a tool call whose arguments are "
                                  f"not JSON: {part['arguments'][:200]!r}",
                                  code="upstream_failed") from None
            if not isinstance(args, dict):
                raise EngineError("the remote server sent a tool call whose arguments are "
                                  "not an object", code="upstream_failed")
            out.append(ToolCall(id=part["id"] or f"call_{i}", name=part["name"], arguments=args))
        return out


class Upstream:
    """One remote model's replicas, with their health, a concurrency limit and a client."""

    def __init__(self, name: str, remote: Remote,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.name = name
        self.remote = remote
        self.replicas = [Replica(url) for url in remote.urls]
        self.parallel = config.upstream_parallel()
        self._slots = asyncio.Semaphore(self.parallel)
        self._waiting = 0
        self._prober: asyncio.Task[None] | None = None
        self.client = httpx.AsyncClient(
            transport=transport or GuardedTransport(config.remote_link_local()),
            follow_redirects=False,  # (httpx's default; a redirect must not pick the host)
            timeout=httpx.Timeout(config.upstream_timeout(), connect=CONNECT_TIMEOUT))

    async def probe(self) -> None:
        """Health check: ask each replica that is down for its model list; one that answers
        (anything but a 5xx) is up again."""
        for replica in self.replicas:
            if replica.down_since is None:
                continue
            try:
                r = await self.client.get(replica.url + "/models", headers=self._headers(),
                                          timeout=PROBE_TIMEOUT)
            except httpx.HTTPError as exc:
                replica.last_error = type(exc).__name__
                continue
            except (AddressRefused, EngineError) as exc:  # it stays down, for this reason
                replica.last_error = str(exc)
                continue
            if r.status_code < 500:
                log.info("%s: replica %s answers again", self.name, replica.url)
                replica.down_since = None
                replica.last_error = ""

    async def _probe_loop(self) -> None:
        while True:
            await asyncio.sleep(PROBE_INTERVAL)
            await self.probe()

    def _headers(self) -> dict[str, str]:
        """The key's header, its variable looked up in the configuration now: a manifest
        does not outlive a change of the owner's mind."""
        try:
            variable = key_variable(self.remote)
        except RemoteKeyError as exc:
            raise EngineError(f"{self.name}: {exc}", code="upstream_failed") from None
        key = os.environ.get(variable) if variable else None
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _order(self) -> list[Replica]:
        """Up replicas first, in their order; then down ones, longest down first (a replica
        down for less than RETRY_DOWN comes last)."""
        now = time.monotonic()
        up = [r for r in self.replicas if r.down_since is None]
        due = [r for r in self.replicas if r.down_since is not None
               and now - r.down_since >= RETRY_DOWN]
        rest = [r for r in self.replicas if r not in up and r not in due]
        return up + sorted(due, key=lambda r: r.down_since or 0) + rest

    def _down(self, replica: Replica, why: str) -> None:
        if replica.down_since is None:
            log.warning("%s: replica %s is down (%s)", self.name, replica.url, why)
        replica.down_since = time.monotonic()
        replica.last_error = why

    async def chat(self, req: ChatRequest) -> AsyncIterator[Started | Chunk | Done]:
        if self._prober is None:  # health checks from the first use on
            self._prober = asyncio.create_task(self._probe_loop())
        if self._waiting >= config.max_queue():
            raise EngineError(f"{self.name}: too many requests are waiting for its remote "
                              "server; retry shortly", code="busy", retry_after=1)
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        try:
            async for event in self._chat(req):
                yield event
        finally:
            self._slots.release()

    async def _chat(self, req: ChatRequest) -> AsyncIterator[Started | Chunk | Done]:
        path, body = request_body(req, self.remote.model)
        headers = self._headers()  # a key that may not be sent fails before any connection
        t0 = time.perf_counter()
        failures: list[str] = []
        refused = 0
        for replica in self._order():
            try:
                async with self.client.stream("POST", replica.url + path, json=body,
                                              headers=headers) as response:
                    if response.status_code in FAILOVER_STATUS:
                        self._down(replica, f"HTTP {response.status_code}")
                        failures.append(f"{replica.url}: HTTP {response.status_code}")
                        continue
                    if response.status_code != 200:
                        await response.aread()
                        if 400 <= response.status_code < 500:
                            raise EngineError(_upstream_error(response),
                                              code="upstream_refused",
                                              details={"status": response.status_code})
                        raise EngineError(_upstream_error(response), code="upstream_failed")
                    replica.down_since = None
                    async for event in self._events(response, t0):
                        yield event
                    return
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                self._down(replica, type(exc).__name__)
                failures.append(f"{replica.url}: cannot connect")
            except AddressRefused as exc:
                self._down(replica, str(exc))
                failures.append(f"{replica.url}: {exc}")
                refused += 1
            except httpx.TimeoutException:
                raise EngineError(f"{self.name}: the remote server {replica.url} sent nothing "
                                  f"for {config.upstream_timeout():g} s",
                                  code="upstream_timeout") from None
            except httpx.HTTPError as exc:  # the connection broke mid-answer
                self._down(replica, type(exc).__name__)
                raise EngineError(f"{self.name}: the remote server {replica.url} broke off the "
                                  f"answer ({type(exc).__name__})",
                                  code="upstream_failed") from None
        if refused == len(self.replicas):  # no retry will change that: not a 503
            raise EngineError(f"{self.name}: no replica of its remote server may be reached ("
                              + "; ".join(failures) + ")", code="upstream_failed")
        raise EngineError(f"{self.name}: no replica of its remote server answers ("
                          + "; ".join(failures) + ")", code="busy", retry_after=5)

    async def _events(self, response: httpx.Response,
                      t0: float) -> AsyncIterator[Started | Chunk | Done]:
        reader = _Reader()
        started = False
        t_first = 0.0
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                break
            try:
                data = json.loads(payload)
            except ValueError:
                raise EngineError("the remote server sent a malformed stream",
                                  code="upstream_failed") from None
            chunks = reader.read(data) if isinstance(data, dict) else []
            if not started and (chunks or reader.finish != "stop" or reader.usage):
                started = True
                t_first = time.perf_counter()
                yield Started(prompt_tokens=0, n_ctx=0)
            for chunk in chunks:
                yield chunk
        if not started:
            t_first = time.perf_counter()
            yield Started(prompt_tokens=0, n_ctx=0)
        calls = reader.tool_calls()
        if calls:
            yield Chunk(text="", tool_calls=calls)
        usage = reader.usage
        details = usage.get("prompt_tokens_details") or {}
        t_end = time.perf_counter()
        yield Done(stats=Stats(
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            cached_tokens=int(details.get("cached_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or reader.completion_tokens),
            prompt_ns=int((t_first - t0) * 1e9), generate_ns=int((t_end - t_first) * 1e9),
            finish_reason="tool_calls" if calls else reader.finish))  # type: ignore[arg-type]

    def health(self) -> list[dict[str, Any]]:
        """Each replica's URL and state, as `ps` shows them."""
        return [{"url": r.url, "state": r.state, **({"error": r.last_error}
                                                     if r.last_error and r.down_since else {})}
                for r in self.replicas]

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
        await self.client.aclose()


def _upstream_error(response: httpx.Response) -> str:
    """The error a remote server answered with, in a few words."""
    try:
        data = response.json()
        error = data.get("error", data) if isinstance(data, dict) else data
        message = error.get("message") if isinstance(error, dict) else error
    except ValueError:
        message = response.text[:300]
    return f"the remote server answered {response.status_code}: {message}"


class AddressRefused(Exception):
    """A remote model's host is, or resolves to, an address it may not reach. Not an
    httpcore error, so httpx passes it up as it is, and no retry or failover takes it for a
    replica that is merely down."""


class _CheckedBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network backend with the host resolved here and every address checked
    before connecting to one of them (by address, so nothing resolves it again)."""

    def __init__(self, allow_link_local: bool) -> None:
        self.allow_link_local = allow_link_local
        self._inner = httpcore.AnyIOBackend()

    async def resolve(self, host: str, port: int,
                      timeout: float | None) -> list[tuple[remoteaddr.IPAddress, str]]:
        """Each address `host` resolves to, and how to connect to it (with its scope, for
        an IPv6 link-local one the owner allowed)."""
        try:
            with anyio.fail_after(timeout):
                infos = await anyio.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except TimeoutError:
            raise httpcore.ConnectTimeout(f"resolving {host} took over {timeout} s") from None
        except OSError as exc:
            raise httpcore.ConnectError(f"cannot resolve {host}: {exc}") from None
        out: list[tuple[remoteaddr.IPAddress, str]] = []
        for *_, sockaddr in infos:
            text = str(sockaddr[0])
            ip = ipaddress.ip_address(text.partition("%")[0])
            if len(sockaddr) == 4 and sockaddr[3] and "%" not in text:
                text = f"{text}%{sockaddr[3]}"
            if all(ip != seen for seen, _ in out):
                out.append((ip, text))
        return out

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
                          ) -> httpcore.AsyncNetworkStream:
        addresses = await self.resolve(host, port, timeout)
        if not self.allow_link_local:
            reason = remoteaddr.host_refusal(host)
            for ip, _ in addresses:  # one bad address refuses the name: it may be the one used
                reason = reason or remoteaddr.address_refusal(ip)
            if reason is not None:
                shown = reason if reason.startswith(host) else f"{host}: {reason}"
                raise AddressRefused(f"refused: {shown} ({remoteaddr.LINK_LOCAL_HINT})")
        error: httpcore.ConnectError | httpcore.ConnectTimeout | None = None
        for _, connect_to in addresses:
            try:
                return await self._inner.connect_tcp(connect_to, port, timeout, local_address,
                                                     socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                error = exc
        raise error or httpcore.ConnectError(f"{host} resolves to no address")

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
                                  ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("a remote model connects over TCP only")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class GuardedTransport(httpx.AsyncHTTPTransport):
    """httpx's transport over a pool whose every connection goes through _CheckedBackend.
    httpx takes no network backend of its own, so the pool it built is replaced by one like
    it (httpx's default limits and TLS context, which checks certificates and sends SNI for
    the host named, not the address connected to)."""

    def __init__(self, allow_link_local: bool = False) -> None:
        super().__init__()
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=20)
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=_CheckedBackend(allow_link_local))
