"""Reference-path paged attention, old KV layout vs the head-major one (issue 29).

The reference path (plain MLX: what runs without Metal, and the built-in the dispatch may
pick on a Mac) for one layer's decode step, per call time and peak memory above the pools:

- before: pools [num_blocks, block_size, kv_heads, dim]; a sequence's keys gathered (or,
  for a run of blocks, sliced) as [B, n, H, D], then transposed to [B, H, n, D] for sdpa
  (quantized: gather packed words / scales / biases, dequantize, transpose): the old
  paged_attention_reference, reimplemented here.
- after: pools [kv_heads, num_blocks, block_size, dim]; a run is a strided view, a batch one
  gather through the shared row-block index (built once per step, outside the timing), no
  transpose; quantized: quantized_sdpa on the packed rows (mlxlocal.metal).

Cases: 4k / 16k / 32k keys; B = 1 over a run of blocks (first_block) and B = 2 over
shuffled tables; fp32 pools and 8-bit pools (group 64, fp32 scales). Both layouts hold the
same values (outputs are checked to agree). Timings alternate before / after, `--repeats`
times, each a chain of `--calls` evaluated calls; medians reported. The machine is shared
and noisy: compare within a row, not across runs.

    python scripts/bench_attention_layout.py [--keys 4096,16384,32768] [--repeats 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import mlx.core as mx
import numpy as np

from mlxlocal.metal.attention import rows_index, sequence_rows, step_mask
from mlxlocal.metal.paged_attention import paged_attention_reference
from mlxlocal.metal.paged_attention_quant import paged_attention_quantized_reference


def old_reference(q, k_pool, v_pool, tables, lens, scale, n_keys, mask, first_block, quant):
    """The previous paged_attention(_quantized)_reference over [NB, BS, H, D] pools."""
    B = q.shape[0]

    def gather(pool):
        parts = []
        for a in pool if quant else (pool,):
            H, last = a.shape[2], a.shape[3]
            if first_block is not None:
                a = a[first_block:first_block + tables.shape[1]].reshape(B, -1, H, last)
            else:
                a = a[tables].reshape(B, -1, H, last)
            parts.append(a[:, :n_keys])
        x = parts[0] if not quant else mx.dequantize(*parts, group_size=quant[0], bits=quant[1])
        return x.astype(q.dtype).transpose(0, 2, 1, 3)

    return mx.fast.scaled_dot_product_attention(q, gather(k_pool), gather(v_pool), scale=scale,
                                                mask=mask)


def new_reference(q, k_pool, v_pool, tables, lens, scale, n_keys, mask, first_block, quant, index):
    kw = dict(n_keys=n_keys, mask=mask, first_block=first_block, index=index)
    if quant:
        return paged_attention_quantized_reference(q, k_pool, v_pool, tables, lens, scale, *quant,
                                                   **kw)
    return paged_attention_reference(q, k_pool, v_pool, tables, lens, scale, **kw)


def build(B, n_keys, Hq, Hkv, D, bs, quant, seed):
    """(old pools, new pools, q, tables, lens, first_block, mask, index) for one case."""
    rng = np.random.default_rng(seed)
    W = math.ceil(n_keys / bs)
    NB = B * W + 8
    if B == 1:
        first, tables = 3, (3 + np.arange(W, dtype=np.int32))[None]
    else:
        first, tables = None, rng.permutation(NB)[: B * W].reshape(B, W).astype(np.int32)
    pools_old, pools_new = [], []
    for _ in "kv":
        new = mx.random.normal((Hkv, NB, bs, D), key=mx.random.key(int(rng.integers(1 << 30))))
        old = mx.contiguous(new.transpose(1, 2, 0, 3))  # [NB, BS, H, D], the same values
        if quant:
            gs, bits = quant
            new, old = (tuple(mx.quantize(x, group_size=gs, bits=bits)) for x in (new, old))
        mx.eval(new, old)
        pools_new.append(new)
        pools_old.append(old)
    q = mx.random.normal((B, Hq, 1, D))
    tables = mx.array(tables)
    lens = mx.array([n_keys - 7 * b for b in range(B)], mx.int32)
    mask = None if B == 1 else step_mask(lens, 1, n_keys, None)
    index = None if B == 1 else rows_index(tables, Hkv, NB)
    mx.eval(q, tables, lens, index if index is not None else q, mask if mask is not None else q)
    return pools_old, pools_new, q, tables, lens, first, mask, index


def timed(fn, calls):
    """(seconds per call, peak bytes above what was live before) of `calls` evaluated calls."""
    mx.synchronize()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    t0 = time.perf_counter()
    for _ in range(calls):
        mx.eval(fn())
    dt = (time.perf_counter() - t0) / calls
    return dt, mx.get_peak_memory() - base


def view_bytes(pool, first, W):
    """Bytes allocated by evaluating a run of W blocks read as [1, H, W * BS, D] (0: a view)."""
    mx.synchronize()
    base = mx.get_active_memory()
    rows = sequence_rows(pool, mx.zeros((1, W), mx.int32), None, first_block=first)
    mx.eval(rows)
    return mx.get_active_memory() - base


def run_case(B, n_keys, quant, args):
    old_p, new_p, q, tables, lens, first, mask, index = build(
        B, n_keys, args.hq, args.hkv, args.dim, args.block, quant, n_keys + B)
    scale = args.dim ** -0.5
    def before():
        return old_reference(q, *old_p, tables, lens, scale, n_keys, mask, first, quant)

    def after():
        return new_reference(q, *new_p, tables, lens, scale, n_keys, mask, first, quant, index)

    diff = float(mx.abs(before() - after()).max())
    runs = {"before": [], "after": []}
    for _ in range(args.repeats):
        for name, fn in (("before", before), ("after", after)):
            runs[name].append(timed(fn, args.calls))
    row = dict(B=B, keys=n_keys, kv="8-bit" if quant else "fp32", max_abs_diff=diff)
    for name, r in runs.items():
        row[f"{name}_ms"] = statistics.median(t for t, _ in r) * 1e3
        row[f"{name}_peak_mb"] = statistics.median(m for _, m in r) / 2 ** 20
    if B == 1 and not quant:
        row["run_view_bytes"] = view_bytes(new_p[0], first, tables.shape[1])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--keys", default="4096,16384,32768")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=3, help="evaluated calls per timing")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = []
    for n_keys in (int(x) for x in args.keys.split(",")):
        for quant in (None, (64, 8)):
            for B in (1, 2):
                rows.append(run_case(B, n_keys, quant, args))
                mx.clear_cache()
                if not args.json:
                    print(line(rows[-1]), flush=True)
    if args.json:
        print(json.dumps({"device": str(mx.default_device()), "shape": vars(args), "rows": rows},
                         indent=1))
    else:
        print(f"(device {mx.default_device()}, Hq={args.hq} Hkv={args.hkv} D={args.dim} "
              f"block={args.block}; medians of {args.repeats} alternating runs of {args.calls} "
              "calls)")


def line(r: dict) -> str:
    view = f", run view allocates {r['run_view_bytes']} B" if "run_view_bytes" in r else ""
    return (f"B={r['B']} keys={r['keys']:>6} {r['kv']:>5}: {r['before_ms']:8.2f} -> "
            f"{r['after_ms']:8.2f} ms (x{r['before_ms'] / r['after_ms']:.2f}), peak "
            f"{r['before_peak_mb']:7.1f} -> {r['after_peak_mb']:7.1f} MB, "
            f"max |diff| {r['max_abs_diff']:.1e}{view}")


if __name__ == "__main__":
    main()
