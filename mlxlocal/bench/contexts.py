"""`bench contexts 4096,16384,32768`: decode and prefill at long context, ours vs mlx-lm.

One row per context C: a random prompt of C - g tokens, then g tokens (-g), so the last
decode step attends to C positions. Each context runs the speed section (local.speed_bench:
a fresh engine sized for it; with --compare mlx-lm, mlx-lm's generate_step in the same process,
runs alternating); the table has the medians of the runs. Warm-up runs only before the first
context (the programs are compiled by then; a long warm-up per context would double the run).
"""

from __future__ import annotations

from typing import Any

from mlxlocal.bench.common import log, median
from mlxlocal.errors import EngineOptionError

COLUMNS = ("prefill_tps", "decode_tps", "ttft_s", "peak_memory_bytes")


def parse_contexts(text: str) -> list[int]:
    """'4096,16k,32768' -> [4096, 16384, 32768]; ValueError naming the bad entry."""
    out = []
    for raw in text.split(","):
        item = raw.strip().lower()
        mult = 1024 if item.endswith("k") else 1
        try:
            value = int(item[:-1] if mult > 1 else item) * mult
        except ValueError:
            raise ValueError(f"--contexts: {raw.strip()!r} is not a token count") from None
        if value < 2:
            raise ValueError(f"--contexts: {value} is too short (at least 2 tokens)")
        out.append(value)
    if not out:
        raise ValueError("--contexts: no context given")
    return out


def contexts_bench(
    loaded,
    contexts: list[int],
    *,
    gen_tokens: int,
    repeats: int = 3,
    warmup: int = 1,
    compare: str | None = None,
    kv: dict | None = None,
) -> dict:
    from mlxlocal.bench.local import MlxLmRunner, speed_bench

    limit = loaded.info.context_length
    too_long = [c for c in contexts if c > limit]
    if too_long:
        raise EngineOptionError(
            f"--contexts {too_long[0]} is over the model's context of {limit} tokens"
        )
    short = [c for c in contexts if c <= gen_tokens]
    if short:
        raise EngineOptionError(f"--contexts {short[0]} leaves no prompt for -g {gen_tokens}")
    ref = None
    if compare == "mlx-lm":
        log(f"loading {loaded.info.path} with mlx_lm.load ...")
        ref = MlxLmRunner(str(loaded.info.path))
    rows: list[dict[str, Any]] = []
    for i, c in enumerate(contexts):
        log(f"context {c}: prompt {c - gen_tokens} + {gen_tokens} generated")
        s = speed_bench(
            loaded,
            prompt_tokens=c - gen_tokens,
            gen_tokens=gen_tokens,
            repeats=repeats,
            warmup=warmup if i == 0 else 0,
            compare=compare,
            kv=kv,
            ref=ref,
        )
        row: dict[str, Any] = dict(
            context=c,
            prompt_tokens=c - gen_tokens,
            gen_tokens=gen_tokens,
            order=s["order"],
            runs=s["runs"],
        )
        row.update({k: median([r[k] for r in s["runs"]]) for k in COLUMNS})
        if ref is not None:
            row["mlx_lm_runs"] = s["mlx_lm_runs"]
            theirs = {k: median([r[k] for r in s["mlx_lm_runs"]]) for k in COLUMNS}
            row.update({f"mlx_lm_{k}": v for k, v in theirs.items()})
            row["ratios"] = {k: row[k] / theirs[k] if theirs[k] else None for k in COLUMNS}
        rows.append(row)
    return dict(
        contexts=contexts, gen_tokens=gen_tokens, repeats=repeats, compare=compare, rows=rows
    )


def print_contexts(c: dict, con) -> None:
    """One row per context; with mlx-lm each cell is ours / theirs ×ratio (TTFT: in the JSON)."""
    from rich.table import Table

    from mlxlocal.bench.report import FORMATS

    both = c["compare"] == "mlx-lm"
    shown = ("prefill_tps", "decode_tps", "peak_memory_bytes")
    t = Table(
        title=f"long context: prompt of C - {c['gen_tokens']} tokens, then {c['gen_tokens']} "
        f"generated; medians of {c['repeats']} runs"
        + (", ours / mlx-lm ×ratio, alternating" if both else "")
    )
    t.add_column("context", justify="right")
    for key in shown:
        t.add_column(FORMATS[key][0], justify="right")
    for row in c["rows"]:
        cells = [f"{row['context']:,}"]
        for key in shown:
            fmt = FORMATS[key][1]
            cell = fmt(row[key])
            if both:
                ratio = row["ratios"][key]
                cell += f" / {fmt(row[f'mlx_lm_{key}'])} " + (
                    "-" if ratio is None else f"×{ratio:.2f}"
                )
            cells.append(cell)
        t.add_row(*cells)
    con.print(t)
