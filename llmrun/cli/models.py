"""Store commands: pull, list, show, create, cp, rm. They work with no daemon running."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from llmrun.cli._common import console, fail, human_size, print_table, rich_console
from llmrun.client import Client, ClientError

if TYPE_CHECKING:  # rich's progress and tables, and the store, load in the commands using them
    from rich.progress import Progress, TaskID

    from llmrun.store import Store


def _ago(when: datetime) -> str:
    seconds = (datetime.now(UTC) - when).total_seconds()
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if n != 1 else ''} ago"
    return "just now"


def _store() -> Store:
    from llmrun.store import Store

    return Store()


def _local_file(ref: str, base_dir: Path) -> Path | None:
    """The local file a FROM/ADAPTER line names, None for a model name, a digest or a
    remote server's URL."""
    from llmrun.store import CreateError

    if ref.startswith(("sha256:", "sha256-", "@sha256:")) or \
            ref.lower().startswith(("http://", "https://")):
        return None
    path = Path(ref).expanduser()
    path = path if path.is_absolute() else base_dir / path
    if path.is_file():
        return path
    if "/" in ref or ref.lower().endswith(".gguf") or ref.startswith(("~", ".")):
        raise CreateError(f"{ref}: no such file")
    return None


def _split(text: str) -> bool:
    """A split GGUF (`-00001-of-0000N`): its parts are imported by the local store."""
    from llmrun.store import modelfile

    try:
        return any(re.search(r"-\d{5}-of-\d{5}\.gguf$", ref)
                   for ref in modelfile.parse(text).froms)
    except modelfile.ModelfileError:
        return False


def _remote_here(text: str, client: Client) -> bool:
    """A remote model (FROM http(s)://) for a daemon on this machine: written to the store
    directly, as this machine's user may. Over HTTP the daemon refuses it unless its owner
    set LLMRUN_REMOTE_CREATE=1, since there it cannot tell its owner from any other
    caller; a daemon elsewhere gets it over HTTP, its owner deciding."""
    from urllib.parse import urlsplit

    from llmrun import config
    from llmrun.store import modelfile

    try:
        froms = modelfile.parse(text).froms
    except modelfile.ModelfileError:
        return False
    return any(ref.lower().startswith(("http://", "https://")) for ref in froms) and \
        config.is_loopback(urlsplit(client.base_url).hostname or "")


def _upload_files(client: Client, text: str, base_dir: Path) -> dict[str, str]:
    """The /api/create body for Modelfile `text`: its FROM (model, projector) and ADAPTER
    files uploaded as blobs and named by digest."""
    from llmrun.store import CreateError, modelfile

    try:
        mf = modelfile.parse(text)
    except modelfile.ModelfileError as exc:
        raise CreateError(str(exc)) from None

    def upload(ref: str) -> str:
        path = _local_file(ref, base_dir)
        if path is None:
            return ref
        console.print(f"[dim]uploading {path.name}[/]", highlight=False)
        return client.upload_blob(path)

    mf.from_ = upload(mf.from_)
    mf.extra_from = [upload(ref) for ref in mf.extra_from]
    mf.adapters = [upload(ref) for ref in mf.adapters]
    return {"modelfile": mf.render()}


class _Bar:
    """Adapts (status, completed, total) progress to rich: a bar per file being moved, and
    a plain line for each step without a size (the choice of quantization, for instance)."""

    def __init__(self, progress: Progress) -> None:
        self.progress = progress
        self.tasks: dict[str, TaskID] = {}

    def __call__(self, status: str, completed: int, total: int) -> None:
        if not total:
            if status and status not in self.tasks:
                self.tasks[status] = self.progress.add_task(status, total=None, visible=False)
                self.progress.console.print(status, markup=False, highlight=False)
            return
        if status not in self.tasks:
            self.tasks[status] = self.progress.add_task(status, total=total)
        self.progress.update(self.tasks[status], completed=completed, total=total)


def _progress() -> Progress:
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    return Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(), TimeRemainingColumn(), console=rich_console(console),
                    transient=True)


def register(app: typer.Typer) -> None:
    @app.command()
    def pull(name: str = typer.Argument(
            ..., help="smollm2:135m, qwen2.5:0.5b, hf.co/{org}/{repo}[:{quant or file}]")) -> None:
        """Download a model into the store (through the daemon when one is running)."""
        client = Client()
        if client.probe() == "llmrun":
            try:
                with _progress() as progress:
                    bar = _Bar(progress)
                    for event in client.pull(name):
                        bar(event.get("status", ""), event.get("completed", 0),
                            event.get("total", 0))
            except ClientError as exc:
                fail(str(exc))
            console.print(f"pulled {name}")
            return
        from llmrun.store import StoreError

        try:
            with _progress() as progress:
                manifest = _store().pull(name, _Bar(progress))
        except StoreError as exc:
            fail(str(exc))
        console.print(f"pulled {manifest.name} ({human_size(manifest.size)}, id {manifest.id})")

    @app.command(name="list")
    def list_() -> None:
        """List the models in the store."""
        from llmrun import config
        from llmrun.store import listing

        # the manifests as plain JSON (fast), or validated when one of them needs it: then
        # those of older versions get the digest the fast reader needs, for the next time
        found = listing.entries(config.home() / "manifests")
        if found is None:
            store = _store()
            rows = [(m.name, m.id, m.size, m.modified_at, m.remote is not None)
                    for m in store.list()]
            store.store_digests()
        else:
            rows = [(m.name, m.id, m.size, m.modified_at, m.remote) for m in found]
        print_table(("NAME", "ID", "SIZE", "MODIFIED"),
                    [(name, mid, "remote" if remote else human_size(size), _ago(when))
                     for name, mid, size, when, remote in rows])

    app.command(name="ls", help="Alias of list.")(list_)

    @app.command()
    def rm(names: list[str] = typer.Argument(..., help="Models to remove")) -> None:
        """Remove models (and their files, when no other model uses them). A running
        daemon removes them itself, so that it unloads them too (as `ollama rm` does)."""
        from llmrun.client import Client, ClientError
        from llmrun.store import InvalidName, ModelNotFound

        client = Client()
        daemon = client.probe() == "llmrun"
        store = None if daemon else _store()
        for name in names:
            try:
                if store is None:
                    client.delete(name)
                else:
                    store.remove(name)
            except (ModelNotFound, InvalidName, ClientError) as exc:
                fail(str(exc))
            console.print(f"deleted '{name}'")

    @app.command()
    def cp(source: str, destination: str) -> None:
        """Copy a model under a new name (no file is duplicated)."""
        from llmrun.store import InvalidName, StoreError

        try:
            _store().copy(source, destination)
        except (StoreError, InvalidName) as exc:
            fail(str(exc))
        console.print(f"copied '{source}' to '{destination}'")

    @app.command()
    def create(
        name: str = typer.Argument(..., help="Name of the new model"),
        file: Path = typer.Option(Path("Modelfile"), "--file", "-f", help="Modelfile path"),
        quantize: str = typer.Option(None, "--quantize", "-q",
                                     help="Quantize an F16/BF16/F32 model, e.g. Q4_K_M"),
    ) -> None:
        """Create a model from a Modelfile (FROM a GGUF file or another model)."""
        from llmrun.store import CreateError, InvalidName, StoreError

        try:
            text = file.read_text()
        except OSError as exc:
            fail(f"cannot read {file}: {exc.strerror}")
        client = Client()
        if client.probe() == "llmrun" and not _split(text) and not _remote_here(text, client):
            # as Ollama's client does: local files go up as blobs, the daemon creates the
            # model (over HTTP it reads no path of its own; it may be on another machine)
            try:
                body = _upload_files(client, text, file.resolve().parent)
                if quantize:
                    body["quantize"] = quantize
                for event in client.create({"model": name, **body}):
                    console.print(f"[dim]{event.get('status', '')}[/]", highlight=False)
            except (CreateError, ClientError, OSError) as exc:
                fail(str(exc))
            console.print(f"created {name}")
            return
        try:
            with _progress() as progress:
                manifest = _store().create(name, text, file.resolve().parent, _Bar(progress),
                                          quantize=quantize)
        except (CreateError, StoreError, InvalidName) as exc:
            fail(str(exc))
        console.print(f"created {manifest.name} (id {manifest.id})")

    @app.command()
    def show(
        name: str,
        modelfile: bool = typer.Option(False, "--modelfile", help="Print as a Modelfile"),
        template: bool = typer.Option(False, "--template", help="Print the chat template"),
        parameters: bool = typer.Option(False, "--parameters", help="Print the parameters"),
        system: bool = typer.Option(False, "--system", help="Print the system prompt"),
        license_: bool = typer.Option(False, "--license", help="Print the license"),
        as_json: bool = typer.Option(False, "--json", help="Everything, as JSON"),
    ) -> None:
        """Show a model's details, parameters, template and system prompt."""
        from rich.table import Table

        from llmrun.store import StoreError
        from llmrun.store.gguf import GGUFError
        from llmrun.store.quantspeed import cpu_class, decode_note
        from llmrun.store.store import human_params

        store = _store()
        try:
            _, m = store.get(name)
            info = store.model_info(m)
            capabilities = store.capabilities(m, info)
            projector = store.projector_info(m)
        except (StoreError, GGUFError) as exc:
            fail(str(exc))
        if as_json:
            out = {"name": m.name, "id": m.id, "size": m.size, "source": m.source,
                   "details": m.details.model_dump(), "parameters": m.parameters,
                   "template": m.template, "system": m.system, "license": m.license,
                   "capabilities": capabilities, "model_info": info}
            if projector is not None:
                out["projector_info"] = projector
            console.print_json(json.dumps(out, default=str))
            return
        sections = [
            (modelfile, lambda: store.modelfile_of(m).render()),
            (template, lambda: store.template_of(m)),
            (parameters, lambda: "\n".join(f"{k} {v}" for k, v in m.parameters.items())),
            (system, lambda: m.system or ""),
            (license_, lambda: "\n".join(m.license)),
        ]
        for wanted, render in sections:
            if wanted:  # never wrapped: a long blob path must stay on its FROM line
                console.print(render(), markup=False, soft_wrap=True)
                return
        arch = m.details.family
        d = m.details
        table = Table(box=None, show_header=False, pad_edge=False)
        rows = (("architecture", arch), ("parameters", d.parameter_size),
                ("quantization", d.quantization_level),
                ("decode speed", decode_note(d.quantization_level, cpu_class())
                 if d.quantization_level else None),
                ("context length", d.context_length),
                ("embedding length", info.get(f"{arch}.embedding_length")),
                ("size", human_size(m.size)), ("id", m.id), ("source", m.source))
        for key, value in rows:
            if value not in (None, ""):
                table.add_row(f"  {key}", str(value))
        console.print("[bold]Model[/]")
        console.print(table)
        if projector is not None:
            console.print("[bold]Projector[/]")
            table = Table(box=None, show_header=False, pad_edge=False)
            count = projector.get("general.parameter_count")
            for key, value in (("architecture", projector.get("general.architecture")),
                               ("parameters", human_params(count)
                                if isinstance(count, int) else None),
                               ("size", human_size(m.projector.size) if m.projector else None)):
                if value not in (None, ""):
                    table.add_row(f"  {key}", str(value))
            console.print(table)
        console.print("[bold]Capabilities[/]")
        for capability in capabilities:
            console.print(f"  {capability}", markup=False)
        if m.parameters:
            console.print("[bold]Parameters[/]")
            for k, v in m.parameters.items():
                console.print(f"  {k:<16} {v}", markup=False)
        if m.system:
            console.print("[bold]System[/]")
            console.print(f"  {m.system}", markup=False)
        if m.license:
            console.print("[bold]License[/]")
            console.print(f"  {m.license[0].splitlines()[0]}", markup=False)
