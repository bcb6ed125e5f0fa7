"""Attention straight from paged K/V pools, through block tables and context lengths.

Pools are head-major [n_kv_heads, num_blocks, block_size, head_dim]: key j of block id for KV
head h is row (h * num_blocks + id) * block_size + j. Sequence b's queries are its
last L positions: q_pos = context_lens[b] - L + i; it sees keys at positions <= q_pos
(and > q_pos - window for sliding-window layers).

Metal kernels (decode, L = 1), as in MLX's sdpa_vector / sdpa_vector_2pass:
- `paged_attention` (one pass) / `paged_attention_split` (pass 1 of 2): one threadgroup of
  SIMDGROUPS simdgroups per (KV head, head group, sequence, partition) = grid
  (Hkv * HG * 32 * SIMDGROUPS, B, P). The GQA group's G = Hq / Hkv query heads are served by
  the threadgroup of their KV head (HG = 1 unless G > 8: then HG groups of GH = G / HG <= 8),
  so a K/V byte is loaded once per head set, not once per query head: the GH heads are split
  into HSETS sets of HPS (a power of two, HPS * dims-per-lane <= QREGS: MLX's register cap);
  simdgroup s serves set s % HSETS over key stripe s / HSETS (KS = SIMDGROUPS / HSETS stripes).
- Keys: the sequence's visible blocks [start / BS, ceil(ctx / BS)) (start = max(0, ctx -
  window)) are cut into P contiguous chunks, partition z taking chunk z; in each of its blocks
  stripe k takes tokens t0 + k, t0 + k + KS, ... Per block one 64-bit base pointer ((kvh * NB +
  id) * BS * D: the head's keys of a block are contiguous); token offsets inside it are 32-bit.
  Lane l holds DPL contiguous dims [l * DPL, (l + 1) * DPL) (DPL = D / 32: vec2 loads at
  D = 64, 3 scalars at 96, vec4 at 128; D = 80: DPL = 4 on lanes 0..19, lanes 20..31 hold no dim). Per key: a dot per head over the
  lane's dims, the HPS sums in one reduce-scatter (REDUCE: HPS - 1 + 5 - log2(HPS) shuffles,
  + HPS to share the sums if HPS > 1; not HPS simd_sums), per head an online softmax (fp32)
  folding p * v into the lane's DPL accumulators.
- Merge (one round per head of a set): each simdgroup's (m, l, acc) go to threadgroup memory,
  threads (set, d) combine the KS stripes. One pass: out[b, h, 0, d]. Split: the unnormalised
  partial part[b, h, z, 0:D] with its max m at [D] and sum l at [D + 1] (float32), and
  `paged_attention_combine` (one simdgroup per (query head, sequence)) merges the P partials.
- P (host, `partitions`): 1 (one pass) while the span (the longest context, n_keys, else the
  table's width; capped by the window) is up to PART_TOKENS keys, then one partition per
  PART_TOKENS keys up to MAX_PARTITIONS, fewer once B * Hkv * HG * P reaches MAX_THREADGROUPS.
- Block-id guard: a table entry the kernel would read (a block holding a visible position) that
  is < 0 or >= num_blocks, or a context longer than the table row (ctx > max_blocks * BS), is
  never dereferenced; that sequence's output is NaN in every head and dim (a stale table must
  not pass as a result). A sequence with no visible key (ctx <= 0) gets zeros.
"""

from __future__ import annotations

import math

import mlx.core as mx

# rows_index and step_mask are re-exported: callers build a step's index and mask from here.
from mlxlocal.metal.attention import rows_index, sdpa, sequence_rows, step_mask  # noqa: F401
from mlxlocal.metal.dispatch import use_kernel
from mlxlocal.metal.kernel import KERNEL_DTYPES, LaunchSpec, dtype_name, metal_available, run

HEAD_DIMS = (64, 80, 96, 128)
BLOCK_SIZES = (16, 32)
SIMDGROUPS = 8  # simdgroups per threadgroup (head sets x key stripes)
MAX_GROUP = 8  # query heads one threadgroup serves (G > 8: several head groups per KV head)
QREGS = 16  # q floats per lane per head set (MLX's sdpa_vector_2pass_1_gqa: 4 heads at D = 128)
PART_TOKENS = 256  # visible keys per partition of the split kernel
MAX_PARTITIONS = 32
MAX_THREADGROUPS = 1024  # no more partitions once the batch fills this many threadgroups

# Loads of N contiguous elements as floats: one vec<T, 4> / vec<T, 2> load when N allows
# (the offsets are multiples of N elements: aligned), scalars otherwise.
HEADER = """
template <typename T, int N>
struct DimLoad {
  static inline void run(const device T* p, thread float* x) {
    for (int i = 0; i < N; i++) {
      x[i] = float(p[i]);
    }
  }
};
template <typename T>
struct DimLoad<T, 2> {
  static inline void run(const device T* p, thread float* x) {
    const float2 v = float2(*reinterpret_cast<const device vec<T, 2>*>(p));
    x[0] = v.x;
    x[1] = v.y;
  }
};
template <typename T>
struct DimLoad<T, 4> {
  static inline void run(const device T* p, thread float* x) {
    const float4 v = float4(*reinterpret_cast<const device vec<T, 4>*>(p));
    x[0] = v.x;
    x[1] = v.y;
    x[2] = v.z;
    x[3] = v.w;
  }
};
template <typename T>
struct DimLoad<T, 8> {
  static inline void run(const device T* p, thread float* x) {
    DimLoad<T, 4>::run(p, x);
    DimLoad<T, 4>::run(p + 4, x + 4);
  }
};
// A quiet NaN of T built from its bits, stored without any float operation (fast math may
// assume no NaN flows through arithmetic, conversions or selects).
template <typename T>
inline T nan_of() {
  return as_type<T>(ushort(0x7e00));
}
template <>
inline float nan_of<float>() {
  return as_type<float>(0x7fc00000u);
}
template <>
inline bfloat16_t nan_of<bfloat16_t>() {
  return as_type<bfloat16_t>(ushort(0x7fc0));
}
"""

# The start of both paged attention kernels (this one and paged_attention_quant), after the
# kernel's constexprs GH, HPS, HSETS, KPS: the launch contract decoded (params {MB, Hq, Hkv,
# window, NB}, scale), which heads / stripe / partition this simdgroup serves, the sequence's
# visible blocks and this partition's share [c0, c1). `bad`: the table cannot be trusted.
PROLOGUE = """
    constexpr float NEG = -1.0e30f;
    constexpr int KS = NSG / HSETS;
    const int MB = params[0];
    const int Hq = params[1];
    const int Hkv = params[2];
    const int window = params[3];
    const int NB = params[4];
    const int HG = (Hq / Hkv) / GH;
    const int kvh = int(threadgroup_position_in_grid.x) / HG;
    const int h_first = kvh * (Hq / Hkv) + (int(threadgroup_position_in_grid.x) % HG) * GH;
    const int b = int(threadgroup_position_in_grid.y);
    const int pz = int(threadgroup_position_in_grid.z);
    const int nparts = int(threadgroups_per_grid.z);
    const int lane = int(thread_index_in_simdgroup);
    const int sg = int(simdgroup_index_in_threadgroup);
    const int tid = int(thread_index_in_threadgroup);
    const int hset = sg % HSETS;
    const int stripe = sg / HSETS;
    const int ctx = context_lens[b];
    const int start = window > 0 ? max(ctx - window, 0) : 0;
    const float sc = scale[0];
    const int blk0 = start / BS;
    const int blk_end = (ctx + BS - 1) / BS;
    bool bad = blk_end > MB;
    const int nblk = bad ? 0 : max(blk_end - blk0, 0);
    const int chunk = (nblk + nparts - 1) / nparts;
    const int c0 = blk0 + pz * chunk;
    const int c1 = min(blk0 + nblk, c0 + chunk);
"""

# Opens the loop over this partition's blocks: an id out of the pool is never read (it marks
# the sequence bad: every simdgroup of the threadgroup reads the same entries, so `bad` is
# uniform). Defines id, row (the pools' row-block kvh * NB + id: the block's keys of this head
# start at row * BS), t0, t1 (the block's visible tokens); the kernel closes the loop.
BLOCKS = """
    for (int blk = c0; blk < c1; blk++) {
        const int id = block_tables[b * MB + blk];
        if (id < 0 || id >= NB) {
            bad = true;
            continue;
        }
        const size_t row = size_t(kvh) * size_t(NB) + size_t(id);
        const int t0 = max(start - blk * BS, 0);
        const int t1 = min(ctx - blk * BS, BS);
"""

# The scores of the HPS heads of a set (HPS a power of two, 2^HB): s[jj] holds this lane's
# partial dot of head jj; the RL = 2^RB lanes of a span (rlane = index in it, rbase = its first
# lane) sum them. A butterfly reduce-scatter (HPS - 1 shuffles: each step sends half the heads
# to the partner lane and keeps the other half) leaves head rlane >> (RB - HB) on each lane, a
# plain butterfly (RB - HB shuffles) finishes its sum, and HPS shuffles give every lane all HPS
# totals in score[] (all lanes the same bits, so the softmax branches stay uniform). Instead of
# HPS reductions of RB steps each (a simd_sum costs ~7 shuffles' throughput on M1).
REDUCE = """
            for (int k = 0; k < HB; k++) {
                const int half = HPS >> (k + 1);
                const ushort o = ushort(RL >> (k + 1));
                const bool up = (rlane & int(o)) != 0;
                for (int i = 0; i < half; i++) {
                    const float send = up ? s[i] : s[i + half];
                    const float keep = up ? s[i + half] : s[i];
                    s[i] = keep + simd_shuffle_xor(send, o);
                }
            }
            float tot = s[0];
            for (int o = RL >> (HB + 1); o > 0; o >>= 1) {
                tot += simd_shuffle_xor(tot, ushort(o));
            }
            float score[HPS];
            if (HPS == 1) {
                score[0] = tot;
            } else {
                for (int j = 0; j < HPS; j++) {
                    score[j] = simd_shuffle(tot, ushort(rbase + (j << (RB - HB))));
                }
            }
"""

# The end of both kernels: one round per head jj of a set. WRITE_PARTIAL (kernel-specific)
# puts producer pr's (m, l, acc) of head jj into tg_m / tg_l / tg_acc; threads e = (set, d)
# merge the producers of their set (stripe-major, KPS slots each) and STORE head h's dim d.
MERGE = """
    threadgroup float tg_m[NSG * KPS];
    threadgroup float tg_l[NSG * KPS];
    threadgroup float tg_acc[NSG * KPS * D];
    for (int jj = 0; jj < HPS; jj++) {
WRITE_PARTIAL
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (int e = tid; e < HSETS * D; e += NSG * 32) {
            const int set = e / D;
            const int d = e % D;
            const int j = set * HPS + jj;
            if (j < GH) {
                float mall = NEG;
                for (int st = 0; st < KS; st++) {
                    for (int sl = 0; sl < KPS; sl++) {
                        const int r = (st * HSETS + set) * KPS + sl;
                        if (tg_l[r] > 0.0f) {
                            mall = max(mall, tg_m[r]);
                        }
                    }
                }
                float num = 0.0f;
                float den = 0.0f;
                for (int st = 0; st < KS; st++) {
                    for (int sl = 0; sl < KPS; sl++) {
                        const int r = (st * HSETS + set) * KPS + sl;
                        if (tg_l[r] > 0.0f) {
                            const float f = exp(tg_m[r] - mall);
                            num += f * tg_acc[r * D + d];
                            den += f * tg_l[r];
                        }
                    }
                }
                const int h = h_first + j;
STORE
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
"""

# One pass: the normalised result (NaN when the table was bad: nan_of, no float op on it).
STORE_OUT = """
                if (bad) {
                    out[(b * Hq + h) * D + d] = nan_of<T>();
                } else {
                    out[(b * Hq + h) * D + d] = static_cast<T>(den > 0.0f ? num / den : 0.0f);
                }
"""

# Split: the partition's unnormalised sum relative to its max; l = -1 marks a bad table.
STORE_PART = """
                const int row = ((b * Hq + h) * nparts + pz) * (D + 2);
                part[row + d] = num;
                if (d == 0) {
                    part[row + D] = mall;
                    part[row + D + 1] = bad ? -1.0f : den;
                }
"""

# Inputs: q [B, Hq, 1, D] T, k_pool / v_pool [Hkv, NB, BS, D] T, block_tables [B, MB] int32,
# context_lens [B] int32, params {MB, Hq, Hkv, window (0: none), NB} int32, scale {scale}
# float32. Template: T, D, BS, NSG, GH, HSETS, HPS. Output: out [B, Hq, 1, D] T (one pass) or
# part [B, Hq, P, D + 2] float32 (split).
BODY = """
    constexpr int KPS = 1;
    constexpr int DPL = D % 32 == 0 ? D / 32 : 4;
    constexpr int LN = D / DPL;
    constexpr int HB = HPS >= 8 ? 3 : (HPS >= 4 ? 2 : (HPS >= 2 ? 1 : 0));
    constexpr int RL = 32;
    constexpr int RB = 5;
""" + PROLOGUE + """
    const int rlane = lane;
    const int rbase = 0;
    const bool holds = lane < LN;
    const int slot = 0;
    float qv[HPS][DPL];
    float acc[HPS][DPL];
    float m[HPS];
    float l[HPS];
    for (int jj = 0; jj < HPS; jj++) {
        const int j = min(hset * HPS + jj, GH - 1);
        if (holds) {
            DimLoad<T, DPL>::run(q + (b * Hq + h_first + j) * D + lane * DPL, qv[jj]);
        }
        for (int i = 0; i < DPL; i++) {
            qv[jj][i] = holds ? sc * qv[jj][i] : 0.0f;
            acc[jj][i] = 0.0f;
        }
        m[jj] = NEG;
        l[jj] = 0.0f;
    }
""" + BLOCKS + """
        const device T* kb = k_pool + row * size_t(BS * D);
        const device T* vb = v_pool + row * size_t(BS * D);
        for (int t = t0 + stripe; t < t1; t += KS) {
            const uint off = uint(t * D + lane * DPL);
            float kx[DPL];
            float vx[DPL];
            for (int i = 0; i < DPL; i++) {
                kx[i] = 0.0f;
                vx[i] = 0.0f;
            }
            if (holds) {
                DimLoad<T, DPL>::run(kb + off, kx);
                DimLoad<T, DPL>::run(vb + off, vx);
            }
            float s[HPS];
            for (int jj = 0; jj < HPS; jj++) {
                s[jj] = 0.0f;
                for (int i = 0; i < DPL; i++) {
                    s[jj] += qv[jj][i] * kx[i];
                }
            }
""" + REDUCE + """
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
                for (int i = 0; i < DPL; i++) {
                    acc[jj][i] = acc[jj][i] * corr + p * vx[i];
                }
            }
        }
    }
    const int pr = sg * KPS + slot;
""" + MERGE.replace("WRITE_PARTIAL", """
        if (lane == 0) {
            tg_m[pr] = m[jj];
            tg_l[pr] = l[jj];
        }
        if (holds) {
            for (int i = 0; i < DPL; i++) {
                tg_acc[pr * D + lane * DPL + i] = acc[jj][i];
            }
        }""")

SOURCE = BODY.replace("STORE", STORE_OUT)
SOURCE_SPLIT = BODY.replace("STORE", STORE_PART)

# Inputs: part [B, Hq, P, D + 2] float32 (pass 1's output), params {P} int32. Template: T, D,
# MAXP. One simdgroup per (query head h, sequence b) = grid (Hq * 32, B): lane z reads
# partition z's (m, l) (and z + 32, ...), the weights exp(m_z - max) go through threadgroup
# memory, lane d sums dims d, d + 32, ... Output: out [B, Hq, 1, D] T (NaN if any l < 0).
COMBINE_SOURCE = """
    constexpr float NEG = -1.0e30f;
    const int P = params[0];
    const int Hq = int(threadgroups_per_grid.x);
    const int bh = int(threadgroup_position_in_grid.y) * Hq + int(threadgroup_position_in_grid.x);
    const int lane = int(thread_index_in_simdgroup);
    const device float* rows = part + size_t(bh) * size_t(P * (D + 2));
    threadgroup float tg_f[MAXP];
    float mall = NEG;
    bool bad = false;
    for (int z = lane; z < P; z += 32) {
        const float lz = rows[z * (D + 2) + D + 1];
        bad = bad || lz < 0.0f;
        if (lz > 0.0f) {
            mall = max(mall, rows[z * (D + 2) + D]);
        }
    }
    mall = simd_max(mall);
    bad = simd_any(bad);
    float den = 0.0f;
    for (int z = lane; z < P; z += 32) {
        const float lz = rows[z * (D + 2) + D + 1];
        const float f = lz > 0.0f ? exp(rows[z * (D + 2) + D] - mall) : 0.0f;
        tg_f[z] = f;
        den += f * lz;
    }
    den = simd_sum(den);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (int d = lane; d < D; d += 32) {
        float num = 0.0f;
        for (int z = 0; z < P; z++) {
            num += tg_f[z] * rows[z * (D + 2) + d];
        }
        if (bad) {
            out[bh * D + d] = nan_of<T>();
        } else {
            out[bh * D + d] = static_cast<T>(den > 0.0f ? num / den : 0.0f);
        }
    }
"""


def head_split(G: int, lane_floats: int) -> tuple[int, int, int]:
    """(GH, HSETS, HPS) for a GQA group of G query heads whose q takes lane_floats floats per
    lane and head: GH heads per threadgroup (the largest divisor of G up to MAX_GROUP), in
    HSETS sets (a divisor of SIMDGROUPS) of HPS heads, HPS a power of two (the reduce-scatter's
    width; slots past GH compute a copy of the last head and store nothing) with
    HPS * lane_floats <= QREGS where possible."""
    GH = max(d for d in range(1, MAX_GROUP + 1) if G % d == 0)

    def hps(hsets: int) -> int:
        return 1 << (math.ceil(GH / hsets) - 1).bit_length()

    hsets = 1
    while hsets < SIMDGROUPS and hps(hsets) * lane_floats > QREGS:
        hsets *= 2
    return GH, hsets, hps(hsets)


def partitions(span: int, threadgroups: int) -> int:
    """Key partitions for the longest visible span when one partition needs `threadgroups`
    threadgroups (1: the one-pass kernel)."""
    want = min(math.ceil(max(span, 1) / PART_TOKENS), MAX_PARTITIONS)
    return max(1, min(want, MAX_THREADGROUPS // max(threadgroups, 1)))


def combine_spec(B: int, Hq: int, D: int, parts: int, dtype: str) -> LaunchSpec:
    """The second launch of a split: merges part [B, Hq, parts, D + 2] into out [B, Hq, 1, D]."""
    if not 1 < parts <= MAX_PARTITIONS:
        raise ValueError(f"partitions must be 2..{MAX_PARTITIONS}, got {parts}")
    return LaunchSpec(
        name="paged_attention_combine",
        source=COMBINE_SOURCE,
        header=HEADER,
        input_names=("part", "params"),
        output_names=("out",),
        template=(("T", dtype), ("D", D), ("MAXP", MAX_PARTITIONS)),
        grid=(Hq * 32, B, 1),
        threadgroup=(32, 1, 1),
        output_shapes=((B, Hq, 1, D),),
        output_dtypes=(dtype,),
        constants=(((parts,), "int32"),),
    )


def split_specs(name: str, source: str, source_split: str, B: int, Hq: int, Hkv: int, D: int,
                dtype: str, parts: int, groups: int, template: tuple, inputs: tuple,
                params: tuple, scale: float) -> tuple[LaunchSpec, ...]:
    """The launches of one paged attention call (both kernels' shared grid and outputs):
    (one pass,) when parts == 1, else (split pass 1, combine)."""
    first = LaunchSpec(
        name=name if parts == 1 else name + "_split",
        source=source if parts == 1 else source_split,
        header=HEADER,
        input_names=inputs,
        output_names=("out",) if parts == 1 else ("part",),
        template=template,
        grid=(Hkv * groups * 32 * SIMDGROUPS, B, parts),
        threadgroup=(32 * SIMDGROUPS, 1, 1),
        output_shapes=((B, Hq, 1, D),) if parts == 1 else ((B, Hq, parts, D + 2),),
        output_dtypes=(dtype,) if parts == 1 else ("float32",),
        constants=((params, "int32"), ((float(scale),), "float32")),
    )
    return (first,) if parts == 1 else (first, combine_spec(B, Hq, D, parts, dtype))


def launch_specs(
    B: int, Hq: int, Hkv: int, D: int, block_size: int, max_blocks: int, num_blocks: int,
    dtype: str, scale: float, window: int | None, span: int | None = None,
    parts: int | None = None,
) -> tuple[LaunchSpec, ...]:
    """The Metal launches for decode attention of q [B, Hq, 1, D] over pools [Hkv, num_blocks,
    block_size, D] through block_tables [B, max_blocks]; dtype names T. `span`: the
    longest context (default: the table's width); `parts` overrides the partition count."""
    G = Hq // Hkv
    DPL = D // 32 if D % 32 == 0 else 4
    GH, hsets, hps = head_split(G, DPL)
    span = min(span or max_blocks * block_size, window or 1 << 30)
    parts = parts or partitions(span, B * Hkv * (G // GH))
    template = (("T", dtype), ("D", D), ("BS", block_size), ("NSG", SIMDGROUPS), ("GH", GH),
                ("HSETS", hsets), ("HPS", hps))
    return split_specs("paged_attention", SOURCE, SOURCE_SPLIT, B, Hq, Hkv, D, dtype, parts,
                       G // GH, template,
                       ("q", "k_pool", "v_pool", "block_tables", "context_lens", "params", "scale"),
                       (max_blocks, Hq, Hkv, window or 0, num_blocks), scale)


def run_launches(specs: tuple[LaunchSpec, ...], tensors: list[mx.array]) -> mx.array:
    """Run launch_specs' launches on Metal: pass 1 on `tensors`, the combine on its output."""
    out = run(specs[0], tensors)[0]
    return out if len(specs) == 1 else run(specs[1], [out])[0]


def cut_window(block_tables: mx.array, n_keys: int | None, index: mx.array | None,
               first_block: int | None, window_start: int, block_size: int) -> tuple:
    """(tables, n_keys, index, first_block) from a window layer's first visible block on: the
    blocks before window_start are never read (a run's first block moves with the cut)."""
    if not window_start:
        return block_tables, n_keys, index, first_block
    return (block_tables[:, window_start:],
            None if n_keys is None else n_keys - window_start * block_size,
            None if index is None else index[:, :, window_start:],
            None if first_block is None else first_block + window_start)


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
    index: mx.array | None = None,
) -> mx.array:
    """q [B, Hq, L, D]; block_tables [B, max_blocks] int32; context_lens [B] -> [B, Hq, L, D].

    A caller that knows the longest context (n_keys) and has the mask for this step
    (None / "causal" / a boolean array, shared by every layer) passes them: fewer keys
    read and no per-layer mask arithmetic. mask=False means "build it here".
    `first_block`: B = 1 and the table is first_block, first_block + 1, ...: a slice, not
    a gather. `window_start`: a window layer's first block any query sees; keys before it
    are not read (the caller's mask starts there too). `index`: rows_index(block_tables, Hkv,
    num_blocks), shared by the layers of a step (built here when None).
    """
    L, bs = q.shape[2], k_pool.shape[2]
    tables, n, index, first = cut_window(block_tables, n_keys, index, first_block, window_start,
                                         bs)
    keys = sequence_rows(k_pool, tables, n, index, first)
    v_index = index if v_pool.shape[:2] == k_pool.shape[:2] else None
    values = sequence_rows(v_pool, tables, n, v_index, first)
    if mask is False:
        start = window_start * bs
        mask = step_mask(context_lens, L, start + keys.shape[2], window, start)
    return sdpa(q, keys, values, scale, mask)


def kernel_supports(
    q: mx.array, k_pool: mx.array, v_pool: mx.array, block_tables: mx.array,
    window: int | None,
) -> bool:
    """Shapes and dtypes the paged_attention kernel handles (Metal availability aside)."""
    if q.ndim != 4 or k_pool.ndim != 4 or block_tables.ndim != 2:
        return False
    B, Hq, L, D = q.shape
    Hkv, _, bs, Dk = k_pool.shape
    if L != 1 or D != Dk or D not in HEAD_DIMS or bs not in BLOCK_SIZES or Hq % Hkv:
        return False
    if v_pool.shape != k_pool.shape or block_tables.shape[0] != B:
        return False
    if dtype_name(q.dtype) not in KERNEL_DTYPES or not q.dtype == k_pool.dtype == v_pool.dtype:
        return False
    return window is None or window > 0


def kernel_taken(q: mx.array, k_pool: mx.array, v_pool: mx.array, block_tables: mx.array,
                 window: int | None) -> bool:
    """Whether paged_attention runs our Metal kernel for these arguments (else the reference:
    a caller may then split a batch into per-sequence runs it can read by slices)."""
    return metal_available() and use_kernel("paged_attention", kernel_supports, q, k_pool, v_pool,
                                            block_tables, window)


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
    index: mx.array | None = None,
) -> mx.array:
    """Dispatch point for paged attention (decode, L = 1, is the Metal kernel's case).

    n_keys / mask / first_block / window_start / index are hints for the reference path (see
    paged_attention_reference); the kernel finds a window's start itself and takes n_keys
    (the longest context) as the span its partition count is chosen for.
    """
    if not kernel_taken(q, k_pool, v_pool, block_tables, window):
        return paged_attention_reference(q, k_pool, v_pool, block_tables, context_lens, scale,
                                         window, n_keys=n_keys, mask=mask, first_block=first_block,
                                         window_start=window_start, index=index)
    B, Hq, _, D = q.shape
    Hkv, NB, bs, _ = k_pool.shape
    specs = launch_specs(B, Hq, Hkv, D, bs, block_tables.shape[1], NB, dtype_name(q.dtype),
                         scale, window, span=n_keys)
    tensors = [q, k_pool, v_pool, block_tables.astype(mx.int32), context_lens.astype(mx.int32)]
    return run_launches(specs, tensors)
