"""Commands about the running daemon: `ps` (what is loaded) and `stop MODEL` (unload it)."""

from __future__ import annotations

from datetime import UTC, datetime

import typer

from llmrun.cli._common import console, fail, human_size, print_table
from llmrun.client import Client, ClientError


def _until(expires_at: str | None) -> str:
    if not expires_at:
        return ""
    try:
        when = datetime.fromisoformat(expires_at.replace("Z", "+00:00"))
    except ValueError:
        return expires_at
    seconds = (when - datetime.now(UTC)).total_seconds()
    if seconds > 10 * 365 * 86400:
        return "Forever"
    if seconds < 60:
        return f"{max(0, int(seconds))} seconds from now"
    if seconds < 3600:
        return f"{int(seconds // 60)} minutes from now"
    return f"{seconds / 3600:.1f} hours from now"


def _sandbox(model: dict[str, object]) -> str:
    """How confined a model's runner is: confined, partial (some layers missing), off."""
    if "confined" not in model:
        return ""  # a daemon that does not say
    if model["confined"]:
        return "confined"
    return "partial" if model.get("sandbox") else "off"


def _client() -> Client:
    client = Client()
    state = client.probe()
    if state != "llmrun":
        fail(f"no llmrun daemon answers on {client.base_url} (start one with `llmrun serve`)"
             if state == "down" else f"{client.base_url} is not an llmrun daemon")
    return client


def register(app: typer.Typer) -> None:
    @app.command()
    def ps() -> None:
        """List the models loaded in the daemon."""
        try:
            models = _client().ps()
        except ClientError as exc:
            fail(str(exc))
        local = [m for m in models if "remote" not in m]
        print_table(("NAME", "ID", "SIZE", "PROCESSOR", "CONTEXT", "SLOTS", "SANDBOX", "UNTIL"),
                    [(m["name"], m["digest"][:12], human_size(m["size"]), _processor(m),
                      str(m.get("context_length", "")),
                      f"{m.get('slots_busy', 0)}/{m.get('slots', '')}",
                      _sandbox(m), _until(m.get("expires_at"))) for m in local])
        remote = [m for m in models if "remote" in m]
        if remote:  # models other servers run: where, and whether each replica answers
            console.print()
            print_table(("NAME", "ID", "REPLICA", "STATE"),
                        [(m["name"], m["digest"][:12], r["url"], r["state"])
                         for m in remote for r in m["remote"]])

    @app.command()
    def stop(model: str = typer.Argument(..., help="Model to unload")) -> None:
        """Unload a model from the daemon now (its requests in flight finish first)."""
        try:
            _client().stop_model(model)
        except ClientError as exc:
            fail(str(exc))


def _processor(m: dict[str, object]) -> str:
    """Where the model computes, as Ollama's `ps` says it: "100% CPU", "100% GPU", or the
    shares of its memory, "41%/59% CPU/GPU"; split with llama.cpp RPC workers, their shares."""
    rpc = m.get("rpc")
    if isinstance(rpc, dict):
        shares = ", ".join(f"{w['endpoint']} {w['share']:.0%}" for w in rpc.get("workers", []))
        return f"{rpc.get('local_layers')}/{rpc.get('layers')} layers here; rest on {shares}"
    size, vram = m.get("size"), m.get("size_vram")
    size = size if isinstance(size, int) else 0
    vram = vram if isinstance(vram, int) else 0
    if vram <= 0:
        return "100% CPU"
    if vram == size:
        return "100% GPU"
    if vram > size:
        return "Unknown"  # (Ollama says so too)
    cpu = round((size - vram) / size * 100)
    return f"{cpu}%/{100 - cpu}% CPU/GPU"
