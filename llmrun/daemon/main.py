"""The daemon in this process: bind, claim the pid file, serve until a signal.

`llmrun serve` calls `run` once it has checked the settings; nothing else starts a daemon
in-process (the CLI starts `llmrun serve` in the background instead, see client.py).
"""

from __future__ import annotations

import errno
import os
import socket

import uvicorn

from llmrun import config
from llmrun.api.openai import realtime
from llmrun.daemon import pidfile
from llmrun.daemon.app import create_app


class ServeError(Exception):
    """The daemon cannot start; the message says why, for the user."""


def check_port(host: str, port: int) -> None:
    """ServeError unless the daemon can listen on host:port."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        # as uvicorn binds: the last daemon's connections in TIME_WAIT do not hold the port
        # (without it, serve refused to start for a minute after a daemon stopped)
        if os.name == "posix":
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ServeError(f"{host}:{port} is already in use (is another llmrun or "
                                 "ollama running?); set LLMRUN_HOST to use another port"
                                 ) from None
            raise ServeError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


def run(host: str, port: int) -> None:
    check_port(host, port)
    pid_path = config.home() / "daemon.pid"
    try:
        pidfile.claim(pid_path)
    except pidfile.AlreadyRunning as exc:
        raise ServeError(str(exc)) from None
    # SIGINT/SIGTERM: uvicorn stops accepting, lets requests in flight finish for up to
    # 10 s (then cancels them, which cancels their sequences), and the app's shutdown
    # stops every runner process.
    app = create_app(on_shutdown=lambda: pidfile.release(pid_path))
    # WebSocket frames (the realtime session) are held by uvicorn before the session sees
    # them: 16 MiB each and 32 queued per connection by default, 512 MiB a connection.
    # Twice the session's own event bound lets the session answer a large event with its
    # error event, and 4 queued frames hold at most 32 MiB a connection.
    uvicorn.run(app, host=host, port=port, log_level="info",
                server_header=False, timeout_graceful_shutdown=10,
                ws_max_size=2 * realtime.MAX_EVENT_CHARS, ws_max_queue=4)
