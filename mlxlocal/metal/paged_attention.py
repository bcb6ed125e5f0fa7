"""Attention straight from paged K/V pools, through block tables and context lengths.

Pools are [num_blocks, block_size, n_kv_heads, head_dim]. Sequence b's queries are its
last L positions: q_pos = context_lens[b] - L + i; it sees keys at positions <= q_pos
(and > q_pos - window for sliding-window layers).

Metal kernel `paged_attention` (decode, L = 1): one threadgroup of SIMDGROUPS simdgroups per
(query head, sequence) = grid (Hq * 32 * SIMDGROUPS, B). Simdgroup s takes the sequence's
blocks s, s + SIMDGROUPS, ... (only those holding positions in [start, ctx), start =
max(0, ctx - window)); one key at a time, lane l owns dims l, l + 32, ... (D = 80 / 96 leave
the last slot to some lanes), the score is a simd_sum of q*k, and an online softmax (running
max m and sum l, fp32) folds p * v into per-lane accumulators. K/V of kv head h / (Hq / Hkv)
are read straight from the pools through the block table. At the end the simdgroups' (m, l,
acc) meet in threadgroup memory and threads d < D combine them and store out[b, h, 0, d].
"""

from __future__ import annotations

import mlx.core as mx

from mlxlocal.metal.attention import sdpa
from mlxlocal.metal.dispatch import use_kernel
from mlxlocal.metal.kernel import KERNEL_DTYPES, LaunchSpec, dtype_name, metal_available, run

HEAD_DIMS = (64, 80, 96, 128)
BLOCK_SIZES = (16, 32)
SIMDGROUPS = 8  # simdgroups per threadgroup, splitting the key blocks between them

HEADER = ""

# The start of both paged attention kernels (this one and paged_attention_quant): their shared
# launch contract decoded (params {MB, Hq, Hkv, window}, scale; one threadgroup per (query head
# h, sequence b)), the sequence's context and first key (start, sliding windows), q's offset.
PROLOGUE = """
    constexpr float NEG = -1.0e30f;
    const int MB = params[0];
    const int Hq = params[1];
    const int Hkv = params[2];
    const int window = params[3];
    const int h = int(threadgroup_position_in_grid.x);
    const int b = int(threadgroup_position_in_grid.y);
    const int tid = int(thread_position_in_threadgroup.x);
    const int lane = tid % 32;
    const int sg = tid / 32;
    const int kvh = h / (Hq / Hkv);
    const int ctx = context_lens[b];
    const int start = window > 0 ? max(ctx - window, 0) : 0;
    const float sc = scale[0];
    const size_t q_off = size_t(b * Hq + h) * D;
"""

# The end of both paged attention kernels (this one and paged_attention_quant): after a
# barrier, threads d < D merge the NPARTS partial online softmaxes (tg_m, tg_l, tg_acc in
# threadgroup memory; tg_l = 0: a partial that saw no key) and store out[q_off + d].
COMBINE = """
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (tid < D) {
        float mx_all = NEG;
        for (int s = 0; s < NPARTS; s++) {
            if (tg_l[s] > 0.0f) {
                mx_all = max(mx_all, tg_m[s]);
            }
        }
        float num = 0.0f;
        float den = 0.0f;
        for (int s = 0; s < NPARTS; s++) {
            if (tg_l[s] > 0.0f) {
                const float f = exp(tg_m[s] - mx_all);
                num += f * tg_acc[s * D + tid];
                den += f * tg_l[s];
            }
        }
        out[q_off + tid] = static_cast<T>(den > 0.0f ? num / den : 0.0f);
    }
"""

# Inputs: q [B, Hq, 1, D] T, k_pool / v_pool [NB, BS, Hkv, D] T, block_tables [B, MB] int32,
# context_lens [B] int32, params {MB, Hq, Hkv, window (0: none)} int32, scale {scale} float32.
# Template: T, D, BS, NSG (simdgroups). Output: out [B, Hq, 1, D] T.
SOURCE = """
    constexpr int QS = (D + 31) / 32;
""" + PROLOGUE + """
    float qv[QS];
    float acc[QS];
    for (int i = 0; i < QS; i++) {
        const int d = lane + 32 * i;
        qv[i] = d < D ? sc * float(q[q_off + d]) : 0.0f;
        acc[i] = 0.0f;
    }
    float m = NEG;
    float l = 0.0f;
    const size_t tok_stride = size_t(Hkv) * D;
    for (int blk = start / BS + sg; blk * BS < ctx; blk += NSG) {
        const size_t base = size_t(block_tables[b * MB + blk]) * BS * tok_stride
            + size_t(kvh) * D;
        const int t0 = max(start - blk * BS, 0);
        const int t1 = min(ctx - blk * BS, BS);
        for (int t = t0; t < t1; t++) {
            const size_t off = base + size_t(t) * tok_stride;
            float part = 0.0f;
            for (int i = 0; i < QS; i++) {
                const int d = lane + 32 * i;
                if (d < D) {
                    part += qv[i] * float(k_pool[off + d]);
                }
            }
            const float s = simd_sum(part);
            float corr = 1.0f;
            float p = 1.0f;
            if (s > m) {
                corr = exp(m - s);
                m = s;
            } else {
                p = exp(s - m);
            }
            l = l * corr + p;
            for (int i = 0; i < QS; i++) {
                const int d = lane + 32 * i;
                if (d < D) {
                    acc[i] = acc[i] * corr + p * float(v_pool[off + d]);
                }
            }
        }
    }

    threadgroup float tg_m[NSG];
    threadgroup float tg_l[NSG];
    threadgroup float tg_acc[NSG * D];
    if (lane == 0) {
        tg_m[sg] = m;
        tg_l[sg] = l;
    }
    for (int i = 0; i < QS; i++) {
        const int d = lane + 32 * i;
        if (d < D) {
            tg_acc[sg * D + d] = acc[i];
        }
    }
""" + COMBINE.replace("NPARTS", "NSG")


def launch_spec(
    B: int, Hq: int, Hkv: int, D: int, block_size: int, max_blocks: int, dtype: str,
    scale: float, window: int | None,
) -> LaunchSpec:
    """The Metal launch for decode attention of q [B, Hq, 1, D] over pools [.., block_size,
    Hkv, D] through block_tables [B, max_blocks]; dtype names T."""
    return LaunchSpec(
        name="paged_attention",
        source=SOURCE,
        header=HEADER,
        input_names=("q", "k_pool", "v_pool", "block_tables", "context_lens", "params", "scale"),
        output_names=("out",),
        template=(("T", dtype), ("D", D), ("BS", block_size), ("NSG", SIMDGROUPS)),
        grid=(Hq * 32 * SIMDGROUPS, B, 1),
        threadgroup=(32 * SIMDGROUPS, 1, 1),
        output_shapes=((B, Hq, 1, D),),
        output_dtypes=(dtype,),
        constants=(((max_blocks, Hq, Hkv, window or 0), "int32"), ((float(scale),), "float32")),
    )


def paged_attention_reference(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
    window: int | None = None,
    *,
    n_keys: int | None = None,
    mask: mx.array | str | None | bool = False,
    first_block: int | None = None,
    window_start: int = 0,
) -> mx.array:
    """q [B, Hq, L, D]; block_tables [B, max_blocks] int32; context_lens [B] -> [B, Hq, L, D].

    A caller that knows the longest context (n_keys) and has the mask for this step
    (None / "causal" / a boolean array, shared by every layer) passes them: fewer keys
    gathered and no per-layer mask arithmetic. mask=False means "build it here".
    `first_block`: B = 1 and the table is first_block, first_block + 1, ...: a slice, not
    a gather. `window_start`: a window layer's first block any query sees; keys before it
    are not read (the caller's mask starts there too).
    """
    B, _, L, _ = q.shape
    _, bs, H, D = k_pool.shape
    if window_start:
        block_tables = block_tables[:, window_start:]
        n_keys = None if n_keys is None else n_keys - window_start * bs
    if first_block is not None:
        end = first_block + block_tables.shape[1]
        keys = k_pool[first_block:end].reshape(B, -1, H, D)
        values = v_pool[first_block:end].reshape(B, -1, H, D)
    else:
        keys = k_pool[block_tables].reshape(B, -1, H, D)
        values = v_pool[block_tables].reshape(B, -1, H, D)
    if n_keys is not None:
        keys, values = keys[:, :n_keys], values[:, :n_keys]
    keys, values = keys.transpose(0, 2, 1, 3), values.transpose(0, 2, 1, 3)
    if mask is False:
        mask = step_mask(context_lens, L, keys.shape[2], window)
    return sdpa(q, keys, values, scale, mask)


def step_mask(context_lens: mx.array, L: int, n_keys: int, window: int | None, first_key: int = 0) -> mx.array:
    """[B, 1, L, n_keys - first_key]: sequence b's query i sits at position
    context_lens[b] - L + i; the keys are positions first_key .. n_keys - 1."""
    k_pos = mx.arange(first_key, n_keys)[None, None, :]
    q_pos = (context_lens[:, None] - L + mx.arange(L)[None, :])[:, :, None]
    mask = k_pos <= q_pos
    if window is not None:
        mask = mask & (k_pos > q_pos - window)
    return mask[:, None]


def kernel_supports(
    q: mx.array, k_pool: mx.array, v_pool: mx.array, block_tables: mx.array,
    window: int | None,
) -> bool:
    """Shapes and dtypes the paged_attention kernel handles (Metal availability aside)."""
    if q.ndim != 4 or k_pool.ndim != 4 or block_tables.ndim != 2:
        return False
    B, Hq, L, D = q.shape
    _, bs, Hkv, Dk = k_pool.shape
    if L != 1 or D != Dk or D not in HEAD_DIMS or bs not in BLOCK_SIZES or Hq % Hkv:
        return False
    if v_pool.shape != k_pool.shape or block_tables.shape[0] != B:
        return False
    if dtype_name(q.dtype) not in KERNEL_DTYPES or not q.dtype == k_pool.dtype == v_pool.dtype:
        return False
    return window is None or window > 0


def paged_attention(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
    window: int | None = None,
    *,
    n_keys: int | None = None,
    mask: mx.array | str | None | bool = False,
    first_block: int | None = None,
    window_start: int = 0,
) -> mx.array:
    """Dispatch point for paged attention (decode, L = 1, is the Metal kernel's case).

    n_keys / mask / first_block / window_start are hints for the reference path (see
    paged_attention_reference); the kernel finds a window's start itself.
    """
    if not (metal_available()
            and use_kernel("paged_attention", kernel_supports, q, k_pool, v_pool, block_tables, window)):
        return paged_attention_reference(q, k_pool, v_pool, block_tables, context_lens, scale,
                                         window, n_keys=n_keys, mask=mask, first_block=first_block,
                                         window_start=window_start)
    B, Hq, _, D = q.shape
    spec = launch_spec(B, Hq, k_pool.shape[2], D, k_pool.shape[1], block_tables.shape[1],
                       dtype_name(q.dtype), scale, window)
    tensors = [q, k_pool, v_pool, block_tables.astype(mx.int32), context_lens.astype(mx.int32)]
    return run(spec, tensors)[0]
