"""Paged attention over quantized K/V pools (mlxlocal/metal/paged_attention_quant.py).

- Everywhere: the MLX reference (gather packed blocks through the tables, then dequantize)
  against paged_attention_reference over pools quantized and dequantized up front.
- Under CPU emulation: the exact Metal launch against that reference.
- On a Mac: the real kernel through the dispatch point.
"""

from __future__ import annotations

import dataclasses
import importlib
import math

import mlx.core as mx
import numpy as np
import pytest
from test_kernels import assert_close, emulate, f32, from_kernel, needs_emu, needs_metal, to_dtype
from test_kernels_paged import STALE, emulate_dispatch, emulate_launches

from mlxlocal.metal import attention
from mlxlocal.metal import paged_attention_quant as pq

paged_attention = importlib.import_module("mlxlocal.metal.paged_attention")

MX_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


def quant_pools(rng, num_blocks, bs, Hkv, D, gs, bits, dtype="float32"):
    """(quantized triple, the same pool dequantized up front) for K or V."""
    x = mx.array(rng.normal(size=(Hkv, num_blocks, bs, D)).astype(np.float32))
    x = x.astype(MX_DTYPES[dtype])
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
    kw = _engine_hints(ctx, L, bs, window, first_block=2)  # a window cut moves the run's start
    got = pq.paged_attention_quantized_reference(q, kq, vq, tables, lens, scale, gs, bits, window, **kw)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    # first_block honoured: pointing it one block off reads other blocks and changes the output
    if window is None:
        kw["first_block"] = 3
        off = pq.paged_attention_quantized_reference(q, kq, vq, tables, lens, scale, gs, bits, **kw)
        assert not np.allclose(np.array(off), np.array(want), atol=1e-3)


@pytest.mark.parametrize("ctx,window", [([45, 70, 3], None), ([70, 66], 24)])
def test_reference_shared_index(ctx, window):
    """The step's shared row index (rows_index) as the engine passes it: same result, and it
    is what is read (another table's index gives that table's output)."""
    q, kq, kd, vq, vd, tables, lens, scale = _case(ctx, 1, 4, 2, 64, 16, 32, 8)
    want = paged_attention.paged_attention_reference(q, kd, vd, tables, lens, scale, window)
    index = paged_attention.rows_index(tables, 2, kq[0].shape[1])
    kw = _engine_hints(ctx, 1, 16, window)
    got = pq.paged_attention_quantized_reference(q, kq, vq, tables, lens, scale, 32, 8, window,
                                                 index=index, **kw)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    other = tables[::-1]
    other_index = paged_attention.rows_index(other, 2, kq[0].shape[1])
    via = pq.paged_attention_quantized_reference(q, kq, vq, tables, lens, scale, 32, 8,
                                                 index=other_index)
    direct = pq.paged_attention_quantized_reference(q, kq, vq, other, lens, scale, 32, 8)
    np.testing.assert_array_equal(np.array(via), np.array(direct))


SDPA_CASES = [
    # B, Hq, Hkv, L, S, D, group size, bits, mask, dtype
    (1, 4, 4, 1, 37, 64, 32, 8, None, "float32"),
    (2, 8, 2, 1, 50, 128, 64, 4, "step", "float32"),  # GQA 4, per-sequence boolean mask
    (1, 6, 2, 5, 40, 64, 64, 8, "causal", "float32"),  # L > 1 under the string mask
    (2, 4, 1, 3, 33, 96, 32, 4, "window", "float32"),  # GQA 4, sliding window
    (2, 16, 8, 1, 300, 128, 128, 8, "step", "float16"),
    (1, 4, 2, 4, 20, 64, 32, 4, "additive", "float32"),
    # a verify step (L = 4) over 3k keys, GQA 4: where broadcast weights went wrong (mlx#3497)
    (2, 16, 4, 4, 3000, 128, 64, 4, "step", "float16"),
]


@pytest.mark.parametrize("B,Hq,Hkv,L,S,D,gs,bits,mask,dtype", SDPA_CASES)
def test_quantized_sdpa_equals_dequantize_then_sdpa(B, Hq, Hkv, L, S, D, gs, bits, mask, dtype):
    """quantized_sdpa (scores and values by quantized_matmul on the packed triples) against
    another path: the same triples dequantized, then mx.fast.scaled_dot_product_attention."""
    rng = np.random.default_rng(7)
    dt = MX_DTYPES[dtype]
    q = mx.array(rng.normal(size=(B, Hq, L, D)).astype(np.float32)).astype(dt)
    k, v = (mx.quantize(mx.array(rng.normal(size=(B, Hkv, S, D)).astype(np.float32)).astype(dt),
                        group_size=gs, bits=bits) for _ in "kv")
    lens = mx.array(np.array([S - b for b in range(B)], np.int32))
    m = {None: None, "causal": "causal", "step": paged_attention.step_mask(lens, L, S, None),
         "window": paged_attention.step_mask(lens, L, S, 9),
         "additive": mx.array(rng.normal(size=(1, 1, L, S)).astype(np.float32))}[mask]
    got = attention.quantized_sdpa(q, k, v, D ** -0.5, m, gs, bits)
    deq = [mx.dequantize(*t, group_size=gs, bits=bits).astype(dt) for t in (k, v)]
    want = attention.sdpa(q, *deq, D ** -0.5, m)
    assert got.shape == want.shape == (B, Hq, L, D) and got.dtype == dt
    tol = 2e-5 if dtype == "float32" else 3e-3
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)),
                               rtol=tol, atol=tol)


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
    k = mx.array(rng.normal(size=(2, 12, bs, D)).astype(np.float32))
    v = mx.array(rng.normal(size=(2, 12, bs, D)).astype(np.float32))
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
    k = mx.quantize(mx.zeros((1, 4, 16, 64)), group_size=32, bits=4)
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


def test_kernel_support_rules():
    q = mx.zeros((2, 8, 1, 128), mx.bfloat16)
    pool = mx.quantize(mx.zeros((2, 10, 16, 128), mx.bfloat16), group_size=64, bits=4)
    tables = mx.zeros((2, 4), mx.int32)
    assert pq.kernel_supports_quantized(q, pool, pool, tables, 64, 4, None)
    assert pq.kernel_supports_quantized(q, pool, pool, tables, 64, 4, 100)
    assert not pq.kernel_supports_quantized(q, pool, pool, tables, 64, 8, None)  # words != D*8/32
    assert not pq.kernel_supports_quantized(q, pool, pool, tables, 32, 4, None)  # scales shape
    assert not pq.kernel_supports_quantized(mx.zeros((2, 8, 3, 128), mx.bfloat16), pool, pool,
                                            tables, 64, 4, None)  # prefill (L > 1)
    assert not pq.kernel_supports_quantized(q.astype(mx.float16), pool, pool, tables, 64, 4,
                                            None)  # scales in another dtype than q
    small = tuple(a[:, :, :8] for a in pool)
    assert not pq.kernel_supports_quantized(q, small, small, tables, 64, 4, None)  # bs 8
    q6 = mx.zeros((2, 6, 1, 128), mx.bfloat16)
    pool4 = mx.quantize(mx.zeros((4, 10, 16, 128), mx.bfloat16), group_size=64, bits=4)
    assert not pq.kernel_supports_quantized(q6, pool4, pool4, tables, 64, 4, None)  # Hq % Hkv


# ---------------------------------------------------------------- emulation



def quant_kernel_case(ctx_lens, Hq, Hkv, D, bs, dtype, gs, bits, window, seed=0):
    """Kernel inputs (numpy, bf16 as bit patterns) over shuffled padded tables, and the float32
    reference on the exact values the kernel reads."""
    rng = np.random.default_rng(seed)
    B = len(ctx_lens)
    max_blocks = max(math.ceil(c / bs) for c in ctx_lens) + 1
    num_blocks = B * max_blocks + 3
    tables = rng.permutation(num_blocks)[: B * max_blocks].reshape(B, max_blocks).astype(np.int32)
    q, qf = to_dtype(rng.normal(size=(B, Hq, 1, D)), dtype)
    tensors, pools = [q], []
    for _ in "kv":
        x = mx.array(rng.normal(size=(Hkv, num_blocks, bs, D)).astype(np.float32))
        packed, scales, biases = mx.quantize(x.astype(MX_DTYPES[dtype]), group_size=gs, bits=bits)
        s, sf = to_dtype(np.array(scales.astype(mx.float32)), dtype)  # exact: already in dtype
        z, zf = to_dtype(np.array(biases.astype(mx.float32)), dtype)
        tensors += [np.array(packed), s, z]
        pools.append((packed, f32(sf), f32(zf)))
    lens = np.array(ctx_lens, dtype=np.int32)
    scale = D ** -0.5
    want = pq.paged_attention_quantized_reference(
        f32(qf), pools[0], pools[1], mx.array(tables), mx.array(lens), scale, gs, bits, window)
    return tensors + [tables, lens], np.array(want), max_blocks, scale


def quant_specs(tensors, ctx, Hq, Hkv, D, bs, dtype, gs, bits, window, max_blocks, scale, parts=None):
    return pq.launch_specs(len(ctx), Hq, Hkv, D, bs, max_blocks, tensors[1].shape[1], dtype, scale,
                           window, gs, bits, span=max(ctx), parts=parts)


# Tolerance (assert_close: fp16 3e-3, bf16 2e-2, fp32 1e-4, scaled by max(1, |want|)): the
# reference is fp32 math on exactly the values the kernel reads (dtype-rounded q, scales,
# biases; same packed words), so only the fp32 summation order and the output's rounding to T
# differ (half an ulp: 4.9e-4 fp16, 3.9e-3 bf16); the broken kernels below miss by far more.
QUANT_PAGED_EMU = [
    # context lens, Hq, Hkv, D, block size, dtype, group size, bits, window, partitions
    ([1, 15, 16, 17], 4, 4, 64, 16, "float16", 32, 4, None, None),  # GQA 1; W = 8: 4 keys a step
    ([100, 33], 8, 4, 64, 32, "bfloat16", 64, 8, None, None),  # GQA 2; W = 16: 2 keys at once
    ([1000, 17], 8, 2, 128, 16, "float16", 128, 4, None, None),  # GQA 4 in 2 sets; 4 partitions
    ([50, 16, 3], 8, 1, 96, 16, "float16", 32, 4, 20, None),  # GQA 8: 4 sets; W = 12; window
    ([160, 9], 4, 1, 96, 32, "bfloat16", 32, 8, 37, 3),  # W = 24 (8 idle lanes); window mid-block
    ([300, 45], 2, 2, 128, 32, "float16", 64, 8, None, None),  # W = 32: one key per step
    ([75, 1], 2, 1, 64, 16, "float32", 64, 8, 64, None),
    ([1001], 16, 2, 128, 32, "bfloat16", 32, 4, 256, 2),  # GQA 8, long context, 9-block window
    ([8190, 700], 8, 2, 128, 16, "float16", 64, 4, None, None),  # ~8k: 32 partitions
]


@needs_emu
@pytest.mark.parametrize("ctx,Hq,Hkv,D,bs,dtype,gs,bits,window,parts", QUANT_PAGED_EMU)
def test_paged_attention_quant_emulated(ctx, Hq, Hkv, D, bs, dtype, gs, bits, window, parts):
    tensors, want, max_blocks, scale = quant_kernel_case(ctx, Hq, Hkv, D, bs, dtype, gs, bits, window)
    specs = quant_specs(tensors, ctx, Hq, Hkv, D, bs, dtype, gs, bits, window, max_blocks, scale, parts)
    assert_close(emulate_launches(specs, tensors), want, dtype)


@needs_emu
@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("what", list(STALE))
def test_quant_stale_block_id_gives_nan(what, parts):
    """The guard of paged_attention (test_kernels_paged.STALE): NaN for sequence 1 only."""
    ctx = [45, 40, 20]
    tensors, want, max_blocks, scale = quant_kernel_case(ctx, 4, 2, 64, 16, "float16", 32, 4, None)
    tables, lens = tensors[7].copy(), tensors[8].copy()
    if what == "short row":
        lens[1] = max_blocks * 16 + 1
    else:
        tables[1, 1] = tensors[1].shape[1] if STALE[what] is None else STALE[what]
    specs = quant_specs(tensors, ctx, 4, 2, 64, 16, "float16", 32, 4, None, max_blocks, scale, parts)
    got = emulate_launches(specs, [*tensors[:7], tables, lens])
    assert np.isnan(got[1]).all()
    assert_close(got[[0, 2]], want[[0, 2]], "float16")


# Deliberately broken kernels: the emulated comparison must catch each one.
BROKEN = {
    "nibble order": ("(word >> (BITS * i))", "(word >> (BITS * (PACK - 1 - i)))"),
    "scale of another group": ("const int g = owns ? (w * PACK) / GS : 0;",
                               "const int g = owns ? ((w * PACK) / GS + 1) % NG : 0;"),
    "key slot skipped": ("tb += KS * KPS", "tb += KS * KPS + 1"),
    "one head set only": ("const int j = min(hset * HPS + jj, GH - 1);", "const int j = min(jj, GH - 1);"),
}


@needs_emu
@pytest.mark.parametrize("what", list(BROKEN))
def test_broken_quant_kernel_fails_emulation(what):
    ctx, Hq, Hkv, D, bs, dtype, gs, bits, window = [75, 1], 8, 1, 64, 16, "float32", 32, 4, None
    tensors, want, max_blocks, scale = quant_kernel_case(ctx, Hq, Hkv, D, bs, dtype, gs, bits, window)
    spec = quant_specs(tensors, ctx, Hq, Hkv, D, bs, dtype, gs, bits, window, max_blocks, scale, 1)[0]
    assert dict(spec.template)["HSETS"] > 1
    assert_close(emulate(spec, tensors), want, dtype)  # the intact kernel passes this case
    old, new = BROKEN[what]
    assert old in spec.source
    broken = dataclasses.replace(spec, name=f"{spec.name}_broken", source=spec.source.replace(old, new))
    with pytest.raises(AssertionError):
        assert_close(emulate(broken, tensors), want, dtype)


@needs_emu
def test_quant_kv_head_row_is_honoured():
    """Each KV head reads its own rows (kvh * NB + id) of the packed words and the groups: a
    kernel reading head 0's for every head fails the comparison."""
    ctx, Hq, Hkv, D, bs, dtype, gs, bits = [75, 20], 4, 2, 64, 16, "float32", 32, 8
    tensors, want, max_blocks, scale = quant_kernel_case(ctx, Hq, Hkv, D, bs, dtype, gs, bits, None)
    spec = quant_specs(tensors, ctx, Hq, Hkv, D, bs, dtype, gs, bits, None, max_blocks, scale, 1)[0]
    assert_close(emulate(spec, tensors), want, dtype)
    row = "const size_t row = size_t(kvh) * size_t(NB) + size_t(id);"
    assert row in spec.source
    broken = dataclasses.replace(spec, name=f"{spec.name}_head0",
                                 source=spec.source.replace(row, "const size_t row = size_t(id);"))
    with pytest.raises(AssertionError):
        assert_close(emulate(broken, tensors), want, dtype)


@pytest.fixture
def emulated_metal(monkeypatch):
    return emulate_dispatch(monkeypatch)


@needs_emu
@pytest.mark.parametrize("ctx,n_keys,launches", [
    ([40, 7], 40, ["paged_attention_quant"]),
    ([600, 7], 600, ["paged_attention_quant_split", "paged_attention_combine"]),
])
def test_quant_dispatch_under_emulation(emulated_metal, ctx, n_keys, launches):
    """paged_attention_quantized() as the engine calls it: its launches, emulated, match."""
    tensors, want, _, scale = quant_kernel_case(ctx, 8, 2, 128, 16, "float16", 64, 4, None)
    q = mx.array(tensors[0])
    k, v = tuple(mx.array(t) for t in tensors[1:4]), tuple(mx.array(t) for t in tensors[4:7])
    tables, lens = mx.array(tensors[7]), mx.array(tensors[8])
    index = paged_attention.rows_index(tables, 2, k[0].shape[1])  # the reference's hint only
    got = pq.paged_attention_quantized(q, k, v, tables, lens, scale, 64, 4, n_keys=n_keys,
                                       mask=None, index=index)
    assert emulated_metal == launches
    assert_close(np.array(got.astype(mx.float32)), want, "float16")


# ---------------------------------------------------------------- real Metal


def _mx(t: np.ndarray, dtype: str) -> mx.array:
    if t.dtype == np.uint16:  # bfloat16 bits
        return mx.array(from_kernel(t, dtype)).astype(mx.bfloat16)
    return mx.array(t)


@needs_metal
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("D,gs", [(64, 32), (64, 64), (96, 32), (128, 64), (128, 128)])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (8, 4), (8, 2), (16, 2), (32, 8)])
@pytest.mark.parametrize("ctx,window", [([1, 15, 16, 17], None), ([1000, 33, 4097], None),
                                        ([8190, 5], None), ([500, 64], 128)])
def test_paged_attention_quant_metal(ctx, window, Hq, Hkv, bs, bits, D, gs, dtype):
    tensors, want, _, scale = quant_kernel_case(ctx, Hq, Hkv, D, bs, dtype, gs, bits, window)
    q = _mx(tensors[0], dtype)
    k = (mx.array(tensors[1]), _mx(tensors[2], dtype), _mx(tensors[3], dtype))
    v = (mx.array(tensors[4]), _mx(tensors[5], dtype), _mx(tensors[6], dtype))
    tables, lens = mx.array(tensors[7]), mx.array(tensors[8])
    assert pq.kernel_supports_quantized(q, k, v, tables, gs, bits, window)
    got = pq.paged_attention_quantized(q, k, v, tables, lens, scale, gs, bits, window,
                                       n_keys=max(ctx))
    assert_close(np.array(got.astype(mx.float32)), want, dtype)
