"""`mlxlocal cache ls / show / rm / clear`: the disk tier's KV stores (serve --kv-disk).

One store per model fingerprint (weights, dtype, KV precision, rope, block size, tokenizer)
under $MLXLOCAL_HOME/kv or --dir; each holds one checksummed file per KV block.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer

from mlxlocal.cli.common import fail, human_bytes

cache_app = typer.Typer(help="The disk tier's KV block stores (--kv-disk): list, inspect, remove.",
                        no_args_is_help=True)
DIR_HELP = "Where the stores are (default: $MLXLOCAL_HOME/kv, as --kv-disk-dir)"


def _root(dir: Optional[Path]) -> Path:
    from mlxlocal.cache.disk import default_kv_dir

    return dir if dir is not None else default_kv_dir()


def _match(root: Path, store: str) -> dict:
    """The one store whose digest starts with `store` (or whose model is named `store`)."""
    from mlxlocal.cache.disk.store import stores

    found = stores(root)
    model = lambda s: str(s["manifest"].get("model", ""))  # noqa: E731
    hits = ([s for s in found if s["digest"].startswith(store)]
            or [s for s in found if store in (model(s), s["manifest"].get("path"))]
            or [s for s in found if model(s).startswith(store + ":")])  # synthetic:tiny:fp32
    if not hits:
        fail(f"no KV store {store!r} under {root} ({len(found)} there: mlxlocal cache ls)", 1)
    if len(hits) > 1:
        fail(f"{store!r} names {len(hits)} stores under {root}: give more of the digest "
             f"({', '.join(s['digest'][:12] for s in hits)})", 1)
    return hits[0]


def _ago(t: float) -> str:
    if not t:
        return "never"
    s = max(0.0, time.time() - t)
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= n:
            return f"{s / n:.0f} {unit} ago"
    return f"{s:.0f} s ago"


def precision(m: dict) -> str:
    """A store's KV precision, from its manifest."""
    bits = m.get("kv_bits")
    return f"{bits}-bit (group {m.get('kv_group_size')})" if bits else str(m.get("dtype", "?"))


@cache_app.command("ls")
def ls(dir: Optional[Path] = typer.Option(None, "--dir", help=DIR_HELP)) -> None:
    """One line per store: digest, model, KV precision, block size, blocks, size, last use."""
    from rich.console import Console
    from rich.table import Table

    from mlxlocal.cache.disk.store import stores

    root = _root(dir)
    found = stores(root)
    if not found:
        typer.echo(f"no KV stores under {root}")
        return
    table = Table(title=f"KV stores under {root}")
    for col in ("store", "model", "KV", "block", "blocks", "size", "last used"):
        table.add_column(col, justify="right" if col in ("block", "blocks", "size") else "left")
    for s in found:
        m = s["manifest"]
        table.add_row(s["digest"][:12], str(m.get("model", "?")), precision(m), str(m.get("block_size", "?")),
                      str(s["blocks"]), human_bytes(s["bytes"]), _ago(s["last_used"]))
    Console().print(table)
    typer.echo(f"total {human_bytes(sum(s['bytes'] for s in found))} in {len(found)} store(s)")


@cache_app.command("show")
def show(store: str = typer.Argument(..., help="A store's digest (or its start), or its model's name or path"),
         dir: Optional[Path] = typer.Option(None, "--dir", help=DIR_HELP)) -> None:
    """Everything a store's manifest records (its fingerprint), and what it holds."""
    s = _match(_root(dir), store)
    m = s["manifest"]
    rows = [("store", s["digest"]), ("directory", s["dir"]), ("model", m.get("model", "?")),
            ("model path", m.get("path", "?")), ("model type", m.get("model_type", "?")),
            ("KV precision", precision(m)), ("block size", m.get("block_size", "?")),
            ("blocks", f"{s['blocks']} in {s['files']} file(s)"), ("size", human_bytes(s["bytes"])), ("last used", _ago(s["last_used"])),
            ("weights digest", m.get("weights", "?")), ("tokenizer digest", m.get("tokenizer", "?")),
            ("rope", m.get("rope", "?"))]
    for k, v in rows:
        typer.echo(f"{k:>17}  {v}")


@cache_app.command("rm")
def rm(store: str = typer.Argument(..., help="A store's digest (or its start), or its model's name or path"),
       dir: Optional[Path] = typer.Option(None, "--dir", help=DIR_HELP)) -> None:
    """Remove one store (a server still using it starts it over, empty)."""
    from mlxlocal.cache.disk.store import remove_store

    s = _match(_root(dir), store)
    freed = remove_store(s["dir"])
    typer.echo(f"removed KV store {s['digest'][:12]} ({s['manifest'].get('model', '?')}): {human_bytes(freed)} freed")


@cache_app.command("clear")
def clear(dir: Optional[Path] = typer.Option(None, "--dir", help=DIR_HELP),
          yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask")) -> None:
    """Remove every store under the directory."""
    from mlxlocal.cache.disk.store import remove_store, stores

    root = _root(dir)
    found = stores(root)
    if not found:
        typer.echo(f"no KV stores under {root}")
        return
    total = sum(s["bytes"] for s in found)
    if not yes and not typer.confirm(f"remove {len(found)} KV store(s), {human_bytes(total)}, under {root}?"):
        raise typer.Exit(1)
    freed = sum(remove_store(s["dir"]) for s in found)
    typer.echo(f"removed {len(found)} KV store(s): {human_bytes(freed)} freed")


def register(app: typer.Typer) -> None:
    app.add_typer(cache_app, name="cache")
