"""Benchmark mlxlocal's Metal kernels against MLX's own ops at real models' decode shapes.

  python scripts/bench_kernels.py [--models qwen3-0.6b,llama-3.1-8b] [--rows 1,2,4,8]
                                  [--contexts 1024,4096,16384] [--repeats 20] [--json]

gemv_wide vs mx.matmul (fp16), qgemv_wide vs mx.quantized_matmul (4-bit, group 64), and
paged_attention vs mx.fast.scaled_dot_product_attention over K/V gathered from the same pools
(gather inside the timing: what the reference path does; and over pre-gathered contiguous K/V:
a dense cache's best case). GB/s = bytes of weights (or K/V) read per call / time per call.
Each timing runs a chain of calls over several weight copies (together larger than the GPU's
system-level cache, so weights really come from DRAM), after warmup; the median of the repeats
is reported, ours and the baseline alternating. Needs Metal (Apple Silicon); elsewhere it says
so and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import statistics
import sys
import time

import mlx.core as mx

from mlxlocal.metal import gemv_wide, qgemv_wide

paged = importlib.import_module("mlxlocal.metal.paged_attention")

# hidden, intermediate, q heads, kv heads, head dim, vocab
MODELS = {
    "qwen3-0.6b": (1024, 3072, 16, 8, 128, 151936),
    "qwen3-4b": (2560, 9728, 32, 8, 128, 151936),
    "qwen3-8b": (4096, 12288, 32, 8, 128, 151936),
    "llama-3.2-1b": (2048, 8192, 32, 8, 64, 128256),
    "llama-3.2-3b": (3072, 8192, 24, 8, 128, 128256),
    "llama-3.1-8b": (4096, 14336, 32, 8, 128, 128256),
}
COPY_BYTES = 256 << 20  # weight copies rotated per timing: more than any Apple SLC
MAX_COPIES = 32
BLOCK_SIZE = 16
QBITS, QGROUP = 4, 64


def projections(model: str) -> dict[str, tuple[int, int]]:
    """Name -> (N, K) of W [N, K] for each distinct decode projection."""
    hidden, inter, hq, hkv, hd, vocab = MODELS[model]
    return {
        "q": (hq * hd, hidden), "k/v": (hkv * hd, hidden), "o": (hidden, hq * hd),
        "gate/up": (inter, hidden), "down": (hidden, inter), "lm_head": (vocab, hidden),
    }


def time_chain(fn, inputs: list, repeats: int, warmup: int) -> list[float]:
    """Seconds per call: each repeat evaluates fn over every input set once."""
    for _ in range(warmup):
        mx.eval([fn(*a) for a in inputs])
    out = []
    for _ in range(repeats):
        mx.synchronize()
        t0 = time.perf_counter()
        mx.eval([fn(*a) for a in inputs])
        out.append((time.perf_counter() - t0) / len(inputs))
    return out


def compare(ours, base, inputs, nbytes: int, args) -> dict:
    """Alternate ours / baseline repeat by repeat; median seconds, GB/s and ratio."""
    t_ours, t_base = [], []
    for _ in range(args.repeats):
        t_ours += time_chain(ours, inputs, 1, args.warmup if not t_ours else 0)
        t_base += time_chain(base, inputs, 1, args.warmup if not t_base else 0)
    ours_s, base_s = statistics.median(t_ours), statistics.median(t_base)
    return {
        "bytes": nbytes, "ours_us": ours_s * 1e6, "base_us": base_s * 1e6,
        "ours_gbs": nbytes / ours_s / 1e9, "base_gbs": nbytes / base_s / 1e9,
        "speedup": base_s / ours_s,
    }


def copies_for(nbytes: int) -> int:
    return max(1, min(MAX_COPIES, math.ceil(COPY_BYTES / nbytes)))


def bench_dense(N: int, K: int, M: int, args) -> dict:
    x = mx.random.normal((M, K)).astype(mx.float16)
    ws = [(mx.random.normal((N, K)) / math.sqrt(K)).astype(mx.float16)
          for _ in range(copies_for(N * K * 2))]
    assert gemv_wide.kernel_supports(x, ws[0], None)
    mx.eval(x, ws)
    return compare(lambda x, w: gemv_wide.linear(x, w), lambda x, w: mx.matmul(x, w.T),
                   [(x, w) for w in ws], N * K * 2, args)


def bench_quant(N: int, K: int, M: int, args) -> dict:
    x = mx.random.normal((M, K)).astype(mx.float16)
    nbytes = N * K * QBITS // 8 + 2 * N * (K // QGROUP) * 2
    qs = []
    for _ in range(copies_for(nbytes)):
        w = (mx.random.normal((N, K)) / math.sqrt(K)).astype(mx.float16)
        qs.append(mx.quantize(w, group_size=QGROUP, bits=QBITS))
        mx.eval(qs[-1])
    assert qgemv_wide.kernel_supports(x, *qs[0], QGROUP, QBITS, "affine", None)

    def ours(x, w, s, b):
        return qgemv_wide.quantized_linear(x, w, s, b, QGROUP, QBITS)

    def base(x, w, s, b):
        return mx.quantized_matmul(x, w, s, b, transpose=True, group_size=QGROUP, bits=QBITS)

    return compare(ours, base, [(x, *q) for q in qs], nbytes, args)


def bench_attention(model: str, ctx: int, batch: int, args) -> list[dict]:
    _, _, hq, hkv, hd, _ = MODELS[model]
    blocks = math.ceil(ctx / BLOCK_SIZE)
    num_blocks = batch * blocks
    q = mx.random.normal((batch, hq, 1, hd)).astype(mx.float16)
    k_pool = mx.random.normal((num_blocks, BLOCK_SIZE, hkv, hd)).astype(mx.float16)
    v_pool = mx.random.normal((num_blocks, BLOCK_SIZE, hkv, hd)).astype(mx.float16)
    tables = mx.random.permutation(num_blocks).reshape(batch, blocks).astype(mx.int32)
    lens = mx.full((batch,), ctx, mx.int32)
    scale = hd ** -0.5
    assert paged.kernel_supports(q, k_pool, v_pool, tables, None)
    mx.eval(q, k_pool, v_pool, tables, lens)

    def gather(pool):
        return pool[tables].reshape(batch, -1, hkv, hd)[:, :ctx].transpose(0, 2, 1, 3)

    keys, values = gather(k_pool), gather(v_pool)
    mx.eval(keys, values)
    nbytes = 2 * batch * ctx * hkv * hd * 2

    def ours(q):
        return paged.paged_attention(q, k_pool, v_pool, tables, lens, scale)

    def gathered(q):
        return mx.fast.scaled_dot_product_attention(q, gather(k_pool), gather(v_pool), scale=scale)

    def dense(q):
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale)

    inputs = [(q,)] * 4
    return [dict(compare(ours, gathered, inputs, nbytes, args), baseline="gather+sdpa"),
            dict(compare(ours, dense, inputs, nbytes, args), baseline="sdpa (contiguous)")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--rows", default="1,2,4,8", help="decode rows M")
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--batch", type=int, default=1, help="sequences for attention")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--skip", default="", help="comma list of: dense,quant,attention")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    if not mx.metal.is_available():
        print("bench_kernels: needs Metal (Apple Silicon); on this machine the dispatch points "
              "run the MLX references, so there is nothing to compare.", file=sys.stderr)
        return 2
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        ap.error(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    rows = [int(r) for r in args.rows.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    skip = set(args.skip.split(","))

    results = []

    def report(row: dict) -> None:
        results.append(row)
        if not args.json:
            shape = row.get("shape", "")
            print(f"{row['model']:<13} {row['op']:<22} {shape:<22} "
                  f"{row['ours_us']:9.1f}us {row['ours_gbs']:7.1f}GB/s | "
                  f"{row['baseline']:<18} {row['base_us']:9.1f}us {row['base_gbs']:7.1f}GB/s "
                  f"x{row['speedup']:.2f}", flush=True)

    for model in models:
        for name, (N, K) in projections(model).items():
            for M in rows:
                shape = f"{name} M={M} {N}x{K}"
                if "dense" not in skip:
                    report(dict(bench_dense(N, K, M, args), model=model, op="gemv_wide fp16",
                                shape=shape, baseline="mx.matmul"))
                if "quant" not in skip:
                    report(dict(bench_quant(N, K, M, args), model=model,
                                op=f"qgemv_wide q{QBITS}g{QGROUP}", shape=shape,
                                baseline="mx.quantized_matmul"))
        if "attention" not in skip:
            for ctx in contexts:
                for row in bench_attention(model, ctx, args.batch, args):
                    report(dict(row, model=model, op="paged_attention fp16",
                                shape=f"B={args.batch} ctx={ctx}"))

    if args.json:
        print(json.dumps({"device": mx.device_info(), "results": results}))
    else:
        for op in sorted({r["op"] + " vs " + r["baseline"] for r in results}):
            ratios = [r["speedup"] for r in results if r["op"] + " vs " + r["baseline"] == op]
            geo = math.exp(sum(math.log(x) for x in ratios) / len(ratios))
            print(f"geomean speedup {op}: x{geo:.2f} over {len(ratios)} shapes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
