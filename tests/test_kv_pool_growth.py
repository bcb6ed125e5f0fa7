"""KV pools that start light: room for one context, grown on demand up to the budget (before
the prefix cache is evicted), given back after a while idle. Checked against an engine whose
pools are that budget from the start (a different path: no growth ever)."""

from __future__ import annotations

import time

import pytest
from conftest import FAMILY_CONFIGS, build_tiny, wait_for
from engine_util import assert_no_leak, prompt_of, run

from mlxlocal.cache import BlockManager
from mlxlocal.engine import EngineConfig, PagedEngine, SamplingParams
from mlxlocal.source.loader import load_from_dir

START = (512 + 512) // 16 + 1  # the tiny models' context and a prefill chunk, in blocks


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return load_from_dir(tiny_model)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """head_dim 64: K/V that 8-bit pools can hold (groups of 64)."""
    cfg = dict(FAMILY_CONFIGS["llama"], hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
    return load_from_dir(build_tiny(tmp_path_factory.mktemp("wide") / "llama", cfg, template="llama3"))


def concurrent(eng: PagedEngine, prompts: list[list[int]], n: int) -> list[list[int]]:
    handles = [eng.submit(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p in prompts]
    return [[c.token for c in h if c.token is not None] for h in handles]


@pytest.mark.parametrize("bits", [None, 8])
def test_pools_grow_under_load_and_decode_as_fixed_ones(loaded, wide, bits):
    q = {"kv_bits": bits} if bits else {}
    loaded = wide if bits else loaded
    eng = PagedEngine(loaded, EngineConfig(kv_memory=4 << 20, kv_shrink_idle_s=3600, **q))
    most = eng.blocks.max_blocks
    assert eng.num_blocks == START < most and eng.stats()["blocks_max"] == most
    prompts = [prompt_of(400, shift=i) for i in range(6)]  # 6 × 26 blocks: more than START
    got = concurrent(eng, prompts, 12)
    st = eng.stats()
    assert START < st["blocks_total"] <= most and eng.pools.num_blocks == st["blocks_total"]
    assert st["blocks_cached"] > 0  # grown, not evicted: every prompt's blocks are cached
    fixed = PagedEngine(loaded, EngineConfig(kv_blocks=most, **q))
    assert got == concurrent(fixed, prompts, 12)
    assert [run(eng, p, 4)[1].cached_tokens for p in prompts] == [399] * 6  # all still cached
    for e in (eng, fixed):
        assert_no_leak(e)
        e.shutdown()


def test_idle_pools_give_back_their_free_tail_and_keep_the_cache(loaded):
    eng = PagedEngine(loaded, EngineConfig(kv_memory=4 << 20, kv_shrink_idle_s=0.2))
    prompts = [prompt_of(400, shift=i) for i in range(5)]
    first = concurrent(eng, prompts, 6)
    grown = eng.num_blocks
    assert grown > START
    time.sleep(1)  # idle: nothing given back while the prefix cache holds the last blocks
    last_kept = eng.call(lambda: max(eng.blocks.radix.by_block))
    assert eng.num_blocks == max(last_kept + 1, START)
    assert [run(eng, p, 2)[1].cached_tokens for p in prompts] == [399] * 5  # still cached
    eng.call(eng.blocks.clear_prefix_cache)  # the cache let go (as eviction would): all of it back
    assert wait_for(lambda: eng.stats()["blocks_total"] == START, timeout=10)
    st = eng.stats()
    assert eng.pools.num_blocks == START and st["blocks_free"] + st["blocks_cached"] == START
    assert concurrent(eng, prompts, 6) == first  # grown again, the same tokens
    assert_no_leak(eng)
    eng.shutdown()


def test_a_session_keeps_its_blocks_through_a_shrink(loaded):
    eng = PagedEngine(loaded, EngineConfig(kv_memory=4 << 20, kv_shrink_idle_s=3600))
    others = [prompt_of(400, shift=i) for i in range(3)]
    handles = [eng.submit(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in others]
    session = eng.new_session()
    mine = prompt_of(300, shift=9)
    tokens, _ = run(eng, mine, 4, session=session)  # admitted while the pool is grown
    for h in handles:
        list(h)
    held = eng.call(lambda: max(b for b in range(eng.blocks.num_blocks) if eng.blocks.refs[b]))
    assert held >= START  # the session's blocks lie past the start size
    eng.call(eng.blocks.clear_prefix_cache)  # only the session holds blocks now
    eng.call(eng._shrink)
    assert eng.num_blocks == held + 1  # cut right after them, not below
    more, stats = run(eng, mine + tokens + [7, 8], 4, session=session)
    assert stats.cached_tokens >= len(mine)  # the session's KV survived the shrink
    session.reset()
    assert_no_leak(eng)
    eng.shutdown()


def test_block_manager_grows_before_evicting_and_shrinks_what_is_cached():
    sizes: list[int] = []
    bm = BlockManager(4, 2, max_blocks=16, on_resize=sizes.append)
    a = bm.allocate(4)
    bm.cache_prefix([1] * 8, a)
    bm.release(a)  # 4 blocks cached, none free
    assert bm.can_allocate(16) and not bm.can_allocate(17)
    b = bm.allocate(2)  # grown (doubled), the cache kept
    assert sizes == [8] and bm.num_blocks == 8 and bm.num_cached == 4 and min(b) >= 4
    c = bm.allocate(8)  # to the budget
    assert sizes == [8, 16] and bm.num_blocks == 16 and bm.num_cached == 4
    d = bm.allocate(4)  # then the prefix cache gives what is missing
    assert sizes == [8, 16] and bm.num_cached == 2
    bm.release(b + c + d)  # free again; a's two cached blocks remain, below 4
    assert bm.shrink(4) == 4 and sizes[-1] == 4
    assert len(bm.free) + bm.num_cached == 4 and bm.num_cached == 2
    e = bm.allocate(8)  # grown again; one block cached high keeps the pool that long
    bm.cache_prefix([2] * 2 * 8, e)
    bm.release(e)
    top = max(e)
    assert bm.shrink(4) == top + 1 == bm.num_blocks
    fixed = BlockManager(4, 2, max_blocks=16)  # no resize hook: the size is the size
    assert fixed.max_blocks == 4 and fixed.shrink(1) == 4


def test_an_idle_engine_tries_the_shrink_once_not_in_a_loop(loaded):
    eng = PagedEngine(loaded, EngineConfig(kv_memory=4 << 20, kv_shrink_idle_s=0.05))
    calls = []
    real = eng._shrink
    eng._shrink = lambda: (calls.append(1), real())[1]
    concurrent(eng, [prompt_of(400, shift=i) for i in range(5)], 4)  # grown; the cache keeps the top
    time.sleep(0.6)
    assert eng.num_blocks > START and len(calls) == 1  # tried once, kept what the cache holds
    run(eng, prompt_of(30, shift=7), 2)  # a request, then idle again: one more try
    time.sleep(0.3)
    assert len(calls) == 2
    eng.shutdown()


def test_mlx_buffer_cache_goes_back_a_while_after_the_last_request_not_at_once(loaded):
    """Right after a request MLX's buffer cache stays (the next request of a burst reuses it;
    clearing it at once held up the request's last chunk), then an idle spell hands it back."""
    import mlx.core as mx

    eng = PagedEngine(loaded, EngineConfig(kv_memory=4 << 20))
    eng._idle.clear_after_s = 3600
    run(eng, prompt_of(400), 4)
    time.sleep(0.3)
    kept = mx.get_cache_memory()
    assert kept > 0
    eng._idle.clear_after_s = 0.05  # from the next idle spell on
    run(eng, prompt_of(400, shift=1), 4)
    assert wait_for(lambda: mx.get_cache_memory() == 0, timeout=10)
    eng.shutdown()
