"""Model commands: `show` (load and describe), `pull`, `list`, `rm` (the HF cache).

The package calls `register(app)`; pull / list / rm print errors from mlxlocal.errors as
one red line on stderr and exit with code 1.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, Optional, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from mlxlocal.cli.common import MODEL_HELP, fail, human_bytes, human_count
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
    from mlxlocal.source import hub

    resolved = hub.pull(model)
    label = resolved.repo or resolved.name
    _console().print("[green]ready[/green] " + escape(f"{label} -> {resolved.path}"))


def list_models(
    catalog: bool = typer.Option(False, "--catalog", help="Show catalog aliases and presets."),
) -> None:
    """List downloaded models (and, with --catalog, what can be pulled or built)."""
    from mlxlocal.source import hub, synthetic
    from mlxlocal.source.catalog import load_catalog

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
    from mlxlocal.source import hub

    if not yes and not typer.confirm(f"Delete {model} from the cache?", default=False):
        _fail("aborted, nothing deleted")
    freed = hub.remove(model)
    _console().print(f"deleted {model}, freed {human_size(freed)}", markup=False)


def show(model: str = typer.Argument(..., help=MODEL_HELP),
         tp: Optional[int] = typer.Option(None, "--tp", help="Also print how N tensor-parallel ranks would "
                                          "split it (launch-cluster -n N): heads and bytes per rank"),
         pp: Optional[int] = typer.Option(None, "--pp", help="Also print how N pipeline stages would split it "
                                          "(launch-cluster -n N --pp): layers and bytes per rank")) -> None:
    """Load a model and print its architecture, size, quantization and how it was loaded."""
    from mlxlocal.engine import engine_kind, kv_bytes_per_token
    from mlxlocal.source.loader import load

    for option, n in (("--tp", tp), ("--pp", pp)):
        if n is not None and n < 1:
            fail(f"{option} must be at least 1 (got {n})", 2)
    try:
        loaded = load(model, tp=1, pp=1)
        plan = (tp_rows(loaded, tp) if tp and tp > 1 else []) + (pp_rows(loaded, pp) if pp and pp > 1 else [])
    except MlxLocalError as e:
        fail(str(e))
    info, cfg = loaded.info, loaded.model_config
    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold cyan")
    table.add_column()
    rows = [
        ("model", info.name),
        ("source", f"{info.source}: {info.path}"),
        ("architecture", f"{info.model_type} ({'native mlxlocal' if info.native else 'mlx-lm compatibility path'})"),
        ("engine", engine_kind(loaded)),
        *kv_rows(kv_bytes_per_token(loaded)),
        ("parameters", f"{human_count(info.n_params)} ({info.n_params:,})"),
        ("quantization", info.quantization),
        ("dtype", info.dtype),
        ("context length", f"{info.context_length:,}"),
    ]
    if cfg is not None:
        rows += [
            ("layers", str(cfg.num_hidden_layers)),
            ("hidden / intermediate", f"{cfg.hidden_size} / {cfg.intermediate_size}"),
            ("heads (q / kv) x dim", f"{cfg.num_attention_heads} / {cfg.num_key_value_heads} x {cfg.head_dim}"),
            ("vocab", f"{cfg.vocab_size:,}"),
            ("rope", f"theta {cfg.rope_theta:g}" + (f", {cfg.rope_scaling['rope_type']} x{cfg.rope_scaling.get('factor')}" if cfg.rope_scaling else "")),
            ("tied embeddings", str(cfg.tie_word_embeddings).lower()),
        ]
        if cfg.sliding_window:
            rows.append(("sliding window", f"{cfg.sliding_window} ({cfg.layer_types.count('sliding_attention')} layers)"))
    for name, size in info.weights.files:
        rows.append(("file", f"{name}  {human_bytes(size)}"))
    rows += [
        ("weights", f"{human_bytes(info.weights.total_bytes)} in {len(info.weights.files)} file(s), {info.weights.n_tensors} tensors"),
        ("loaded by", info.weights.load_path),
        ("load time", f"{info.load_seconds:.2f} s"),
    ]
    rows += [("note", note) for note in info.notes]
    rows += kv_store_rows(info.path)
    rows += plan
    for row in rows:
        table.add_row(*row)
    Console().print(table)
    print_kernel_paths(loaded)


def kv_store_rows(model_path) -> list[tuple[str, str]]:
    """The disk tier's stores of this model (--kv-disk, under $MLXLOCAL_HOME/kv): one row each
    (its KV precision and block size make a store of their own)."""
    from mlxlocal.cache.disk import default_kv_dir
    from mlxlocal.cache.disk.store import stores
    from mlxlocal.cli.cache import precision

    return [("KV on disk", f"{s['blocks']} blocks, {human_bytes(s['bytes'])} ({precision(m)}, block "
             f"{m.get('block_size', '?')}): store {s['digest'][:12]}, mlxlocal cache show")
            for s in stores(default_kv_dir()) if (m := s["manifest"]).get("path") == str(model_path)]


def print_kernel_paths(loaded) -> None:
    """Which path each decode op takes at the default engine settings (warm-up: on a Mac the
    kernels are compiled and, under auto, unknown shapes measured now)."""
    from mlxlocal.bench.report import kernel_lines, kernel_table
    from mlxlocal.engine import EngineConfig, kernel_plan, kernel_status

    cfg = EngineConfig()
    k = dict(kernel_status(), plan=kernel_plan(loaded, cfg))
    console = Console(highlight=False, soft_wrap=True)
    for line in kernel_lines(k):
        console.print(line)
    t = kernel_table(k, f"decode ops (decode rows 1..{cfg.max_num_seqs}, block size {cfg.block_size}): "
                        "path per op and shape")
    console.print(t if t is not None else "kernels: none of mlxlocal's dispatch points (mlx-lm's model code)")


def _native_only(loaded, option: str) -> None:
    from mlxlocal.errors import ModelLoadError

    if loaded.model_config is None:
        raise ModelLoadError(f"{option}: {loaded.info.name} runs through mlx-lm's model code: the plan is printed "
                             "for the native families (llama, mistral, qwen2, qwen3); an mlx-lm model with shard() "
                             "is split by mlx-lm's own rules under launch-cluster -n N")


def tp_rows(loaded, n: int) -> list[tuple[str, str]]:
    """`show --tp N`: what each rank holds (the plan the ranks load by) and its weight bytes."""
    from mlxlocal.distributed import shard_report

    _native_only(loaded, "--tp")
    total = sum(r["weight_bytes"] for r in shard_report(loaded.model, loaded.model_config, 1))
    rows = [("tensor parallel", f"{n} ranks: q/k/v and gate/up split by rows, o and down by columns (one "
             "all_sum each per layer); embeddings, norms and head on every rank")]
    for r in shard_report(loaded.model, loaded.model_config, n):
        rows.append((f"  rank {r['rank']}", f"q heads {r['q_heads'][0]}..{r['q_heads'][1] - 1}, kv heads "
                     f"{r['kv_heads'][0]}..{r['kv_heads'][1] - 1}, mlp columns {r['mlp'][0]}..{r['mlp'][1] - 1}; "
                     f"weights {human_bytes(r['weight_bytes'])} ({r['weight_bytes'] / total:.0%} of "
                     f"{human_bytes(total)})"))
    return rows


def pp_rows(loaded, n: int) -> list[tuple[str, str]]:
    """`show --pp N`: each stage's layers (rank 0 also the embeddings and the head) and bytes."""
    from mlxlocal.distributed import stage_report

    _native_only(loaded, "--pp")
    rows = stage_report(loaded.model, loaded.model_config, n)
    total = rows[0]["total_bytes"]
    out = [("pipeline parallel", f"{n} stages: a range of layers each, hidden states rank to rank around the ring")]
    for r in rows:
        ends = " + embeddings, final norm, head" if r["ends"] else ""
        out.append((f"  rank {r['rank']}", f"layers {r['layers'][0]}..{r['layers'][1] - 1}{ends}; weights "
                    f"{human_bytes(r['weight_bytes'])} ({r['weight_bytes'] / total:.0%} of {human_bytes(total)})"))
    return out


def kv_rows(per_token: dict | None) -> list[tuple[str, str]]:
    """`show`'s KV-cache row: bytes per token at the model dtype and with --kv-bits 8 / 4."""
    if per_token is None:
        return []
    parts = [f"{label} {human_bytes(n)}" if isinstance(n, int) else f"{label}: not with this model"
             for label, n in per_token.items()]
    return [("KV per token", " · ".join(parts) + " (--kv-bits 8 / 4 quantize it, group 64)")]


def register(app: typer.Typer) -> None:
    """Add `show`, `pull`, `list` and `rm` to the main Typer app."""
    app.command()(show)  # catches its own errors (fail), like generate
    app.command("pull")(_handle_errors(pull))
    app.command("list")(_handle_errors(list_models))
    app.command("rm")(_handle_errors(rm))
