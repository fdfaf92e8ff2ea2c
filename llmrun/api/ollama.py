"""Ollama's native API (`/api/*`): NDJSON streams, `{"error": ...}` bodies, nanosecond stats."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any, Literal, cast

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field, ValidationError
from starlette.requests import ClientDisconnect

from llmrun import __version__, config, jsonio
from llmrun.api.dialect import (
    Dialect,
    plain_engine_error,
    plain_error_body,
    plain_validation_error,
)
from llmrun.api.disconnect import unless_disconnected
from llmrun.api.events import EventStream, OutputStream, first_output
from llmrun.api.images import from_base64, from_data_url
from llmrun.request import (
    ChatRequest,
    Chunk,
    Done,
    EngineError,
    Format,
    Message,
    Options,
    Progress,
    Started,
    Stats,
    Think,
    Tool,
    ToolCall,
)
from llmrun.server.fit import Device
from llmrun.server.service import Service
from llmrun.store import (
    HOST_PATH_REFUSED,
    BlobTooLarge,
    CreateError,
    DigestError,
    InvalidName,
    Manifest,
    ModelNotFound,
    Store,
    StoreError,
    refuse_host_paths,
)
from llmrun.store.gguf import PROJECTOR_ARCHITECTURE
from llmrun.store.modelfile import Modelfile, ModelfileError
from llmrun.store.modelfile import parse as modelfile_parse

log = logging.getLogger(__name__)

# Ollama ends a turn with tool calls as "stop", the calls being in the message
# The Ollama release whose API llmrun answers as (`/api/version`); clients gate features on
# it, Codex on 0.13.4 or newer. Raise it when llmrun follows a newer API.
OLLAMA_API_VERSION = "0.13.5"
DONE_REASONS = {"stop": "stop", "length": "length", "cancel": "stop", "error": "stop",
                "tool_calls": "stop"}


class OllamaMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[dict[str, Any]] | None = None
    thinking: str | None = None
    tool_name: str | None = None


class ChatBody(BaseModel):
    model: str
    messages: list[OllamaMessage] = []
    stream: bool = True
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    keep_alive: str | float | None = None
    tools: list[dict[str, Any]] | None = None
    think: bool | str | None = None
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=20)
    truncate: bool | None = None  # when the prompt outgrows num_ctx: drop the oldest turns
    shift: bool | None = None  # when the output fills num_ctx: shift it and go on
    return_progress: bool = False  # stream a long prompt's reading (llama-server's name)


class GenerateBody(BaseModel):
    model: str
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    raw: bool = False
    images: list[str] | None = None
    format: str | dict[str, Any] | None = None
    options: dict[str, Any] | None = None
    stream: bool = True
    keep_alive: str | float | None = None
    context: list[int] | None = None
    think: bool | str | None = None
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=20)
    shift: bool | None = None  # when the output fills num_ctx: shift it and go on
    return_progress: bool = False  # stream a long prompt's reading (llama-server's name)


class EmbedBody(BaseModel):
    model: str
    input: str | list[str] = ""
    truncate: bool = True
    options: dict[str, Any] | None = None
    keep_alive: str | float | None = None
    dimensions: int | None = Field(None, ge=1)


class LegacyEmbedBody(BaseModel):
    model: str
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: str | float | None = None


class PullBody(BaseModel):
    model: str | None = None
    name: str | None = None  # older clients send `name`
    insecure: bool = False
    stream: bool = True


def error(status: int, message: str, retry_after: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after else None
    return JSONResponse({"error": message}, status_code=status, headers=headers)


def now() -> str:
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def parse_options(raw: dict[str, Any] | None) -> Options:
    """Validate request options; unknown names are ignored with a warning, as Ollama does."""
    if not raw:
        return Options()
    known = {k: v for k, v in raw.items() if k in Options.model_fields}
    for k in raw.keys() - known.keys():
        log.warning("ignoring unknown option %r", k)
    try:
        return Options.model_validate(known)
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise EngineError(f"invalid options.{field}: {first['msg']}", status=400) from None


def _with_fit(options: Options, truncate: bool | None, shift: bool | None) -> Options:
    """The request's `truncate` and `shift` fields over its options (and so over the
    Modelfile's PARAMETERs of those names)."""
    fit = {k: v for k, v in (("truncate", truncate), ("shift", shift)) if v is not None}
    return options.model_copy(update=fit) if fit else options


def stats_fields(stats: Stats) -> dict[str, Any]:
    return {
        "done_reason": DONE_REASONS.get(stats.finish_reason, stats.finish_reason),
        "total_duration": stats.total_ns,
        "load_duration": stats.load_ns,
        "prompt_eval_count": stats.prompt_tokens,
        "prompt_eval_duration": stats.prompt_ns,
        "eval_count": stats.completion_tokens,
        "eval_duration": stats.generate_ns,
        **stats.context_notes(),
    }


def model_entry(m: Manifest) -> dict[str, Any]:
    d = m.details
    # as Ollama lists a vision model (some clients look for "clip" here to offer images)
    families = [d.family] if d.family else []
    if m.projector is not None:
        families.append(PROJECTOR_ARCHITECTURE)
    return {
        "name": m.name,
        "model": m.name,
        "modified_at": m.modified_at.isoformat(),
        "size": m.size,
        "digest": m.digest,
        "details": {
            "parent_model": "",
            "format": d.format,
            "family": d.family,
            "families": families or None,
            "parameter_size": d.parameter_size,
            "quantization_level": d.quantization_level,
        },
    }


def router(service: Service) -> APIRouter:
    api = APIRouter()

    @api.get("/api/version")
    async def version() -> dict[str, str]:
        # `version` is the Ollama API level implemented (clients such as Codex check it);
        # llmrun's own is alongside, and in every response's X-Llmrun-Version header
        return {"version": OLLAMA_API_VERSION, "llmrun_version": __version__}

    @api.get("/api/tags")
    async def tags() -> dict[str, Any]:
        return {"models": [model_entry(m) for m in service.store.list()]}

    @api.post("/api/pull", response_model=None)
    async def pull(body: PullBody) -> Response:
        name = body.model or body.name
        if not name:
            return error(400, "missing field 'model'")
        events = _pull_events(service.store, name)
        if body.stream:
            return StreamingResponse(
                (json.dumps({k: v for k, v in e.items() if k != "_status"}).encode() + b"\n"
                 async for e in events),
                media_type="application/x-ndjson")
        last: dict[str, Any] = {}
        async for event in events:
            last = event
        if "error" in last:
            return error(last["_status"], last["error"])
        return JSONResponse(last)

    @api.post("/api/chat", response_model=None)
    async def chat(body: ChatBody, request: Request) -> Response:
        if isinstance(body.format, str) and body.format not in ("json", ""):
            return error(400, f"invalid format {body.format!r}: use \"json\" or a JSON schema")
        try:
            req = ChatRequest(
                model=body.model,
                messages=[_message(m, i) for i, m in enumerate(body.messages)],
                tools=[_tool(t) for t in body.tools or []],
                options=_with_fit(parse_options(body.options), body.truncate, body.shift),
                stream=body.stream,
                progress=body.stream and body.return_progress,
                keep_alive=body.keep_alive,
                # (a string here is "json": anything else was refused above)
                format=cast(Format, body.format or None),
                format_strict=True,  # Ollama's `format` is enforced: what cannot be is a 400
                logprobs=body.top_logprobs if body.logprobs else None,
                think=_think(body.think),
                think_required=bool(body.think),
            )
        except EngineError as exc:
            return error(exc.status, exc.message, exc.retry_after)
        if not req.messages:
            return await _load_only(service, req, "chat")
        return await _respond(req, service.chat(req), "chat", request)

    @api.post("/api/generate", response_model=None)
    async def generate(body: GenerateBody, request: Request) -> Response:
        if isinstance(body.format, str) and body.format not in ("json", ""):
            return error(400, f"invalid format {body.format!r}: use \"json\" or a JSON schema")
        if body.images and (body.raw or body.suffix):
            # a raw or fill-in-the-middle prompt is tokenized as is: no turn to place them in
            return error(400, "images need a chat template; raw prompts (`raw`, `suffix`) "
                              "cannot carry images")
        messages = []
        if body.system:
            messages.append(Message(role="system", content=body.system))
        try:
            pictures = _images(body.images, "images")
            if body.prompt or pictures:  # the images go on the prompt's turn, before its text
                messages.append(Message(role="user", content=body.prompt, images=pictures))
            req = ChatRequest(
                model=body.model,
                messages=messages,
                # fill-in-the-middle: the prompt is the text before the gap, the suffix after
                prompt=body.prompt if (body.raw or body.suffix) and body.prompt else None,
                suffix=body.suffix or None,
                context=body.context or None,
                return_context=not body.raw,
                think=_think(body.think),
                think_required=bool(body.think),
                template=body.template or None,
                options=_with_fit(parse_options(body.options), None, body.shift),
                stream=body.stream,
                progress=body.stream and body.return_progress,
                keep_alive=body.keep_alive,
                # (a string here is "json": anything else was refused above)
                format=cast(Format, body.format or None),
                format_strict=True,  # Ollama's `format` is enforced: what cannot be is a 400
                logprobs=body.top_logprobs if body.logprobs else None,
            )
        except EngineError as exc:
            return error(exc.status, exc.message, exc.retry_after)
        if not body.prompt and not body.images:  # images alone are a prompt (describe them)
            return await _load_only(service, req, "generate")
        return await _respond(req, service.chat(req), "generate", request)

    @api.post("/api/embed", response_model=None)
    async def embed(body: EmbedBody) -> Response:
        inputs = [body.input] if isinstance(body.input, str) else list(body.input)
        try:
            req = ChatRequest(model=body.model, messages=[], options=parse_options(body.options),
                              keep_alive=body.keep_alive)
            if not inputs:
                await service.load(req)
                return JSONResponse({"model": body.model, "embeddings": []})
            vectors, n_tokens, load_ns, total_ns = await service.embed(req, inputs,
                                                                       body.truncate)
        except EngineError as exc:
            return error(exc.status, exc.message, exc.retry_after)
        if body.dimensions:
            vectors = [_shorten(v, body.dimensions) for v in vectors]
        return JSONResponse({"model": body.model, "embeddings": vectors,
                             "total_duration": total_ns, "load_duration": load_ns,
                             "prompt_eval_count": n_tokens})

    @api.post("/api/embeddings", response_model=None)
    async def embeddings(body: LegacyEmbedBody) -> Response:
        try:
            req = ChatRequest(model=body.model, messages=[], options=parse_options(body.options),
                              keep_alive=body.keep_alive)
            if not body.prompt:
                await service.load(req)
                return JSONResponse({"embedding": []})
            vectors, *_ = await service.embed(req, [body.prompt], True)
        except EngineError as exc:
            return error(exc.status, exc.message, exc.retry_after)
        return JSONResponse({"embedding": vectors[0]})

    @api.get("/api/ps")
    async def ps() -> dict[str, Any]:
        models = []
        for m in service.ps():
            entry = model_entry(m.manifest)
            entry["name"] = entry["model"] = m.name
            entry["expires_at"] = m.expires_at
            # as Ollama: what the loaded model takes (weights, KV cache, buffers), estimated
            entry["size"] = m.memory or entry["size"]
            entry["size_vram"] = m.vram  # of it, on GPUs (0: all on the CPU)
            if m.vram:
                entry["devices"] = m.devices  # bytes on each device, the host as "CPU"
            entry["kv_cache_type"] = m.kv_cache_type
            entry["flash_attention"] = m.flash_attention
            entry["context_length"] = m.context_length
            entry["slots"] = m.slots
            entry["slots_busy"] = m.slots_busy
            # confinement layers the runner applied, and whether that is all of them
            entry["sandbox"] = m.sandbox
            entry["confined"] = m.confined
            # requests with other load options wait for it to be idle, then reload it
            entry["reload_pending"] = m.reload_pending
            if m.placement is not None:  # layers on llama.cpp RPC workers
                entry["rpc"] = m.placement
            models.append(entry)
        for name, digest, replicas in service.remotes():  # served elsewhere: replica health
            models.append({"name": name, "model": name, "digest": digest, "size": 0,
                           "size_vram": 0, "remote": replicas})
        return {"models": models}

    return api


def _shorten(vector: list[float], dims: int) -> list[float]:
    """Matryoshka-style truncation, renormalised (what `dimensions` asks for)."""
    cut = vector[:dims]
    norm = sum(x * x for x in cut) ** 0.5
    return [x / norm for x in cut] if norm > 0 else cut


def _store_status(exc: BaseException | None) -> int:
    if isinstance(exc, ModelNotFound):
        return 404
    if isinstance(exc, InvalidName | DigestError | CreateError):
        return 400
    return 500


async def _pull_events(store: Store, name: str) -> AsyncIterator[dict[str, Any]]:
    """Run a (blocking) pull in a thread and relay its progress as Ollama's status objects,
    at most ~10 per second per file so a fast local download does not flood the client."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    last: dict[str, Any] = {"status": "", "t": 0.0}

    def progress(status: str, completed: int, total: int) -> None:
        now = time.monotonic()
        if status == last["status"] and now - last["t"] < 0.1 and completed < total:
            return
        last["status"], last["t"] = status, now
        event: dict[str, Any] = {"status": status}
        if total:
            event.update(total=total, completed=completed)
        loop.call_soon_threadsafe(queue.put_nowait, event)

    yield {"status": "pulling manifest"}
    task = asyncio.create_task(asyncio.to_thread(store.pull, name, progress))
    while not task.done() or not queue.empty():
        getter = asyncio.create_task(queue.get())
        done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
        if getter in done:
            yield getter.result()
        else:
            getter.cancel()
    try:
        manifest = task.result()
    except StoreError as exc:
        yield {"error": str(exc), "_status": _store_status(exc)}
        return
    yield {"status": "verifying sha256 digest"}
    yield {"status": "writing manifest", "digest": manifest.layer.digest}
    yield {"status": "success"}


Shape = Literal["chat", "generate"]


def _text(shape: Shape, text: str, thinking: str | None = None) -> dict[str, Any]:
    """Where the generated text goes: /api/chat's message, /api/generate's response; the
    model's thought (if it thinks) beside it."""
    extra = {"thinking": thinking} if thinking else {}
    if shape == "chat":
        return {"message": {"role": "assistant", "content": text, **extra}}
    return {"response": text, **extra}


def _think(value: bool | str | None) -> Think:
    """Ollama's `think`: true/false, or an effort level for models that take one."""
    if value is None or isinstance(value, bool):
        return value
    if value in ("low", "medium", "high"):
        return value  # type: ignore[return-value]
    raise EngineError(f"invalid think value {value!r}: use true, false, \"low\", \"medium\" "
                      "or \"high\"", status=400)


async def _load_only(service: Service, req: ChatRequest, shape: Shape) -> Response:
    """An empty prompt loads the model; with keep_alive 0 it unloads it."""
    unloading = req.keep_alive is not None and str(req.keep_alive).strip() in ("0", "0s", "0.0")
    try:
        if unloading:
            await service.unload(req.model)
        else:
            await service.load(req)
    except EngineError as exc:
        return error(exc.status, exc.message, exc.retry_after)
    return JSONResponse({"model": req.model, "created_at": now(), **_text(shape, ""),
                         "done_reason": "unload" if unloading else "load", "done": True})


def _tool(spec: dict[str, Any]) -> Tool:
    fn = spec.get("function", spec)
    if not isinstance(fn, dict) or not fn.get("name"):
        raise EngineError("invalid field 'tools': each tool needs function.name", status=400)
    return Tool(name=fn["name"], description=fn.get("description") or "",
                parameters=fn.get("parameters") or {"type": "object", "properties": {}})


def _images(raw: list[str] | None, where: str) -> list[str]:
    """Ollama's `images`: base64 image files (a data: URL is taken too, as some clients send
    one). Any role may carry them, as in Ollama."""
    return [from_data_url(x, f"{where}[{k}]") if x[:5].lower() == "data:"
            else from_base64(x, f"{where}[{k}]") for k, x in enumerate(raw or [])]


def _message(m: OllamaMessage, at: int) -> Message:
    """Ollama's message -> internal: assistant tool_calls carry arguments as objects; a tool
    result names its function in `tool_name`."""
    calls = []
    for i, call in enumerate(m.tool_calls or []):
        fn = call.get("function", {})
        args = fn.get("arguments") or {}
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = {"value": args}
        calls.append(ToolCall(id=call.get("id") or f"call_{i}", name=fn.get("name", ""),
                              arguments=args if isinstance(args, dict) else {"value": args}))
    return Message(role=m.role, content=m.content, tool_calls=calls,
                   images=_images(m.images, f"messages[{at}].images"),
                   name=m.tool_name if m.role == "tool" else None,
                   thinking=m.thinking if m.role == "assistant" else None)


def _tool_calls(calls: list[ToolCall]) -> list[dict[str, Any]]:
    return [{"id": c.id, "function": {"index": i, "name": c.name, "arguments": c.arguments}}
            for i, c in enumerate(calls)]


def _logprobs(chunk: Chunk) -> list[dict[str, Any]]:
    return [{"token": e.token, "logprob": e.logprob, "bytes": e.bytes,
             "top_logprobs": [{"token": t, "logprob": lp, "bytes": list(t.encode())}
                              for t, lp in e.top]} for e in chunk.logprobs or []]


def _chunk_line(req: ChatRequest, chunk: Chunk, shape: Shape) -> bytes:
    obj: dict[str, Any] = {"model": req.model, "created_at": now(),
                           **_text(shape, chunk.text, chunk.thinking), "done": False}
    if chunk.tool_calls and shape == "chat":
        obj["message"]["tool_calls"] = _tool_calls(chunk.tool_calls)
    if chunk.logprobs is not None:
        obj["logprobs"] = _logprobs(chunk)
    return jsonio.dumps(obj) + b"\n"


def _done_obj(req: ChatRequest, stats: Stats, shape: Shape, content: str = "",
              thinking: str | None = None) -> dict[str, Any]:
    out = {"model": req.model, "created_at": now(), **_text(shape, content, thinking),
           "done": True}
    if stats.context is not None:
        out["context"] = stats.context
    return {**out, **stats_fields(stats)}


async def _respond(req: ChatRequest, events: EventStream,
                   shape: Shape, request: Request | None = None) -> Response:
    """Errors before the first token are HTTP errors; after it, a final NDJSON error line.
    A non-streaming request whose client disconnects is cancelled."""
    if not req.stream:
        return await unless_disconnected(request, _first_then_collect(req, events, shape))
    try:
        # with `return_progress` the stream opens once the prompt has a slot, to say how
        # far its reading is; else with the first token
        first = await anext(events) if req.progress else await first_output(events)
    except EngineError as exc:
        return error(exc.status, exc.message, exc.retry_after)
    return StreamingResponse(_ndjson(req, first, events, shape),
                             media_type="application/x-ndjson")


async def _first_then_collect(req: ChatRequest, events: EventStream,
                              shape: Shape) -> Response:
    try:
        first = await first_output(events)
    except EngineError as exc:
        return error(exc.status, exc.message, exc.retry_after)
    return await _collect(req, first, cast(OutputStream, events), shape)


async def _ndjson(req: ChatRequest, first: Started | Progress | Chunk | Done,
                  rest: EventStream, shape: Shape) -> AsyncIterator[bytes]:
    event: Started | Progress | Chunk | Done | None = first
    try:
        while event is not None:
            if isinstance(event, Chunk):
                yield _chunk_line(req, event, shape)
            elif isinstance(event, Progress):
                yield jsonio.dumps(_progress_obj(req, event, shape)) + b"\n"
            elif isinstance(event, Started):
                pass
            else:
                yield jsonio.dumps(_done_obj(req, event.stats, shape)) + b"\n"
                return
            event = await anext(rest, None)
    except EngineError as exc:
        yield json.dumps({"error": exc.message}).encode() + b"\n"
    finally:
        await rest.aclose()


def _progress_obj(req: ChatRequest, p: Progress, shape: Shape) -> dict[str, Any]:
    """A line with no text yet and how far the prompt's reading is, in llama-server's
    `prompt_progress` terms (`cache`: tokens the cache held; `processed` counts them)."""
    return {"model": req.model, "created_at": now(), **_text(shape, "", None), "done": False,
            "prompt_progress": {"total": p.total, "cache": p.cached, "processed": p.processed}}


async def _collect(req: ChatRequest, first: Chunk | Done,
                   rest: OutputStream, shape: Shape) -> Response:
    parts: list[str] = []
    thoughts: list[str] = []
    logprobs: list[dict[str, Any]] = []
    calls: list[ToolCall] = []
    event: Chunk | Done | None = first
    try:
        while isinstance(event, Chunk):
            parts.append(event.text)
            thoughts.append(event.thinking or "")
            logprobs += _logprobs(event)
            calls += event.tool_calls or []
            event = await anext(rest, None)
    except EngineError as exc:
        return error(exc.status, exc.message, exc.retry_after)
    finally:
        await rest.aclose()
    stats = event.stats if isinstance(event, Done) else Stats(finish_reason="error")
    body = _done_obj(req, stats, shape, "".join(parts), "".join(thoughts))
    if calls and shape == "chat":
        body["message"]["tool_calls"] = _tool_calls(calls)
    if req.logprobs is not None:
        body["logprobs"] = logprobs
    return JSONResponse(body)


class ModelBody(BaseModel):
    model: str | None = None
    name: str | None = None  # older clients
    verbose: bool = False

    @property
    def target(self) -> str:
        if not (self.model or self.name):
            raise EngineError("missing field 'model'", status=400)
        return str(self.model or self.name)


class CopyBody(BaseModel):
    source: str
    destination: str


class CreateBody(BaseModel):
    model: str | None = None
    name: str | None = None
    from_: str | None = Field(None, alias="from")
    files: dict[str, str] | None = None
    adapters: dict[str, str] | None = None
    template: str | None = None
    license: str | list[str] | None = None
    system: str | None = None
    parameters: dict[str, Any] | None = None
    messages: list[OllamaMessage] | None = None
    quantize: str | None = None
    stream: bool = True
    modelfile: str | None = None  # pre-0.5 clients sent the Modelfile text


def show_response(store: Store, manifest: Manifest) -> dict[str, Any]:
    params = []
    for key, value in manifest.parameters.items():
        for v in value if isinstance(value, list) else [value]:
            params.append(f"{key:<20} {json.dumps(v) if isinstance(v, str) else v}")
    entry = model_entry(manifest)
    info = store.model_info(manifest)
    out: dict[str, Any] = {
        "modelfile": store.modelfile_of(manifest).render(),
        "parameters": "\n".join(params),
        "template": manifest.template or "",
        "details": entry["details"],
        "model_info": info,
        # the store decides, so `llmrun show` with no daemon says the same
        "capabilities": store.capabilities(manifest, info),
        "modified_at": entry["modified_at"],
    }
    projector = store.projector_info(manifest)
    if projector is not None:  # Ollama's field: the projector's GGUF metadata
        out["projector_info"] = projector
    if manifest.system:
        out["system"] = manifest.system
    if manifest.license:
        out["license"] = "\n".join(manifest.license)
    return out


def store_router(store: Store,
                 devices: Callable[[], list[Device]] | None = None) -> APIRouter:
    """Store operations: show, copy, delete, create, blobs (no model is loaded for these).
    `devices`: the daemon's cached device list, which `show` adds."""
    api = APIRouter()

    def fail(exc: Exception) -> JSONResponse:
        return error(_store_status(exc) if isinstance(exc, StoreError) else 400, str(exc))

    @api.post("/api/show", response_model=None)
    async def show(body: ModelBody) -> Response:
        try:
            _, manifest = store.get(body.target)
            out = show_response(store, manifest)
            if devices is not None:
                # llmrun's own field, not Ollama's: the devices the daemon places models on
                # (LLMRUN_GPUS applied; free memory as of the last listing). Where this
                # model's layers would go depends on its load options and what else is
                # loaded then, so this names the candidates, not a placement.
                out["devices"] = [{"name": d.name, "description": d.description,
                                   "type": d.type, "total": d.total, "free": d.free}
                                  for d in devices()]
            return JSONResponse(out)
        except StoreError as exc:
            return fail(exc)

    @api.post("/api/copy", response_model=None)
    async def copy(body: CopyBody) -> Response:
        try:
            store.copy(body.source, body.destination)
        except StoreError as exc:
            return fail(exc)
        return Response(status_code=200)

    @api.delete("/api/delete", response_model=None)
    async def delete(body: ModelBody) -> Response:
        try:
            store.remove(body.target)
        except StoreError as exc:
            return fail(exc)
        return Response(status_code=200)

    @api.head("/api/blobs/{digest}", response_model=None)
    async def blob_exists(digest: str) -> Response:
        try:
            return Response(status_code=200 if store.blobs.exists(digest) else 404)
        except DigestError as exc:
            return fail(exc)

    @api.post("/api/blobs/{digest}", response_model=None)
    async def blob_upload(digest: str, request: Request) -> Response:
        """Stream the body into a temporary file, hashing as it arrives; it becomes a blob
        only whole, within LLMRUN_MAX_BLOB_SIZE and matching `digest`. Any other ending (too
        large, wrong digest, the client gone) leaves nothing behind."""
        limit = config.max_blob_size()
        try:
            if store.blobs.exists(digest):
                return Response(status_code=200)
            if _declared_length(request) > limit:  # refused before a byte is written
                raise BlobTooLarge(f"blob is larger than the limit of {limit} bytes "
                                   "(LLMRUN_MAX_BLOB_SIZE)")
            incoming = store.blobs.incoming(expected=digest, limit=limit)
            try:
                async for chunk in request.stream():
                    incoming.write(chunk)
                await asyncio.to_thread(incoming.commit)  # fsync off the event loop
            finally:
                incoming.discard()
        except BlobTooLarge as exc:
            return error(413, str(exc))
        except DigestError as exc:
            return fail(exc)
        except ClientDisconnect:
            return error(400, "the upload was cut short; nothing was kept")
        return Response(status_code=201)

    @api.post("/api/create", response_model=None)
    async def create(body: CreateBody, request: Request) -> Response:
        name = body.model or body.name
        if not name:
            return error(400, "missing field 'model'")
        # a remote model (FROM http(s)://) makes the daemon connect where the caller says:
        # only a caller on this machine, or one holding a key (the middleware checked it)
        allow_remote = bool(config.api_keys()) or \
            (request.client is not None and config.is_loopback(request.client.host))
        try:  # host paths refused here, before any stream starts
            mf = _modelfile_from(body, allow_remote)
        except (StoreError, ValueError) as exc:
            return fail(exc)

        async def events() -> AsyncIterator[dict[str, Any]]:
            yield {"status": "parsing modelfile"}
            try:
                manifest = await asyncio.to_thread(store.create, name, mf, None, None,
                                                   body.quantize, allow_paths=False,
                                                   allow_remote=allow_remote)
            except StoreError as exc:
                yield {"error": str(exc), "_status": _store_status(exc)}
                return
            yield {"status": "using model " + (manifest.model.digest if manifest.model
                                               else "served remotely")}
            yield {"status": "writing manifest"}
            yield {"status": "success"}

        if body.stream:
            return StreamingResponse(
                (json.dumps({k: v for k, v in e.items() if k != "_status"}).encode() + b"\n"
                 async for e in events()),
                media_type="application/x-ndjson")
        last: dict[str, Any] = {}
        async for event in events():
            last = event
        if "error" in last:
            return error(last["_status"], last["error"])
        return JSONResponse(last)

    return api


def _declared_length(request: Request) -> int:
    try:
        return int(request.headers.get("content-length") or 0)
    except ValueError:
        return 0  # chunked or bogus: the byte count while streaming still bounds it


def _modelfile_from(body: CreateBody, allow_remote: bool = False) -> Modelfile:
    """The Modelfile a create body describes. Over HTTP, FROM/`files`/ADAPTER name uploaded
    blobs or models only (or, with `allow_remote`, a remote server's URL): anything else is
    refused with one message, whatever is on disk."""
    if body.modelfile and not (body.from_ or body.files):
        try:
            mf = modelfile_parse(body.modelfile)
        except ModelfileError as exc:
            raise CreateError(str(exc)) from None
        refuse_host_paths(mf, allow_remote)
        return mf
    if any(not d.startswith(("sha256:", "sha256-")) for d in
           [*(body.files or {}).values(), *(body.adapters or {}).values()]):
        raise CreateError(HOST_PATH_REFUSED)  # Ollama's clients send digests here, never paths
    extra: list[str] = []
    if body.files:
        # a model and its vision projector, which the store tells apart by their headers
        ggufs = [d for f, d in body.files.items() if f.lower().endswith(".gguf")]
        if not 1 <= len(ggufs) <= 2:
            raise CreateError("'files' must name one .gguf blob: the model's (and, for a "
                              "vision model, its projector's beside it)")
        source, *extra = ggufs
    elif body.from_:
        source = body.from_
    else:
        raise CreateError("give 'from' (a model name) or 'files' (an uploaded GGUF blob)")
    params = dict(body.parameters or {})
    unknown = sorted(set(params) - set(Options.model_fields))
    if unknown:
        raise CreateError(f"unknown parameter(s): {', '.join(unknown)}")
    if isinstance(params.get("stop"), str):
        params["stop"] = [params["stop"]]
    licenses = [body.license] if isinstance(body.license, str) else list(body.license or [])
    mf = Modelfile(
        from_=source, extra_from=extra, parameters=params, template=body.template,
        system=body.system,
        adapters=list((body.adapters or {}).values()),  # uploaded blobs: sha256:<hex>
        messages=[Message(role=m.role, content=m.content) for m in body.messages or []
                  if m.role != "tool"],
        license=licenses)
    refuse_host_paths(mf, allow_remote)
    return mf


DIALECT = Dialect(
    name="ollama", prefixes=("/",),
    routers=lambda backends: [router(backends.service),
                              store_router(backends.store, backends.devices)],
    error_body=plain_error_body, validation_error=plain_validation_error,
    engine_error=plain_engine_error)
