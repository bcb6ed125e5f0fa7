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
    pool = mx.zeros((10, 16, 2, 80), mx.bfloat16)
    tables = mx.zeros((2, 4), mx.int32)
    assert paged_attention.kernel_supports(q, pool, pool, tables, None)
    assert paged_attention.kernel_supports(q, pool, pool, tables, 100)
    assert not paged_attention.kernel_supports(mx.zeros((2, 8, 3, 80), mx.bfloat16), pool, pool,
                                               tables, None)  # prefill (L > 1)
    assert not paged_attention.kernel_supports(q, pool[:, :8], pool[:, :8], tables, None)  # bs 8


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
    # M, N, K, dtype, bias
    (1, 20, 72, "float16", False),  # N not a multiple of the 16-column tile; K % 32 != 0
    (2, 33, 100, "float16", True),  # K % 8 == 4: scalar tail
    (3, 16, 256, "float16", False),
    (4, 7, 45, "float16", True),  # N < one simdgroup's columns, K odd
    (5, 40, 64, "float16", False),
    (6, 24, 200, "float16", False),
    (7, 9, 31, "float16", False),  # K < 32: some lanes idle
    (8, 50, 136, "float16", True),  # M * COLS = 32: every lane stores
    (3, 37, 96, "bfloat16", True),
    (8, 18, 40, "bfloat16", False),
    (2, 21, 70, "float32", False),
]


@needs_emu
@pytest.mark.parametrize("M,N,K,dtype,bias", DENSE_EMU)
def test_gemv_wide_emulated(M, N, K, dtype, bias):
    tensors, want = dense_case(M, N, K, dtype, bias)
    got = emulate(gemv_wide.launch_spec(M, N, K, dtype, bias), tensors)
    assert_close(got, want, dtype)


QUANT_EMU = [
    # M, N, K, dtype, group_size, bits, bias
    (1, 20, 96, "float16", 32, 4, False),  # K = 3 groups: not a multiple of 64 / 128
    (3, 17, 256, "float16", 64, 4, True),
    (8, 33, 384, "float16", 128, 4, False),  # 3 groups of 128
    (2, 12, 160, "float16", 32, 8, True),
    (5, 40, 192, "float16", 64, 8, False),
    (4, 9, 1024, "bfloat16", 128, 8, True),  # several words per lane
    (7, 24, 128, "bfloat16", 32, 4, False),
]


@needs_emu
@pytest.mark.parametrize("M,N,K,dtype,gs,bits,bias", QUANT_EMU)
def test_qgemv_wide_emulated(M, N, K, dtype, gs, bits, bias):
    tensors, want = quant_case(M, N, K, dtype, gs, bits, bias)
    got = emulate(qgemv_wide.launch_spec(M, N, K, dtype, gs, bits, bias), tensors)
    assert_close(got, want, dtype)


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
