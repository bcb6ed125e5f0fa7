"""y = x @ W.T (+ bias): the dense projection every native Linear calls.

Metal kernel `gemv_wide` (decode, M = 1..8 rows): W is streamed once for all M rows.
Layout: threadgroup = SIMDGROUPS simdgroups of 32 lanes; simdgroup g (grid row y) owns COLS
consecutive output columns n0 = y * COLS ...; its lanes stride over K in runs of VEC
contiguous elements (lane l covers k = l*VEC + j*32*VEC ...), load VEC weights of each of its
COLS rows of W once, and multiply them into M x COLS fp32 accumulators (x is tiny and stays in
cache). A scalar tail covers K % VEC; one simd_sum per (row, column) at the end, and lane
m*COLS + c stores y[m, n0 + c]. Columns past N read row N - 1 and store nothing.
"""

from __future__ import annotations

import math

import mlx.core as mx

from mlxlocal.metal.dispatch import use_kernel
from mlxlocal.metal.kernel import KERNEL_DTYPES, LaunchSpec, dtype_name, metal_available, run

MAX_ROWS = 8  # decode batch rows the kernel is instantiated for (template M = 1..8)
COLS = 4  # output columns per simdgroup (M * COLS <= 32: one storing lane per output)
SIMDGROUPS = 4  # simdgroups per threadgroup
VEC = 8  # contiguous K elements per lane per step

HEADER = ""

# Inputs: x [M, K] T, w [N, K] T, bias [N] (read only when HAS_BIAS), params {N, K} int32.
# Template: T, M (rows), HAS_BIAS (0/1). Output: y [M, N] T.
SOURCE = f"""
    constexpr int COLS = {COLS};
    constexpr int VEC = {VEC};
    const int N = params[0];
    const int K = params[1];
    const int lane = int(thread_position_in_threadgroup.x);
    const int n0 = int(thread_position_in_grid.y) * COLS;

    size_t row[COLS];
    for (int c = 0; c < COLS; c++) {{
        row[c] = size_t(min(n0 + c, N - 1)) * size_t(K);
    }}
    float acc[M][COLS];
    for (int m = 0; m < M; m++) {{
        for (int c = 0; c < COLS; c++) {{
            acc[m][c] = 0.0f;
        }}
    }}

    const int k_vec = (K / VEC) * VEC;
    for (int k = lane * VEC; k < k_vec; k += 32 * VEC) {{
        float wv[COLS][VEC];
        for (int c = 0; c < COLS; c++) {{
            for (int j = 0; j < VEC; j++) {{
                wv[c][j] = float(w[row[c] + k + j]);
            }}
        }}
        for (int m = 0; m < M; m++) {{
            float xv[VEC];
            for (int j = 0; j < VEC; j++) {{
                xv[j] = float(x[m * K + k + j]);
            }}
            for (int c = 0; c < COLS; c++) {{
                float s = 0.0f;
                for (int j = 0; j < VEC; j++) {{
                    s += xv[j] * wv[c][j];
                }}
                acc[m][c] += s;
            }}
        }}
    }}
    for (int k = k_vec + lane; k < K; k += 32) {{
        for (int c = 0; c < COLS; c++) {{
            const float wk = float(w[row[c] + k]);
            for (int m = 0; m < M; m++) {{
                acc[m][c] += float(x[m * K + k]) * wk;
            }}
        }}
    }}

    for (int m = 0; m < M; m++) {{
        for (int c = 0; c < COLS; c++) {{
            const float s = simd_sum(acc[m][c]);
            const int n = n0 + c;
            if (lane == m * COLS + c && n < N) {{
                y[m * N + n] = static_cast<T>(HAS_BIAS ? s + float(bias[n]) : s);
            }}
        }}
    }}
"""


def launch_spec(M: int, N: int, K: int, dtype: str, has_bias: bool) -> LaunchSpec:
    """The Metal launch for y[M, N] = x[M, K] @ w[N, K].T (+ bias); dtype names T.

    Without a bias the `bias` input is a 1-element float32 constant the kernel never reads.
    """
    simdgroups = math.ceil(N / COLS)
    groups = math.ceil(simdgroups / SIMDGROUPS)
    return LaunchSpec(
        name="gemv_wide",
        source=SOURCE,
        header=HEADER,
        input_names=("x", "w", "bias", "params") if has_bias else ("x", "w", "params", "bias"),
        output_names=("y",),
        template=(("T", dtype), ("M", M), ("HAS_BIAS", int(has_bias))),
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
    if not (1 <= M <= MAX_ROWS) or weight.dtype != dtype or dtype_name(dtype) not in KERNEL_DTYPES:
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
