"""Sliding-window layers on the paged engine: blocks that left the window go back.

gemma3 here alternates sliding-window layers (32 tokens) and global ones. The window
layers hold about window / block_size blocks per sequence however long it runs, and the
outputs stay those of mlx-lm's own RotatingKVCache (a different code path).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from engine_util import mlx_lm_greedy, prompt_of, run

from mlxlocal.cache import KVPools
from mlxlocal.cache.window import HOLE, WindowBlocks
from mlxlocal.engine import PagedEngine, SamplingParams, open_engine
from mlxlocal.source.loader import load_from_dir

BS = 16
WINDOW = 32


@pytest.fixture(scope="module")
def loaded(mlx_lm_models):
    return load_from_dir(mlx_lm_models["gemma3"])


@pytest.fixture(scope="module")
def ref(mlx_lm_models):
    return mlx_lm_greedy(mlx_lm_models["gemma3"])


@pytest.fixture
def make(loaded):
    engines = []

    def make(**kw) -> PagedEngine:
        kw.setdefault("block_size", BS)
        kw.setdefault("kv_blocks", 128)
        eng = open_engine(loaded, **kw)
        assert isinstance(eng, PagedEngine) and eng.windows is not None
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.shutdown()


def held(table: list[int]) -> int:
    return sum(b != HOLE for b in table)


def test_long_run_holds_only_the_window_and_matches_mlx_lm(make, ref):
    eng = make(max_step_tokens=24)  # prefill chunks shorter than the window: trims in between
    prompt = prompt_of(150, shift=1)
    handle = eng.submit(prompt, SamplingParams(max_tokens=60, ignore_eos=True))
    seq, most, tokens = handle.seq, 0, []
    for chunk in handle:
        if chunk.token is not None:
            tokens.append(chunk.token)
        most = max(most, eng.call(lambda: held(seq.window_table)))
    assert tokens == ref(prompt, 60)
    # 210 positions = 14 blocks in the global layers; the window layers never held more
    # than the window's blocks plus one being filled and one step's chunk.
    assert most <= -(-WINDOW // BS) + 1 + -(-24 // BS)
    assert eng.stats()["blocks_used"] == 0


def test_window_pools_are_smaller_and_memory_buys_full_blocks(loaded):
    budget = 4 << 20
    eng = open_engine(loaded, block_size=BS, kv_memory=budget, max_num_seqs=4)
    try:
        pool = eng.kv_pool
        # The budget (what the full-attention pools may grow to) against the window pools.
        assert pool["window"] == WINDOW and pool["window_blocks"] < pool["max_blocks"]
        assert eng.pools.nbytes <= pool["max_bytes"] <= budget
        # Without window pools every layer would take a block of every id.
        every_layer = KVPools.bytes_per_block(eng.runner.shapes, BS, eng.runner.dtype)
        assert pool["max_blocks"] > budget // every_layer
    finally:
        eng.shutdown()


def test_prefix_reuse_resumes_where_the_window_blocks_are_kept(make, ref):
    eng = make()
    system = prompt_of(80, shift=2)
    a = system + [1, 2, 3]
    assert run(eng, a, 20)[0] == ref(a, 20)
    # b shares a's first five blocks; the window blocks before position 80 left a's
    # window while it ran but were kept with the prefix, so b resumes at 80.
    b = system + [9, 9, 9, 9]
    tokens, stats = run(eng, b, 10)
    assert tokens == ref(b, 10) and stats.cached_tokens == 80
    # Once the kept blocks are gone, the same prompt recomputes from the start, still right.
    eng.call(lambda: eng.windows.clear())
    tokens, stats = run(eng, b + [5], 10)
    assert tokens == ref(b + [5], 10) and stats.cached_tokens == 0


def test_session_turns_extend_and_edits_fall_back(make, ref):
    eng = make()
    session = eng.new_session()
    p1 = prompt_of(70, shift=3)
    out1, _ = run(eng, p1, 30, session)
    assert out1 == ref(p1, 30)
    p2 = p1 + out1 + [4, 4]
    out2, stats = run(eng, p2, 10, session)
    assert out2 == ref(p2, 10) and stats.cached_tokens == len(p1) + len(out1) - 1
    # An edit far behind the window: the session's own window blocks there are gone.
    edited = p1[:40] + [6, 6, 6]
    out3, stats = run(eng, edited, 10, session)
    assert out3 == ref(edited, 10)
    assert stats.cached_tokens % BS == 0 and stats.cached_tokens <= 32
    session.reset()
    assert eng.call(lambda: eng.blocks.clear_prefix_cache()) >= 0
    assert eng.call(lambda: (eng.windows.num_referenced, eng.blocks.num_referenced)) == (0, 0)


def test_window_blocks_unit():
    w = WindowBlocks(num_blocks=6, block_size=4, window=6)
    assert [w.first_needed(p) for p in (0, 5, 6, 9, 10)] == [0, 0, 0, 1, 1]
    table = w.allocate(4)  # positions 0..15
    full = [100, 101, 102, 103]
    w.trim(table, 13, full)  # a query at 13 sees 8..13: blocks 0 and 1 go, kept for the prefix
    assert table[:2] == [HOLE, HOLE] and w.num_referenced == 4 and set(w.kept) == {100, 101}
    assert w.restorable(full, 8) and not w.restorable([100, 105], 8)
    restored = w.restore(full, 8)  # a query at 8 sees 3..8: blocks 0 and 1
    assert restored == [w.kept[100], w.kept[101]]
    w.release(restored)
    w.allocate(2)  # 2 free: nothing evicted
    assert len(w.kept) == 2
    w.allocate(1)  # needs the oldest kept block back
    assert len(w.kept) == 1
    w.forget(101)
    assert not w.kept


def test_window_layers_gather_and_mask_only_from_the_window_start():
    from mlxlocal.cache import StepBatch

    batch = StepBatch(positions=mx.array([99, 59]), slot_blocks=mx.array([6, 3]), slot_offsets=mx.array([3, 11]),
                      block_tables=mx.array([[0, 1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 0, 0, 0]]),
                      context_lens=mx.array([100, 60]), host_context_lens=[100, 60])
    # The second sequence's query at 59 sees 28..59: block 1 on; nothing before is read.
    assert batch.window_start(WINDOW, BS) == 1
    mask = batch.window_mask(1, WINDOW, BS)
    assert mask.shape == (2, 1, 1, 100 - BS)
    seen = [int(mask[b, 0, 0].sum()) for b in range(2)]
    assert seen == [WINDOW, WINDOW]
    assert bool(mask[1, 0, 0, 28 - BS]) and not bool(mask[1, 0, 0, 27 - BS])


def test_native_sliding_window_model_matches_mlx_lm(tmp_path):
    """Our own llama with a sliding-window layer: window pools, trimmed reads (reference
    path) and holes, against mlx-lm's llama on its RotatingKVCache."""
    from conftest import FAMILY_CONFIGS, build_tiny

    cfg = dict(FAMILY_CONFIGS["llama"], layer_types=["sliding_attention", "full_attention"], sliding_window=WINDOW)
    path = build_tiny(tmp_path / "swa-llama", cfg)
    loaded = load_from_dir(path)
    assert loaded.info.native
    ref = mlx_lm_greedy(path)
    eng = open_engine(loaded, block_size=BS, kv_blocks=64, max_step_tokens=40)
    try:
        assert eng.windows is not None and eng.pools.windowed == [True, False]
        prompts = [prompt_of(100, shift=4), prompt_of(37, shift=5)]
        for p in prompts:
            assert run(eng, p, 40)[0] == ref(p, 40)
        handles = [eng.submit(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in prompts]
        assert [[c.token for c in h if c.token is not None] for h in handles] == [ref(p, 40) for p in prompts]
    finally:
        eng.shutdown()
