"""`mlxlocal convert`: a GGUF file -> an MLX checkpoint directory.

The package calls `register(app)`. The output (config.json with per-layer quantization,
model.safetensors, tokenizer files with the chat template) loads in mlxlocal and mlx-lm.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.markup import escape

from mlxlocal.cli.models import _console, _handle_errors, human_size
from mlxlocal.errors import ModelLoadError


def convert(
    model: str = typer.Option(..., "--model", "-m", help="A .gguf file (or a directory holding exactly one)."),
    out: Path = typer.Option(..., "--out", "-o", help="Directory to write the MLX checkpoint into."),
    as_json: bool = typer.Option(False, "--json", help="Print the summary as one JSON object."),
) -> None:
    """Convert a llama-family GGUF checkpoint (F32/F16/BF16, Q8_0, Q4_0/1, Q5_0/1, k-quants)
    into an MLX checkpoint."""
    from mlxlocal.source import hub
    from mlxlocal.weights.gguf import convert as convert_gguf

    resolved = hub.resolve(model)
    if not resolved.path.is_file():
        raise ModelLoadError(f"{model}: `convert` needs a .gguf file (or a directory holding exactly one)")
    if out.exists() and (not out.is_dir() or (out / "config.json").exists() and
                         out.resolve() == resolved.path.parent.resolve()):
        raise ModelLoadError(f"{out}: not a usable output directory")
    summary = convert_gguf(resolved.path, out)
    if as_json:
        typer.echo(json.dumps(summary))
        return
    console = _console()
    console.print("[green]converted[/green] " + escape(f"{resolved.path.name} -> {out}"))
    console.print(f"  {summary['load_path']}", markup=False)
    console.print(f"  {human_size(summary['gguf_bytes'])} GGUF -> {human_size(summary['mlx_bytes'])} MLX")


def register(app: typer.Typer) -> None:
    """Add `convert` to the main Typer app."""
    app.command("convert")(_handle_errors(convert))
