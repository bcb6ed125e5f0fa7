"""Paged attention over quantized K/V pools (issue 18: --kv-bits).

Each of K and V is a triple laid out exactly as `mx.quantize(x, group_size, bits)` over the
last axis of x [n_kv_heads, num_blocks, block_size, head_dim] (head-major, as the unquantized
pools): packed uint32 [H, NB, BS, D * bits / 32], scales and biases [H, NB, BS, D / group_size]
in the model dtype; x = scale * q + bias per group. The reference reads a sequence's rows by a
slice or one gather (attention.sequence_rows) and attends on the packed values by
mx.quantized_matmul (attention.quantized_sdpa): the context is never dequantized. Semantics
(positions, causal-per-sequence mask, windows, GQA, the n_keys / mask / first_block /
window_start / index hints) are paged_attention_reference's.

Metal kernels `paged_attention_quant` (one pass) / `paged_attention_quant_split` + the shared
`paged_attention_combine` (decode, L = 1): the unquantized kernels' grid, partitions, head
sets, merge and block-id guard (see paged_attention: one threadgroup per (KV head, head group,
sequence, partition) serving all its query heads; NaN for a sequence whose table names a block
out of the pool). A key is only W = D * BITS / 32 words, so a simdgroup reads KPS = 32 / LPK
keys at once: LPK lanes per key (W rounded up to 8 / 16 / 32; lanes past W idle), lane w owning
word w = dims [w * PACK, (w + 1) * PACK) (PACK = 32 / BITS, one group: GS >= 32 >= PACK), one
uint32 load per lane from the block's base (row kvh * NB + id), 32-bit offsets inside it.
Stripe k of the threadgroup takes tokens t0 + k * KPS + slot, stepping KS * KPS. Per word and
head: q.k = scale * sum_j q_j u_j + bias * sum_j q_j (sum q_j precomputed; the word unpacked once for all
HPS heads of the set), the HPS sums over the LPK lanes in one reduce-scatter (REDUCE); each
(simdgroup, key slot) keeps its own online softmax per head (fp32) and folds p * (scale * u +
bias) of V into PACK accumulators per lane and head. The merge combines the KS * KPS
producers (stripes x key slots) of each head.
"""

from __future__ import annotations

import mlx.core as mx

from mlxlocal.metal.attention import quantized_sdpa, sequence_rows, step_mask
from mlxlocal.metal.dispatch import use_kernel
from mlxlocal.metal.kernel import KERNEL_DTYPES, LaunchSpec, dtype_name, metal_available
from mlxlocal.metal.paged_attention import (
    BLOCK_SIZES,
    BLOCKS,
    MERGE,
    PROLOGUE,
    REDUCE,
    SIMDGROUPS,
    STORE_OUT,
    STORE_PART,
    cut_window,
    head_split,
    partitions,
    run_launches,
    split_specs,
)

QuantPool = tuple[mx.array, mx.array, mx.array]  # (packed uint32, scales, biases)

# No group size mx.quantize accepts (32 / 64 / 128) divides 80, so D = 80 has no quantized pool.
HEAD_DIMS = (64, 96, 128)
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)

# Inputs: q [B, Hq, 1, D] T; k_q / v_q [Hkv, NB, BS, W] uint32; k_s, k_b, v_s, v_b
# [Hkv, NB, BS, D / GS] T; block_tables [B, MB] int32; context_lens [B] int32; params {MB, Hq,
# Hkv, window (0: none), NB} int32; scale {scale} float32. Template: T, D, BS, NSG, GH, HSETS,
# HPS, BITS, GS. Output: out [B, Hq, 1, D] T (one pass) or part [B, Hq, P, D + 2] float32.
BODY = """
    constexpr int PACK = 32 / BITS;
    constexpr uint MASK = (1u << BITS) - 1u;
    constexpr int W = D / PACK;
    constexpr int NG = D / GS;
    constexpr int LPK = W <= 8 ? 8 : (W <= 16 ? 16 : 32);
    constexpr int KPS = 32 / LPK;
    constexpr int HB = HPS >= 8 ? 3 : (HPS >= 4 ? 2 : (HPS >= 2 ? 1 : 0));
    constexpr int RL = LPK;
    constexpr int RB = LPK == 8 ? 3 : (LPK == 16 ? 4 : 5);
""" + PROLOGUE + """
    const int slot = lane / LPK;
    const int w = lane % LPK;
    const int rlane = w;
    const int rbase = slot * LPK;
    const bool owns = w < W;
    const int g = owns ? (w * PACK) / GS : 0;

    float qv[HPS][PACK];
    float acc[HPS][PACK];
    float qsum[HPS];
    float m[HPS];
    float l[HPS];
    for (int jj = 0; jj < HPS; jj++) {
        const int j = min(hset * HPS + jj, GH - 1);
        if (owns) {
            DimLoad<T, PACK>::run(q + (b * Hq + h_first + j) * D + w * PACK, qv[jj]);
        }
        qsum[jj] = 0.0f;
        for (int i = 0; i < PACK; i++) {
            qv[jj][i] = owns ? sc * qv[jj][i] : 0.0f;
            qsum[jj] += qv[jj][i];
            acc[jj][i] = 0.0f;
        }
        m[jj] = NEG;
        l[jj] = 0.0f;
    }
""" + BLOCKS + """
        const device uint* kqb = k_q + row * size_t(BS * W);
        const device uint* vqb = v_q + row * size_t(BS * W);
        const size_t gbase = row * size_t(BS * NG);
        const device T* ksb = k_s + gbase;
        const device T* kzb = k_b + gbase;
        const device T* vsb = v_s + gbase;
        const device T* vzb = v_b + gbase;
        for (int tb = t0 + stripe * KPS; tb < t1; tb += KS * KPS) {
            const int t = tb + slot;
            const bool live = t < t1;
            const bool reads = owns && live;
            const uint wo = uint(t * W + w);
            const uint go = uint(t * NG + g);
            float u[PACK];
            float ks = 0.0f;
            float kz = 0.0f;
            for (int i = 0; i < PACK; i++) {
                u[i] = 0.0f;
            }
            if (reads) {
                const uint word = kqb[wo];
                for (int i = 0; i < PACK; i++) {
                    u[i] = float((word >> (BITS * i)) & MASK);
                }
                ks = float(ksb[go]);
                kz = float(kzb[go]);
            }
            float s[HPS];
            for (int jj = 0; jj < HPS; jj++) {
                float dot = 0.0f;
                for (int i = 0; i < PACK; i++) {
                    dot += qv[jj][i] * u[i];
                }
                s[jj] = ks * dot + kz * qsum[jj];
            }
""" + REDUCE + """
            if (live) {
                float x[PACK];
                for (int i = 0; i < PACK; i++) {
                    x[i] = 0.0f;
                }
                if (owns) {
                    const uint word = vqb[wo];
                    const float vs = float(vsb[go]);
                    const float vz = float(vzb[go]);
                    for (int i = 0; i < PACK; i++) {
                        x[i] = vs * float((word >> (BITS * i)) & MASK) + vz;
                    }
                }
                for (int jj = 0; jj < HPS; jj++) {
                    float corr = 1.0f;
                    float p = 1.0f;
                    if (score[jj] > m[jj]) {
                        corr = exp(m[jj] - score[jj]);
                        m[jj] = score[jj];
                    } else {
                        p = exp(score[jj] - m[jj]);
                    }
                    l[jj] = l[jj] * corr + p;
                    if (owns) {
                        for (int i = 0; i < PACK; i++) {
                            acc[jj][i] = acc[jj][i] * corr + p * x[i];
                        }
                    }
                }
            }
        }
    }
    const int pr = sg * KPS + slot;
""" + MERGE.replace("WRITE_PARTIAL", """
        if (w == 0) {
            tg_m[pr] = m[jj];
            tg_l[pr] = l[jj];
        }
        if (owns) {
            for (int i = 0; i < PACK; i++) {
                tg_acc[pr * D + w * PACK + i] = acc[jj][i];
            }
        }""")

SOURCE = BODY.replace("STORE", STORE_OUT)
SOURCE_SPLIT = BODY.replace("STORE", STORE_PART)


def launch_specs(
    B: int, Hq: int, Hkv: int, D: int, block_size: int, max_blocks: int, num_blocks: int,
    dtype: str, scale: float, window: int | None, group_size: int, bits: int,
    span: int | None = None, parts: int | None = None,
) -> tuple[LaunchSpec, ...]:
    """The Metal launches for decode attention of q [B, Hq, 1, D] over quantized pools
    [Hkv, num_blocks, block_size, ..] through block_tables [B, max_blocks]; dtype names T.
    `span` / `parts` as in paged_attention.launch_specs."""
    G = Hq // Hkv
    GH, hsets, hps = head_split(G, 32 // bits)
    span = min(span or max_blocks * block_size, window or 1 << 30)
    parts = parts or partitions(span, B * Hkv * (G // GH))
    template = (("T", dtype), ("D", D), ("BS", block_size), ("NSG", SIMDGROUPS), ("GH", GH),
                ("HSETS", hsets), ("HPS", hps), ("BITS", bits), ("GS", group_size))
    return split_specs("paged_attention_quant", SOURCE, SOURCE_SPLIT, B, Hq, Hkv, D, dtype,
                       parts, G // GH, template,
                       ("q", "k_q", "k_s", "k_b", "v_q", "v_s", "v_b", "block_tables",
                        "context_lens", "params", "scale"),
                       (max_blocks, Hq, Hkv, window or 0, num_blocks), scale)


def _check_pool(name: str, pool: QuantPool, D: int, group_size: int, bits: int) -> None:
    if not isinstance(pool, (tuple, list)) or len(pool) != 3:
        raise ValueError(f"{name}: expected a (packed, scales, biases) triple")
    packed, scales, biases = pool
    if packed.ndim != 4 or packed.dtype != mx.uint32:
        raise ValueError(f"{name}: packed must be uint32 [heads, num_blocks, block_size, "
                         f"head_dim*bits/32], got {packed.dtype} {tuple(packed.shape)}")
    if D % group_size or packed.shape[-1] * 32 != D * bits:
        raise ValueError(f"{name}: head_dim {D} with bits={bits}, group_size={group_size} needs "
                         f"{D * bits // 32} packed words, pool has {packed.shape[-1]}")
    want = (*packed.shape[:3], D // group_size)
    if tuple(scales.shape) != want or tuple(biases.shape) != want:
        raise ValueError(f"{name}: scales / biases must be {want}, got {tuple(scales.shape)} / "
                         f"{tuple(biases.shape)}")


def paged_attention_quantized_reference(
    q: mx.array,
    k: QuantPool,
    v: QuantPool,
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
    group_size: int,
    bits: int,
    window: int | None = None,
    *,
    n_keys: int | None = None,
    mask: mx.array | str | None | bool = False,
    first_block: int | None = None,
    window_start: int = 0,
    index: mx.array | None = None,
) -> mx.array:
    """q [B, Hq, L, D] -> [B, Hq, L, D]: each sequence's first n_keys rows of the packed words,
    scales and biases (a slice for a run, else one gather through `index`), then
    quantized_sdpa on them; hints as in paged_attention_reference."""
    L, D = q.shape[2], q.shape[3]
    _check_pool("k", k, D, group_size, bits)
    _check_pool("v", v, D, group_size, bits)
    bs = k[0].shape[2]
    tables, n, index, first = cut_window(block_tables, n_keys, index, first_block, window_start,
                                         bs)
    keys = tuple(sequence_rows(a, tables, n, index, first) for a in k)
    v_index = index if v[0].shape[:2] == k[0].shape[:2] else None
    values = tuple(sequence_rows(a, tables, n, v_index, first) for a in v)
    if mask is False:
        start = window_start * bs
        mask = step_mask(context_lens, L, start + keys[0].shape[2], window, start)
    return quantized_sdpa(q, keys, values, scale, mask, group_size, bits)


def kernel_supports_quantized(
    q: mx.array, k: QuantPool, v: QuantPool, block_tables: mx.array, group_size: int,
    bits: int, window: int | None,
) -> bool:
    """Shapes, dtypes and quantizations the paged_attention_quant kernel handles (Metal
    availability aside)."""
    if bits not in BITS or group_size not in GROUP_SIZES or len(k) != 3 or len(v) != 3:
        return False
    if q.ndim != 4 or block_tables.ndim != 2 or any(a.ndim != 4 for a in (*k, *v)):
        return False
    B, Hq, L, D = q.shape
    packed, scales, biases = k
    Hkv, NB, bs, words = packed.shape
    if L != 1 or D not in HEAD_DIMS or D % group_size or bs not in BLOCK_SIZES or Hq % Hkv:
        return False
    if packed.dtype != mx.uint32 or words * 32 != D * bits or block_tables.shape[0] != B:
        return False
    if dtype_name(q.dtype) not in KERNEL_DTYPES:
        return False
    gshape = (Hkv, NB, bs, D // group_size)
    for p, s, z in (k, v):
        if p.shape != packed.shape or p.dtype != mx.uint32:
            return False
        if s.shape != gshape or z.shape != gshape or not s.dtype == z.dtype == q.dtype:
            return False
    return window is None or window > 0


def quantized_kernel_taken(q: mx.array, k: QuantPool, v: QuantPool, block_tables: mx.array,
                           group_size: int, bits: int, window: int | None) -> bool:
    """Whether paged_attention_quantized runs our Metal kernel for these arguments."""
    return metal_available() and use_kernel("paged_attention_quantized", kernel_supports_quantized,
                                            q, k, v, block_tables, group_size, bits, window)


def paged_attention_quantized(
    q: mx.array,
    k: QuantPool,
    v: QuantPool,
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
    group_size: int,
    bits: int,
    window: int | None = None,
    *,
    n_keys: int | None = None,
    mask: mx.array | str | None | bool = False,
    first_block: int | None = None,
    window_start: int = 0,
    index: mx.array | None = None,
) -> mx.array:
    """Dispatch point for paged attention over quantized pools (the Metal kernel: decode, L = 1).

    n_keys / mask / first_block / window_start / index are hints for the reference path; the
    kernel finds a window's start itself and takes n_keys (the longest context) as the span
    its partition count is chosen for.
    """
    if not quantized_kernel_taken(q, k, v, block_tables, group_size, bits, window):
        return paged_attention_quantized_reference(
            q, k, v, block_tables, context_lens, scale, group_size, bits, window, n_keys=n_keys,
            mask=mask, first_block=first_block, window_start=window_start, index=index)
    B, Hq, _, D = q.shape
    Hkv, NB, bs, _ = k[0].shape
    specs = launch_specs(B, Hq, Hkv, D, bs, block_tables.shape[1], NB, dtype_name(q.dtype), scale,
                         window, group_size, bits, span=n_keys)
    tensors = [q, *k, *v, block_tables.astype(mx.int32), context_lens.astype(mx.int32)]
    return run_launches(specs, tensors)
