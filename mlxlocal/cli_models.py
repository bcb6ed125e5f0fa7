"""Model management commands: `pull`, `list`, `rm`.

`cli.py` calls `register(app)`; each command prints errors from mlxlocal.errors as one
red line on stderr and exits with code 1.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table
from rich.text import Text

from mlxlocal import hub, synthetic
from mlxlocal.catalog import load_catalog
from mlxlocal.errors import MlxLocalError

F = TypeVar("F", bound=Callable[..., Any])


def _console() -> Console:
    # Created per call so CliRunner's captured stdout is honoured.
    return Console(highlight=False, soft_wrap=True)


def _fail(message: str) -> None:
    Console(stderr=True, highlight=False, soft_wrap=True).print(
        Text(f"error: {message}", style="red")
    )
    raise typer.Exit(1)


def _handle_errors(func: F) -> F:
    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return func(*args, **kwargs)
        except MlxLocalError as e:
            _fail(str(e))

    return wrapper  # type: ignore[return-value]


def human_size(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def _ago(ts: float) -> str:
    seconds = max(0.0, time.time() - ts)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{int(seconds // size)}{unit} ago"
    return "just now"


def pull(
    model: str = typer.Argument(..., help="Alias, owner/name[@revision], or synthetic:NAME"),
) -> None:
    """Download a model into the Hugging Face cache (or build a synthetic one)."""
    resolved = hub.pull(model)
    label = resolved.repo or resolved.name
    _console().print(f"[green]ready[/green] {label} -> {resolved.path}")


def list_models(
    catalog: bool = typer.Option(False, "--catalog", help="Show catalog aliases and presets."),
) -> None:
    """List downloaded models (and, with --catalog, what can be pulled or built)."""
    console = _console()
    cat = load_catalog()
    table = Table(title="Downloaded models", title_justify="left")
    for col in ("name", "repo", "size", "modified"):
        table.add_column(col, justify="right" if col == "size" else "left", no_wrap=True)
    for m in hub.list_cached():
        alias = cat.alias_for_repo(m.repo_id)
        note = "" if m.has_config else " (no config.json)"
        table.add_row(alias.name if alias else m.repo_id, m.repo_id + note,
                      human_size(m.size_bytes), _ago(m.last_modified))
    for s in synthetic.list_materialized():
        table.add_row(s.spec, "(synthetic)", human_size(s.size_bytes), _ago(s.last_modified))
    if table.row_count:
        console.print(table)
    else:
        console.print(f"No models downloaded yet (cache: {hub.hub_cache_dir()}). "
                      "Try `mlxlocal pull qwen3-0.6b` or `mlxlocal list --catalog`.")
    if not catalog:
        return
    # Names a user types are folded, never cut; narrow terminals drop the description.
    wide = console.width >= 120
    aliases = Table(title="Catalog aliases", title_justify="left")
    aliases.add_column("alias", overflow="fold")
    aliases.add_column("repo", overflow="fold")
    aliases.add_column("model", no_wrap=True)
    aliases.add_column("context", no_wrap=True, justify="right")
    if wide:
        aliases.add_column("description", ratio=1)
    for a in cat.aliases.values():
        row = [a.name, a.repo, f"{a.params} {a.quant}", f"{a.context // 1024}k"]
        aliases.add_row(*row, *([a.description] if wide else []))
    console.print(aliases)
    presets = Table(title="Synthetic presets (--model synthetic:NAME[:q4|q8][:seed=N])",
                    title_justify="left")
    for col in ("name", "type", "hidden", "layers", "vocab"):
        presets.add_column(col, no_wrap=True)
    if wide:
        presets.add_column("description", ratio=1)
    for p in cat.synthetic.values():
        c = p.config
        row = [p.name, p.model_type, str(c["hidden_size"]), str(c["num_hidden_layers"]),
               str(c["vocab_size"])]
        presets.add_row(*row, *([p.description] if wide else []))
    console.print(presets)


def rm(
    model: str = typer.Argument(..., help="Alias, owner/name or synthetic:NAME to delete"),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
) -> None:
    """Delete a downloaded model from the cache."""
    if not yes and not typer.confirm(f"Delete {model} from the cache?", default=False):
        _fail("aborted, nothing deleted")
    freed = hub.remove(model)
    _console().print(f"deleted {model}, freed {human_size(freed)}")


def register(app: typer.Typer) -> None:
    """Add `pull`, `list` and `rm` to the main Typer app."""
    app.command("pull")(_handle_errors(pull))
    app.command("list")(_handle_errors(list_models))
    app.command("rm")(_handle_errors(rm))
