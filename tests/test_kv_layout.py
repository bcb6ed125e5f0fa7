"""The head-major KV layout: runs of blocks from the allocator, read in place by attention."""

from __future__ import annotations

import random
from types import SimpleNamespace

import mlx.core as mx
import mlx_lm
import pytest
from engine_util import assert_no_leak
from test_paged import greedy_params, mlx_lm_tokens, paused, prompt_of, tokens_of

from mlxlocal.cache import KVPools, StepBatch, paged
from mlxlocal.cache.blocks import BlockManager, FreeBlocks
from mlxlocal.engine import open_engine, runner
from mlxlocal.engine.runner import MAX_SEGMENTS, run_start, step_batch, table_segments
from mlxlocal.metal import attention
from mlxlocal.metal.attention import sdpa, sequence_rows
from mlxlocal.source.loader import load_from_dir


# --- the allocator keeps sequences on runs ------------------------------------------------
def test_allocation_grows_in_place_and_leaves_room():
    bm = BlockManager(64, 16)
    a = bm.allocate(3, room=4)
    b = bm.allocate(2, room=4)
    assert run_start(a) == 0 and run_start(b) is not None
    # a grows right after its last block: room was left before b's run.
    for _ in range(4):
        a += bm.allocate(1, after=a[-1], room=4)
    assert run_start(a) == 0 and not set(a) & set(b)
    b += bm.allocate(3, after=b[-1])
    assert run_start(b) == b[0]
    # Without room, runs are packed from the start of the free map.
    packed = BlockManager(16, 16)
    assert packed.allocate(2) == [0, 1] and packed.allocate(3) == [2, 3, 4]


def test_fragmented_free_map_still_allocates_every_free_block():
    free = FreeBlocks(12)
    taken = free.take(12)
    assert taken == list(range(12)) and len(free) == 0
    free.extend([1, 2, 5, 6, 7, 10])
    got = free.take(5, room=3)  # no run of 5: the longest runs first
    assert sorted(got) == [1, 2, 5, 6, 7] and got[:3] == [5, 6, 7] and len(free) == 1
    assert list(free) == [10] and 10 in free and 5 not in free
    with pytest.raises(AssertionError, match="freed twice"):
        free.extend([10])


def test_run_start_and_device_built_tables_equal_host_tables(monkeypatch):
    assert run_start([4, 5, 6]) == 4 and run_start([7]) == 7
    assert run_start([4, 6, 5]) is None and run_start([4, 6]) is None and run_start([]) is None
    seqs = [SimpleNamespace(block_table=list(range(9, 13)), window_table=[], edit=None, run_cache=None),
            SimpleNamespace(block_table=[2, 3], window_table=[], edit=None, run_cache=None)]
    monkeypatch.setattr(runner, "DEVICE_TABLE_IDS", 1)  # tables this short come from the host
    on_runs = step_batch(seqs, [60, 20], 1, 16)
    assert on_runs.block_tables.tolist() == [[9, 10, 11, 12], [2, 3, 0, 0]]
    assert on_runs.slot_blocks.tolist() == [12, 3] and on_runs.host_segments == [[(9, 4)], [(2, 2)]]
    seqs[1].block_table = [3, 2]  # not a run: the tables come from the host lists
    mixed = step_batch(seqs, [60, 20], 1, 16)
    assert mixed.block_tables.tolist() == [[9, 10, 11, 12], [3, 2, 0, 0]]
    assert mixed.host_segments == [[(9, 4)], [(3, 1), (2, 1)]]
    assert mixed.slot_blocks.tolist() == [12, 2]


def runs_of(table: list[int]) -> list[tuple[int, int]] | None:
    """The oracle: a table's runs of consecutive ids, worked out whole."""
    out: list[tuple[int, int]] = []
    for b in table:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out if len(out) <= MAX_SEGMENTS else None


def test_table_segments_check_only_what_was_added_and_stay_exact():
    """Random growth, rollback and replacement of a table: the cached answer always equals
    the full check (in place a table only grows; trim makes a new list)."""
    rng = random.Random(0)
    seq = SimpleNamespace(block_table=[], run_cache=None)
    seen = set()
    for _ in range(600):
        op, t = rng.random(), seq.block_table
        if op < 0.75:  # grow: after the last block (a run) or elsewhere
            nxt = t[-1] + 1 if t and rng.random() < 0.5 else rng.randrange(100)
            seq.block_table += [nxt + i for i in range(rng.randrange(1, 4))]
        elif op < 0.9:  # rollback, as Scheduler.trim does
            seq.block_table = t[: rng.randrange(len(t) + 1)]
        elif op < 0.95:  # a new table (prefix reuse, cache edits)
            start = rng.randrange(50)
            seq.block_table = list(range(start, start + rng.randrange(6))) + ([99] if rng.random() < 0.3 else [])
        else:  # a new long one (a long prompt's prefix hit): its runs found apart
            seq.block_table = [b for _ in range(rng.randrange(1, 11))
                               for s in [rng.randrange(1000)] for b in range(s, s + rng.randrange(1, 80))]
        got = table_segments(seq)
        assert got == runs_of(seq.block_table), seq.block_table
        seen.add(len(got) if got is not None else None)
    assert {0, 1, 2, MAX_SEGMENTS, None} <= seen  # no runs, one, several, the most, too many


def test_pieces_cut_a_long_context_in_half_at_a_block():
    runs = [(10, 6), (40, 1), (3, 5)]  # 12 blocks of 4: the last one holds 2 of its 4 keys
    assert attention._pieces(runs, 46, 4, False) == ([(10, 24), (40, 4), (3, 18)], 3)
    # Half of 46 keys, in whole blocks: 20, inside the first run.
    assert attention._pieces(runs, 46, 4, True) == ([(10, 20), (15, 4), (40, 4), (3, 18)], 1)
    # Half at a run's end: the second half starts with the next run.
    assert attention._pieces(runs, 48, 4, True) == ([(10, 24), (40, 4), (3, 20)], 1)
    assert attention._pieces(runs, 10, 4, False) == ([(10, 10)], 1)  # the context ends in the first


# --- reads in place equal the gather ---------------------------------------------------
def _batch(tables: list[list[int]], lens: list[int], bs: int) -> StepBatch:
    width = max(len(t) for t in tables)
    slots = [(t[(n - 1) // bs], (n - 1) % bs) for t, n in zip(tables, lens)]
    return StepBatch(positions=mx.array([n - 1 for n in lens]), slot_blocks=mx.array([b for b, _ in slots]),
                     slot_offsets=mx.array([o for _, o in slots]),
                     block_tables=mx.array([t + [0] * (width - len(t)) for t in tables]),
                     context_lens=mx.array(lens), host_context_lens=list(lens),
                     host_segments=[runs_of(t) for t in tables])


@pytest.mark.parametrize("bits", [None, 8])
@pytest.mark.parametrize("split", [False, True])
def test_decode_reads_runs_in_place_like_the_gather(monkeypatch, bits, split):
    """Decode attention over each sequence's runs of blocks read by slices (one run; a shared
    prefix's run and then blocks elsewhere), merged, and split over two CPU streams: equal
    to the gather and to dense attention over the rows as stored, batched and alone."""
    H, Hq, D, bs = 2, 4, 64, 8
    monkeypatch.setattr(attention, "SPLIT_KEYS", 1 if split else 10**9)
    pools = KVPools(KVPools.uniform(1, H, D), 40, bs, mx.float32, bits=bits)
    tables, lens = [list(range(3, 10)), [20, 21, 22, 30, 31, 12]], [53, 45]
    keys = [mx.random.normal((1, H, n, D), key=mx.random.key(i)) for i, n in enumerate(lens)]
    values = [mx.random.normal((1, H, n, D), key=mx.random.key(9 + i)) for i, n in enumerate(lens)]
    for t, n, k, v in zip(tables, lens, keys, values):  # each sequence's prompt, as one chunk
        pos = list(range(n - 1))
        chunk = StepBatch(positions=0, slot_blocks=mx.array([t[p // bs] for p in pos]),
                          slot_offsets=mx.array([p % bs for p in pos]), block_tables=mx.array([t]),
                          context_lens=mx.array([n - 1]), host_context_lens=[n - 1])
        pools.write(0, chunk, k[:, :, :-1], v[:, :, :-1])
    q = mx.random.normal((2, Hq, 1, D), key=mx.random.key(5))
    # The oracle: dense attention over each sequence's rows as stored (quantized: dequantized).
    dq = (lambda x: x) if bits is None else (
        lambda x: mx.dequantize(*mx.quantize(x, group_size=64, bits=bits), group_size=64, bits=bits))
    want = [sdpa(q[i : i + 1], dq(keys[i]), dq(values[i]), 0.125) for i in range(2)]

    def attend(rows: list[int], in_place_from: int) -> mx.array:
        monkeypatch.setattr(paged, "IN_PLACE_KEYS", in_place_from)
        batch = _batch([tables[i] for i in rows], [lens[i] for i in rows], bs)
        assert (batch.in_place(1) is not None) == (in_place_from <= max(lens[i] for i in rows))
        # Each time from the pools as the prompts left them: attend writes the new rows.
        saved = [tuple(p) if isinstance(p, tuple) else p for p in pools.k + pools.v]
        out = paged.PagedLayerView(pools, 0, batch, None).attend(
            q[mx.array(rows)], mx.concatenate([keys[i][:, :, -1:] for i in rows]),
            mx.concatenate([values[i][:, :, -1:] for i in rows]), 0.125)
        mx.eval(out)
        pools.k[:], pools.v[:] = saved[:1], saved[1:]
        return out

    for rows in ([0, 1], [1], [0]):
        in_place, gathered = attend(rows, 1), attend(rows, 10**9)
        assert mx.allclose(in_place, gathered, atol=1e-5), rows
        assert mx.allclose(in_place, mx.concatenate([want[i] for i in rows]), atol=1e-4), rows
    # More runs than MAX_SEGMENTS: the batch goes through the gather.
    monkeypatch.setattr(paged, "IN_PLACE_KEYS", 1)
    assert _batch([list(range(0, 18, 2)), tables[1]], lens, bs).in_place(1) is None


def test_with_metal_only_a_batch_on_one_run_each_reads_in_place(monkeypatch):
    """What was measured on a Mac stays: there, a lone sequence and tables of several runs go
    to the dispatch's choice (the paged kernel or MLX's attention over a gather)."""
    monkeypatch.setattr(paged, "IN_PLACE_KEYS", 1)
    runs, split = [list(range(3, 10)), list(range(20, 24))], [[20, 21, 22, 30], [3, 4, 5]]
    for metal in (False, True):
        monkeypatch.setattr(paged, "metal_available", lambda metal=metal: metal)
        assert _batch(runs, [53, 30], 8).in_place(1) == [[(3, 7)], [(20, 4)]]
        assert (_batch(split, [29, 20], 8).in_place(1) is None) == metal
        assert (_batch(runs[:1], [53], 8).in_place(1) is None) == metal
        assert _batch(runs, [53, 30], 8).in_place(2) is None  # a prefill chunk: never


def test_gather_reads_runs_and_tables_alike():
    H, D, bs = 2, 16, 4
    pools = KVPools(KVPools.uniform(1, H, D), 16, bs, mx.float32)
    pools.k[0] = mx.random.normal(pools.k[0].shape, key=mx.random.key(1))
    pools.v[0] = mx.random.normal(pools.v[0].shape, key=mx.random.key(2))
    run = sequence_rows(pools.k[0], mx.array([[5, 6, 7]]), 10, first_block=5)
    table = sequence_rows(pools.k[0], mx.array([[5, 6, 7]]), 10)
    assert run.shape == (1, H, 10, D) and mx.array_equal(run, table)
    # Per head, a sequence's keys are its blocks' rows in table order.
    want = mx.concatenate([pools.k[0][:, b] for b in (7, 2)], axis=1)[None]
    assert mx.array_equal(sequence_rows(pools.k[0], mx.array([[7, 2]]), 8), want)


# --- through the engine ------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen3(tiny_models):
    return tiny_models["qwen3"]


def test_engine_decodes_runs_in_place_with_mlx_lm_parity(monkeypatch, qwen3):
    monkeypatch.setattr(paged, "IN_PLACE_KEYS", 1)  # every decode batch reads in place
    ref = mlx_lm.load(str(qwen3))[0]
    prompts = [prompt_of(40 + 9 * i, shift=i) for i in range(3)]
    want = [mlx_lm_tokens(ref, p, 12) for p in prompts]
    eng = open_engine(load_from_dir(qwen3), block_size=16, kv_blocks=128, prefix_cache=False)
    seen = []
    real = paged.PagedLayerView._one
    monkeypatch.setattr(paged.PagedLayerView, "_one", lambda self, *a: seen.append(1) or real(self, *a))
    try:
        with paused(eng):
            handles = [eng.submit(p, greedy_params(12)) for p in prompts]
        assert [tokens_of(h) for h in handles] == want
        assert seen  # the in-place path ran
        assert_no_leak(eng)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("split", [False, True])
def test_engine_decodes_after_a_prefix_hit_in_place_with_mlx_lm_parity(monkeypatch, qwen3, split):
    """Prompts sharing a cached prefix: each table is the prefix's run and then blocks of its
    own, read by slices and merged (split over two CPU streams, or not), alone and batched:
    mlx-lm's greedy tokens."""
    monkeypatch.setattr(paged, "IN_PLACE_KEYS", 1)
    monkeypatch.setattr(attention, "SPLIT_KEYS", 1 if split else 10**9)
    ref = mlx_lm.load(str(qwen3))[0]
    shared = prompt_of(50, shift=7)
    prompts = [shared + prompt_of(5 + 7 * i, shift=i) for i in range(3)]
    want = [mlx_lm_tokens(ref, p, 10) for p in prompts]
    eng = open_engine(load_from_dir(qwen3), block_size=16, kv_blocks=128)
    runs_seen = []
    real = paged.PagedLayerView._one

    def one(self, i, q, scale):
        runs_seen.append(len(self.batch.host_segments[i]))
        return real(self, i, q, scale)
    monkeypatch.setattr(paged.PagedLayerView, "_one", one)
    try:
        tokens_of(eng.submit(shared + [1, 2, 3], greedy_params(2)))  # caches the prefix
        assert tokens_of(eng.submit(prompts[0], greedy_params(10))) == want[0]  # alone
        with paused(eng):
            handles = [eng.submit(p, greedy_params(10)) for p in prompts]
        assert [tokens_of(h) for h in handles] == want
        assert max(runs_seen) > 1  # tables of several runs were read in place
        assert_no_leak(eng)
    finally:
        eng.shutdown()


def test_next_agent_turn_takes_over_its_partial_block(qwen3):
    eng = open_engine(load_from_dir(qwen3), block_size=16, kv_blocks=64)
    try:
        first = prompt_of(40)
        out = tokens_of(eng.submit(first, greedy_params(5)))
        turn = first + out + prompt_of(30, shift=2)
        tables = []
        real = eng.scheduler.admit

        def admit(seq):
            real(seq)
            tables.append(list(seq.block_table))

        eng.scheduler.admit = admit
        tokens_of(eng.submit(turn, greedy_params(5)))
        # The turn continues where the last one stopped: its table is one run, no copy.
        assert tables and run_start(tables[-1]) is not None and len(tables[-1]) == 3
    finally:
        eng.shutdown()
