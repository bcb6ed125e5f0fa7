"""Paged attention over quantized K/V pools (mlxlocal/metal/paged_attention_quant.py).

- Everywhere: the MLX reference (gather packed blocks through the tables, then dequantize)
  against paged_attention_reference over pools quantized and dequantized up front.
- Under CPU emulation: the exact Metal launch against that reference.
- On a Mac: the real kernel through the dispatch point.
"""

from __future__ import annotations

import importlib
import math

import mlx.core as mx
import numpy as np
import pytest

from mlxlocal.metal import paged_attention_quant as pq

paged_attention = importlib.import_module("mlxlocal.metal.paged_attention")

MX_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def quant_pools(rng, num_blocks, bs, Hkv, D, gs, bits, dtype="float32"):
    """(quantized triple, the same pool dequantized up front) for K or V."""
    x = mx.array(rng.normal(size=(num_blocks, bs, Hkv, D)).astype(np.float32)).astype(MX_DTYPES[dtype])
    triple = mx.quantize(x, group_size=gs, bits=bits)
    return triple, mx.dequantize(*triple, group_size=gs, bits=bits)


# ---------------------------------------------------------------- reference

REF_CASES = [
    # context lens, L, Hq, Hkv, D, block size, group size, bits, window
    ([1, 17, 40], 1, 4, 4, 64, 16, 32, 8, None),  # decode, one-token sequence
    ([33, 70], 1, 8, 2, 96, 32, 32, 4, None),  # GQA 4, D = 96 (3 groups of 32)
    ([50, 16, 3], 1, 8, 1, 96, 16, 32, 4, 20),  # GQA 8, sliding window
    ([23, 40], 5, 4, 2, 64, 16, 64, 4, None),  # L > 1: causal per sequence
    ([60, 35], 3, 4, 1, 128, 16, 128, 8, 24),  # L > 1 with a window
    ([1000], 1, 2, 1, 64, 32, 64, 4, 300),  # long context, window past many blocks
]


def _case(ctx, L, Hq, Hkv, D, bs, gs, bits, seed=0, contiguous=False, dtype="float32"):
    rng = np.random.default_rng(seed)
    B = len(ctx)
    max_blocks = max(math.ceil(c / bs) for c in ctx) + 1  # one spare padding column
    num_blocks = B * max_blocks + 3
    if contiguous:  # B = 1, the table a run of blocks (the first_block fast path)
        tables = (2 + np.arange(max_blocks, dtype=np.int32))[None]
    else:
        tables = rng.permutation(num_blocks)[: B * max_blocks].reshape(B, max_blocks).astype(np.int32)
    q = mx.array(rng.normal(size=(B, Hq, L, D)).astype(np.float32)).astype(MX_DTYPES[dtype])
    kq, kd = quant_pools(rng, num_blocks, bs, Hkv, D, gs, bits, dtype)
    vq, vd = quant_pools(rng, num_blocks, bs, Hkv, D, gs, bits, dtype)
    return q, kq, kd, vq, vd, mx.array(tables), mx.array(np.array(ctx, np.int32)), D ** -0.5


def _engine_hints(ctx, L, bs, window, first_block=None):
    """The hints mlxlocal/cache/paged.py passes (n_keys, mask, window_start)."""
    lens, longest = mx.array(np.array(ctx, np.int32)), max(ctx)
    start = 0 if window is None else min(max(0, c - L - window + 1) for c in ctx) // bs
    mask = paged_attention.step_mask(lens, L, longest, window, start * bs)
    return dict(n_keys=longest, mask=mask, first_block=first_block, window_start=start)


@pytest.mark.parametrize("hints", [False, True])
@pytest.mark.parametrize("ctx,L,Hq,Hkv,D,bs,gs,bits,window", REF_CASES)
def test_reference_equals_dequantized_pools(ctx, L, Hq, Hkv, D, bs, gs, bits, window, hints):
    q, kq, kd, vq, vd, tables, lens, scale = _case(ctx, L, Hq, Hkv, D, bs, gs, bits)
    # Different path: whole pools dequantized up front, the unquantized reference, no hints.
    want = paged_attention.paged_attention_reference(q, kd, vd, tables, lens, scale, window)
    kw = _engine_hints(ctx, L, bs, window) if hints else {}
    got = pq.paged_attention_quantized_reference(q, kq, vq, tables, lens, scale, gs, bits, window, **kw)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    assert got.shape == (len(ctx), Hq, L, D)


@pytest.mark.parametrize("L,window", [(1, None), (4, None), (1, 20), (6, 20)])
def test_reference_first_block_slice(L, window):
    ctx, bs, gs, bits = [45], 16, 32, 4
    q, kq, kd, vq, vd, tables, lens, scale = _case(ctx, L, 4, 2, 64, bs, gs, bits, contiguous=True)
    want = paged_attention.paged_attention_reference(q, kd, vd, tables, lens, scale, window)
    kw = _engine_hints(ctx, L, bs, window, first_block=2)
    if window is not None:  # the engine slices window layers through the table, not first_block
        kw["first_block"] = None
    got = pq.paged_attention_quantized_reference(q, kq, vq, tables, lens, scale, gs, bits, window, **kw)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    # first_block honoured: pointing it one block off reads other blocks and changes the output
    if window is None:
        kw["first_block"] = 3
        off = pq.paged_attention_quantized_reference(q, kq, vq, tables, lens, scale, gs, bits, **kw)
        assert not np.allclose(np.array(off), np.array(want), atol=1e-3)


def test_reference_float16_pools():
    ctx, L, bs, gs, bits = [30, 64], 1, 32, 64, 8
    q, kq, kd, vq, vd, tables, lens, scale = _case(ctx, L, 8, 2, 128, bs, gs, bits, dtype="float16")
    assert kq[1].dtype == mx.float16
    want = paged_attention.paged_attention_reference(q, kd, vd, tables, lens, scale)
    got = pq.paged_attention_quantized_reference(q, kq, vq, tables, lens, scale, gs, bits)
    assert got.dtype == mx.float16
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)),
                               rtol=2e-3, atol=2e-3)


def test_quantization_is_honoured():
    """The reference reads the quantized values: 4-bit output differs from fp32 K/V by more
    than 8-bit does (so bits / group_size are not silently ignored)."""
    rng = np.random.default_rng(1)
    ctx, bs, D = [80, 41], 16, 64
    tables = mx.array(np.arange(12, dtype=np.int32).reshape(2, 6))
    lens = mx.array(np.array(ctx, np.int32))
    q = mx.array(rng.normal(size=(2, 4, 1, D)).astype(np.float32))
    k = mx.array(rng.normal(size=(12, bs, 2, D)).astype(np.float32))
    v = mx.array(rng.normal(size=(12, bs, 2, D)).astype(np.float32))
    exact = np.array(paged_attention.paged_attention_reference(q, k, v, tables, lens, D ** -0.5))
    err = {}
    for bits in (8, 4):
        kq = mx.quantize(k, group_size=32, bits=bits)
        vq = mx.quantize(v, group_size=32, bits=bits)
        got = pq.paged_attention_quantized_reference(q, kq, vq, tables, lens, D ** -0.5, 32, bits)
        err[bits] = float(np.abs(np.array(got) - exact).max())
    assert 0 < err[8] < err[4] < 0.5


def test_reference_rejects_mismatched_pools():
    q = mx.zeros((1, 2, 1, 64))
    k = mx.quantize(mx.zeros((4, 16, 1, 64)), group_size=32, bits=4)
    tables, lens = mx.zeros((1, 2), mx.int32), mx.array([5])
    with pytest.raises(ValueError, match="bits=8"):
        pq.paged_attention_quantized_reference(q, k, k, tables, lens, 1.0, 32, 8)
    with pytest.raises(ValueError, match="scales / biases"):
        pq.paged_attention_quantized_reference(q, k, k, tables, lens, 1.0, 64, 4)
    with pytest.raises(ValueError, match="triple"):
        pq.paged_attention_quantized_reference(q, k[:2], k, tables, lens, 1.0, 32, 4)


def test_cpu_dispatch_is_the_reference():
    if mx.metal.is_available():
        pytest.skip("on Metal the dispatch runs the kernel for L = 1 (covered below)")
    ctx = [40, 7]
    q, kq, _, vq, _, tables, lens, scale = _case(ctx, 1, 4, 2, 64, 16, 32, 4)
    got = pq.paged_attention_quantized(q, kq, vq, tables, lens, scale, 32, 4, 16)
    want = pq.paged_attention_quantized_reference(q, kq, vq, tables, lens, scale, 32, 4, 16)
    assert mx.array_equal(got, want)
