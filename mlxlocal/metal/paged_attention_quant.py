"""Paged attention over quantized K/V pools (issue 18: --kv-bits).

Each of K and V is a triple laid out exactly as `mx.quantize(x, group_size, bits)` over the
last axis of x [num_blocks, block_size, n_kv_heads, head_dim]: packed uint32
[NB, BS, H, D * bits / 32], scales and biases [NB, BS, H, D / group_size] in the model dtype;
x = scale * q + bias per group. Semantics (positions, causal-per-sequence mask, windows, GQA,
the n_keys / mask / first_block / window_start hints) are paged_attention_reference's.

Metal kernel `paged_attention_quant` (decode, L = 1): the unquantized kernel's threadgroup
(SIMDGROUPS simdgroups per (query head, sequence), simdgroup s takes blocks s, s + SIMDGROUPS,
...) but a key is only W = D * BITS / 32 words, so a simdgroup reads KPS = 32 / LPK keys at
once: LPK lanes per key (W rounded up to 8 / 16 / 32; lanes past W idle), lane w owning word w
= dims [w * PACK, (w + 1) * PACK) (PACK = 32 / BITS, one group: GS >= 32 >= PACK). Per word:
q.k = scale * sum_j q_j u_j + bias * sum_j q_j (sum q_j precomputed), reduced over the LPK
lanes with simd_shuffle_xor; each of the NSG * KPS (simdgroup, key slot) pairs keeps its own
online softmax (fp32) and folds p * (scale * u + bias) of V into PACK accumulators per lane.
The partials meet in threadgroup memory and threads d < D combine them into out[b, h, 0, d].
"""

from __future__ import annotations

import mlx.core as mx

from mlxlocal.metal.attention import sdpa
from mlxlocal.metal.dispatch import use_kernel
from mlxlocal.metal.kernel import KERNEL_DTYPES, LaunchSpec, dtype_name, metal_available, run
from mlxlocal.metal.paged_attention import BLOCK_SIZES, COMBINE, PROLOGUE, SIMDGROUPS, step_mask

QuantPool = tuple[mx.array, mx.array, mx.array]  # (packed uint32, scales, biases)

# No group size mx.quantize accepts (32 / 64 / 128) divides 80, so D = 80 has no quantized pool.
HEAD_DIMS = (64, 96, 128)
BITS = (4, 8)
GROUP_SIZES = (32, 64, 128)

HEADER = ""

# Inputs: q [B, Hq, 1, D] T; k_q / v_q [NB, BS, Hkv, W] uint32; k_s, k_b, v_s, v_b
# [NB, BS, Hkv, D / GS] T; block_tables [B, MB] int32; context_lens [B] int32; params {MB, Hq,
# Hkv, window (0: none)} int32; scale {scale} float32. Template: T, D, BS, NSG, BITS, GS.
# Output: out [B, Hq, 1, D] T.
SOURCE = """
    constexpr int PACK = 32 / BITS;
    constexpr uint MASK = (1u << BITS) - 1u;
    constexpr int W = D / PACK;
    constexpr int G = D / GS;
    constexpr int LPK = W <= 8 ? 8 : (W <= 16 ? 16 : 32);
    constexpr int KPS = 32 / LPK;
    constexpr int NP = NSG * KPS;
""" + PROLOGUE + """    const int slot = lane / LPK;
    const int w = lane % LPK;
    const bool owns = w < W;
    const int g = owns ? (w * PACK) / GS : 0;

    float qv[PACK];
    float acc[PACK];
    float qsum = 0.0f;
    for (int j = 0; j < PACK; j++) {
        qv[j] = owns ? sc * float(q[q_off + w * PACK + j]) : 0.0f;
        qsum += qv[j];
        acc[j] = 0.0f;
    }
    float m = NEG;
    float l = 0.0f;
    const size_t tok_w = size_t(Hkv) * W;
    const size_t tok_g = size_t(Hkv) * G;
    for (int blk = start / BS + sg; blk * BS < ctx; blk += NSG) {
        const size_t tok0 = size_t(block_tables[b * MB + blk]) * BS;
        const int t0 = max(start - blk * BS, 0);
        const int t1 = min(ctx - blk * BS, BS);
        for (int tb = t0; tb < t1; tb += KPS) {
            const int t = tb + slot;
            const bool live = t < t1;
            const size_t wo = (tok0 + size_t(live ? t : t0)) * tok_w + size_t(kvh) * W + w;
            const size_t go = (tok0 + size_t(live ? t : t0)) * tok_g + size_t(kvh) * G + g;
            float part = 0.0f;
            if (owns && live) {
                const uint word = k_q[wo];
                float dot = 0.0f;
                for (int j = 0; j < PACK; j++) {
                    dot += qv[j] * float((word >> (BITS * j)) & MASK);
                }
                part = float(k_s[go]) * dot + float(k_b[go]) * qsum;
            }
            for (int o = LPK / 2; o > 0; o /= 2) {
                part += simd_shuffle_xor(part, ushort(o));
            }
            if (live) {
                const float s = part;
                float corr = 1.0f;
                float p = 1.0f;
                if (s > m) {
                    corr = exp(m - s);
                    m = s;
                } else {
                    p = exp(s - m);
                }
                l = l * corr + p;
                if (owns) {
                    const uint word = v_q[wo];
                    const float vs = float(v_s[go]);
                    const float vb = float(v_b[go]);
                    for (int j = 0; j < PACK; j++) {
                        const float x = vs * float((word >> (BITS * j)) & MASK) + vb;
                        acc[j] = acc[j] * corr + p * x;
                    }
                }
            }
        }
    }

    threadgroup float tg_m[NP];
    threadgroup float tg_l[NP];
    threadgroup float tg_acc[NP * D];
    const int pi = sg * KPS + slot;
    if (w == 0) {
        tg_m[pi] = m;
        tg_l[pi] = l;
    }
    if (owns) {
        for (int j = 0; j < PACK; j++) {
            tg_acc[pi * D + w * PACK + j] = acc[j];
        }
    }
""" + COMBINE.replace("NPARTS", "NP")


def launch_spec(
    B: int, Hq: int, Hkv: int, D: int, block_size: int, max_blocks: int, dtype: str,
    scale: float, window: int | None, group_size: int, bits: int,
) -> LaunchSpec:
    """The Metal launch for decode attention of q [B, Hq, 1, D] over quantized pools
    [.., block_size, Hkv, ..] through block_tables [B, max_blocks]; dtype names T."""
    return LaunchSpec(
        name="paged_attention_quant",
        source=SOURCE,
        header=HEADER,
        input_names=("q", "k_q", "k_s", "k_b", "v_q", "v_s", "v_b", "block_tables",
                     "context_lens", "params", "scale"),
        output_names=("out",),
        template=(("T", dtype), ("D", D), ("BS", block_size), ("NSG", SIMDGROUPS),
                  ("BITS", bits), ("GS", group_size)),
        grid=(Hq * 32 * SIMDGROUPS, B, 1),
        threadgroup=(32 * SIMDGROUPS, 1, 1),
        output_shapes=((B, Hq, 1, D),),
        output_dtypes=(dtype,),
        constants=(((max_blocks, Hq, Hkv, window or 0), "int32"), ((float(scale),), "float32")),
    )


def _check_pool(name: str, pool: QuantPool, D: int, group_size: int, bits: int) -> None:
    if not isinstance(pool, (tuple, list)) or len(pool) != 3:
        raise ValueError(f"{name}: expected a (packed, scales, biases) triple")
    packed, scales, biases = pool
    if packed.ndim != 4 or packed.dtype != mx.uint32:
        raise ValueError(f"{name}: packed must be uint32 [num_blocks, block_size, heads, "
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
) -> mx.array:
    """q [B, Hq, L, D] -> [B, Hq, L, D]: gather the blocks the tables name (packed, scales and
    biases alike), keep the first n_keys positions, dequantize only those, then masked sdpa."""
    B, _, L, D = q.shape
    _check_pool("k", k, D, group_size, bits)
    _check_pool("v", v, D, group_size, bits)
    bs = k[0].shape[1]
    if window_start:
        block_tables = block_tables[:, window_start:]
        n_keys = None if n_keys is None else n_keys - window_start * bs

    def gather(pool: QuantPool) -> mx.array:
        parts = []
        for a in pool:
            H, last = a.shape[2], a.shape[3]
            if first_block is not None:  # B = 1, contiguous run of blocks: a slice
                a = a[first_block:first_block + block_tables.shape[1]].reshape(B, -1, H, last)
            else:
                a = a[block_tables].reshape(B, -1, H, last)
            parts.append(a if n_keys is None else a[:, :n_keys])
        x = mx.dequantize(*parts, group_size=group_size, bits=bits)
        return x.astype(q.dtype).transpose(0, 2, 1, 3)

    keys, values = gather(k), gather(v)
    if mask is False:
        mask = step_mask(context_lens, L, keys.shape[2], window)
    return sdpa(q, keys, values, scale, mask)


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
    NB, bs, Hkv, words = packed.shape
    if L != 1 or D not in HEAD_DIMS or D % group_size or bs not in BLOCK_SIZES or Hq % Hkv:
        return False
    if packed.dtype != mx.uint32 or words * 32 != D * bits or block_tables.shape[0] != B:
        return False
    if dtype_name(q.dtype) not in KERNEL_DTYPES:
        return False
    gshape = (NB, bs, Hkv, D // group_size)
    for p, s, z in (k, v):
        if p.shape != packed.shape or p.dtype != mx.uint32:
            return False
        if s.shape != gshape or z.shape != gshape or not s.dtype == z.dtype == q.dtype:
            return False
    return window is None or window > 0


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
) -> mx.array:
    """Dispatch point for paged attention over quantized pools (the Metal kernel: decode, L = 1).

    n_keys / mask / first_block / window_start are hints for the reference path; the kernel
    finds a window's start itself.
    """
    if not (metal_available() and use_kernel("paged_attention_quantized", kernel_supports_quantized,
                                             q, k, v, block_tables, group_size, bits, window)):
        return paged_attention_quantized_reference(
            q, k, v, block_tables, context_lens, scale, group_size, bits, window, n_keys=n_keys,
            mask=mask, first_block=first_block, window_start=window_start)
    B, Hq, _, D = q.shape
    _, bs, Hkv, _ = k[0].shape
    spec = launch_spec(B, Hq, Hkv, D, bs, block_tables.shape[1], dtype_name(q.dtype), scale,
                       window, group_size, bits)
    tensors = [q, *k, *v, block_tables.astype(mx.int32), context_lens.astype(mx.int32)]
    return run(spec, tensors)[0]
