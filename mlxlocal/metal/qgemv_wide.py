"""y = x @ dequant(W).T (+ bias) over MLX affine-quantized weights (w, scales, biases).

Metal kernel `qgemv_wide` (decode, M = 1..8 rows) over exactly `mx.quantize`'s layout:
w uint32 [N, K * BITS / 32] (value j of a word in bits [BITS*j, BITS*(j+1))), scales / biases
[N, K / GS] in T, dequant(q) = scale * q + bias. Same layout as gemv_wide: simdgroup owns COLS
output columns, lane l reads words l, l + 32, ... of each of its COLS rows (coalesced), i.e.
PACK = 32 / BITS consecutive values of one group, unpacks them once and applies them to all M
rows with sum_k x_k (s q_k + b) = s * sum_k x_k q_k + b * sum_k x_k (fp32). One simd_sum per
output at the end. A word never straddles a group (GS >= 32 >= PACK).
"""

from __future__ import annotations

import math

import mlx.core as mx

from mlxlocal.metal.dispatch import use_kernel
from mlxlocal.metal.gemv_wide import COLS, MAX_ROWS, SIMDGROUPS
from mlxlocal.metal.kernel import KERNEL_DTYPES, LaunchSpec, dtype_name, metal_available, run

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)

HEADER = ""

# Inputs: x [M, K] T, w [N, K*BITS/32] uint32, scales / biases [N, K/GS] T, bias [N] (read
# only when HAS_BIAS), params {N, K} int32. Template: T, M, GS, BITS, HAS_BIAS. Output y [M, N].
SOURCE = f"""
    constexpr int COLS = {COLS};
    constexpr int PACK = 32 / BITS;
    constexpr uint MASK = (1u << BITS) - 1u;
    const int N = params[0];
    const int K = params[1];
    const int words = K / PACK;
    const int groups = K / GS;
    const int lane = int(thread_position_in_threadgroup.x);
    const int n0 = int(thread_position_in_grid.y) * COLS;

    size_t wrow[COLS];
    size_t grow[COLS];
    for (int c = 0; c < COLS; c++) {{
        const size_t n = size_t(min(n0 + c, N - 1));
        wrow[c] = n * size_t(words);
        grow[c] = n * size_t(groups);
    }}
    float acc[M][COLS];
    for (int m = 0; m < M; m++) {{
        for (int c = 0; c < COLS; c++) {{
            acc[m][c] = 0.0f;
        }}
    }}

    for (int i = lane; i < words; i += 32) {{
        const int k = i * PACK;
        const int g = k / GS;
        float q[COLS][PACK];
        float sc[COLS];
        float bi[COLS];
        for (int c = 0; c < COLS; c++) {{
            const uint word = w[wrow[c] + i];
            for (int j = 0; j < PACK; j++) {{
                q[c][j] = float((word >> (BITS * j)) & MASK);
            }}
            sc[c] = float(scales[grow[c] + g]);
            bi[c] = float(biases[grow[c] + g]);
        }}
        for (int m = 0; m < M; m++) {{
            float xv[PACK];
            float xs = 0.0f;
            for (int j = 0; j < PACK; j++) {{
                xv[j] = float(x[m * K + k + j]);
                xs += xv[j];
            }}
            for (int c = 0; c < COLS; c++) {{
                float d = 0.0f;
                for (int j = 0; j < PACK; j++) {{
                    d += xv[j] * q[c][j];
                }}
                acc[m][c] += sc[c] * d + bi[c] * xs;
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


def launch_spec(
    M: int, N: int, K: int, dtype: str, group_size: int, bits: int, has_bias: bool
) -> LaunchSpec:
    """The Metal launch for y[M, N] = x[M, K] @ dequant(w)[N, K].T (+ bias); dtype names T.

    Without a bias the `bias` input is a 1-element float32 constant the kernel never reads.
    """
    simdgroups = math.ceil(N / COLS)
    groups = math.ceil(simdgroups / SIMDGROUPS)
    tensors = ("x", "w", "scales", "biases")
    return LaunchSpec(
        name="qgemv_wide",
        source=SOURCE,
        header=HEADER,
        input_names=tensors + (("bias", "params") if has_bias else ("params", "bias")),
        output_names=("y",),
        template=(("T", dtype), ("M", M), ("GS", group_size), ("BITS", bits),
                  ("HAS_BIAS", int(has_bias))),
        grid=(32, groups * SIMDGROUPS, 1),
        threadgroup=(32, SIMDGROUPS, 1),
        output_shapes=((M, N),),
        output_dtypes=(dtype,),
        constants=(((N, K), "int32"),) + (() if has_bias else (((0.0,), "float32"),)),
    )


def quantized_linear_reference(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
    mode: str = "affine",
    bias: mx.array | None = None,
) -> mx.array:
    y = mx.quantized_matmul(
        x, w, scales=scales, biases=biases, transpose=True,
        group_size=group_size, bits=bits, mode=mode,
    )
    return y if bias is None else y + bias


def kernel_supports(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
    mode: str,
    bias: mx.array | None,
) -> bool:
    """Shapes, dtypes and quantization modes the qgemv_wide kernel handles."""
    if mode != "affine" or biases is None or bits not in BITS or group_size not in GROUP_SIZES:
        return False
    if w.ndim != 2 or w.dtype != mx.uint32 or x.ndim < 1:
        return False
    N, K = w.shape[0], w.shape[1] * 32 // bits
    dtype = x.dtype
    if x.shape[-1] != K or K % group_size or dtype_name(dtype) not in KERNEL_DTYPES:
        return False
    if scales.shape != (N, K // group_size) or biases.shape != scales.shape:
        return False
    if scales.dtype != dtype or biases.dtype != dtype:
        return False
    if not 1 <= math.prod(x.shape[:-1]) <= MAX_ROWS:
        return False
    return bias is None or (bias.shape == (N,) and bias.dtype == dtype)


def quantized_linear(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
    mode: str = "affine",
    bias: mx.array | None = None,
) -> mx.array:
    """Dispatch point for quantized projections."""
    if not (metal_available() and use_kernel("quantized_linear", kernel_supports, x, w, scales, biases,
                                             group_size, bits, mode, bias)):
        return quantized_linear_reference(x, w, scales, biases, group_size, bits, mode, bias)
    N, K = w.shape[0], w.shape[1] * 32 // bits
    lead = x.shape[:-1]
    spec = launch_spec(math.prod(lead), N, K, dtype_name(x.dtype), group_size, bits,
                       bias is not None)
    tensors = [x.reshape(-1, K), w, scales, biases] + ([bias] if bias is not None else [])
    return run(spec, tensors)[0].reshape(*lead, N)
