"""The `llmrun` command. One module per command group; this file only assembles them."""

from __future__ import annotations

import os

import typer

from llmrun import __version__
from llmrun.cli import audio, bench, daemon, launch, models, retrieval, run, serve

app = typer.Typer(
    name="llmrun",
    help="Run local GGUF models behind Ollama, OpenAI and Anthropic compatible APIs.",
    no_args_is_help=True,
    add_completion=True,  # --install-completion, --show-completion (bash, zsh, fish)
    context_settings={"help_option_names": ["-h", "--help"]},
    # plain help, as Ollama's: rendering it through rich took 0.15 s of every `--help`
    rich_markup_mode=None,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"llmrun {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", "-v", callback=_version, is_eager=True,
                                 help="Print the version and exit."),
) -> None:
    pass


serve.register(app)
serve.register_rpc_worker(app)
run.register(app)
models.register(app)
daemon.register(app)
launch.register(app)
bench.register(app)
retrieval.register(app)
audio.register(app)


def main() -> None:
    # Everything llmrun writes (store, logs, pid and lock files, the daemon's and the runners'
    # files, which inherit this) is the user's alone: files 0600, directories 0700.
    os.umask(0o077)
    app()
