"""Self-tests of the Metal emulation harness (tests/metal_emu) on known Metal semantics."""

from __future__ import annotations

import metal_emu
import numpy as np
import pytest
from metal_emu import KernelCompileError, KernelRuntimeError, run_kernel

pytestmark = pytest.mark.skipif(not metal_emu.compiler_available(),
                                reason=metal_emu.skip_reason())

RNG = np.random.default_rng(0)


def run1(source, inputs, out_shape, out_dtype=np.float32, grid=None, threadgroup=(32, 1, 1),
         header="", input_names=None, template=None, **kw):
    """One-output helper: inputs named inp0, inp1, ...; output named `out`."""
    names = input_names or [f"inp{i}" for i in range(len(inputs))]
    (out,) = run_kernel("t", source, header, names, ["out"], inputs, [out_shape], [out_dtype],
                        grid, threadgroup, template or [], **kw)
    return out


def simd_groups(n_threads: int, tg: int):
    """(group, simdgroup) id of each thread of a 1-D dispatch, for numpy expectations."""
    idx = np.arange(n_threads)
    local = idx % tg
    return idx // tg * 1000 + local // 32


# --------------------------------------------------------------------------------------------
# The MLX docs example
# --------------------------------------------------------------------------------------------
EXP_SOURCE = """
        uint elem = thread_position_in_grid.x;
        T tmp = inp[elem];
        out[elem] = metal::exp(tmp);
"""


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_exp_elementwise_from_mlx_docs(dtype):
    a = RNG.standard_normal((4, 16)).astype(dtype)
    (out,) = run_kernel(name="myexp", input_names=["inp"], output_names=["out"],
                        source=EXP_SOURCE, inputs=[a], template=[("T", dtype)],
                        grid=(a.size, 1, 1), threadgroup=(256, 1, 1),
                        output_shapes=[a.shape], output_dtypes=[dtype])
    assert out.dtype == dtype and out.shape == a.shape
    tol = 1e-6 if dtype == np.float32 else 1e-3
    np.testing.assert_allclose(out.astype(np.float32), np.exp(a.astype(np.float32)),
                               rtol=tol, atol=tol)


def test_metal_kernel_drop_in_with_mx_arrays():
    mx = pytest.importorskip("mlx.core")
    kernel = metal_emu.metal_kernel(name="myexp", input_names=["inp"], output_names=["out"],
                                    source=EXP_SOURCE)
    a = mx.random.normal((64,)).astype(mx.bfloat16)
    (out,) = kernel(inputs=[a], template=[("T", mx.bfloat16)], grid=(64, 1, 1),
                    threadgroup=(32, 1, 1), output_shapes=[a.shape],
                    output_dtypes=[mx.bfloat16])
    assert out.dtype == mx.bfloat16
    ref = mx.exp(a.astype(mx.float32)).astype(mx.bfloat16)
    np.testing.assert_allclose(np.array(out.astype(mx.float32)),
                               np.array(ref.astype(mx.float32)), rtol=1e-2)


# --------------------------------------------------------------------------------------------
# SIMD-group functions
# --------------------------------------------------------------------------------------------
def test_simd_sum_full_and_partial_simdgroups():
    # 101 threads in groups of 64: group 1 has a full simdgroup and a 5-lane partial one.
    n, tg = 101, 64
    x = RNG.standard_normal(n).astype(np.float32)
    src = "out[thread_position_in_grid.x] = simd_sum(inp0[thread_position_in_grid.x]);"
    out = run1(src, [x], (n,), grid=(n, 1, 1), threadgroup=(tg, 1, 1))
    ids = simd_groups(n, tg)
    expected = np.array([x[ids == i].sum() for i in ids], dtype=np.float32)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)
    assert len({len(x[ids == i]) for i in ids}) == 2  # full and partial groups both covered


def test_simd_max_min_prefix_and_integer_sum():
    n = 96
    x = RNG.standard_normal(n).astype(np.float32)
    ints = RNG.integers(-50, 50, n).astype(np.int32)
    src = """
        uint i = thread_position_in_grid.x;
        out[4 * i + 0] = simd_max(inp0[i]);
        out[4 * i + 1] = simd_min(inp0[i]);
        out[4 * i + 2] = simd_prefix_exclusive_sum(inp0[i]);
        out[4 * i + 3] = float(simd_sum(inp1[i]));
    """
    out = run1(src, [x, ints], (n * 4,), grid=(n, 1, 1), threadgroup=(96, 1, 1)).reshape(n, 4)
    xs, isum = x.reshape(-1, 32), ints.reshape(-1, 32)
    np.testing.assert_array_equal(out[:, 0], np.repeat(xs.max(1), 32))
    np.testing.assert_array_equal(out[:, 1], np.repeat(xs.min(1), 32))
    excl = np.cumsum(xs, axis=1) - xs
    np.testing.assert_allclose(out[:, 2], excl.ravel(), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[:, 3], np.repeat(isum.sum(1), 32).astype(np.float32))


def test_simd_shuffles_and_broadcasts():
    n = 64
    x = np.arange(n, dtype=np.float32) * 1.5 + 3
    src = """
        uint i = thread_position_in_grid.x;
        ushort lane = thread_index_in_simdgroup;
        float v = inp0[i];
        out[8 * i + 0] = simd_shuffle_down(v, 3);
        out[8 * i + 1] = simd_shuffle_up(v, 5);
        out[8 * i + 2] = simd_shuffle_xor(v, 6);
        out[8 * i + 3] = simd_broadcast(v, 7);
        out[8 * i + 4] = simd_broadcast_first(v);
        out[8 * i + 5] = simd_shuffle(v, ushort((lane * 7) % 32));
        out[8 * i + 6] = simd_shuffle_rotate_down(v, 4);
        float r = v;  // butterfly reduction must equal simd_sum
        for (ushort o = 16; o > 0; o /= 2) r += simd_shuffle_xor(r, o);
        out[8 * i + 7] = r - simd_sum(v);
    """
    out = run1(src, [x], (n * 8,), grid=(n, 1, 1), threadgroup=(64, 1, 1)).reshape(n, 8)
    lane = np.arange(n) % 32
    base = np.arange(n) - lane
    down = np.where(lane + 3 < 32, base + lane + 3, np.arange(n))
    up = np.where(lane >= 5, base + lane - 5, np.arange(n))
    np.testing.assert_array_equal(out[:, 0], x[down])
    np.testing.assert_array_equal(out[:, 1], x[up])
    np.testing.assert_array_equal(out[:, 2], x[base + (lane ^ 6)])
    np.testing.assert_array_equal(out[:, 3], x[base + 7])
    np.testing.assert_array_equal(out[:, 4], x[base])
    np.testing.assert_array_equal(out[:, 5], x[base + (lane * 7) % 32])
    np.testing.assert_array_equal(out[:, 6], x[base + (lane + 4) % 32])
    np.testing.assert_allclose(out[:, 7], 0, atol=1e-3)


def test_simd_sum_skips_lanes_that_returned():
    src = """
        uint i = thread_position_in_grid.x;
        if (thread_index_in_simdgroup >= 20) return;
        out[i] = simd_sum(inp0[i]);
    """
    x = np.ones(32, dtype=np.float32)
    out = run1(src, [x], (32,), grid=(32, 1, 1))
    np.testing.assert_array_equal(out[:20], 20)


def test_simd_vector_and_half_values():
    src = """
        uint i = thread_position_in_grid.x;
        float4 v = float4(inp0[i], 2.0f * inp0[i], float2(1.0f, -inp0[i]));
        float4 s = simd_sum(v);
        half h = simd_max(half(inp0[i]));
        out[5 * i + 0] = s.x; out[5 * i + 1] = s.y; out[5 * i + 2] = s.z; out[5 * i + 3] = s.w;
        out[5 * i + 4] = float(h);
    """
    x = np.arange(32, dtype=np.float32)
    out = run1(src, [x], (32 * 5,), grid=(32, 1, 1)).reshape(32, 5)
    np.testing.assert_allclose(out[0], [x.sum(), 2 * x.sum(), 32, -x.sum(), 31])


# --------------------------------------------------------------------------------------------
# Threadgroup memory and barriers
# --------------------------------------------------------------------------------------------
TG_SOURCE = """
    uint tid = thread_position_in_threadgroup.x;
    uint n = threads_per_threadgroup.x;
    threadgroup float tg[128];
    tg[tid] = inp0[thread_position_in_grid.x];
    {barrier}
    out[thread_position_in_grid.x] = tg[(tid + 1) % n];
"""


def test_threadgroup_memory_with_barrier():
    n, tg = 300, 128  # last group is partial (44 threads)
    x = RNG.standard_normal(n).astype(np.float32)
    src = TG_SOURCE.replace("{barrier}", "threadgroup_barrier(mem_flags::mem_threadgroup);")
    out = run1(src, [x], (n,), grid=(n, 1, 1), threadgroup=(tg, 1, 1))
    idx = np.arange(n)
    start = idx // tg * tg
    size = np.minimum(tg, n - start)
    np.testing.assert_array_equal(out, x[start + (idx - start + 1) % size])


def test_threadgroup_memory_without_barrier_is_wrong():
    n, tg = 256, 128
    x = RNG.standard_normal(n).astype(np.float32)
    src = TG_SOURCE.replace("{barrier}", "")
    out = run1(src, [x], (n,), grid=(n, 1, 1), threadgroup=(tg, 1, 1))
    # Thread k reads tg[k+1] before thread k+1 wrote it: uninitialised (NaN pattern).
    assert np.isnan(out).sum() >= tg


def test_threadgroups_do_not_share_threadgroup_memory():
    src = """
        uint tid = thread_index_in_threadgroup;
        uint g = threadgroup_position_in_grid.x;
        threadgroup float seen[64];
        threadgroup uint ids[64], tag;
        float before = seen[tid];          // uninitialised in every group
        if (tid == 0) tag = g;
        ids[tid] = g * 1000 + tid;
        seen[tid] = 1.0f;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (tid == 0) {
            float s = 0.0f;
            for (uint k = 0; k < threads_per_threadgroup.x; k++) s += float(ids[k]);
            out[3 * g + 0] = s;
            out[3 * g + 1] = float(tag);
        }
        if (tid == 5) out[3 * g + 2] = before;
    """
    out = run1(src, [np.zeros(1, np.float32)], (12,), grid=(256, 1, 1),
               threadgroup=(64, 1, 1)).reshape(4, 3)
    for g in range(4):
        assert out[g, 0] == sum(g * 1000 + t for t in range(64))
        assert out[g, 1] == g
        assert np.isnan(out[g, 2])  # nothing leaks from the previous group


def test_header_helpers_threadgroup_pointers_and_half_literals():
    header = """
    #include <metal_stdlib>
    using namespace metal;
    template <typename T>
    METAL_FUNC T tg_reduce(threadgroup T* buf, uint tid, uint n) {
        for (uint s = n / 2; s > 0; s /= 2) {
            if (tid < s) buf[tid] += buf[tid + s];
            threadgroup_barrier(mem_flags::mem_threadgroup);
        }
        return buf[0];
    }
    """
    src = """
        uint tid = thread_position_in_threadgroup.x;
        // the partial sums live in threadgroup memory
        threadgroup float buf[64];  /* one per thread; threadgroup x; */
        threadgroup float* p = buf;   // a pointer to threadgroup memory stays thread-private
        p[tid] = inp0[thread_position_in_grid.x] * float(0.5h + 0.5h);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        float total = tg_reduce(buf, tid, 64);
        if (tid == 0) out[threadgroup_position_in_grid.x] = total;
    """
    x = RNG.standard_normal(128).astype(np.float32)
    out = run1(src, [x], (2,), grid=(128, 1, 1), threadgroup=(64, 1, 1), header=header)
    np.testing.assert_allclose(out, x.reshape(2, 64).sum(1), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# Attributes, grids, partial edge groups
# --------------------------------------------------------------------------------------------
ATTRS = [
    "thread_position_in_grid", "thread_position_in_threadgroup",
    "threadgroup_position_in_grid", "threads_per_threadgroup", "threads_per_grid",
    "threadgroups_per_grid", "thread_index_in_threadgroup", "thread_index_in_simdgroup",
    "simdgroup_index_in_threadgroup", "simdgroups_per_threadgroup",
]


@pytest.mark.parametrize("grid,tg", [((10, 7, 3), (4, 4, 2)), ((40, 3, 1), (32, 2, 1)),
                                     ((5, 1, 1), (32, 1, 1))])
def test_attribute_values(grid, tg):
    lines = ["uint3 p = thread_position_in_grid;",
             f"uint base = ((p.z * {grid[1]} + p.y) * {grid[0]} + p.x) * 24;", "uint k = 0;"]
    for a in ATTRS:
        if a in ("thread_index_in_threadgroup", "thread_index_in_simdgroup",
                 "simdgroup_index_in_threadgroup", "simdgroups_per_threadgroup"):
            lines.append(f"out[base + k++] = {a};")
        else:
            lines += [f"out[base + k++] = {a}.x;", f"out[base + k++] = {a}.y;",
                      f"out[base + k++] = {a}.z;"]
    n = grid[0] * grid[1] * grid[2]
    out = run1("\n".join(lines), [np.zeros(1, np.uint32)], (n * 24,), np.uint32, grid=grid,
               threadgroup=tg, init_value=12345).reshape(grid[2], grid[1], grid[0], 24)
    t = tuple(min(a, b) for a, b in zip(tg, grid))  # MLX clamps the group to the grid
    ngroups = tuple(-(-g // d) for g, d in zip(grid, t))
    for z in range(grid[2]):
        for y in range(grid[1]):
            for x in range(grid[0]):
                pos = (x, y, z)
                gpos = tuple(p // d for p, d in zip(pos, t))
                local = tuple(p % d for p, d in zip(pos, t))
                size = tuple(min(d, g - gp * d) for d, g, gp in zip(t, grid, gpos))
                index = local[0] + local[1] * size[0] + local[2] * size[0] * size[1]
                nthreads = size[0] * size[1] * size[2]
                expected = [*pos, *local, *gpos, *size, *grid, *ngroups, index, index % 32,
                            index // 32, -(-nthreads // 32)]
                got = [int(v) for v in out[z, y, x]]
                assert got == expected + [12345, 12345], (pos, got, expected)


# --------------------------------------------------------------------------------------------
# half / bfloat16
# --------------------------------------------------------------------------------------------
def _special_floats():
    vals = [0.0, -0.0, 1.0, -1.0, 65504.0, 65520.0, 70000.0, 1e-8, 6e-8, 3e-5, 1.0009765625,
            1.00048828125, 1.00146484375, 3.14159265, np.inf, -np.inf, np.nan,
            1.00390625, 1.005859375, 1.001953125, 3.3895314e38, -2.5e-39]
    rnd = RNG.standard_normal(200) * 10.0 ** RNG.integers(-10, 10, 200)
    return np.concatenate([vals, rnd]).astype(np.float32)


def _to_half(x: np.ndarray) -> np.ndarray:
    # The special values include finite floats beyond half's range: overflow to inf is the point.
    with np.errstate(over="ignore"):
        return x.astype(np.float16)


def test_half_and_bfloat_conversions_match_numpy_and_mlx():
    mx = pytest.importorskip("mlx.core")
    x = _special_floats()
    src = """
        uint i = thread_position_in_grid.x;
        out_h[i] = half(inp[i]);
        out_b[i] = bfloat16_t(inp[i]);
        back_h[i] = float(half(inp[i]));
        back_b[i] = float(static_cast<bfloat16_t>(inp[i]));
    """
    n = x.size
    oh, ob, bh, bb = run_kernel(
        "conv", src, "", ["inp"], ["out_h", "out_b", "back_h", "back_b"], [x],
        [(n,)] * 4, ["float16", "bfloat16", np.float32, np.float32], (n, 1, 1), (64, 1, 1))
    np.testing.assert_array_equal(oh.view(np.uint16), _to_half(x).view(np.uint16))
    mlx_bits = np.array(mx.array(x).astype(mx.bfloat16).view(mx.uint16))
    finite = ~np.isnan(x)
    np.testing.assert_array_equal(ob[finite], mlx_bits[finite])
    assert np.isnan(metal_emu.bf16_to_float32(ob[~finite])).all()
    np.testing.assert_array_equal(metal_emu.float32_to_bf16(x)[finite], mlx_bits[finite])
    np.testing.assert_array_equal(bh, _to_half(x).astype(np.float32))
    np.testing.assert_array_equal(bb[finite], metal_emu.bf16_to_float32(mlx_bits)[finite])


def test_half_and_bfloat_inputs_round_trip():
    mx = pytest.importorskip("mlx.core")
    x = _special_floats()
    h = _to_half(x)
    b = mx.array(x).astype(mx.bfloat16)
    src = """
        uint i = thread_position_in_grid.x;
        out[2 * i] = float(a[i]);
        out[2 * i + 1] = float(b[i]) + float(c[i]) * 0.0f;
    """
    bits = np.array(b.view(mx.uint16))
    for b_input in (b, metal_emu.bfloat16(bits)):
        (out,) = run_kernel("rt", src, "", ["a", "b", "c"], ["out"],
                            [h, b_input, bits], [(2 * x.size,)], [np.float32],
                            (x.size, 1, 1), (32, 1, 1), input_dtypes=None
                            if not isinstance(b_input, np.ndarray) else [None, None, None])
        out = out.reshape(-1, 2)
        np.testing.assert_array_equal(out[:, 0], h.astype(np.float32))
        np.testing.assert_array_equal(out[:, 1], np.array(b.astype(mx.float32)))
    # a raw uint16 array marked bfloat16 through input_dtypes
    (out,) = run_kernel("rt", src, "", ["a", "b", "c"], ["out"], [h, bits, bits],
                        [(2 * x.size,)], [np.float32], (x.size, 1, 1), (32, 1, 1),
                        input_dtypes=[None, "bfloat16", None])
    np.testing.assert_array_equal(out.reshape(-1, 2)[:, 1], np.array(b.astype(mx.float32)))


def test_bfloat_arithmetic_rounds_like_mlx():
    mx = pytest.importorskip("mlx.core")
    x = RNG.standard_normal(64).astype(np.float32)
    y = RNG.standard_normal(64).astype(np.float32)
    src = """
        uint i = thread_position_in_grid.x;
        bfloat16_t a = inp0[i], b = inp1[i];
        out[i] = a * b + a;
    """
    xb, yb = metal_emu.float32_to_bf16(x), metal_emu.float32_to_bf16(y)
    out = run1(src, [metal_emu.bfloat16(xb), metal_emu.bfloat16(yb)], (64,), "bfloat16",
               grid=(64, 1, 1))
    ma = mx.array(xb).view(mx.bfloat16)
    mb = mx.array(yb).view(mx.bfloat16)
    ref = np.array((ma * mb + ma).view(mx.uint16))
    np.testing.assert_array_equal(out, ref)


# --------------------------------------------------------------------------------------------
# Templates, shapes, scalars, vectors
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("T", ["float16", "bfloat16", "float32"])
def test_template_type_int_and_bool(T):
    src = """
        uint i = thread_position_in_grid.x;
        out[i] = static_cast<T>(float(inp0[i]) * M + (B ? 0.5f : 0.0f));
    """
    x = np.arange(16, dtype=np.float32)
    out = run1(src, [x], (16,), T, grid=(16, 1, 1),
               template=[("T", T), ("M", 3), ("B", True)])
    got = metal_emu.bf16_to_float32(out) if T == "bfloat16" else out.astype(np.float32)
    np.testing.assert_array_equal(got, x * 3 + 0.5)


def test_shape_strides_ndim_and_scalar_inputs():
    x = np.zeros((2, 3, 5), dtype=np.float32)
    scale = np.array(2.5, dtype=np.float32)  # 0-d: passed by reference
    src = """
        if (thread_position_in_grid.x == 0) {
            for (int d = 0; d < a_ndim; d++) {
                out[d] = a_shape[d];
                out[3 + d] = float(a_strides[d]);
            }
            out[6] = a_ndim;
            out[7] = s;
        }
    """
    (out,) = run_kernel("shapes", src, "", ["a", "s"], ["out"], [x, scale], [(8,)],
                        [np.float32], (1, 1, 1), (1, 1, 1))
    np.testing.assert_array_equal(out, [2, 3, 5, 15, 5, 1, 3, 2.5])


def test_vector_types_and_math():
    src = """
        uint i = thread_position_in_grid.x;
        const device float4* v = reinterpret_cast<const device float4*>(inp0);
        float4 a = v[i];
        half4 h = half4(a);
        float4 b = float4(h) * 2.0f + 1.0f;
        out[4 * i + 0] = dot(a, b);
        out[4 * i + 1] = metal::max(a.x, a.y) + fast::exp(a.z) + precise::sqrt(metal::abs(a.w));
        out[4 * i + 2] = as_type<float>(as_type<uint>(a.x));
        out[4 * i + 3] = metal::numeric_limits<float>::infinity() > 1e38f ? rsqrt(4.0f) : 0.0f;
    """
    x = RNG.standard_normal(32).astype(np.float32)
    out = run1(src, [x], (32,), grid=(8, 1, 1)).reshape(8, 4)
    a = x.reshape(8, 4)
    b = a.astype(np.float16).astype(np.float32) * 2 + 1
    np.testing.assert_allclose(out[:, 0], (a * b).sum(1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[:, 1], np.maximum(a[:, 0], a[:, 1]) + np.exp(a[:, 2])
                               + np.sqrt(np.abs(a[:, 3])), rtol=1e-5)
    np.testing.assert_array_equal(out[:, 2], a[:, 0])
    np.testing.assert_array_equal(out[:, 3], 0.5)


def test_init_value_and_threads_outside_grid_do_not_run():
    src = "out[thread_position_in_grid.x] = 1.0f;"
    out = run1(src, [np.zeros(1, np.float32)], (50,), grid=(40, 1, 1),
               threadgroup=(32, 1, 1), init_value=-1.0)
    np.testing.assert_array_equal(out, [1.0] * 40 + [-1.0] * 10)


def test_compiled_kernels_are_cached():
    src = "out[thread_position_in_grid.x] = inp0[thread_position_in_grid.x] + 41.0f;"
    x = np.ones(4, np.float32)
    run1(src, [x], (4,), grid=(4, 1, 1))
    n_libs = len(metal_emu._libs)
    np.testing.assert_array_equal(run1(src, [x * 2], (4,), grid=(4, 1, 1)), 43.0)
    assert len(metal_emu._libs) == n_libs


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------
def test_compile_error_reports_compiler_message_and_source_line():
    src = """
        uint i = thread_position_in_grid.x;
        out[i] = undeclared_thing + 1.0f;
    """
    with pytest.raises(KernelCompileError) as e:
        run1(src, [np.zeros(4, np.float32)], (4,), grid=(4, 1, 1))
    msg = str(e.value)
    assert "undeclared_thing" in msg and "error" in msg
    assert "kernel source line 3" in msg
    assert "out[i] = undeclared_thing + 1.0f;" in msg
    assert e.value.stderr and "custom_kernel_t" in e.value.source


def test_out_of_bounds_access_is_reported():
    src = "out[thread_position_in_grid.x * 4096] = inp0[0];"
    with pytest.raises(KernelRuntimeError, match="buffer 'out'.*out-of-bounds"):
        run1(src, [np.zeros(1, np.float32)], (16,), grid=(16, 1, 1))
    src = "out[int(thread_position_in_grid.x) - 1] = 1.0f;"  # the bytes just before `out`
    with pytest.raises(KernelRuntimeError, match="out-of-bounds write to buffer 'out'"):
        run1(src, [np.zeros(1, np.float32)], (15,), grid=(15, 1, 1))


def test_deadlock_and_divergence_are_reported():
    src = """
        if (thread_index_in_threadgroup == 0) threadgroup_barrier(mem_flags::mem_threadgroup);
        else out[thread_index_in_threadgroup] = simd_sum(1.0f);
    """
    with pytest.raises(KernelRuntimeError, match="deadlock"):
        run1(src, [np.zeros(1, np.float32)], (64,), grid=(64, 1, 1), threadgroup=(64, 1, 1))
    src = """
        uint l = thread_index_in_simdgroup;
        out[l] = l < 16 ? simd_sum(1.0f) : simd_max(1.0f);
    """
    with pytest.raises(KernelRuntimeError, match="divergent"):
        run1(src, [np.zeros(1, np.float32)], (32,), grid=(32, 1, 1))


def test_threadgroup_memory_limit_and_division_by_zero():
    src = """
        threadgroup float big[9000];
        big[thread_index_in_threadgroup] = 1.0f;
        out[0] = big[0];
    """
    with pytest.raises(KernelRuntimeError, match="32 KiB"):
        run1(src, [np.zeros(1, np.float32)], (1,), grid=(1, 1, 1))
    src = "out[0] = float(100 / inp0[0]);"
    with pytest.raises(KernelRuntimeError, match="division by zero"):
        run1(src, [np.zeros(1, np.int32)], (1,), grid=(1, 1, 1), threadgroup=(1, 1, 1))


def test_metal_syntax_subset():
    header = """
    constant constexpr int kTwo = 2;
    struct Acc { float s; int n; };
    METAL_FUNC float twice(thread const float& x) { return kTwo * x; }
    """
    src = """
        uint i = thread_position_in_grid.x;
        uint tid = thread_index_in_threadgroup;
        threadgroup float a[4], b[4];
        threadgroup int counter;
        if (tid == 0) counter = 0;
        threadgroup_barrier(mem_flags::mem_device | mem_flags::mem_threadgroup);
        a[tid] = inp0[i];
        b[tid] = -inp0[i];
        simdgroup_barrier(mem_flags::mem_none);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        float x = a[(tid + 1) % 4] + b[tid];                  // a[t+1] - a[t]
        half h = half(x);
        bfloat16_t bf = bfloat16_t(x);
        float2 v2 = float2(1.0f);
        vec<float, 4> v4(v2, 3.0f, 4.0f);
        v4 += 1.0f;
        v4 *= float4(2.0f);
        uint2 u = uint2(7, 9);
        Acc acc = {0.0f, 0};
        acc.s += twice(x);
        acc.n++;
        float r = max(x, 0.0f) + min(float(h), 1.0f) + float(bf * 2.0f)
            + clamp(int(i), 0, 2) + metal::select(0.0f, 1.0f, x > 0.0f)
            + v4.x + v4.w + float(u.y - u.x) + acc.s + float(exp(h)) - exp(float(h))
            + (Limits<float>::min < -1e38f ? 1.0f : 0.0f)
            + precise::divide(1.0f, 4.0f) + fast::exp(0.0f);
        out[i] = r;
    """
    x = RNG.standard_normal(8).astype(np.float32)
    out = run1(src, [x], (8,), grid=(8, 1, 1), threadgroup=(4, 1, 1), header=header)
    g = x.reshape(2, 4)
    d = (np.roll(g, -1, axis=1) - g).ravel()
    h = d.astype(np.float16).astype(np.float32)
    bf = metal_emu.bf16_to_float32(metal_emu.float32_to_bf16(d))
    expected = (np.maximum(d, 0) + np.minimum(h, 1) + bf * 2 + np.minimum(np.arange(8), 2)
                + (d > 0) + 4 + 10 + 2 + 2 * d + 1 + 0.25 + 1)
    np.testing.assert_allclose(out, expected, rtol=1e-3, atol=1e-2)


def test_ucontext_fiber_fallback(monkeypatch):
    monkeypatch.setenv("METAL_EMU_CXXFLAGS", "-DMTL_USE_UCONTEXT")
    n, tg = 200, 64
    x = RNG.standard_normal(n).astype(np.float32)
    src = TG_SOURCE.replace("{barrier}", "threadgroup_barrier(mem_flags::mem_threadgroup);")
    src += "out[thread_position_in_grid.x] += 0.0f * simd_sum(1.0f);"
    out = run1(src, [x], (n,), grid=(n, 1, 1), threadgroup=(tg, 1, 1))
    idx = np.arange(n)
    start = idx // tg * tg
    size = np.minimum(tg, n - start)
    np.testing.assert_array_equal(out, x[start + (idx - start + 1) % size])
