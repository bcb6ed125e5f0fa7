"""`mlxlocal quantize` and `mlxlocal perplexity` (added to the main app by `register`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NoReturn, Optional

import typer
from rich.console import Console
from rich.markup import escape

from mlxlocal.errors import MlxLocalError

err = Console(stderr=True, soft_wrap=True)
MODEL_HELP = "Local HF-layout directory, catalog alias, Hugging Face repo id, or synthetic:NAME"


def _fail(message: str) -> NoReturn:
    err.print("[bold red]error:[/] " + escape(message), highlight=False)
    raise typer.Exit(1)


def _progress():
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
    )

    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=err, transient=True)


def _read_text(path: Optional[Path]) -> Optional[str]:
    if path is None:
        return None
    try:
        return path.read_text(encoding="utf-8")
    except OSError as e:
        _fail(f"cannot read {path}: {e.strerror}")


def quantize_cmd(
    model: str = typer.Option(..., "--model", "-m", help=MODEL_HELP),
    out: Path = typer.Option(..., "--out", "-o", help="Output directory (MLX checkpoint, mlx-lm compatible)"),
    mode: str = typer.Option("affine", "--mode", help="affine | mxfp4 | nvfp4 | mxfp8"),
    bits: Optional[int] = typer.Option(None, "--bits", help="affine: 2,3,4,5,6,8 (default 4); fixed for fp modes"),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="affine: 32,64,128 (default 64)"),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="mixed-4-6: 4-bit with sensitive tensors at 6"),
    method: str = typer.Option("rtn", "--method", help="rtn (round to nearest) | awq (activation-aware)"),
    calib_file: Optional[Path] = typer.Option(None, "--calib-file", help="Calibration text for awq (default: built in)"),
    calib_seq_len: int = typer.Option(256, "--calib-seq-len", help="Tokens per calibration sample"),
    calib_samples: int = typer.Option(32, "--calib-samples", help="Calibration samples the quantizer sees"),
    awq_grid: int = typer.Option(20, "--awq-grid", help="Scale / clip search grid size for awq"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object"),
) -> None:
    """Quantize a model into an MLX checkpoint."""
    from mlxlocal.quant.quantize import quantize

    text = _read_text(calib_file)
    steps = ["load", "quantize", "save"]
    try:
        with _progress() as prog:
            task = prog.add_task("quantize", total=len(steps))

            def step(name: str) -> None:
                prog.update(task, completed=steps.index(name), description=name)

            res = quantize(model, out, mode=mode, bits=bits, group_size=group_size, recipe=recipe, method=method,
                           calib_text=text, calib_seq_len=calib_seq_len, calib_samples=calib_samples,
                           n_grid=awq_grid, progress=step)
            prog.update(task, completed=len(steps))
    except MlxLocalError as e:
        _fail(str(e))
    summary = {
        "out": str(res.out), "mode": res.mode, "bits": res.bits, "group_size": res.group_size,
        "recipe": res.recipe, "method": res.method, "size_bytes": res.size_bytes,
        "bits_per_weight": round(res.bits_per_weight, 3), "overrides": res.overrides, "notes": res.notes,
    }
    if as_json:
        typer.echo(json.dumps(summary))
        return
    for note in res.notes:
        err.print("[yellow]note:[/] " + escape(note), highlight=False)
    desc = f"{res.mode} {res.bits}-bit g{res.group_size}" + (f", {res.recipe}" if res.recipe else "")
    typer.echo(f"wrote {res.out} ({desc}, method {res.method}): {res.size_bytes / 2**20:.2f} MiB, "
               f"{res.bits_per_weight:.2f} bits/weight, {res.overrides} per-layer overrides")


def perplexity_cmd(
    model: str = typer.Option(..., "--model", "-m", help=MODEL_HELP),
    file: Optional[Path] = typer.Option(None, "--file", "-f", help="Text file (default: a built-in English text)"),
    seq_len: int = typer.Option(512, "--seq-len", help="Window length; windows do not overlap"),
    batch_size: int = typer.Option(8, "--batch-size", help="Windows per forward pass"),
    kv_bits: Optional[int] = typer.Option(None, "--kv-bits", help="Score with the K/V quantized to 8 or 4 bits "
                                          "as the engine's paged pools store them (--kv-bits of generate/serve)"),
    kv_group_size: int = typer.Option(64, "--kv-group-size", help="With --kv-bits: elements per scale and bias"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object"),
) -> None:
    """Perplexity of a model on a text (mlx-lm's chunking: non-overlapping windows)."""
    from mlxlocal.cli.common import kv_precision
    from mlxlocal.quant.quantize import perplexity
    from mlxlocal.quant.text import BUILTIN_TEXT
    from mlxlocal.source.loader import load

    kv = kv_precision(kv_bits, kv_group_size)  # exits 2 naming the option
    text = _read_text(file) or BUILTIN_TEXT
    try:
        loaded = load(model, tp=1)  # runs the model directly: whole, on this rank
        with _progress() as prog:
            task = prog.add_task("perplexity", total=None)
            res = perplexity(loaded, text, seq_len=seq_len, batch_size=batch_size,
                             on_batch=lambda i, n: prog.update(task, completed=i, total=n), **kv)
    except MlxLocalError as e:
        _fail(str(e))
    if as_json:
        typer.echo(json.dumps({"perplexity": res.ppl, "nll": res.nll, "tokens": res.tokens,
                               "windows": res.windows, "seq_len": res.seq_len, "kv_bits": kv_bits,
                               "kv_group_size": kv_group_size if kv_bits else None}))
    else:
        kv_note = f", K/V {kv_bits}-bit group {kv_group_size}" if kv_bits else ""
        typer.echo(f"perplexity {res.ppl:.4f} (mean NLL {res.nll:.4f} over {res.tokens} tokens, "
                   f"{res.windows} windows of {res.seq_len}{kv_note})")


def register(app: typer.Typer) -> None:
    """Add `quantize` and `perplexity` to the main Typer app."""
    app.command("quantize")(quantize_cmd)
    app.command("perplexity")(perplexity_cmd)
