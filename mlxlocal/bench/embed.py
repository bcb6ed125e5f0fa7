"""`mlxlocal bench embed`: embedding throughput (texts/s, tokens/s) at several batch sizes.

The texts are a fixed, varied set (short queries to paragraphs), the same every run. With
sentence-transformers importable (it needs PyTorch, never a dependency of mlxlocal) the same
texts go through it in the same process, runs alternating, and the report gives ratios
ours ÷ sentence-transformers; without it the report says the comparison was skipped.
"""

from __future__ import annotations

import importlib.util
import statistics
import time
from typing import Any

from mlxlocal.embeddings import DEFAULT_EMBED_MODEL, open_embedder

_WORDS = ("search the files for a function that reads the configuration and returns the model name "
          "then send an email to the team about the failing build on the main branch with the logs "
          "attached and ask whether the weather in the city will allow the outdoor meeting tomorrow").split()


def bench_texts(n: int = 32) -> list[str]:
    """n texts of 4 to 63 words (a query to a tool description), deterministic."""
    out = []
    for i in range(n):
        length = 4 + (i * 37) % 60
        out.append(" ".join(_WORDS[(i * 7 + k * 3) % len(_WORDS)] for k in range(length)) + ".")
    return out


def _time(fn, repeats: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def _sentence_transformers(path) -> Any | None:
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("sentence_transformers") is None:
        return None
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu")


def run_embed_bench(model: str | None = None, batch_sizes: tuple[int, ...] = (1, 8, 32), n_texts: int = 32,
                    repeats: int = 3, warmup: int = 1) -> dict[str, Any]:
    engine = open_embedder(model or DEFAULT_EMBED_MODEL)
    texts = bench_texts(n_texts)
    try:
        tokens = sum(engine.embed_detailed(texts).tokens)  # also the first warm-up
        st = _sentence_transformers(engine.info.path)
        rows = []
        for b in batch_sizes:
            ours = _time(lambda b=b: engine.embed(texts, batch_size=b), repeats, warmup)
            row: dict[str, Any] = {"batch": b, "seconds": statistics.median(ours),
                                   "texts_per_s": n_texts / statistics.median(ours),
                                   "tokens_per_s": tokens / statistics.median(ours)}
            if st is not None:
                theirs = _time(lambda b=b: st.encode(texts, batch_size=b), repeats, warmup)
                row["st_texts_per_s"] = n_texts / statistics.median(theirs)
                row["ratio_vs_st"] = statistics.median(theirs) / statistics.median(ours)
            rows.append(row)
    finally:
        engine.shutdown()
    import mlx.core as mx

    return {
        "model": engine.info.name, "dim": engine.info.dim, "max_length": engine.info.max_length,
        "backend": "Metal" if mx.metal.is_available() else "CPU", "texts": n_texts, "tokens": tokens,
        "repeats": repeats, "results": rows,
        "compare": "sentence-transformers (same process, same texts)" if st is not None else
        "skipped: sentence-transformers / PyTorch not installed (not a dependency of mlxlocal)",
    }


def format_report(res: dict[str, Any]) -> str:
    lines = [f"embeddings: {res['model']} (dim {res['dim']}, max {res['max_length']} tokens) on {res['backend']}, "
             f"{res['texts']} texts / {res['tokens']} tokens, median of {res['repeats']}",
             f"{'batch':>6} {'texts/s':>10} {'tokens/s':>10}" + (
                 f" {'st texts/s':>11} {'ours÷st':>8}" if "ratio_vs_st" in res["results"][0] else "")]
    for r in res["results"]:
        line = f"{r['batch']:>6} {r['texts_per_s']:>10.1f} {r['tokens_per_s']:>10.0f}"
        if "ratio_vs_st" in r:
            line += f" {r['st_texts_per_s']:>11.1f} {r['ratio_vs_st']:>8.2f}"
        lines.append(line)
    lines.append(f"compare: {res['compare']}")
    return "\n".join(lines)
