"""Retrieval commands: `rerank MODEL QUERY DOC...` (a ranked table) and `embed MODEL
TEXT...` (one vector per text, a JSON array a line)."""

from __future__ import annotations

import json
import shutil

import typer

from llmrun.cli._common import connect, fail, print_table
from llmrun.client import ClientError


def _one_line(text: str, width: int) -> str:
    """A document on one table line: its whitespace folded, cut to `width` characters."""
    flat = " ".join(text.split())
    return flat if len(flat) <= width else flat[: max(width - 3, 1)] + "..."


def register(app: typer.Typer) -> None:
    @app.command()
    def rerank(
        model: str = typer.Argument(..., help="A reranker (a Modelfile with PARAMETER rerank)"),
        query: str = typer.Argument(..., help="What the documents are ranked against"),
        documents: list[str] = typer.Argument(..., help="The documents to rank"),
        top_n: int | None = typer.Option(None, "--top-n", "-n", min=1,
                                         help="Show only the best N"),
    ) -> None:
        """Rank documents by their relevance to a query, most relevant first."""
        client = connect()
        try:
            answer = client.rerank(model, query, documents, top_n)
        except ClientError as exc:
            fail(str(exc))
        # RANK, SCORE and INDEX take about 20 columns; the document gets the rest
        width = max(shutil.get_terminal_size((100, 24)).columns - 24, 20)
        print_table(("RANK", "SCORE", "INDEX", "DOCUMENT"),
                    [(str(rank), f"{r['relevance_score']:.4f}", str(r["index"]),
                      _one_line(r.get("document", {}).get("text", ""), width))
                     for rank, r in enumerate(answer["results"], 1)])

    @app.command()
    def embed(
        model: str = typer.Argument(..., help="An embedding model (or any model that embeds)"),
        texts: list[str] = typer.Argument(..., help="The texts to embed"),
        dimensions: int | None = typer.Option(
            None, "--dimensions", "-d", min=1,
            help="Keep the first N dimensions (renormalised; Matryoshka models)"),
    ) -> None:
        """Embed texts: one JSON array of floats per line, in the texts' order (JSON lines,
        for `jq` or a script)."""
        client = connect()
        try:
            vectors = client.embed(model, texts, dimensions)
        except ClientError as exc:
            fail(str(exc))
        for vector in vectors:
            typer.echo(json.dumps(vector))
