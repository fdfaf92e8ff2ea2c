"""`transcribe MODEL FILE`: a sound file's transcript (or English translation), printed as
text or as subtitles (`--format srt|vtt`), by a model whose projector hears."""

from __future__ import annotations

from pathlib import Path

import typer

from llmrun.cli._common import connect, fail
from llmrun.client import ClientError

FORMATS = ("text", "srt", "vtt", "json", "verbose_json")


def register(app: typer.Typer) -> None:
    @app.command()
    def transcribe(
        model: str = typer.Argument(..., help="A model whose projector hears (show lists audio)"),
        file: Path = typer.Argument(..., exists=True, dir_okay=False, readable=True,
                                    help="The sound file (WAV or MP3)"),
        fmt: str = typer.Option("text", "--format", "-f",
                                help="text, srt, vtt, json or verbose_json"),
        language: str | None = typer.Option(None, "--language", "-l",
                                            help="The speech's language (ISO-639-1: en, fr)"),
        prompt: str | None = typer.Option(None, "--prompt",
                                          help="Context or spellings the transcript follows"),
        translate: bool = typer.Option(False, "--translate",
                                       help="Translate the speech into English instead"),
    ) -> None:
        """Transcribe a sound file (OpenAI's /v1/audio/transcriptions)."""
        if fmt not in FORMATS:
            fail(f"--format must be one of {', '.join(FORMATS)}")
        client = connect()
        try:
            out = client.transcribe(model, file.name, file.read_bytes(), fmt, language, prompt,
                                    translate)
        except ClientError as exc:
            fail(str(exc))
        typer.echo(out, nl=not out.endswith("\n"))
