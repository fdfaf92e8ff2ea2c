"""Ollama's routes: `/api/chat`, `/api/generate`, embeddings, `/api/ps`, `/api/version`,
`/api/tags`, pulls (`router`), and the store's own (`store_router`: show, copy, delete,
create, blobs)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.requests import ClientDisconnect

from llmrun import __version__, config
from llmrun.api.dialect import http_status
from llmrun.api.ollama.errors import error, store_status
from llmrun.api.ollama.stream import load_only, respond
from llmrun.api.ollama.wire import (
    ChatBody,
    CopyBody,
    CreateBody,
    EmbedBody,
    GenerateBody,
    LegacyEmbedBody,
    ModelBody,
    PullBody,
    parse_options,
)
from llmrun.request import (
    EngineError,
    ModelRequest,
)
from llmrun.server.fit import Device
from llmrun.server.service import Service
from llmrun.store import (
    BlobTooLarge,
    DigestError,
    Manifest,
    Store,
    StoreError,
)
from llmrun.store.gguf import PROJECTOR_ARCHITECTURE

log = logging.getLogger(__name__)

# The Ollama release whose API llmrun answers as (`/api/version`); clients gate features on
# it, Codex on 0.13.4 or newer. Raise it when llmrun follows a newer API.
OLLAMA_API_VERSION = "0.13.5"


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

    @api.delete("/api/delete", response_model=None)
    async def delete(body: ModelBody) -> Response:
        try:
            await service.remove(body.target)
        except StoreError as exc:
            return error(store_status(exc), str(exc))
        return Response(status_code=200)

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
        try:
            req = body.to_request()
        except EngineError as exc:
            return error(http_status(exc), exc.message, exc.retry_after)
        if not req.messages:
            return await load_only(service, req, "chat")
        return await respond(req, service.chat(req), "chat", request)

    @api.post("/api/generate", response_model=None)
    async def generate(body: GenerateBody, request: Request) -> Response:
        try:
            req = body.to_request()
        except EngineError as exc:
            return error(http_status(exc), exc.message, exc.retry_after)
        if not body.prompt and not body.images:  # images alone are a prompt (describe them)
            return await load_only(service, req, "generate")
        return await respond(req, service.chat(req), "generate", request)

    @api.post("/api/embed", response_model=None)
    async def embed(body: EmbedBody) -> Response:
        inputs = [body.input] if isinstance(body.input, str) else list(body.input)
        try:
            req = ModelRequest(model=body.model, options=parse_options(body.options),
                               keep_alive=body.keep_alive)
            if not inputs:
                await service.load(req.stand_in())
                return JSONResponse({"model": body.model, "embeddings": []})
            vectors, n_tokens, load_ns, total_ns = await service.embed(req, inputs,
                                                                       body.truncate)
        except EngineError as exc:
            return error(http_status(exc), exc.message, exc.retry_after)
        if body.dimensions:
            vectors = [_shorten(v, body.dimensions) for v in vectors]
        return JSONResponse({"model": body.model, "embeddings": vectors,
                             "total_duration": total_ns, "load_duration": load_ns,
                             "prompt_eval_count": n_tokens})

    @api.post("/api/embeddings", response_model=None)
    async def embeddings(body: LegacyEmbedBody) -> Response:
        try:
            req = ModelRequest(model=body.model, options=parse_options(body.options),
                               keep_alive=body.keep_alive)
            if not body.prompt:
                await service.load(req.stand_in())
                return JSONResponse({"embedding": []})
            vectors, *_ = await service.embed(req, [body.prompt], True)
        except EngineError as exc:
            return error(http_status(exc), exc.message, exc.retry_after)
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
        yield {"error": str(exc), "_status": store_status(exc)}
        return
    yield {"status": "verifying sha256 digest"}
    yield {"status": "writing manifest", "digest": manifest.layer.digest}
    yield {"status": "success"}


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
    """Store operations: show, copy, create, blobs (no model is loaded for these; delete,
    which unloads, is in `router`).
    `devices`: the daemon's cached device list, which `show` adds."""
    api = APIRouter()

    def fail(exc: Exception) -> JSONResponse:
        return error(store_status(exc) if isinstance(exc, StoreError) else 400, str(exc))

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
    async def create(body: CreateBody) -> Response:
        name = body.model or body.name
        if not name:
            return error(400, "missing field 'model'")
        # a remote model (FROM http(s)://) makes the daemon connect where the caller says,
        # sending a key its owner configured: that is the owner's to allow. Being on
        # loopback proves nothing (every local user is), nor does holding an API key (it
        # lets a client chat, not pick where the daemon's secrets go)
        allow_remote = config.remote_create()
        try:  # host paths refused here, before any stream starts
            mf = body.to_modelfile(allow_remote)
        except (StoreError, ValueError) as exc:
            return fail(exc)

        async def events() -> AsyncIterator[dict[str, Any]]:
            yield {"status": "parsing modelfile"}
            try:
                manifest = await asyncio.to_thread(store.create, name, mf, None, None,
                                                   body.quantize, allow_paths=False,
                                                   allow_remote=allow_remote)
            except StoreError as exc:
                yield {"error": str(exc), "_status": store_status(exc)}
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



