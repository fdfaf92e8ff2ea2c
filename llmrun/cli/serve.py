"""`llmrun serve`: the daemon in the foreground."""

from __future__ import annotations

import logging

import typer

from llmrun import config
from llmrun.cli._common import fail


def _settings_help() -> str:
    rows = [f"{s.name:<26} {s.description} (default: {s.default or 'unset'})"
            for s in config.SETTINGS]
    return "Environment (also read from LLMRUN_HOME/config.yaml):\n\n\b\n" + "\n".join(rows)


def _check_exposure(host: str, port: int, insecure: bool) -> None:
    """Refuse to serve other machines with no key (anyone who reaches the port could run
    models, pull, create and delete), unless --insecure says the user means it."""
    if config.is_loopback(host) or config.api_keys():
        return
    if not insecure:
        fail(f"refusing to listen on {host}:{port}, which other machines can reach, without "
             "API keys: set LLMRUN_API_KEYS=<key>[,<key>...] (clients then send "
             "`Authorization: Bearer <key>`), bind LLMRUN_HOST to 127.0.0.1, or pass "
             "--insecure to serve it open anyway")
    log = logging.getLogger("llmrun.serve")
    log.warning("serving %s:%d with no LLMRUN_API_KEYS (--insecure): anyone who can reach "
                "this port can use and change the model store", host, port)
    if host in ("0.0.0.0", "::"):
        log.warning("bound to all interfaces without keys: the Host check is off, so web pages "
                    "can reach this daemon through DNS rebinding; set LLMRUN_API_KEYS")


def register(app: typer.Typer) -> None:
    @app.command(epilog=_settings_help())
    def serve(insecure: bool = typer.Option(
            False, "--insecure",
            help="Allow a non-loopback LLMRUN_HOST without LLMRUN_API_KEYS")) -> None:
        """Start the llmrun daemon in the foreground."""
        host, port = config.host()
        logging.basicConfig(level=logging.DEBUG if config.debug() else logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        _check_exposure(host, port, insecure)  # before binding, before the heavy imports

        from llmrun.daemon.main import ServeError, run

        try:
            run(host, port)
        except ServeError as exc:
            fail(str(exc))


def register_rpc_worker(app: typer.Typer) -> None:
    @app.command(name="rpc-worker")
    def rpc_worker(
        host: str = typer.Option("127.0.0.1", help="Address to bind (default: loopback)"),
        port: int = typer.Option(50052, help="Port to listen on"),
        threads: int = typer.Option(0, help="Threads computing the layers (0: half the cores)"),
        insecure: bool = typer.Option(False, "--insecure",
                                      help="Allow an address other hosts can reach (the RPC "
                                           "protocol has no authentication)"),
    ) -> None:
        """Lend this machine's CPU to other hosts' runners (llama.cpp RPC): they place a share
        of each model's layers here (LLMRUN_RPC_WORKERS=host:port on their daemon)."""
        import os
        import sys

        args = [sys.executable, "-m", "llmrun.engine.rpcworker", "--host", host,
                "--port", str(port)]
        if threads:
            args += ["--threads", str(threads)]
        if insecure:
            args.append("--insecure")
        # a process of its own (the CLI never imports the engine); signals reach it directly
        os.execv(sys.executable, args)
