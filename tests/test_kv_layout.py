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
from mlxlocal.engine.runner import run_start, step_batch, table_run
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
    assert on_runs.slot_blocks.tolist() == [12, 3] and on_runs.host_runs == [9, 2]
    seqs[1].block_table = [3, 2]  # not a run: the tables come from the host lists
    mixed = step_batch(seqs, [60, 20], 1, 16)
    assert mixed.block_tables.tolist() == [[9, 10, 11, 12], [3, 2, 0, 0]] and mixed.host_runs == [9, None]
    assert mixed.slot_blocks.tolist() == [12, 2]


def test_table_run_checks_only_what_was_added_and_stays_exact():
    """Random growth, rollback and replacement of a table: the cached answer always equals
    the full check (in place a table only grows; trim makes a new list)."""
    rng = random.Random(0)
    seq = SimpleNamespace(block_table=[], run_cache=None)
    for _ in range(400):
        op, t = rng.random(), seq.block_table
        if op < 0.5:  # grow: after the last block (a run) or elsewhere
            nxt = t[-1] + 1 if t and rng.random() < 0.8 else rng.randrange(100)
            seq.block_table += [nxt + i for i in range(rng.randrange(1, 4))]
        elif op < 0.75:  # rollback, as Scheduler.trim does
            seq.block_table = t[: rng.randrange(len(t) + 1)]
        else:  # a new table (prefix reuse, cache edits)
            start = rng.randrange(50)
            seq.block_table = list(range(start, start + rng.randrange(6))) + ([99] if rng.random() < 0.3 else [])
        assert table_run(seq) == run_start(seq.block_table), seq.block_table


# --- reads in place equal the gather ---------------------------------------------------
def _batch(tables: list[list[int]], lens: list[int], bs: int) -> StepBatch:
    width = max(len(t) for t in tables)
    slots = [(t[(n - 1) // bs], (n - 1) % bs) for t, n in zip(tables, lens)]
    return StepBatch(positions=mx.array([n - 1 for n in lens]), slot_blocks=mx.array([b for b, _ in slots]),
                     slot_offsets=mx.array([o for _, o in slots]),
                     block_tables=mx.array([t + [0] * (width - len(t)) for t in tables]),
                     context_lens=mx.array(lens), host_context_lens=list(lens),
                     host_runs=[run_start(t) for t in tables])


@pytest.mark.parametrize("bits", [None, 8])
def test_decode_batch_on_runs_reads_in_place_like_the_gather(monkeypatch, bits):
    H, Hq, D, bs = 2, 4, 64, 8
    pools = KVPools(KVPools.uniform(1, H, D), 40, bs, mx.float32, bits=bits)
    tables, lens = [list(range(3, 10)), list(range(20, 24))], [53, 30]  # two runs, uneven
    keys = [mx.random.normal((1, H, n, D), key=mx.random.key(i)) for i, n in enumerate(lens)]
    values = [mx.random.normal((1, H, n, D), key=mx.random.key(9 + i)) for i, n in enumerate(lens)]
    for t, n, k, v in zip(tables, lens, keys, values):  # each sequence's prompt, as one chunk
        pos = list(range(n - 1))
        chunk = StepBatch(positions=0, slot_blocks=mx.array([t[p // bs] for p in pos]),
                          slot_offsets=mx.array([p % bs for p in pos]), block_tables=mx.array([t]),
                          context_lens=mx.array([n - 1]), host_context_lens=[n - 1])
        pools.write(0, chunk, k[:, :, :-1], v[:, :, :-1])
    q = mx.random.normal((2, Hq, 1, D), key=mx.random.key(5))
    k_new = mx.concatenate([k[:, :, -1:] for k in keys])
    v_new = mx.concatenate([v[:, :, -1:] for v in values])

    def attend(in_place_from: int) -> mx.array:
        monkeypatch.setattr(paged, "IN_PLACE_KEYS", in_place_from)
        batch = _batch(tables, lens, bs)
        assert batch.reads_in_place(1) == (in_place_from <= max(lens))
        return paged.PagedLayerView(pools, 0, batch, None).attend(q, k_new, v_new, 0.125)

    in_place, gathered = attend(1), attend(10**9)
    assert mx.allclose(in_place, gathered, atol=1e-5)
    # The oracle: dense attention over each sequence's rows as stored (quantized: dequantized).
    dq = (lambda x: x) if bits is None else (
        lambda x: mx.dequantize(*mx.quantize(x, group_size=64, bits=bits), group_size=64, bits=bits))
    want = mx.concatenate([sdpa(q[i : i + 1], dq(keys[i]), dq(values[i]), 0.125) for i in range(2)])
    assert mx.allclose(in_place, want, atol=1e-4)
    # A sequence that is not on a run: the batch goes through the gather.
    assert not _batch([[3, 5, 4, 6, 7, 8, 9], tables[1]], lens, bs).reads_in_place(1)


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
