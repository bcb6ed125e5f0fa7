"""What gemv_wide / qgemv_wide execute per weight element, counted in an emulated run.

A test-only copy of each kernel's source gets a counter at every device-load site and every
simd_shuffle_xor (a comma expression in the call, so the arithmetic is untouched), and each
thread stores its counters to an extra output. The totals must match the formulas the module
docstrings and /work/notes/i19_gemv.md state (vector loads per chunk, scale/bias loads per
chunk, shuffles per pass), and the instrumented kernel must produce the same bits as the real one.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from mlxlocal.metal import gemv_wide, qgemv_wide
from mlxlocal.metal.kernel import LaunchSpec

try:  # the emulation harness lives in tests/metal_emu
    from metal_emu import run_kernel
except ImportError:  # pragma: no cover - depends on the checkout
    run_kernel = None

pytestmark = pytest.mark.skipif(run_kernel is None, reason="tests/metal_emu is not importable")

COUNTERS = ("w", "x", "scale_bias", "scalar", "shuffle")  # index = counter slot
W, X, SB, SCALAR, SHUFFLE = range(len(COUNTERS))

# (text in the source, the same with a counter bumped in a comma expression: same value)
GEMV_SITES = [
    ("gemv_load4<ALIGNED>(wr[", f"gemv_load4<ALIGNED>((cnt[{W}]++, wr)["),
    ("gemv_load4<ALIGNED>(xr[", f"gemv_load4<ALIGNED>((cnt[{X}]++, xr)["),
    ("float(wr[c][k])", f"float((cnt[{SCALAR}]++, wr)[c][k])"),
    ("float(xr[r][k])", f"float((cnt[{SCALAR}]++, xr)[r][k])"),
]
QGEMV_SITES = [
    ("wr[c][i]", f"(cnt[{W}]++, wr)[c][i]"),
    ("xr[r][i * (V / 4) + p]", f"(cnt[{X}]++, xr)[r][i * (V / 4) + p]"),
    ("scales[sr[c] + g]", f"(cnt[{SB}]++, scales)[sr[c] + g]"),
    ("biases[sr[c] + g]", f"(cnt[{SB}]++, biases)[sr[c] + g]"),
]
SHUFFLE_SITES = [
    ("simd_shuffle_xor(send,", f"simd_shuffle_xor((cnt[{SHUFFLE}]++, send),"),
    ("simd_shuffle_xor(v[0],", f"simd_shuffle_xor((cnt[{SHUFFLE}]++, v[0]),"),
]


def instrumented(spec: LaunchSpec, sites) -> LaunchSpec:
    src = spec.source
    for text, counting in sites:
        assert text in src, f"the counting instrument is stale: {text!r} not in {spec.name}"
        src = src.replace(text, counting)
    n = len(COUNTERS)
    store = (f"{{ const uint gid = thread_position_in_grid.y * 32 + thread_position_in_grid.x;"
             f" for (int q = 0; q < {n}; q++) {{ counts[gid * {n} + q] = cnt[q]; }} }}")
    assert src.count("return;") == 1
    src = src.replace("return;", store + " return;")
    src = f"    uint cnt[{n}] = {{}};\n" + src + "    " + store + "\n"
    threads = spec.grid[0] * spec.grid[1]
    return dataclasses.replace(
        spec, name=spec.name + "_counted", source=src,
        output_names=spec.output_names + ("counts",),
        output_shapes=spec.output_shapes + ((threads, n),),
        output_dtypes=spec.output_dtypes + ("uint32",))


def _run(spec: LaunchSpec, tensors):
    return run_kernel(
        spec.name, spec.source, spec.header, list(spec.input_names), list(spec.output_names),
        list(tensors) + spec.constant_arrays(), [list(s) for s in spec.output_shapes],
        list(spec.output_dtypes), grid=spec.grid, threadgroup=spec.threadgroup,
        template=list(spec.template))


def counted(spec: LaunchSpec, tensors, sites) -> dict[str, int]:
    """Totals over all threads of each counter; asserts the instrument left the output alone."""
    y = _run(spec, tensors)[0]
    y_counted, counts = _run(instrumented(spec, sites + SHUFFLE_SITES), tensors)
    assert y_counted.tobytes() == y.tobytes()
    return dict(zip(COUNTERS, counts.sum(axis=0).tolist()))


def _dense(M, N, K, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, (M, K)).astype(np.float16),
            (rng.uniform(-1, 1, (N, K)) / math.sqrt(K)).astype(np.float16)]


def _shuffles_per_lane(rows: int) -> int:
    rp = max(4, 1 << (rows * gemv_wide.COLS - 1).bit_length())
    return rp - 1 + 5 - int(math.log2(rp))


@pytest.mark.parametrize("M,N,K", [(1, 20, 1024), (4, 9, 320), (8, 12, 1027), (5, 8, 72)])
def test_gemv_wide_load_and_shuffle_counts(M, N, K):
    spec = gemv_wide.launch_spec(M, N, K, "float16", False)
    c = counted(spec, _dense(M, N, K), GEMV_SITES)
    passes, rows = gemv_wide.tiling(M)
    simdgroups = math.ceil(N / gemv_wide.COLS)  # the rest return before loading anything
    chunks = K // 4  # each lane-row chunk is one load4: a vec4 load when K % 4 == 0
    assert c["w"] == passes * simdgroups * gemv_wide.COLS * chunks
    assert c["x"] == passes * simdgroups * rows * chunks
    assert c["scalar"] == passes * simdgroups * (gemv_wide.COLS + rows) * (K % 4)
    assert c["shuffle"] == passes * simdgroups * 32 * _shuffles_per_lane(rows)


def test_shuffle_formula_matches_the_issue():
    # one simd_sum per output cost 5 shuffle steps: 160 at M = 8; the butterfly: 16 per pass
    assert [_shuffles_per_lane(r) for r in (1, 2, 3, 4)] == [6, 9, 16, 16]
    assert [gemv_wide.tiling(M) for M in range(1, 9)] == [
        (1, 1), (1, 2), (1, 3), (1, 4), (2, 3), (2, 3), (2, 4), (2, 4)]


@pytest.mark.parametrize("M,N,K,gs,bits", [(1, 20, 1024, 64, 4), (3, 9, 384, 128, 8),
                                           (8, 6, 160, 32, 4)])
def test_qgemv_wide_load_and_shuffle_counts(M, N, K, gs, bits):
    rng = np.random.default_rng(0)
    words = K * bits // 32
    tensors = [rng.uniform(-1, 1, (M, K)).astype(np.float16),
               rng.integers(0, 2**32, (N, words), dtype=np.uint32),
               rng.uniform(0.01, 0.1, (N, K // gs)).astype(np.float16),
               rng.uniform(-0.1, 0.1, (N, K // gs)).astype(np.float16)]
    spec = qgemv_wide.launch_spec(M, N, K, "float16", gs, bits, False)
    c = counted(spec, tensors, QGEMV_SITES)
    passes, rows = gemv_wide.tiling(M)
    simdgroups = math.ceil(N / gemv_wide.COLS)
    chunks = K // qgemv_wide.CHUNK  # one vec<uint, CHUNK * bits / 32> load each
    assert c["w"] == passes * simdgroups * gemv_wide.COLS * chunks
    assert c["scale_bias"] == 2 * passes * simdgroups * gemv_wide.COLS * chunks
    assert c["x"] == passes * simdgroups * rows * chunks * (qgemv_wide.CHUNK // 4)
    assert c["scalar"] == 0
    assert c["shuffle"] == passes * simdgroups * 32 * _shuffles_per_lane(rows)
