"""`llmrun serve`: the daemon in the foreground."""

from __future__ import annotations

import errno
import logging
import socket

import typer

from llmrun import config
from llmrun.cli._common import fail
from llmrun.server import pidfile


def _settings_help() -> str:
    rows = [f"{s.name:<26} {s.description} (default: {s.default or 'unset'})"
            for s in config.SETTINGS]
    return "Environment (also read from LLMRUN_HOME/config.yaml):\n\n\b\n" + "\n".join(rows)


def register(app: typer.Typer) -> None:
    @app.command(epilog=_settings_help())
    def serve() -> None:
        """Start the llmrun daemon in the foreground."""
        import uvicorn

        from llmrun.server.app import create_app

        host, port = config.host()
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            try:
                probe.bind((host, port))
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    fail(f"{host}:{port} is already in use (is another llmrun or ollama "
                         "running?); set LLMRUN_HOST to use another port")
                fail(f"cannot listen on {host}:{port}: {exc.strerror}")
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        pid_path = config.home() / "daemon.pid"
        try:
            pidfile.claim(pid_path)
        except pidfile.AlreadyRunning as exc:
            fail(str(exc))
        # SIGINT/SIGTERM: uvicorn stops accepting, lets requests in flight finish for up to
        # 10 s (then cancels them, which cancels their sequences), and the app's shutdown
        # stops every runner process.
        app = create_app(on_shutdown=lambda: pidfile.release(pid_path))
        uvicorn.run(app, host=host, port=port, log_level="info",
                    server_header=False, timeout_graceful_shutdown=10)
