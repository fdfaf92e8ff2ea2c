"""A fake HTTP server on a thread, for tests that need something to answer over HTTP (a
model server, an API the CLI calls): `with serving(Handler) as url: ...`."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, HTTPServer, ThreadingHTTPServer


@contextmanager
def serving(handler: type[BaseHTTPRequestHandler], host: str = "127.0.0.1", port: int = 0,
            threaded: bool = True) -> Iterator[str]:
    """Serve `handler` on `host`:`port` (0: a free port) until the block ends; yields the
    base URL. Each request on a thread of its own unless `threaded` is False."""
    server = (ThreadingHTTPServer if threaded else HTTPServer)((host, port), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
