"""The daemon's ASGI app: routes of every dialect, error shapes, lifecycle.

FastAPI (on Starlette + uvicorn) because the dialects are defined by pydantic models anyway,
request validation then costs nothing extra, and streaming responses are cancelled when the
client goes away, which is how a disconnect frees a slot.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, RedirectResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmrun import __version__, config
from llmrun.api.dialect import Backends
from llmrun.daemon import web
from llmrun.daemon.dialects import DIALECTS, dialect, error_body
from llmrun.daemon.intake import BodyLimit, ClientContext, RateLimit
from llmrun.daemon.jsonshape import JSONShape
from llmrun.daemon.security import Security, authorized
from llmrun.request import EngineError
from llmrun.server.devices import DeviceList
from llmrun.server.metrics import CONTENT_TYPE, Metrics
from llmrun.server.responsestore import ResponseStore
from llmrun.server.scheduler import Scheduler
from llmrun.server.service import Service
from llmrun.store import Store

IDENTITY_HEADER = b"x-llmrun-version"


class OnResponseStart:
    """Calls `hook(scope, message)` as each HTTP response starts, where it may read the
    routed scope or add headers. (Pure ASGI: BaseHTTPMiddleware would buffer streams.)"""

    def __init__(self, app: ASGIApp, hook: Callable[[Scope, Message], None]) -> None:
        self.app = app
        self.hook = hook

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def hooked_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.hook(scope, message)
            await send(message)

        await self.app(scope, receive, hooked_send)


def identity_header(_: Scope, message: Message) -> None:
    """`X-Llmrun-Version` on every response, so the CLI can tell llmrun from another server
    that holds the port."""
    message["headers"] = [*message.get("headers", []), (IDENTITY_HEADER, __version__.encode())]


class JSONBodies:
    """Treat request bodies as JSON whatever their Content-Type says: Ollama's own docs use
    `curl -d '{...}'`, which sends application/x-www-form-urlencoded. Not blob uploads, nor
    OpenAI's audio routes, whose bodies are multipart forms."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] in ("POST", "PUT", "DELETE") \
                and not scope["path"].startswith(("/api/blobs/", "/v1/audio/")):
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def create_app(store: Store | None = None,
               on_shutdown: Callable[[], None] | None = None) -> FastAPI:
    store = store or Store()
    devices = DeviceList()
    scheduler = Scheduler(store, config.home() / "logs", devices=devices.current)
    metrics = Metrics(scheduler, devices.cached)
    service = Service(store, scheduler, metrics)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        store.prune()  # blobs uploaded but never used, temp files of writes that crashed
        # the devices' line in the log at start (a child lists them; serving does not wait)
        listing = asyncio.create_task(devices.current())
        yield
        listing.cancel()
        await scheduler.shutdown()
        await service.close()
        if on_shutdown is not None:
            on_shutdown()  # here, not atexit: uvicorn re-raises SIGTERM after shutting down

    app = FastAPI(title="llmrun", version=__version__, lifespan=lifespan,
                  docs_url=None, redoc_url=None)
    app.state.service = service

    # errors no route answered itself, in the shape of the dialect whose prefix the path has
    @app.exception_handler(RequestValidationError)
    async def on_validation(request: Request, exc: RequestValidationError) -> Response:
        return dialect(request.url.path).validation_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        # unknown routes (404) and wrong methods (405): the dialect's shape, not {"detail"}
        path = request.url.path
        message = f"{exc.detail}: {request.method} {path}"
        return JSONResponse(error_body(path, exc.status_code, message),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(EngineError)
    async def on_engine_error(request: Request, exc: EngineError) -> Response:
        return dialect(request.url.path).engine_error(exc)

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root(request: Request) -> Response:
        if request.method == "GET" and web.wants_html(request):  # a browser: the web page
            return RedirectResponse(web.PREFIX, status_code=302)
        return PlainTextResponse("llmrun is running")

    app.include_router(web.router())

    @app.get("/health")
    async def health(request: Request) -> dict[str, Any]:
        # open to probes even when keys are set, so without a key it says only "up"
        if not authorized(request.headers):
            return {"status": "ok"}
        return {"status": "ok", "version": __version__,
                "loaded": [m.name for m in scheduler.models()]}

    backends = Backends(service, store, devices.cached,
                        ResponseStore(config.home() / "responses"))
    for each in DIALECTS:
        for router in each.routers(backends):
            app.include_router(router)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    # outermost last: identity header, Security, RateLimit (after the key check, so it can
    # count per key), BodyLimit, JSONShape (the body's values and depth, within BodyLimit's
    # size), ClientContext (X-Llmrun-Num-Ctx), JSONBodies, metrics
    app.add_middleware(OnResponseStart, hook=metrics.count_response)
    app.add_middleware(JSONBodies)
    app.add_middleware(ClientContext)
    app.add_middleware(JSONShape)
    app.add_middleware(BodyLimit)
    app.add_middleware(RateLimit)
    app.add_middleware(Security)
    app.add_middleware(OnResponseStart, hook=identity_header)
    return app


