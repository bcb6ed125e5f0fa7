"""The Metal kernels against their plain-MLX references.

- Everywhere: the dispatch points pick the kernel only for supported shapes, and each launch
  spec covers its output.
- Under CPU emulation (tests/metal_emu, a C++ model of Metal): the exact launch each dispatch
  point would make on a Mac (`launch_spec`), run on numpy inputs.
- On a Mac: the real kernels, through the dispatch points, over a wider sweep.
"""

from __future__ import annotations

import importlib
import math

import mlx.core as mx
import numpy as np
import pytest

from mlxlocal.metal import gemv_wide, qgemv_wide
from mlxlocal.metal.kernel import LaunchSpec

# The package re-exports the function `paged_attention` under the module's name.
paged_attention = importlib.import_module("mlxlocal.metal.paged_attention")

try:  # the emulation harness lives in tests/metal_emu
    from metal_emu import bfloat16, run_kernel
except ImportError:  # pragma: no cover - depends on the checkout
    bfloat16 = run_kernel = None

needs_emu = pytest.mark.skipif(run_kernel is None, reason="tests/metal_emu is not importable")
needs_metal = pytest.mark.skipif(not mx.metal.is_available(), reason="needs Metal (Apple Silicon)")

TOL = {"float16": 3e-3, "bfloat16": 2e-2, "float32": 1e-4}
MX_DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


# ---------------------------------------------------------------- helpers


def to_dtype(a: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(kernel input, its exact float32 value): bfloat16 goes in as uint16 bit patterns."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    if dtype == "bfloat16":
        u = a.view(np.uint32)
        bits = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
        return bits, from_kernel(bits, dtype)
    stored = a.astype(dtype)
    return stored, stored.astype(np.float32)


def from_kernel(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (np.asarray(a).view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(a).astype(np.float32)


SCHEDULE_SEEDS = (None, 1, 2)  # thread order, then two shuffled interleavings


def emulate(spec: LaunchSpec, tensors: list[np.ndarray]) -> np.ndarray:
    """Run `spec` exactly as the Metal dispatch would, under the CPU emulation: in thread order
    and in two seeded interleavings, which must agree bit for bit (a missing barrier or a race
    between threads would make them differ)."""
    inputs = [bfloat16(t) if t.dtype == np.uint16 else t for t in tensors]  # bf16 bit patterns
    outs = [run_kernel(
        spec.name, spec.source, spec.header, list(spec.input_names), list(spec.output_names),
        inputs + spec.constant_arrays(), [list(s) for s in spec.output_shapes],
        list(spec.output_dtypes), grid=spec.grid, threadgroup=spec.threadgroup,
        template=list(spec.template), schedule_seed=seed,
    )[0] for seed in SCHEDULE_SEEDS]
    for seed, out in zip(SCHEDULE_SEEDS[1:], outs[1:]):
        assert out.tobytes() == outs[0].tobytes(), f"{spec.name}: schedule seed {seed} changes the output"
    return from_kernel(outs[0], spec.output_dtypes[0])


def assert_close(got: np.ndarray, want: np.ndarray, dtype: str) -> None:
    tol = TOL[dtype]
    scale = max(1.0, float(np.abs(want).max()))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * scale)


def f32(a: np.ndarray) -> mx.array:
    return mx.array(np.asarray(a, dtype=np.float32))


def dense_case(M, N, K, dtype, has_bias, seed=0):
    rng = np.random.default_rng(seed)
    x, xf = to_dtype(rng.uniform(-1, 1, (M, K)), dtype)
    w, wf = to_dtype(rng.uniform(-1, 1, (N, K)) / math.sqrt(K), dtype)
    b, bf = to_dtype(rng.uniform(-1, 1, (N,)), dtype) if has_bias else (None, None)
    want = gemv_wide.linear_reference(f32(xf), f32(wf), None if bf is None else f32(bf))
    return [x, w] + ([b] if has_bias else []), np.array(want)


def quant_case(M, N, K, dtype, group_size, bits, has_bias, seed=0):
    rng = np.random.default_rng(seed)
    x, xf = to_dtype(rng.uniform(-1, 1, (M, K)), dtype)
    w_full = mx.array(rng.uniform(-1, 1, (N, K)).astype(np.float32) / math.sqrt(K))
    w_full = w_full.astype(MX_DTYPES[dtype])
    wq, scales, biases = mx.quantize(w_full, group_size=group_size, bits=bits)
    s, sf = to_dtype(np.array(scales.astype(mx.float32)), dtype)
    z, zf = to_dtype(np.array(biases.astype(mx.float32)), dtype)
    b, bf = to_dtype(rng.uniform(-1, 1, (N,)), dtype) if has_bias else (None, None)
    want = qgemv_wide.quantized_linear_reference(
        f32(xf), wq, f32(sf), f32(zf), group_size, bits, bias=None if bf is None else f32(bf))
    tensors = [x, np.array(wq), s, z] + ([b] if has_bias else [])
    return tensors, np.array(want)


# ---------------------------------------------------------------- everywhere


def test_dispatch_support_rules():
    x = mx.zeros((2, 1, 64), mx.float16)
    w = mx.zeros((32, 64), mx.float16)
    assert gemv_wide.kernel_supports(x, w, None)
    assert gemv_wide.kernel_supports(x, w, mx.zeros((32,), mx.float16))
    assert not gemv_wide.kernel_supports(mx.zeros((9, 64), mx.float16), w, None)  # M > 8
    assert not gemv_wide.kernel_supports(x.astype(mx.float32), w, None)  # mixed dtypes
    wq, s, b = mx.quantize(w, group_size=32, bits=4)
    assert qgemv_wide.kernel_supports(x, wq, s, b, 32, 4, "affine", None)
    assert not qgemv_wide.kernel_supports(x, wq, s, b, 32, 4, "mxfp4", None)
    assert not qgemv_wide.kernel_supports(mx.zeros((3, 4, 64), mx.float16), wq, s, b, 32, 4,
                                          "affine", None)  # M = 12
    q = mx.zeros((2, 8, 1, 80), mx.bfloat16)
    pool = mx.zeros((2, 10, 16, 80), mx.bfloat16)  # [kv_heads, blocks, block_size, dim]
    tables = mx.zeros((2, 4), mx.int32)
    assert paged_attention.kernel_supports(q, pool, pool, tables, None)
    assert paged_attention.kernel_supports(q, pool, pool, tables, 100)
    assert not paged_attention.kernel_supports(mx.zeros((2, 8, 3, 80), mx.bfloat16), pool, pool,
                                               tables, None)  # prefill (L > 1)
    assert not paged_attention.kernel_supports(q, pool[:, :, :8], pool[:, :, :8], tables, None)  # bs 8


@pytest.mark.parametrize("N", [1, 15, 16, 17, 151936])
def test_gemv_launch_covers_every_column(N):
    for spec in (gemv_wide.launch_spec(8, N, 64, "float16", False),
                 qgemv_wide.launch_spec(8, N, 64, "float16", 32, 4, True)):
        simdgroups = spec.grid[1]
        assert spec.grid[0] == spec.threadgroup[0] == 32
        assert spec.grid[1] % spec.threadgroup[1] == 0
        assert simdgroups * gemv_wide.COLS >= N > (simdgroups - spec.threadgroup[1]) * gemv_wide.COLS


def test_cpu_dispatch_is_the_reference():
    if mx.metal.is_available():
        pytest.skip("on Metal the dispatch runs the kernel (covered below)")
    tensors, _ = dense_case(3, 20, 72, "float32", True)
    x, w, b = (mx.array(t) for t in tensors)
    assert mx.array_equal(gemv_wide.linear(x, w, b), gemv_wide.linear_reference(x, w, b))


# ---------------------------------------------------------------- emulation
# Each case is a distinct template instantiation (one compile) unless noted; keep the list short.

DENSE_EMU = [
    # M, N, K, dtype, bias. Chunks = K // 4 per row; the main loop takes 64 chunks per lane step
    # (32 lanes x UNROLL 2), the rest one per lane; K % 4 != 0 runs the scalar (unaligned) path.
    (1, 20, 72, "float16", False),  # remainder chunks only; 2nd threadgroup: 3 simdgroups return
    (1, 36, 2560, "float16", True),  # a 4B model's hidden size: 10 main steps
    (2, 33, 100, "float16", True),
    (2, 1, 64, "float16", True),  # N = 1: columns 1..3 re-read row 0 and store nothing
    (3, 16, 256, "float16", False),  # exactly one main step, no remainder
    (4, 7, 45, "float16", True),  # N < COLS * SIMDGROUPS, unaligned K
    (5, 40, 320, "float16", False),  # two passes of 3 rows (row 5 = a clamped copy, not stored)
    (6, 24, 200, "float16", False),
    (7, 9, 31, "float16", False),  # K < 32: unaligned, lanes idle in the tail
    (8, 50, 136, "float16", True),  # two full passes of 4: R = 16 per pass
    (8, 12, 1027, "float16", False),  # unaligned K with main steps (scalar load4) + 3-element tail
    (1, 21, 4096, "bfloat16", False),
    (3, 37, 96, "bfloat16", True),
    (5, 18, 1024, "bfloat16", True),
    (8, 18, 42, "bfloat16", False),  # unaligned bfloat16: vec<T, 4> built from 4 scalars
    (1, 13, 515, "float32", True),  # unaligned float32
    (2, 21, 70, "float32", False),
    (4, 17, 2048, "float32", False),
    (6, 5, 8, "float32", True),  # K = MIN_K
]


@needs_emu
@pytest.mark.parametrize("M,N,K,dtype,bias", DENSE_EMU)
def test_gemv_wide_emulated(M, N, K, dtype, bias):
    tensors, want = dense_case(M, N, K, dtype, bias)
    got = emulate(gemv_wide.launch_spec(M, N, K, dtype, bias), tensors)
    assert_close(got, want, dtype)


QUANT_EMU = [
    # M, N, K, dtype, group_size, bits, bias. Chunks of 16 values = K // 16 per row, one per lane.
    (1, 20, 96, "float16", 32, 4, False),  # K = 3 groups: 6 chunks, most lanes idle
    (1, 36, 2560, "float16", 64, 4, True),  # 4B hidden: 160 chunks, 5 per lane
    (2, 12, 160, "float16", 32, 8, True),
    (3, 17, 256, "float16", 64, 4, True),
    (4, 9, 1024, "bfloat16", 128, 8, True),  # several chunks per lane
    (5, 40, 192, "float16", 64, 8, False),  # two passes of 3
    (6, 10, 640, "bfloat16", 128, 4, False),
    (7, 24, 128, "bfloat16", 32, 4, False),
    (8, 33, 384, "float16", 128, 4, False),  # 3 groups of 128
    (8, 7, 2048, "bfloat16", 64, 8, True),
    (2, 5, 4096, "float16", 128, 4, False),
    (1, 3, 9728, "bfloat16", 64, 4, False),  # a 4B model's MLP width (down_proj K)
    (3, 6, 512, "float32", 32, 8, True),
]


@needs_emu
@pytest.mark.parametrize("M,N,K,dtype,gs,bits,bias", QUANT_EMU)
def test_qgemv_wide_emulated(M, N, K, dtype, gs, bits, bias):
    tensors, want = quant_case(M, N, K, dtype, gs, bits, bias)
    got = emulate(qgemv_wide.launch_spec(M, N, K, dtype, gs, bits, bias), tensors)
    assert_close(got, want, dtype)


def test_gemv_launch_contracts():
    """Shapes outside a kernel's contract fail with the limit named, and the dispatch gate
    (kernel_supports) refuses them instead of launching."""
    with pytest.raises(ValueError, match="K >= 8"):
        gemv_wide.launch_spec(1, 4, 7, "float16", False)
    with pytest.raises(ValueError, match="M <= 8"):
        gemv_wide.launch_spec(9, 4, 64, "float16", False)
    assert not gemv_wide.kernel_supports(mx.zeros((1, 7), mx.float16), mx.zeros((4, 7), mx.float16),
                                         None)
    assert dict(gemv_wide.launch_spec(1, 4, 64, "float16", False).template)["ALIGNED"] == 1
    assert dict(gemv_wide.launch_spec(1, 4, 66, "float16", False).template)["ALIGNED"] == 0
    with pytest.raises(ValueError, match="multiple of group_size 64"):
        qgemv_wide.launch_spec(1, 4, 96, "float16", 64, 4, False)
    with pytest.raises(ValueError, match="bits 3"):
        qgemv_wide.launch_spec(1, 4, 96, "float16", 32, 3, False)
    with pytest.raises(ValueError, match="needs >= 8"):
        qgemv_wide.launch_spec(1, 1, 32, "float16", 32, 4, False)  # 4 words: constant space
    w = mx.zeros((1, 32), mx.float16)
    wq, s, b = mx.quantize(w, group_size=32, bits=4)
    assert not qgemv_wide.kernel_supports(mx.zeros((1, 32), mx.float16), wq, s, b, 32, 4,
                                          "affine", None)



# ---------------------------------------------------------------- real Metal


def _mx(t: np.ndarray, dtype: str) -> mx.array:
    if t.dtype == np.uint16:  # bfloat16 bits
        return mx.array(from_kernel(t, dtype)).astype(mx.bfloat16)
    return mx.array(t)


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32))


@needs_metal
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("M", range(1, 9))
@pytest.mark.parametrize("N,K,bias", [(20, 72, False), (33, 100, True), (1024, 1024, False),
                                      (4096, 2560, True), (151, 4095, False)])
def test_gemv_wide_metal(M, N, K, bias, dtype):
    tensors, want = dense_case(M, N, K, dtype, bias)
    args = [_mx(t, dtype) for t in tensors]
    assert gemv_wide.kernel_supports(args[0], args[1], args[2] if bias else None)
    assert_close(_np(gemv_wide.linear(*args)), want, dtype)


@needs_metal
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("M", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 64, 128])
@pytest.mark.parametrize("N,K,bias", [(20, 384, False), (33, 1024, True), (2048, 4096, False)])
def test_qgemv_wide_metal(M, N, K, bias, gs, bits, dtype):
    tensors, want = quant_case(M, N, K, dtype, gs, bits, bias)
    x, wq, s, z = (_mx(t, dtype) if t.dtype != np.uint32 else mx.array(t) for t in tensors[:4])
    b = _mx(tensors[4], dtype) if bias else None
    assert qgemv_wide.kernel_supports(x, wq, s, z, gs, bits, "affine", b)
    got = qgemv_wide.quantized_linear(x, wq, s, z, gs, bits, bias=b)
    assert_close(_np(got), want, dtype)
