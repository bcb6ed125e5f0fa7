"""The paged attention kernels (mlxlocal/metal/paged_attention.py) against the plain-MLX reference.

- Everywhere: the host's launch plan (partitions, head groups and sets) and its coverage.
- Under CPU emulation (tests/metal_emu, strict: outputs poisoned, buffers end at a guard page,
  thread order + two seeded interleavings must agree bit for bit): the exact launches the
  dispatch point makes on a Mac, one pass or split + combine, against paged_attention_reference
  (an MLX gather through the tables + masked sdpa), at the shapes models use; the block-id
  guard on stale tables.
- On a Mac: the real kernels through the dispatch point.
"""

from __future__ import annotations

import dataclasses
import importlib
import math

import mlx.core as mx
import numpy as np
import pytest
from test_kernels import (
    _mx,
    _np,
    assert_close,
    emulate,
    f32,
    needs_emu,
    needs_metal,
    to_dtype,
)

try:
    from metal_emu import KernelRuntimeError
except ImportError:  # pragma: no cover - needs_emu skips these tests then
    KernelRuntimeError = RuntimeError

# The package re-exports the function `paged_attention` under the module's name.
pa = importlib.import_module("mlxlocal.metal.paged_attention")


def dense_oracle(q, k, v, tables, lens, scale, window=None) -> np.ndarray:
    """Plain float64 attention per sequence and query (numpy, no MLX): the sequence's keys
    concatenated block by block from head-major pools [Hkv, NB, BS, D], query i of L at
    position lens[b] - L + i sees keys <= it (and > it - window)."""
    q, k, v = (np.asarray(a, np.float64) for a in (q, k, v))
    B, Hq, L, _ = q.shape
    Hkv, _, bs, _ = k.shape
    out = np.zeros((B, Hq, L, v.shape[-1]))
    for b in range(B):
        n = int(lens[b])
        blocks = np.asarray(tables[b][: math.ceil(n / bs)])
        keys = np.repeat(k[:, blocks].reshape(Hkv, -1, k.shape[-1])[:, :n], Hq // Hkv, axis=0)
        vals = np.repeat(v[:, blocks].reshape(Hkv, -1, v.shape[-1])[:, :n], Hq // Hkv, axis=0)
        for i in range(L):
            pos = n - L + i
            seen = np.arange(n) <= pos
            if window is not None:
                seen &= np.arange(n) > pos - window
            s = np.einsum("hd,hnd->hn", q[b, :, i], keys[:, seen]) * scale
            p = np.exp(s - s.max(-1, keepdims=True))
            out[b, :, i] = np.einsum("hn,hnd->hd", p / p.sum(-1, keepdims=True), vals[:, seen])
    return out


def paged_case(ctx_lens, Hq, Hkv, D, bs, dtype, window, seed=0):
    """Head-major pools [Hkv, NB, BS, D] with shuffled, padded block tables (context lens may
    end mid-block); the reference's output, checked against dense_oracle."""
    rng = np.random.default_rng(seed)
    B = len(ctx_lens)
    max_blocks = max(math.ceil(c / bs) for c in ctx_lens) + 1  # one spare padding column
    num_blocks = B * max_blocks + 3
    perm = rng.permutation(num_blocks)[: B * max_blocks].reshape(B, max_blocks)
    tables = perm.astype(np.int32)
    q, qf = to_dtype(rng.normal(size=(B, Hq, 1, D)), dtype)
    k, kf = to_dtype(rng.normal(size=(Hkv, num_blocks, bs, D)), dtype)
    v, vf = to_dtype(rng.normal(size=(Hkv, num_blocks, bs, D)), dtype)
    lens = np.array(ctx_lens, dtype=np.int32)
    scale = D ** -0.5
    want = pa.paged_attention_reference(
        f32(qf), f32(kf), f32(vf), mx.array(tables), mx.array(lens), scale, window)
    oracle = dense_oracle(qf, kf, vf, tables, lens, scale, window)
    np.testing.assert_allclose(np.array(want), oracle, rtol=1e-4, atol=1e-4)
    return [q, k, v, tables, lens], np.array(want), max_blocks, scale


def emulate_launches(specs, tensors) -> np.ndarray:
    """The dispatch's launches under the strict emulation: pass 1, then the combine on its
    float32 partials (each launch in thread order and two seeded interleavings)."""
    out = emulate(specs[0], tensors)
    return out if len(specs) == 1 else emulate(specs[1], [out])


def specs_for(tensors, ctx, Hq, Hkv, D, bs, dtype, window, max_blocks, scale, parts=None):
    return pa.launch_specs(len(ctx), Hq, Hkv, D, bs, max_blocks, tensors[1].shape[1], dtype,
                           scale, window, span=max(ctx), parts=parts)


# ---------------------------------------------------------------- everywhere


def test_partitions_follow_the_longest_context():
    assert pa.partitions(1, 8) == pa.partitions(pa.PART_TOKENS, 8) == 1  # short: one pass
    assert pa.partitions(pa.PART_TOKENS + 1, 8) == 2
    assert pa.partitions(1024, 8) == 4 and pa.partitions(4096, 8) == 16
    assert pa.partitions(8192, 8) == pa.partitions(10 ** 6, 8) == pa.MAX_PARTITIONS
    assert pa.partitions(8192, pa.MAX_THREADGROUPS) == 1  # a full batch: no split
    assert pa.partitions(8192, pa.MAX_THREADGROUPS // 4) == 4


@pytest.mark.parametrize("G,lane_floats,want", [
    (1, 4, (1, 1, 1)), (4, 4, (4, 1, 4)), (8, 2, (8, 1, 8)), (8, 4, (8, 2, 4)), (8, 3, (8, 2, 4)),
    (7, 4, (7, 2, 4)), (16, 4, (8, 2, 4)), (12, 2, (6, 1, 8)), (6, 3, (6, 2, 4)), (8, 8, (8, 4, 2)),
    (5, 8, (5, 4, 2)),
])
def test_head_split(G, lane_floats, want):
    GH, hsets, hps = pa.head_split(G, lane_floats)
    assert (GH, hsets, hps) == want
    assert G % GH == 0 and pa.SIMDGROUPS % hsets == 0 and hsets * hps >= GH
    assert hps * lane_floats <= pa.QREGS or hsets == pa.SIMDGROUPS
    assert hps & (hps - 1) == 0  # the reduce-scatter's width


@pytest.mark.parametrize("Hq,Hkv,ctx,window", [(32, 8, 1024, None), (32, 8, 8192, None),
                                               (16, 1, 200, None), (28, 4, 8192, 1024)])
def test_launch_plan(Hq, Hkv, ctx, window):
    specs = pa.launch_specs(1, Hq, Hkv, 128, 16, ctx // 16 + 1, 1000, "float16", 0.1, window,
                            span=ctx)
    t = dict(specs[0].template)
    groups = specs[0].grid[0] // (32 * pa.SIMDGROUPS)
    assert groups == Hkv * (Hq // Hkv) // t["GH"]  # one threadgroup per KV head (and head group)
    parts = specs[0].grid[2]
    assert parts == pa.partitions(min(ctx, window or ctx), groups)
    if parts == 1:
        assert len(specs) == 1 and specs[0].output_shapes == ((1, Hq, 1, 128),)
    else:
        assert [s.name for s in specs] == ["paged_attention_split", "paged_attention_combine"]
        assert specs[0].output_shapes == ((1, Hq, parts, 130),)
        assert specs[1].output_shapes == ((1, Hq, 1, 128),)
        assert specs[1].grid == (Hq * 32, 1, 1) and specs[1].constants == (((parts,), "int32"),)


def test_cpu_dispatch_is_the_reference():
    if mx.metal.is_available():
        pytest.skip("on Metal the dispatch runs the kernels (covered below)")
    tensors, want, _, scale = paged_case([40, 7], 4, 2, 64, 16, "float32", None)
    got = pa.paged_attention(*(mx.array(t) for t in tensors), scale)
    np.testing.assert_array_equal(np.array(got), want)


# The reference path's reads of head-major pools (everywhere; the MLX built-in path on a Mac).

def _pools(H=2, NB=12, bs=16, D=32, seed=3):
    rng = np.random.default_rng(seed)
    return [mx.array(rng.normal(size=(H, NB, bs, D)).astype(np.float32)) for _ in "kv"]


def test_rows_index_is_head_times_blocks_plus_id():
    tables = mx.array([[3, 0, 7], [5, 11, -1]], mx.int32)
    got = np.array(pa.rows_index(tables, 3, 12))
    assert got.shape == (2, 3, 3) and got.dtype == np.int32
    want = np.arange(3)[None, :, None] * 12 + np.array(tables)[:, None, :]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("n_keys", [None, 1, 16, 37])
def test_sequence_rows_gather(n_keys):
    k, _ = _pools()
    tables = np.array([[4, 9, 1], [0, 11, 6]], np.int32)
    got = np.array(pa.sequence_rows(k, mx.array(tables), n_keys))
    kn = np.array(k)
    want = np.stack([np.concatenate([kn[:, i] for i in row], axis=1) for row in tables])
    want = want[:, :, :n_keys]
    assert got.shape == (2, 2, n_keys or 48, 32)
    np.testing.assert_array_equal(got, want)
    index = pa.rows_index(mx.array(tables), 2, 12)  # the shared index: the same rows
    got = pa.sequence_rows(k, mx.array(tables), n_keys, index)
    np.testing.assert_array_equal(np.array(got), want)


def test_sequence_rows_run_slice_reads_only_the_blocks_it_needs():
    """A run ending at the pool's last block, its table a column wider than the pool: n_keys
    cuts the slice to the blocks holding keys (the spare column is never addressed)."""
    k, _ = _pools()
    tables = mx.array([[9, 10, 11, 12]], mx.int32)
    got = pa.sequence_rows(k, tables, 40, first_block=9)
    want = pa.sequence_rows(k, mx.array([[9, 10, 11]], mx.int32), 40)
    assert got.shape == (1, 2, 40, 32)
    np.testing.assert_array_equal(np.array(got), np.array(want))


def test_run_slice_is_a_view():
    """Reading a run of blocks allocates nothing: the slice and its reshape share the pool's
    buffer (a gather or transpose would allocate a copy of the context)."""
    k = mx.random.normal((4, 256, 16, 64))
    mx.eval(k)
    copy_bytes = 4 * 200 * 16 * 64 * 4
    before = mx.get_active_memory()
    rows = pa.sequence_rows(k, mx.zeros((1, 200), mx.int32), 200 * 16 - 5, first_block=30)
    mx.eval(rows)
    assert rows.shape == (1, 4, 3195, 64)
    assert mx.get_active_memory() - before < copy_bytes // 8
    np.testing.assert_array_equal(np.array(rows[0, 3, 16 * 7 + 2]), np.array(k[3, 37, 2]))


D_SCALE = 32 ** -0.5


def _run_case(ctx, L, window, seed=0, H=2, Hq=4, bs=16, D=32):
    """B sequences over one pool; sequence 0's table a run (first_block 2) when B = 1."""
    rng = np.random.default_rng(seed)
    k, v = _pools(H, 40, bs, D, seed)
    W = max(math.ceil(c / bs) for c in ctx) + 1
    if len(ctx) == 1:
        tables = (2 + np.arange(W, dtype=np.int32))[None]
    else:
        tables = rng.permutation(40)[: len(ctx) * W].reshape(len(ctx), W).astype(np.int32)
    q = mx.array(rng.normal(size=(len(ctx), Hq, L, D)).astype(np.float32))
    lens = np.array(ctx, np.int32)
    want = dense_oracle(np.array(q), np.array(k), np.array(v), tables, lens, D ** -0.5, window)
    return q, k, v, mx.array(tables), mx.array(lens), want


@pytest.mark.parametrize("ctx,L,window", [
    ([45], 1, None), ([45], 6, None), ([80], 1, 20), ([80], 5, 20),  # a run: first_block
    ([45, 70, 3], 1, None), ([45, 70], 4, None), ([70, 45], 1, 24), ([70, 66], 3, 24),
])
@pytest.mark.parametrize("mask", ["built", "given"])
def test_reference_hints_match_the_dense_oracle(ctx, L, window, mask):
    """The engine's hints (n_keys, the step's mask, window_start, first_block for a run, the
    shared index) change what is read, never the result: all equal the numpy oracle."""
    bs = 16
    q, k, v, tables, lens, want = _run_case(ctx, L, window)
    start = 0 if window is None else min(max(0, c - L - window + 1) for c in ctx) // bs
    kw = dict(n_keys=max(ctx), window_start=start)
    if mask == "given":
        kw["mask"] = pa.step_mask(lens, L, max(ctx), window, start * bs)
    if len(ctx) == 1:
        kw["first_block"] = 2
    else:
        kw["index"] = pa.rows_index(tables, k.shape[0], k.shape[1])
    if window is not None:
        assert start > 0  # the cut is exercised
    got = pa.paged_attention_reference(q, k, v, tables, lens, D_SCALE, window, **kw)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-5)
    plain = pa.paged_attention_reference(q, k, v, tables, lens, D_SCALE, window)
    np.testing.assert_allclose(np.array(plain), want, rtol=1e-4, atol=1e-5)


def test_index_hint_is_what_is_read():
    """A passed index is used as given (not rebuilt from the table): another table's index
    gives that table's result."""
    q, k, v, tables, lens, _ = _run_case([45, 70], 1, None)
    other = tables[::-1]
    via_index = pa.paged_attention_reference(q, k, v, tables, lens, D_SCALE,
                                             index=pa.rows_index(other, 2, 40))
    want = pa.paged_attention_reference(q, k, v, other, lens, D_SCALE)
    np.testing.assert_array_equal(np.array(via_index), np.array(want))
    assert not np.allclose(np.array(via_index),
                           np.array(pa.paged_attention_reference(q, k, v, tables, lens, D_SCALE)))


def test_first_block_is_honoured():
    q, k, v, tables, lens, want = _run_case([45], 1, None)
    off = pa.paged_attention_reference(q, k, v, tables, lens, D_SCALE, n_keys=45, mask=None,
                                       first_block=3)
    assert not np.allclose(np.array(off), want, atol=1e-3)


def test_cpu_takes_no_kernel():
    if mx.metal.is_available():
        pytest.skip("on Metal: test_kernel_taken_follows_the_dispatch")
    q, k, v, tables, _, _ = _run_case([45], 1, None, D=64)
    assert pa.kernel_taken(q, k, v, tables, None) is False


# ---------------------------------------------------------------- emulation
# Each case compiles its own instantiation(s); the list is a chosen few, not a grid.

PAGED_EMU = [
    # context lens, Hq, Hkv, D, block size, dtype, window, partitions (None: the host's choice)
    ([1, 17, 40], 4, 4, 64, 16, "float16", None, None),  # GQA 1; one token; mid-block ends
    ([33, 70], 8, 2, 80, 32, "bfloat16", None, None),  # GQA 4; D = 80: lanes 20..31 hold no dim
    ([50, 16, 3], 8, 1, 96, 16, "float16", 20, None),  # GQA 8 in 2 head sets; window; block end
    ([300, 45], 4, 2, 128, 32, "float16", None, None),  # GQA 2; span 352: the host splits in 2
    ([160, 9], 4, 1, 128, 16, "float16", 37, 5),  # window from mid-block; empty partitions
    ([75], 2, 1, 64, 32, "float32", 64, 3),
    ([512, 256, 257, 1], 16, 2, 64, 16, "float16", None, 4),  # chunks end at block/partition edges
    ([1024, 100], 32, 2, 128, 32, "bfloat16", None, None),  # G = 16: 2 head groups per KV head
    ([4097, 2000], 4, 1, 96, 32, "bfloat16", 1000, None),  # window 1000 of 4k: 4 partitions
    ([8190], 8, 1, 128, 16, "float16", None, None),  # ~8k: 32 partitions of 16 blocks
    ([300, 45], 12, 2, 128, 16, "float16", None, None),  # G = 6: 2 sets of 4, 2 padding slots
    ([130, 64], 14, 2, 64, 32, "bfloat16", 100, None),  # G = 7: one set of 8 (reduce-scatter 8)
]


@needs_emu
@pytest.mark.parametrize("ctx,Hq,Hkv,D,bs,dtype,window,parts", PAGED_EMU)
def test_paged_attention_emulated(ctx, Hq, Hkv, D, bs, dtype, window, parts):
    tensors, want, max_blocks, scale = paged_case(ctx, Hq, Hkv, D, bs, dtype, window)
    specs = specs_for(tensors, ctx, Hq, Hkv, D, bs, dtype, window, max_blocks, scale, parts)
    if parts is not None:
        assert specs[0].grid[2] == parts
    assert_close(emulate_launches(specs, tensors), want, dtype)


# The guard: sequence 1's table names a block out of the pool inside its visible range (a
# stale id, a hole, an id past the pool), or its context outruns the table row. Its output is
# NaN in every head and dim; the other sequences' are exact. Pool buffers end at a guard page
# in the emulation: an unguarded read past the pool faults (test_unguarded_kernel_faults).
STALE = {"hole": -1, "past the pool": None, "huge": 2 ** 31 - 1, "short row": "ctx"}


def stale_case(what, window=None, ctx=(45, 40, 20), Hq=4, Hkv=2, D=64, bs=16, dtype="float16"):
    tensors, want, max_blocks, scale = paged_case(list(ctx), Hq, Hkv, D, bs, dtype, window)
    tables, lens = tensors[3].copy(), tensors[4].copy()
    if what == "short row":
        lens[1] = max_blocks * bs + 1
    else:
        tables[1, 1] = tensors[1].shape[1] if STALE[what] is None else STALE[what]
    return [*tensors[:3], tables, lens], want, max_blocks, scale


@needs_emu
@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("what,dtype", list(zip(STALE, ["float16", "bfloat16", "float32", "float16"])))
def test_stale_block_id_gives_nan(what, dtype, parts):
    ctx = (45, 40, 20)
    tensors, want, max_blocks, scale = stale_case(what, dtype=dtype)
    specs = specs_for(tensors, ctx, 4, 2, 64, 16, dtype, None, max_blocks, scale, parts)
    got = emulate_launches(specs, tensors)
    assert np.isnan(got[1]).all()
    assert_close(got[[0, 2]], want[[0, 2]], dtype)


@needs_emu
@pytest.mark.parametrize("parts", [1, 2])
def test_empty_context_gives_zeros(parts):
    """A sequence with no visible key (context 0) reads nothing and gets zeros (documented)."""
    tensors, want, max_blocks, scale = paged_case([30, 20], 4, 2, 64, 16, "float32", None)
    lens = np.array([0, 20], np.int32)
    specs = specs_for(tensors, [30, 20], 4, 2, 64, 16, "float32", None, max_blocks, scale, parts)
    got = emulate_launches(specs, [*tensors[:4], lens])
    assert (got[0] == 0).all()
    assert_close(got[1], want[1], "float32")


@needs_emu
def test_holes_before_the_window_are_never_read():
    """A window layer's table has holes (-1) where blocks left the window: not an error."""
    ctx, window = [45, 40, 20], 10
    tensors, want, max_blocks, scale = paged_case(ctx, 4, 2, 64, 16, "float16", window)
    tables = tensors[3].copy()
    for b, c in enumerate(ctx):
        tables[b, : max(0, c - window) // 16] = -1
    assert (tables == -1).sum() == 3
    specs = specs_for(tensors, ctx, 4, 2, 64, 16, "float16", window, max_blocks, scale, 2)
    assert_close(emulate_launches(specs, [*tensors[:3], tables, tensors[4]]), want, "float16")


@needs_emu
def test_unguarded_kernel_faults():
    """Without the guard, the same stale id reads past the pool: the harness faults."""
    ctx = (45, 40, 20)
    tensors, _, max_blocks, scale = stale_case("past the pool")
    spec = specs_for(tensors, ctx, 4, 2, 64, 16, "float16", None, max_blocks, scale, 1)[0]
    guard = "if (id < 0 || id >= NB) {"
    assert guard in spec.source
    broken = dataclasses.replace(spec, name=spec.name + "_unguarded",
                                 source=spec.source.replace(guard, "if (id < 0) {"))
    with pytest.raises(KernelRuntimeError, match="out-of-bounds"):
        emulate(broken, tensors)


# Broken kernels the emulated comparison must catch (each passes the compiler).
BROKEN = {
    "combine drops the last partition": ("for (int z = 0; z < P; z++)",
                                         "for (int z = 0; z < P - 1; z++)"),
    "stripes skip a token": ("t += KS)", "t += KS + 1)"),
    "every head reads head 0's query": ("const int j = min(hset * HPS + jj, GH - 1);",
                                        "const int j = 0;"),
    "reduce-scatter sends the half it keeps": ("const float send = up ? s[i] : s[i + half];",
                                               "const float send = up ? s[i + half] : s[i];"),
    "gather from the wrong lanes": ("simd_shuffle(tot, ushort(rbase + (j << (RB - HB))))",
                                    "simd_shuffle(tot, ushort(rbase + j))"),
    "missing barrier before the merge": (
        "        threadgroup_barrier(mem_flags::mem_threadgroup);\n        for (int e", "        for (int e"),
}


@needs_emu
@pytest.mark.parametrize("what", list(BROKEN))
def test_broken_paged_kernel_fails_emulation(what):
    ctx = [90, 33]
    tensors, want, max_blocks, scale = paged_case(ctx, 4, 1, 64, 16, "float32", None)
    specs = specs_for(tensors, ctx, 4, 1, 64, 16, "float32", None, max_blocks, scale, 3)
    old, new = BROKEN[what]
    which = 1 if old in specs[1].source else 0
    assert old in specs[which].source
    broken = list(specs)
    broken[which] = dataclasses.replace(specs[which], name=specs[which].name + "_broken",
                                        source=specs[which].source.replace(old, new))
    with pytest.raises(AssertionError):
        assert_close(emulate_launches(broken, tensors), want, "float32")


def _to_kernel(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        return to_dtype(np.array(a.astype(mx.float32)), "bfloat16")[0]  # exact: bf16 -> f32 -> bf16
    return np.array(a)


def _emulated_run(spec, tensors):
    """kernel.run's contract (mx arrays in, mx arrays out) through the emulation."""
    out = emulate(spec, [_to_kernel(t) for t in tensors])
    return [mx.array(out).astype(getattr(mx, spec.output_dtypes[0]))]


def emulate_dispatch(monkeypatch) -> list[str]:
    """The dispatch points believe Metal is there; their launches run under the emulation.
    Returns the list the launched kernels' names are appended to."""
    from mlxlocal.metal import paged_attention_quant as pq

    launched = []

    def run(spec, tensors):
        launched.append(spec.name)
        return _emulated_run(spec, tensors)

    monkeypatch.setattr(pa, "metal_available", lambda: True)
    monkeypatch.setattr(pq, "metal_available", lambda: True)
    monkeypatch.setattr(pa, "run", run)
    return launched


@pytest.fixture
def emulated_metal(monkeypatch):
    return emulate_dispatch(monkeypatch)


@needs_emu
@pytest.mark.parametrize("ctx,window,n_keys,launches", [
    ([40, 7], None, None, ["paged_attention"]),
    ([600, 7], None, 600, ["paged_attention_split", "paged_attention_combine"]),
    ([600, 300], 100, 600, ["paged_attention"]),  # the window caps the span: one pass
])
def test_dispatch_under_emulation(emulated_metal, ctx, window, n_keys, launches):
    """paged_attention() as the engine calls it (hints, int casts, n_keys as the span): the
    launches it picks, run under the emulation, match the reference."""
    tensors, want, _, scale = paged_case(ctx, 8, 2, 64, 16, "bfloat16", window)
    q, k, v = (_mx(t, "bfloat16") for t in tensors[:3])
    tables, lens = mx.array(tensors[3]).astype(mx.int64), mx.array(tensors[4])
    index = pa.rows_index(tables, 2, k.shape[1])  # the reference's hint; the kernel reads tables
    got = pa.paged_attention(q, k, v, tables, lens, scale, window, n_keys=n_keys, mask=None,
                             index=index)
    assert emulated_metal == launches
    assert got.dtype == mx.bfloat16 and got.shape == (2, 8, 1, 64)
    assert_close(_np(got), want, "bfloat16")


def test_kernel_taken_follows_the_dispatch(emulated_metal):
    """kernel_taken says what paged_attention will run: the kernel when forced to ours on a
    supported shape, the reference when forced to MLX's or for a prefill chunk (L > 1)."""
    from mlxlocal.metal.dispatch import MLX, OURS, forced

    q, k, v, tables, _, _ = _run_case([45], 1, None, D=64)
    q6 = mx.zeros((1, 4, 6, 64))
    with forced(OURS):
        assert pa.kernel_taken(q, k, v, tables, None) and pa.kernel_taken(q, k, v, tables, 32)
        assert not pa.kernel_taken(q6, k, v, tables, None)
        assert not pa.kernel_taken(q, k, v[:, :, :8], tables, None)  # v of another shape
    with forced(MLX):
        assert not pa.kernel_taken(q, k, v, tables, None)


@needs_emu
def test_kv_head_row_is_honoured():
    """Each KV head reads its own rows (kvh * NB + id): a kernel reading head 0's rows for
    every head fails the comparison."""
    ctx = [90, 33]
    tensors, want, max_blocks, scale = paged_case(ctx, 4, 2, 64, 16, "float32", None)
    spec = specs_for(tensors, ctx, 4, 2, 64, 16, "float32", None, max_blocks, scale, 1)[0]
    assert_close(emulate(spec, tensors), want, "float32")
    row = "const size_t row = size_t(kvh) * size_t(NB) + size_t(id);"
    assert row in spec.source
    broken = dataclasses.replace(spec, name=spec.name + "_head0",
                                 source=spec.source.replace(row, "const size_t row = size_t(id);"))
    with pytest.raises(AssertionError):
        assert_close(emulate(broken, tensors), want, "float32")


# ---------------------------------------------------------------- real Metal


@needs_metal
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("D", [64, 80, 96, 128])
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (8, 4), (8, 2), (16, 2), (32, 8), (32, 2)])
@pytest.mark.parametrize("ctx,window", [([1, 17, 40], None), ([1000, 33, 4097], None),
                                        ([8190, 5], None), ([500, 64], 128), ([4097], 1000)])
def test_paged_attention_metal(ctx, window, Hq, Hkv, D, bs, dtype):
    tensors, want, _, scale = paged_case(ctx, Hq, Hkv, D, bs, dtype, window)
    q, k, v = (_mx(t, dtype) for t in tensors[:3])
    tables, lens = mx.array(tensors[3]), mx.array(tensors[4])
    assert pa.kernel_supports(q, k, v, tables, window)
    got = pa.paged_attention(q, k, v, tables, lens, scale, window, n_keys=max(ctx))
    assert_close(_np(got), want, dtype)


@needs_metal
@pytest.mark.parametrize("n_keys", [45, 4000])  # one pass / split
@pytest.mark.parametrize("what", list(STALE))
def test_stale_block_id_gives_nan_metal(what, n_keys):
    tensors, want, _, scale = stale_case(what)
    q, k, v = (_mx(t, "float16") for t in tensors[:3])
    got = _np(pa.paged_attention(q, k, v, mx.array(tensors[3]), mx.array(tensors[4]), scale,
                                 n_keys=n_keys))
    assert np.isnan(got[1]).all()
    assert_close(got[[0, 2]], want[[0, 2]], "float16")
