"""The dispatch points as the chooser and `bench kernels` see them: each op's shape key (what
a choice is recorded for), inputs of a shape, and timings of ours vs MLX's built-in.

A key is derived from the gate arguments of a dispatch function (the arguments its
kernel_supports takes), so warm-up, the chooser and the real calls agree on it. Timing runs
the dispatch function itself under `forced` (dispatch.py): "ours" is exactly the production
kernel launch, "mlx built-in" exactly the reference path (mx.matmul / mx.addmm,
mx.quantized_matmul, a slice or gather of the head-major pools, then
mx.fast.scaled_dot_product_attention or quantized_sdpa).
"""

from __future__ import annotations

import importlib
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from mlxlocal.metal.attention import rows_index, sequence_rows
from mlxlocal.metal.kernel import dtype_name

OURS, MLX, REFERENCE = "ours", "mlx built-in", "reference (no Metal)"
CONTIGUOUS = "sdpa (contiguous)"  # bench only: attention over K/V gathered before the timing
ATTENTION_CONTEXT = 1024  # keys per sequence when the chooser times an attention shape
COPY_BYTES = 64 << 20  # weights rotated per timing, so they come from DRAM as in a real forward
MAX_COPIES = 8

Key = tuple[tuple[str, int | str], ...]


def _m(x: mx.array) -> int:
    return math.prod(x.shape[:-1])


def linear_key(x, weight, bias) -> Key:
    return (("M", _m(x)), ("N", weight.shape[0]), ("K", x.shape[-1]), ("dtype", dtype_name(x.dtype)),
            ("bias", int(bias is not None)))


def quantized_linear_key(x, w, scales, biases, group_size, bits, mode, bias) -> Key:
    key = (("M", _m(x)), ("N", w.shape[0]), ("K", x.shape[-1]), ("dtype", dtype_name(x.dtype)),
           ("bits", bits), ("group", group_size), ("bias", int(bias is not None)))
    return key if mode == "affine" else key + (("mode", mode),)


def paged_attention_key(q, k_pool, v_pool, block_tables, window) -> Key:
    return (("Hq", q.shape[1]), ("Hkv", k_pool.shape[0]), ("D", q.shape[-1]),
            ("block", k_pool.shape[2]), ("dtype", dtype_name(q.dtype)))


def paged_attention_quantized_key(q, k, v, block_tables, group_size, bits, window) -> Key:
    return (("Hq", q.shape[1]), ("Hkv", k[0].shape[0]), ("D", q.shape[-1]),
            ("block", k[0].shape[2]),
            ("dtype", dtype_name(q.dtype)), ("bits", bits), ("group", group_size))


# Cheaper stand-ins for the keys on the per-call path: equal exactly when the keys are.
def _linear_fast(x, weight, bias):
    return x.shape, weight.shape[0], x.dtype, bias is None


def _quantized_linear_fast(x, w, scales, biases, group_size, bits, mode, bias):
    return x.shape, w.shape[0], x.dtype, group_size, bits, mode, bias is None


def _paged_attention_fast(q, k_pool, v_pool, block_tables, window):
    return q.shape[1:], k_pool.shape[0], k_pool.shape[2], q.dtype


def _paged_attention_quantized_fast(q, k, v, block_tables, group_size, bits, window):
    return q.shape[1:], k[0].shape[0], k[0].shape[2], q.dtype, group_size, bits


@dataclass(frozen=True)
class Op:
    module: str  # mlxlocal.metal.<module>: the dispatch function and its kernel_supports
    function: str
    supports: str
    key: Callable[..., Key]  # gate arguments -> key
    baseline: str  # what the reference path runs, for reports
    fast: Callable[..., tuple]  # gate arguments -> a cheap tuple equal exactly when the keys are

    def dispatch(self) -> Callable:
        return getattr(importlib.import_module(self.module), self.function)

    def kernel_supports(self) -> Callable:
        return getattr(importlib.import_module(self.module), self.supports)


OPS = {
    "linear": Op("mlxlocal.metal.gemv_wide", "linear", "kernel_supports", linear_key, "mx.matmul", _linear_fast),
    "quantized_linear": Op("mlxlocal.metal.qgemv_wide", "quantized_linear", "kernel_supports",
                           quantized_linear_key, "mx.quantized_matmul", _quantized_linear_fast),
    "paged_attention": Op("mlxlocal.metal.paged_attention", "paged_attention", "kernel_supports",
                          paged_attention_key, "slice / gather + sdpa", _paged_attention_fast),
    "paged_attention_quantized": Op("mlxlocal.metal.paged_attention_quant", "paged_attention_quantized",
                                    "kernel_supports_quantized", paged_attention_quantized_key,
                                    "slice / gather + quantized sdpa",
                                    _paged_attention_quantized_fast),
}


def shape_key(op: str, **fields: int | str) -> Key:
    """The key of `op` from its fields (bench kernels builds shapes without arrays)."""
    order = {"linear": ("M", "N", "K", "dtype", "bias"),
             "quantized_linear": ("M", "N", "K", "dtype", "bits", "group", "bias"),
             "paged_attention": ("Hq", "Hkv", "D", "block", "dtype"),
             "paged_attention_quantized": ("Hq", "Hkv", "D", "block", "dtype", "bits", "group")}[op]
    return tuple((name, fields[name]) for name in order)


def key_text(op: str, key: Key) -> str:
    return op + " " + " ".join(f"{k}={v}" for k, v in key)


# ---------------------------------------------------------------- inputs of a shape
def _normal(shape, dtype, scale: float = 1.0) -> mx.array:
    return (mx.random.normal(shape) * scale).astype(dtype)


def nbytes(op: str, key: Key, context: int = ATTENTION_CONTEXT, batch: int = 1) -> int:
    """Bytes of weights (or K/V) one call reads: what GB/s is counted over."""
    k = dict(key)
    elt = getattr(mx, k["dtype"]).size
    if op == "linear":
        return k["N"] * k["K"] * elt
    if op == "quantized_linear":
        return k["N"] * k["K"] * k["bits"] // 8 + 2 * k["N"] * (k["K"] // k["group"]) * elt
    row = k["Hkv"] * k["D"] * elt
    if op == "paged_attention_quantized":
        row = k["Hkv"] * (k["D"] * k["bits"] // 8 + 2 * (k["D"] // k["group"]) * elt)
    return 2 * batch * context * row


def copies_for(size: int) -> int:
    return max(1, min(MAX_COPIES, math.ceil(COPY_BYTES / max(size, 1))))


def inputs(op: str, key: Key, copies: int = 1, context: int = ATTENTION_CONTEXT,
           batch: int = 1) -> list[tuple[tuple, dict]]:
    """`copies` argument sets (args, kwargs) for the dispatch function at this shape: the same
    activations, different weights (or pools); random values, evaluated."""
    k = dict(key)
    dt = getattr(mx, k["dtype"])
    calls: list[tuple[tuple, dict]] = []
    if op in ("linear", "quantized_linear"):
        M, N, K = k["M"], k["N"], k["K"]
        x = _normal((M, K), dt)
        for _ in range(copies):
            w = _normal((N, K), dt, K ** -0.5)
            bias = _normal((N,), dt) if k["bias"] else None
            if op == "linear":
                calls.append(((x, w, bias), {}))
            else:
                wq, s, b = mx.quantize(w, group_size=k["group"], bits=k["bits"])
                calls.append(((x, wq, s, b, k["group"], k["bits"], "affine", bias), {}))
            mx.eval(calls[-1][0][:4])
        return calls
    Hq, Hkv, D, bs = k["Hq"], k["Hkv"], k["D"], k["block"]
    blocks = -(-context // bs)
    q = _normal((batch, Hq, 1, D), dt)
    lens = mx.full((batch,), context, mx.int32)
    # The hints the engine gives the reference path for such a step: a lone sequence's blocks
    # are a run (read by a slice, no mask); a batch's are scattered (one gather through the
    # step's row index, built once for all layers: outside the timing).
    if batch == 1:
        tables = mx.arange(blocks, dtype=mx.int32)[None]
        hints = dict(n_keys=context, mask=None, first_block=0)
    else:
        tables = mx.random.permutation(batch * blocks).reshape(batch, blocks).astype(mx.int32)
        index = rows_index(tables, Hkv, batch * blocks)
        mx.eval(index)
        hints = dict(n_keys=context, mask=False, index=index)
    for _ in range(copies):
        pools = [_normal((Hkv, batch * blocks, bs, D), dt) for _ in range(2)]
        if op == "paged_attention":
            calls.append(((q, *pools, tables, lens, D ** -0.5), hints))
        else:
            kv = [tuple(mx.quantize(p, group_size=k["group"], bits=k["bits"])) for p in pools]
            calls.append(((q, *kv, tables, lens, D ** -0.5, k["group"], k["bits"]), hints))
        mx.eval(calls[-1][0])
    return calls


def _gathered(pool, tables: mx.array, n: int, q: mx.array, group_size: int | None, bits: int | None):
    parts = pool if isinstance(pool, tuple) else (pool,)
    got = [sequence_rows(a, tables, n) for a in parts]
    x = got[0] if len(got) == 1 else mx.dequantize(*got, group_size=group_size, bits=bits)
    return x.astype(q.dtype)


def _contiguous(calls: list[tuple[tuple, dict]]) -> tuple[Callable, list]:
    """Bench baseline: sdpa over K/V gathered (and dequantized) before the timing."""
    out = []
    for args, kw in calls:
        q, tables, quant = args[0], args[3], args[6:8] if len(args) > 6 else (None, None)
        keys, values = (_gathered(p, tables, kw["n_keys"], q, *quant) for p in args[1:3])
        mx.eval(keys, values)
        out.append(((q, keys, values), {"scale": args[5]}))
    return mx.fast.scaled_dot_product_attention, out


class Timer:
    """Seconds per call of one path at one shape: a chain of calls over weight copies (together
    larger than the GPU's system-level cache), evaluated at once, after `warmup` untimed chains.
    Inputs are built once per (op, key) and reused while the same shape is timed; weights are
    kept when only the projection's rows M change (warm-up measures M = 1..8 in a row)."""

    def __init__(self, warmup: int = 1, context: int = ATTENTION_CONTEXT, batch: int = 1,
                 copies: int | None = None):
        self.warmup, self.context, self.batch, self.copies = warmup, context, batch, copies
        self._shape: tuple | None = None
        self._weights: tuple | None = None
        self._calls: list = []
        self._warm: dict[str, tuple[Callable, list]] = {}

    def __call__(self, op: str, key: Key, path: str) -> float:
        from mlxlocal.metal.dispatch import forced

        if self._shape != (op, key):
            weights = (op, tuple(f for f in key if f[0] != "M"))
            if self._shape is not None and "M" in dict(key) and self._weights == weights:
                x = _normal((dict(key)["M"], dict(key)["K"]), self._calls[0][0][0].dtype)
                self._calls = [((x, *a[1:]), kw) for a, kw in self._calls]
            else:
                size = nbytes(op, key, self.context, self.batch)
                self._calls = inputs(op, key, self.copies or copies_for(size), self.context, self.batch)
            self._shape, self._weights, self._warm = (op, key), weights, {}
        if path not in self._warm:
            fn, calls = _contiguous(self._calls) if path == CONTIGUOUS else (OPS[op].dispatch(), self._calls)
            self._warm[path] = (fn, calls)
            with forced(None if path == CONTIGUOUS else path):
                for _ in range(self.warmup):
                    mx.eval([fn(*a, **kw) for a, kw in calls])
        fn, calls = self._warm[path]
        with forced(None if path == CONTIGUOUS else path):
            mx.synchronize()
            t0 = time.perf_counter()
            mx.eval([fn(*a, **kw) for a, kw in calls])
            return (time.perf_counter() - t0) / len(calls)


def time_paths(op: str, key: Key, paths: tuple[str, ...], timer: Callable[[str, Key, str], float],
               repeats: int) -> dict[str, float]:
    """Median seconds per call of each path, the paths alternating repeat by repeat."""
    runs: dict[str, list[float]] = {p: [] for p in paths}
    for _ in range(repeats):
        for p in paths:
            runs[p].append(float(timer(op, key, p)))
    return {p: statistics.median(t) for p, t in runs.items()}
