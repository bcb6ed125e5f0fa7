"""y = x @ W.T (+ bias): the dense projection every native Linear calls.

Metal kernel `gemv_wide` (decode, M = 1..8 rows): W is streamed for all rows of a pass at once.
Layout: threadgroup = SIMDGROUPS simdgroups of 32 lanes; simdgroup g of threadgroup t owns COLS
consecutive output columns n0 = (t * SIMDGROUPS + g) * COLS ... (W rows; columns past N read row
N - 1 and store nothing; a simdgroup wholly past N returns at once). Each W row and each x row
gets one base pointer (the only 64-bit index arithmetic); every load below is a 32-bit offset
from it. K is cut into 4-element chunks: lane l reads chunks l + 32 j (j < UNROLL) of each of its
COLS rows per step as vec<T, 4> (ALIGNED = K % 4 == 0, so every row starts on a vec4 boundary),
else as 4 scalar loads; leftover chunks go one per lane, and the K % 4 last elements (unaligned
case only) one per lane as scalars. Rows are taken in passes of MT <= MAX_TILE (M = 5..8: two
passes, each re-reading the simdgroup's COLS rows of W) so a lane holds at most MAX_TILE x COLS
fp32 accumulators plus a COLS x UNROLL vec4 W tile whatever M is. The pass ends with a butterfly
reduce-scatter over the 32 lanes (`REDUCE_STORE`, shared with qgemv_wide): RP = MT * COLS
rounded up to a power of two values take RP - 1 + 5 - log2(RP) simd_shuffle_xor per lane in all,
after which lane l holds output l / (32 / RP) and the first lane of each run stores it.
"""

from __future__ import annotations

import math

import mlx.core as mx

from mlxlocal.metal.dispatch import use_kernel
from mlxlocal.metal.kernel import KERNEL_DTYPES, LaunchSpec, dtype_name, metal_available, run

MAX_ROWS = 8  # decode batch rows the kernel is instantiated for (template M = 1..8)
MAX_TILE = 4  # rows per pass: accumulators stay MAX_TILE * COLS (<= 16) per lane
COLS = 4  # output columns per simdgroup
SIMDGROUPS = 4  # simdgroups per threadgroup
UNROLL = 2  # vec4 chunks per row per lane per step: COLS * UNROLL loads in flight
# MLX passes inputs of < 8 elements in the constant address space; K >= 8 keeps x and w device
# buffers (the kernel derives device pointers from them).
MIN_K = 8


def tiling(M: int) -> tuple[int, int]:
    """(passes, rows per pass) for M rows: the fewest passes, then the smallest tile covering M."""
    passes = math.ceil(M / MAX_TILE)
    return passes, math.ceil(M / passes)


# Butterfly reduce-scatter and store of one pass (acc[MT][COLS] per lane; needs lane, n0, m0,
# N, M, y, bias, T, HAS_BIAS). Halving step h keeps half of the lane's values (the upper half
# when lane bit `off` is set) and adds the partner lane's copy of that half: h shuffles.
REDUCE_STORE = """
        constexpr int RP = MT * COLS <= 4 ? 4 : MT * COLS <= 8 ? 8 : MT * COLS <= 16 ? 16 : 32;
        constexpr int SHARE = 32 / RP;  // lanes that end up holding the same output
        float v[RP];
        #pragma unroll
        for (int r = 0; r < RP; r++) {
            v[r] = r < MT * COLS ? acc[r / COLS][r % COLS] : 0.0f;
        }
        #pragma unroll
        for (int h = RP / 2, off = 16; h >= 1; h /= 2, off /= 2) {
            const bool upper = (lane & off) != 0;
            #pragma unroll
            for (int i = 0; i < h; i++) {
                const float send = upper ? v[i] : v[i + h];
                const float keep = upper ? v[i + h] : v[i];
                v[i] = keep + simd_shuffle_xor(send, ushort(off));
            }
        }
        #pragma unroll
        for (int off = SHARE / 2; off >= 1; off /= 2) {
            v[0] += simd_shuffle_xor(v[0], ushort(off));
        }
        const int idx = lane / SHARE;  // output r = m * COLS + c this lane now holds
        const int m = m0 + idx / COLS;
        const int n = n0 + idx % COLS;
        if (lane % SHARE == 0 && idx < MT * COLS && m < M && n < N) {
            y[m * N + n] = static_cast<T>(HAS_BIAS ? v[0] + float(bias[n]) : v[0]);
        }
"""

# 4 consecutive elements from chunk `i` (elements 4i..4i+3) of a row: one vec<T, 4> load when
# rows are vec4-aligned, else 4 scalar loads (same values, so both paths give the same bits).
# Kept in T until used: a 16-bit W tile takes half the registers of a float4 one.
HEADER = """
template <int ALIGNED, typename T>  // int like the kernel's template argument (no bool narrowing)
inline vec<T, 4> gemv_load4(const device T* row, int i) {
    if (ALIGNED) {
        return ((const device vec<T, 4>*)row)[i];
    }
    const int k = 4 * i;
    return vec<T, 4>(row[k], row[k + 1], row[k + 2], row[k + 3]);
}
"""

# Inputs: x [M, K] T, w [N, K] T, bias [N] (read only when HAS_BIAS), params {N, K} int32.
# Template: T, M (rows), HAS_BIAS (0/1), ALIGNED (K % 4 == 0). Output: y [M, N] T.
SOURCE = f"""
    constexpr int COLS = {COLS};
    constexpr int U = {UNROLL};
    constexpr int TILES = (M + {MAX_TILE} - 1) / {MAX_TILE};
    constexpr int MT = (M + TILES - 1) / TILES;
    const int N = params[0];
    const int K = params[1];
    const int lane = int(thread_index_in_simdgroup);
    const int n0 = (int(threadgroup_position_in_grid.y) * {SIMDGROUPS}
                    + int(simdgroup_index_in_threadgroup)) * COLS;
    if (n0 >= N) {{
        return;  // the whole simdgroup: no SIMD function is left waiting for it
    }}
    const device T* wr[COLS];
    #pragma unroll
    for (int c = 0; c < COLS; c++) {{
        wr[c] = w + size_t(min(n0 + c, N - 1)) * size_t(K);
    }}
    const int K4 = K / 4;
    const int K_main = K4 - K4 % (32 * U);

    for (int t = 0; t < TILES; t++) {{
        const int m0 = t * MT;
        const device T* xr[MT];
        float acc[MT][COLS];
        #pragma unroll
        for (int r = 0; r < MT; r++) {{
            xr[r] = x + min(m0 + r, M - 1) * K;
            #pragma unroll
            for (int c = 0; c < COLS; c++) {{
                acc[r][c] = 0.0f;
            }}
        }}
        for (int i = lane; i < K_main; i += 32 * U) {{
            vec<T, 4> wv[COLS][U];
            #pragma unroll
            for (int c = 0; c < COLS; c++) {{
                #pragma unroll
                for (int j = 0; j < U; j++) {{
                    wv[c][j] = gemv_load4<ALIGNED>(wr[c], i + 32 * j);
                }}
            }}
            #pragma unroll
            for (int r = 0; r < MT; r++) {{
                #pragma unroll
                for (int j = 0; j < U; j++) {{
                    const float4 xf = float4(gemv_load4<ALIGNED>(xr[r], i + 32 * j));
                    #pragma unroll
                    for (int c = 0; c < COLS; c++) {{
                        acc[r][c] += dot(float4(wv[c][j]), xf);
                    }}
                }}
            }}
        }}
        for (int i = K_main + lane; i < K4; i += 32) {{
            vec<T, 4> wv[COLS];
            #pragma unroll
            for (int c = 0; c < COLS; c++) {{
                wv[c] = gemv_load4<ALIGNED>(wr[c], i);
            }}
            #pragma unroll
            for (int r = 0; r < MT; r++) {{
                const float4 xf = float4(gemv_load4<ALIGNED>(xr[r], i));
                #pragma unroll
                for (int c = 0; c < COLS; c++) {{
                    acc[r][c] += dot(float4(wv[c]), xf);
                }}
            }}
        }}
        for (int k = 4 * K4 + lane; k < K; k += 32) {{
            float xk[MT];
            #pragma unroll
            for (int r = 0; r < MT; r++) {{
                xk[r] = float(xr[r][k]);
            }}
            #pragma unroll
            for (int c = 0; c < COLS; c++) {{
                const float wk = float(wr[c][k]);
                #pragma unroll
                for (int r = 0; r < MT; r++) {{
                    acc[r][c] += xk[r] * wk;
                }}
            }}
        }}
{REDUCE_STORE}
    }}
"""


def launch_spec(M: int, N: int, K: int, dtype: str, has_bias: bool) -> LaunchSpec:
    """The Metal launch for y[M, N] = x[M, K] @ w[N, K].T (+ bias); dtype names T.

    Vector loads (ALIGNED) need every row of x and w to start on a 4-element boundary, i.e.
    K % 4 == 0 (MLX buffers start at least 16-byte aligned and a contiguous input's offset is
    a whole number of rows). Without a bias the `bias` input is a 1-element float32 constant
    the kernel never reads.
    """
    if not (1 <= M <= MAX_ROWS and N >= 1 and K >= MIN_K):
        raise ValueError(f"gemv_wide: needs 1 <= M <= {MAX_ROWS}, N >= 1, K >= {MIN_K} "
                         f"(got M={M}, N={N}, K={K})")
    simdgroups = math.ceil(N / COLS)
    groups = math.ceil(simdgroups / SIMDGROUPS)
    return LaunchSpec(
        name="gemv_wide",
        source=SOURCE,
        header=HEADER,
        input_names=("x", "w", "bias", "params") if has_bias else ("x", "w", "params", "bias"),
        output_names=("y",),
        template=(("T", dtype), ("M", M), ("HAS_BIAS", int(has_bias)),
                  ("ALIGNED", int(K % 4 == 0))),
        grid=(32, groups * SIMDGROUPS, 1),
        threadgroup=(32, SIMDGROUPS, 1),
        output_shapes=((M, N),),
        output_dtypes=(dtype,),
        constants=(((N, K), "int32"),) + (() if has_bias else (((0.0,), "float32"),)),
    )


def linear_reference(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    if bias is None:
        return x @ weight.T
    return mx.addmm(bias, x, weight.T)


def kernel_supports(x: mx.array, weight: mx.array, bias: mx.array | None) -> bool:
    """Shapes and dtypes the gemv_wide kernel handles (Metal availability aside)."""
    if weight.ndim != 2 or x.ndim < 1 or x.shape[-1] != weight.shape[1]:
        return False
    M = math.prod(x.shape[:-1])
    dtype = x.dtype
    if not (1 <= M <= MAX_ROWS) or weight.shape[1] < MIN_K or weight.dtype != dtype:
        return False
    if dtype_name(dtype) not in KERNEL_DTYPES:
        return False
    return bias is None or (bias.shape == (weight.shape[0],) and bias.dtype == dtype)


def linear(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """Dispatch point for dense projections (decode rows M <= 8 are the Metal kernel's case)."""
    if not (metal_available() and use_kernel("linear", kernel_supports, x, weight, bias)):
        return linear_reference(x, weight, bias)
    N, K = weight.shape
    lead = x.shape[:-1]
    spec = launch_spec(math.prod(lead), N, K, dtype_name(x.dtype), bias is not None)
    tensors = [x.reshape(-1, K), weight] + ([bias] if bias is not None else [])
    return run(spec, tensors)[0].reshape(*lead, N)
