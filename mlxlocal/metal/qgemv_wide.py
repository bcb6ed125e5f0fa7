"""y = x @ dequant(W).T (+ bias) over MLX affine-quantized weights (w, scales, biases).

Metal kernel `qgemv_wide` (decode, M = 1..8 rows) over exactly `mx.quantize`'s layout:
w uint32 [N, K * BITS / 32] (value j of a word in bits [BITS*j, BITS*(j+1))), scales / biases
[N, K / GS] in T, dequant(q) = scale * q + bias. Same layout as gemv_wide (whose row tiling,
early return and `REDUCE_STORE` butterfly it shares): a simdgroup owns COLS output columns and
takes M in passes of at most MAX_TILE rows. K is cut into chunks of V = 16 values = WPL =
BITS / 2 packed words; lane l reads chunks l, l + 32, ... of each of its COLS rows as one
vec<uint, WPL> load (8 B for 4-bit, 16 B for 8-bit; rows are WPL-word aligned because K % 32
== 0), with that chunk's scale and bias (a chunk never straddles a group: GS >= 32 > V), and
dequantizes it 4 values at a time (shift, mask, convert, one FMA with scale and bias: once per
value and pass, not per row) and applies those 4 to each row of the pass with one dot. W rows
get one 64-bit base pointer each; every other index is a 32-bit offset (scale rows as int
offsets: N * K / GS < 2^31, checked by the launcher).
"""

from __future__ import annotations

import math

import mlx.core as mx

from mlxlocal.metal.dispatch import use_kernel
from mlxlocal.metal.gemv_wide import COLS, MAX_ROWS, MAX_TILE, REDUCE_STORE, SIMDGROUPS
from mlxlocal.metal.kernel import KERNEL_DTYPES, LaunchSpec, dtype_name, metal_available, run

BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)
CHUNK = 16  # values per lane per row per step (V): 2 words at 4 bits, 4 at 8 bits

HEADER = ""

# Inputs: x [M, K] T, w [N, K*BITS/32] uint32, scales / biases [N, K/GS] T, bias [N] (read
# only when HAS_BIAS), params {N, K} int32. Template: T, M, GS, BITS, HAS_BIAS. Output y [M, N].
SOURCE = f"""
    constexpr int COLS = {COLS};
    constexpr int V = {CHUNK};
    constexpr int PACK = 32 / BITS;
    constexpr int WPL = V / PACK;
    constexpr uint MASK = (1u << BITS) - 1u;
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
    const int groups = K / GS;
    const int chunks = K / V;
    const device vec<uint, WPL>* wr[COLS];
    int sr[COLS];
    #pragma unroll
    for (int c = 0; c < COLS; c++) {{
        const int n = min(n0 + c, N - 1);
        wr[c] = (const device vec<uint, WPL>*)(w + size_t(n) * size_t(K / PACK));
        sr[c] = n * groups;
    }}

    for (int t = 0; t < TILES; t++) {{
        const int m0 = t * MT;
        const device vec<T, 4>* xr[MT];
        float acc[MT][COLS];
        #pragma unroll
        for (int r = 0; r < MT; r++) {{
            xr[r] = (const device vec<T, 4>*)(x + min(m0 + r, M - 1) * K);
            #pragma unroll
            for (int c = 0; c < COLS; c++) {{
                acc[r][c] = 0.0f;
            }}
        }}
        for (int i = lane; i < chunks; i += 32) {{
            const int g = i / (GS / V);
            vec<uint, WPL> wq[COLS];
            float sc[COLS];
            float bi[COLS];
            #pragma unroll
            for (int c = 0; c < COLS; c++) {{
                wq[c] = wr[c][i];
                sc[c] = float(scales[sr[c] + g]);
                bi[c] = float(biases[sr[c] + g]);
            }}
            #pragma unroll
            for (int p = 0; p < V / 4; p++) {{
                float4 wd[COLS];  // values 4p..4p+3 of each row, dequantized once per pass
                #pragma unroll
                for (int c = 0; c < COLS; c++) {{
                    #pragma unroll
                    for (int e = 0; e < 4; e++) {{
                        const int word = (4 * p + e) / PACK;
                        const int shift = BITS * ((4 * p + e) % PACK);
                        wd[c][e] = fma(sc[c], float((wq[c][word] >> shift) & MASK), bi[c]);
                    }}
                }}
                #pragma unroll
                for (int r = 0; r < MT; r++) {{
                    const float4 xf = float4(xr[r][i * (V / 4) + p]);
                    #pragma unroll
                    for (int c = 0; c < COLS; c++) {{
                        acc[r][c] += dot(xf, wd[c]);
                    }}
                }}
            }}
        }}
{REDUCE_STORE}
    }}
"""


def shape_problem(M: int, N: int, K: int, group_size: int, bits: int) -> str | None:
    """Why (M, N, K, group_size, bits) is outside the kernel's contract, or None."""
    if bits not in BITS or group_size not in GROUP_SIZES:
        return f"bits {bits} / group_size {group_size} not in {BITS} / {GROUP_SIZES}"
    if not 1 <= M <= MAX_ROWS:
        return f"M = {M} rows, the kernel takes 1..{MAX_ROWS}"
    if N < 1 or K < group_size or K % group_size:
        return f"K = {K} must be a positive multiple of group_size {group_size} (N = {N} >= 1)"
    if N * (K // group_size) >= 2**31:
        return f"N * K / group_size = {N * (K // group_size)} overflows the 32-bit scale offsets"
    if N * K * bits // 32 < 8:  # MLX would pass w in the constant address space
        return f"w has {N * K * bits // 32} words, the kernel needs >= 8"
    return None


def launch_spec(
    M: int, N: int, K: int, dtype: str, group_size: int, bits: int, has_bias: bool
) -> LaunchSpec:
    """The Metal launch for y[M, N] = x[M, K] @ dequant(w)[N, K].T (+ bias); dtype names T.

    Without a bias the `bias` input is a 1-element float32 constant the kernel never reads.
    """
    problem = shape_problem(M, N, K, group_size, bits)
    if problem:
        raise ValueError(f"qgemv_wide: {problem}")
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
    if shape_problem(math.prod(x.shape[:-1]), N, K, group_size, bits):
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
