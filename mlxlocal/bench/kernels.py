"""`mlxlocal bench kernels`: mlxlocal's Metal kernels against MLX's own ops at real models' decode
shapes (the microbenchmark that was scripts/bench_kernels.py).

gemv_wide vs mx.matmul (fp16), qgemv_wide vs mx.quantized_matmul (4-bit, group 64), and
paged_attention vs mx.fast.scaled_dot_product_attention over K/V gathered from the same pools
(gather inside the timing: what the reference path does; and over pre-gathered contiguous K/V:
a dense cache's best case). GB/s = bytes of weights (or K/V) read per call / time per call.
Each timing runs a chain of calls over several weight copies (together larger than the GPU's
system-level cache, so weights really come from DRAM), after warm-up; the median of the repeats
is reported, ours and the baseline alternating. Ours is forced (whatever the dispatch would
choose); the timing itself is mlxlocal.metal.measure's, the one the chooser uses.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from mlxlocal.metal import measure

# hidden, intermediate, q heads, kv heads, head dim, vocab
MODELS = {
    "qwen3-0.6b": (1024, 3072, 16, 8, 128, 151936),
    "qwen3-4b": (2560, 9728, 32, 8, 128, 151936),
    "qwen3-8b": (4096, 12288, 32, 8, 128, 151936),
    "llama-3.2-1b": (2048, 8192, 32, 8, 64, 128256),
    "llama-3.2-3b": (3072, 8192, 24, 8, 128, 128256),
    "llama-3.1-8b": (4096, 14336, 32, 8, 128, 128256),
}
SECTIONS = ("dense", "quant", "attention")
BLOCK_SIZE = 16
QBITS, QGROUP = 4, 64
DTYPE = "float16"


def projections(model: str) -> dict[str, tuple[int, int]]:
    """Name -> (N, K) of W [N, K] for each distinct decode projection."""
    hidden, inter, hq, hkv, hd, vocab = MODELS[model]
    return {
        "q": (hq * hd, hidden), "k/v": (hkv * hd, hidden), "o": (hidden, hq * hd),
        "gate/up": (inter, hidden), "down": (hidden, inter), "lm_head": (vocab, hidden),
    }


def parse_list(text: str, option: str, known: tuple[str, ...] | None = None) -> list:
    """'1,2,4' -> [1, 2, 4] (or names checked against `known`); ValueError naming the option."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"{option}: give a comma-separated list")
    if known is not None:
        bad = [t for t in items if t not in known]
        if bad:
            raise ValueError(f"{option}: unknown {', '.join(bad)}; known: {', '.join(known)}")
        return items
    try:
        values = [int(t) for t in items]
    except ValueError:
        raise ValueError(f"{option}: expected positive integers, got {text!r}") from None
    if min(values) < 1:
        raise ValueError(f"{option}: expected positive integers, got {text!r}")
    return values


def _row(op: str, key, baseline_path: str, baseline: str, t: dict, size: int, **labels) -> dict:
    ours_s, base_s = t[measure.OURS], t[baseline_path]
    return dict(labels, op=op, key=dict(key), baseline=baseline, bytes=size,
                ours_us=ours_s * 1e6, base_us=base_s * 1e6, ours_gbs=size / ours_s / 1e9,
                base_gbs=size / base_s / 1e9, speedup=base_s / ours_s)


def run_kernel_bench(models: list[str], rows: list[int], contexts: list[int], batch: int = 1,
                     repeats: int = 15, warmup: int = 3, skip: tuple[str, ...] = (),
                     report: Callable[[dict], None] | None = None) -> list[dict]:
    """Every (model, section, shape) row; `report` sees each as soon as it is measured."""
    results = []

    def add(row: dict) -> None:
        results.append(row)
        if report is not None:
            report(row)

    timer = measure.Timer(warmup=warmup)
    for model in models:
        for name, (N, K) in projections(model).items():
            for M in rows:
                shape = f"{name} M={M} {N}x{K}"
                if "dense" not in skip:
                    key = measure.shape_key("linear", M=M, N=N, K=K, dtype=DTYPE, bias=0)
                    t = measure.time_paths("linear", key, (measure.OURS, measure.MLX), timer, repeats)
                    add(_row("gemv_wide fp16", key, measure.MLX, "mx.matmul", t, measure.nbytes("linear", key),
                             model=model, shape=shape))
                if "quant" not in skip:
                    key = measure.shape_key("quantized_linear", M=M, N=N, K=K, dtype=DTYPE, bits=QBITS,
                                            group=QGROUP, bias=0)
                    t = measure.time_paths("quantized_linear", key, (measure.OURS, measure.MLX), timer, repeats)
                    add(_row(f"qgemv_wide q{QBITS}g{QGROUP}", key, measure.MLX, "mx.quantized_matmul", t,
                             measure.nbytes("quantized_linear", key), model=model, shape=shape))
        if "attention" in skip:
            continue
        _, _, hq, hkv, hd, _ = MODELS[model]
        key = measure.shape_key("paged_attention", Hq=hq, Hkv=hkv, D=hd, block=BLOCK_SIZE, dtype=DTYPE)
        for ctx in contexts:
            at = measure.Timer(warmup=warmup, context=ctx, batch=batch, copies=4)
            paths = (measure.OURS, measure.MLX, measure.CONTIGUOUS)
            t = measure.time_paths("paged_attention", key, paths, at, repeats)
            size = measure.nbytes("paged_attention", key, ctx, batch)
            for path, baseline in ((measure.MLX, "gather+sdpa"), (measure.CONTIGUOUS, "sdpa (contiguous)")):
                add(_row("paged_attention fp16", key, path, baseline, t, size, model=model,
                         shape=f"B={batch} ctx={ctx}"))
    return results


def format_row(row: dict) -> str:
    return (f"{row['model']:<13} {row['op']:<22} {row['shape']:<22} "
            f"{row['ours_us']:9.1f}us {row['ours_gbs']:7.1f}GB/s | "
            f"{row['baseline']:<18} {row['base_us']:9.1f}us {row['base_gbs']:7.1f}GB/s x{row['speedup']:.2f}")


def summary(results: list[dict]) -> list[str]:
    """Geometric-mean speedup per (op, baseline)."""
    lines = []
    for op in sorted({r["op"] + " vs " + r["baseline"] for r in results}):
        ratios = [r["speedup"] for r in results if r["op"] + " vs " + r["baseline"] == op]
        geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
        lines.append(f"geomean speedup {op}: x{geo:.2f} over {len(ratios)} shapes")
    return lines


def device() -> dict:
    import mlx.core as mx

    return dict(mx.device_info())
