"""The paged engine: parity with mlx-lm, batching, preemption, prefix cache, blocks, stats."""

from __future__ import annotations

import asyncio
import contextlib
import threading

import mlx.core as mx
import mlx_lm
import pytest
from conftest import wait_for
from engine_util import assert_no_leak, idle
from mlx_lm.generate import generate_step

from mlxlocal.cache import BlockManager, OutOfBlocks, RadixCache
from mlxlocal.engine import OutOfCapacity, PagedEngine, SamplingParams, open_engine
from mlxlocal.source.loader import load_from_dir

BS = 16


def prompt_of(n: int, shift: int = 0, vocab: int = 300) -> list[int]:
    return [(i * 37 + 11 + shift * 101) % vocab for i in range(n)]


def greedy_params(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def mlx_lm_tokens(model, prompt: list[int], n: int) -> list[int]:
    sampler = lambda logits: mx.argmax(logits, axis=-1)  # noqa: E731
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, sampler=sampler)]


def tokens_of(handle) -> list[int]:
    chunks = list(handle)
    assert chunks[-1].finish_reason is not None
    return [c.token for c in chunks if c.token is not None]


@contextlib.contextmanager
def paused(eng: PagedEngine):
    """Hold the engine thread so everything submitted meanwhile starts in the same step."""
    gate, started = threading.Event(), threading.Event()

    def hold():
        started.set()
        gate.wait(30)

    t = threading.Thread(target=eng.call, args=(hold,), daemon=True)
    t.start()
    assert started.wait(10)
    try:
        yield
    finally:
        gate.set()
        t.join(30)


# Every engine test runs for a native model, an mlx-lm model with sliding-window layers
# (gemma3) and a hybrid with recurrent Mamba layers (nemotron_h), all on the paged engine.
FAMILIES = ["qwen3", "gemma3", "hybrid"]


@pytest.fixture(scope="module")
def model_dirs(tiny_models, mlx_lm_models):
    return {**tiny_models, **mlx_lm_models}


@pytest.fixture(scope="module")
def loaded(model_dirs):
    return {f: load_from_dir(model_dirs[f]) for f in ("qwen3", "llama", "gemma3", "hybrid")}


@pytest.fixture(scope="module")
def refs(model_dirs):
    return {f: mlx_lm.load(str(model_dirs[f]))[0] for f in ("qwen3", "llama", "gemma3", "hybrid")}


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


def hybrid(eng: PagedEngine) -> bool:
    """Recurrent layers: prefixes are reused only up to a block boundary with a state snapshot."""
    return eng.runner.recurrent


def whole_blocks(eng: PagedEngine) -> bool:
    """Hybrid and sliding-window models reuse whole blocks of a shared prefix, never a copied
    partial one (no state mid-block; window layers' blocks are reused whole)."""
    return eng.runner.recurrent or eng.windows is not None


@pytest.fixture
def make_engine(loaded, family):
    engines = []

    def make(family: str = family, **kw) -> PagedEngine:
        kw.setdefault("block_size", BS)
        kw.setdefault("kv_blocks", 256)
        eng = open_engine(loaded[family], **kw)
        assert isinstance(eng, PagedEngine)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.shutdown()


# --- 1. parity with mlx-lm ------------------------------------------------------------
LENGTHS = [1, 7, 16, 32, 33, 50]


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3", "hybrid"])
def test_single_and_batched_match_mlx_lm(make_engine, refs, family):
    n = 10
    prompts = [prompt_of(k) for k in LENGTHS] + [prompt_of(k, shift=3) for k in (16, 33)]
    expected = [mlx_lm_tokens(refs[family], p, n) for p in prompts]
    eng = make_engine(family)
    for p, exp in zip(prompts, expected):
        assert tokens_of(eng.submit(p, greedy_params(n))) == exp, len(p)
    # Batched, on a cold engine, all submitted before the first step.
    eng = make_engine(family)
    with paused(eng):
        handles = [eng.submit(p, greedy_params(n)) for p in prompts]
    for h, p, exp in zip(handles, prompts, expected):
        assert tokens_of(h) == exp, len(p)
    assert_no_leak(eng)


# --- 2. batch invariance ----------------------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_batch_invariance(make_engine, temperature):
    prompts = [prompt_of(5 + 6 * i, shift=i) for i in range(8)]

    def params(i):
        return SamplingParams(max_tokens=12, ignore_eos=True, temperature=temperature, seed=100 + i)

    eng = make_engine(prefix_cache=False)
    alone = [tokens_of(eng.submit(p, params(i))) for i, p in enumerate(prompts)]
    eng = make_engine(prefix_cache=False)
    with paused(eng):
        handles = [eng.submit(p, params(i)) for i, p in enumerate(prompts)]
    assert [tokens_of(h) for h in handles] == alone
    if temperature > 0:  # the seed matters: another seed gives other tokens somewhere
        other = [tokens_of(eng.submit(p, SamplingParams(max_tokens=12, ignore_eos=True,
                                                         temperature=temperature, seed=7 + i)))
                 for i, p in enumerate(prompts)]
        assert other != alone


# --- 3. preemption -----------------------------------------------------------------------
@pytest.mark.parametrize("prefix_cache", [True, False])
def test_preemption_outputs_equal_solo_runs(make_engine, prefix_cache):
    prompts = [prompt_of(20, shift=i) for i in range(8)]  # 20 + 40 tokens -> 4 blocks each
    solo_eng = make_engine()
    solo = [tokens_of(solo_eng.submit(p, greedy_params(40))) for p in prompts]
    eng = make_engine(kv_blocks=8, prefix_cache=prefix_cache)
    with paused(eng):
        handles = [eng.submit(p, greedy_params(40)) for p in prompts]
    assert [tokens_of(h) for h in handles] == solo
    assert sum(h.seq.preemptions for h in handles) > 0
    assert_no_leak(eng)


# --- 4. prefix sharing ---------------------------------------------------------------------
def test_prefix_blocks_are_shared_and_outputs_match_cold(make_engine):
    common = prompt_of(48, shift=5)  # three full blocks
    pa, pb = common + [1, 2, 3, 4, 5], common + [9, 8, 7]
    eng = make_engine()
    a = eng.submit(pa, greedy_params(400))
    ia = iter(a)
    next(ia)  # a's prompt blocks are now in the prefix cache
    b = eng.submit(pb, greedy_params(400))
    ib = iter(b)
    next(ib)

    def inspect():
        assert a.seq.num_generated < 400 and b.seq.num_generated < 400
        ta, tb = a.seq.block_table, b.seq.block_table
        return ta[:3], tb[:3], [eng.blocks.refs[x] for x in ta[:3]], ta[3], tb[3]

    sa, sb, counts, a3, b3 = eng.call(inspect)
    assert sa == sb and counts == [2, 2, 2]
    assert a3 != b3  # the partial block after the prefix is each one's own
    assert b.seq.stats.cached_tokens == 48
    a.cancel()
    b.cancel()
    list(ia), list(ib)
    assert_no_leak(eng)

    # A cache hit gives the same tokens as a cold engine without a prefix cache.
    warm = make_engine()
    cold = make_engine(prefix_cache=False)
    tokens_of(warm.submit(pa, greedy_params(6)))
    hit = warm.submit(pb, greedy_params(16))
    assert tokens_of(hit) == tokens_of(cold.submit(pb, greedy_params(16)))
    assert hit.seq.stats.cached_tokens == 48
    assert warm.stats()["prefix_hit_tokens"] == 48 and cold.stats()["prefix_hit_tokens"] == 0


# --- 5. eviction order (unit) ----------------------------------------------------------------
def chunked(*ids: int) -> list[int]:
    """Tokens of whole 4-token blocks, block k filled with ids[k]."""
    return [t for i in ids for t in [i] * 4]


def test_radix_evicts_lru_leaves_first_and_parents_after_children():
    r = RadixCache(4)
    r.insert(chunked(1, 2, 3), [10, 11, 12])  # path 10 -> 11 -> 12
    r.insert(chunked(1, 5), [10, 15])  # 10 -> 15
    r.insert(chunked(7), [17])
    r.match(chunked(1, 5))  # 10 and 15 most recent
    always = lambda b: True  # noqa: E731
    assert r.evict(1, always) == [12]  # oldest leaf
    assert r.evict(1, always) == [11]  # its parent is now a leaf, older than 17
    assert r.evict(1, always) == [17]
    assert r.evict(1, always) == [15]
    assert r.evict(5, always) == [10]
    assert len(r) == 0 and r.match(chunked(1)) == []


def test_radix_parent_only_after_children_and_referenced_kept():
    r = RadixCache(4)
    r.insert(chunked(1, 2), [0, 1])
    r.match(chunked(1))  # the parent is more recent, but it has a child
    assert r.evict(1, lambda b: True) == [1]
    r.insert(chunked(1, 3), [0, 3])
    referenced = {3}
    assert r.evict(5, lambda b: b not in referenced) == []  # 0 is a parent of a referenced leaf
    assert r.contains(0) and r.contains(3)
    assert r.match(chunked(1, 3, 9)) == [0, 3]
    assert r.match(chunked(1, 2)[:7]) == [0]  # a partial chunk never matches


def test_block_manager_allocate_evicts_and_raises():
    bm = BlockManager(4, 4)
    a = bm.allocate(3)
    assert bm.num_referenced == 3 and len(bm.free) == 1
    table = bm.cache_prefix(chunked(1, 2, 3)[:11], a)  # 2 full blocks + a partial one
    assert table == a and len(bm.radix) == 2 and not bm.radix.contains(a[2])
    bm.release(table)
    assert bm.num_cached == 2 and len(bm.free) == 2 and bm.num_referenced == 0
    # A matching prefix revives the cached blocks.
    shared = bm.match_prefix(chunked(1, 2, 3))
    assert shared == a[:2] and bm.refs[a[0]] == 1
    bm.release(shared)
    # Short free list: allocate evicts the LRU leaf first, then its parent.
    got = bm.allocate(3)
    assert a[1] in got and a[0] not in got and bm.num_cached == 1
    with pytest.raises(OutOfBlocks):
        bm.allocate(2)
    got2 = bm.allocate(1)
    assert got2 == [a[0]] and bm.num_cached == 0
    with pytest.raises(OutOfBlocks):  # nothing free, nothing reclaimable
        bm.allocate(1)
    assert not bm.can_allocate(1)
    bm.release(got + got2)
    assert len(bm.free) == 4 and bm.num_referenced == 0


def test_block_manager_referenced_blocks_never_evicted_and_dedup():
    bm = BlockManager(6, 4)
    t1 = bm.allocate(2)
    bm.cache_prefix(chunked(1, 2), t1)
    t2 = bm.allocate(2)  # the same content computed again elsewhere
    t2 = bm.cache_prefix(chunked(1, 2), t2)
    assert t2 == t1 and bm.refs[t1[0]] == 2 and len(bm.free) == 4  # its own copies went back
    with pytest.raises(OutOfBlocks):
        bm.allocate(5)
    assert bm.refs[t1[0]] == 2 and bm.radix.contains(t1[1])
    bm.release(t1)
    bm.release(t2)
    assert bm.clear_prefix_cache() == 2 and len(bm.free) == 6


# --- 6. copy on write -------------------------------------------------------------------------
def test_partial_block_never_shared(make_engine):
    eng = make_engine()
    p = prompt_of(20, shift=2)
    first = tokens_of(eng.submit(p, greedy_params(4)))
    # 23 computed tokens -> one full block and a partial leaf of 7 tokens.
    radix = eng.blocks.radix
    nodes = eng.call(lambda: {b: len(radix.chunk(b)) for b in radix.by_block})
    assert sorted(nodes.values()) == [7, BS]
    partial_block = next(b for b, n in nodes.items() if n == 7)
    again = eng.submit(p, greedy_params(4))
    it = iter(again)
    next(it)
    # The partial block was copied into a block of its own, not shared for writing.
    table = eng.call(lambda: list(again.seq.block_table))
    assert partial_block not in table
    assert [next(it).token for _ in range(3)] == first[1:] and again.seq.tokens[len(p)] == first[0]
    list(it)
    # Exact: 16 shared + 3 copied; whole blocks only for hybrid and window models.
    assert again.seq.stats.cached_tokens == (BS if whole_blocks(eng) else len(p) - 1)
    assert_no_leak(eng)


def test_session_divergence_inside_cached_block_does_not_overwrite(make_engine):
    eng, cold = make_engine(), make_engine(prefix_cache=False)
    p = prompt_of(40, shift=4)
    q = p[:20] + [3, 1, 4, 1, 5, 9, 2, 6]  # diverges inside block 1, which the cache holds
    session = eng.new_session()
    assert tokens_of(eng.generate(p, greedy_params(8), session=session)) == tokens_of(
        cold.generate(p, greedy_params(8)))
    held = eng.call(lambda: list(session.block_table))
    assert eng.call(lambda: eng.blocks.radix.contains(held[1]))
    h2 = eng.submit(q, greedy_params(8), session=session)
    assert tokens_of(h2) == tokens_of(cold.generate(q, greedy_params(8)))
    # Block 1 was copied, not written into. A hybrid has no state snapshot at 16 (p's one
    # prefill chunk ended at 32), so it recomputes from the start.
    assert h2.seq.stats.cached_tokens == (0 if hybrid(eng) else BS)
    # Another request reading block 1 from the cache still sees p's K/V.
    other = eng.submit(p + [7], greedy_params(10))
    assert tokens_of(other) == tokens_of(cold.generate(p + [7], greedy_params(10)))
    assert other.seq.stats.cached_tokens >= 2 * BS
    session.reset()
    assert_no_leak(eng)


def test_session_diverging_in_own_partial_block(make_engine):
    eng, cold = make_engine(), make_engine(prefix_cache=False)
    p = prompt_of(10, shift=6)
    session = eng.new_session()
    tokens_of(eng.generate(p, greedy_params(3), session=session))
    q = p[:7] + [5, 5, 5]
    h = eng.submit(q, greedy_params(6), session=session)
    assert tokens_of(h) == tokens_of(cold.generate(q, greedy_params(6)))
    # Its own block, nobody else sees it: reused in place (a hybrid has no state at 7).
    assert h.seq.stats.cached_tokens == (0 if hybrid(eng) else 7)
    assert eng.stats()["blocks_used"] == 1  # pinned by the session
    session.reset()
    assert_no_leak(eng)


# --- 7. no leaks --------------------------------------------------------------------------------
def test_no_leaks_after_finish_cancel_break_and_reset(make_engine):
    eng = make_engine()
    assert eng.stats()["blocks_used"] == 0
    tokens_of(eng.submit(prompt_of(30), greedy_params(5)))
    assert idle(eng)["blocks_used"] == 0

    # Cancel mid-stream through the handle.
    h = eng.submit(prompt_of(25, shift=1), greedy_params(400))
    it = iter(h)
    next(it)
    h.cancel()
    rest = list(it)
    assert rest[-1].finish_reason == "cancelled"
    assert idle(eng)["blocks_used"] == 0

    # Cancel through the event passed to generate.
    ev = threading.Event()
    gen = eng.generate(prompt_of(25, shift=2), greedy_params(400), cancel=ev)
    next(gen)
    ev.set()
    assert list(gen)[-1].finish_reason == "cancelled"
    assert idle(eng)["blocks_used"] == 0

    # The consumer walks away.
    h = eng.submit(prompt_of(25, shift=3), greedy_params(400))
    for _ in h:
        break
    assert wait_for(lambda: h.seq.status.value == "finished")
    assert idle(eng)["blocks_used"] == 0

    # Cancelled while still waiting (never admitted).
    eng2 = make_engine(max_num_seqs=1)
    with paused(eng2):
        first = eng2.submit(prompt_of(9), greedy_params(30))
        waiting = eng2.submit(prompt_of(9, shift=1), greedy_params(30))
        waiting.cancel()
    assert tokens_of(waiting) == []
    assert len(tokens_of(first)) == 30
    assert_no_leak(eng2)

    # Sessions pin blocks until reset.
    session = eng.new_session()
    tokens_of(eng.generate(prompt_of(40, shift=7), greedy_params(5), session=session))
    assert eng.stats()["blocks_used"] == 3  # 44 computed tokens
    session.reset()
    assert_no_leak(eng)


# --- 8. chunked prefill -------------------------------------------------------------------------
def test_chunked_prefill_matches_and_interleaves_decodes(make_engine, refs, family):
    long_prompt = prompt_of(150, shift=1)
    expected = mlx_lm_tokens(refs[family], long_prompt, 8)
    eng = make_engine(max_step_tokens=8)
    assert tokens_of(eng.submit(long_prompt, greedy_params(8))) == expected
    eng.call(eng.blocks.clear_prefix_cache)

    log: list[int] = []
    accept = eng._accept
    eng._accept = lambda seq, token, *rest: (log.append(seq.id), accept(seq, token, *rest))[1]
    a = eng.submit(prompt_of(5, shift=9), greedy_params(120))
    ia = iter(a)
    next(ia)
    b = eng.submit(long_prompt, greedy_params(8))
    assert tokens_of(b) == expected
    a.cancel()
    list(ia)
    # Between b's submission and its first token (150 / 7 steps of prefill), a kept decoding.
    first_b = log.index(b.id)
    assert log[:first_b].count(a.id) >= 150 // 7 - 2
    assert b.seq.stats.ttft_s > 0


# --- 9. stats -----------------------------------------------------------------------------------
def test_stats_waste_counts_and_prefix_hits(make_engine):
    eng = make_engine(max_num_seqs=2)
    with paused(eng):
        hs = [eng.submit(prompt_of(n, shift=i), greedy_params(300)) for i, n in enumerate((20, 5, 40, 3))]
    its = [iter(h) for h in hs[:2]]
    for it in its:
        next(it)

    def snapshot():
        st = eng._stats()
        return st, [s.num_computed for s in eng.scheduler.running]

    st, computed = eng.call(snapshot)
    assert st["running"] == 2 and st["waiting"] == 2
    blocks = sum(-(-c // BS) for c in computed)
    assert st["blocks_used"] == blocks
    assert st["waste"] == pytest.approx(1 - sum(computed) / (blocks * BS))
    assert 0 < st["waste"] < 1
    assert st["tokens_in"] == 68 and st["tokens_out"] >= 2
    for h in hs:
        h.cancel()
    for h in hs:
        list(h)
    st = idle(eng)
    assert st["waste"] == 0.0 and st["running"] == st["waiting"] == 0

    before = st["prefix_hit_tokens"]
    p = prompt_of(40, shift=11)
    tokens_of(eng.submit(p, greedy_params(2)))
    assert eng.stats()["prefix_hit_tokens"] == before
    tokens_of(eng.submit(p, greedy_params(2)))
    # To the token: 32 shared + 7 copied (hybrid and window models: the whole blocks).
    assert eng.stats()["prefix_hit_tokens"] == before + (32 if whole_blocks(eng) else len(p) - 1)


# --- 10. asyncio ----------------------------------------------------------------------------------
def test_async_stream(make_engine):
    eng = make_engine()
    prompts = [prompt_of(9, shift=i) for i in range(3)]
    expected = [tokens_of(eng.submit(p, greedy_params(6))) for p in prompts]

    async def main():
        loop = asyncio.get_running_loop()

        async def one(p):
            chunks = [c async for c in eng.submit(p, greedy_params(6), loop=loop).astream()]
            assert chunks[-1].finish_reason == "length" and chunks[-1].stats.completion_tokens == 6
            return [c.token for c in chunks if c.token is not None]

        results = await asyncio.gather(*(one(p) for p in prompts))
        # Walking away from an async stream cancels the request.
        h = eng.submit(prompts[0], greedy_params(400), loop=loop)
        async for _ in h.astream():
            break
        await asyncio.sleep(0)
        # Nobody ever reads this one, and its loop closes while it still runs.
        orphan = eng.submit(prompts[1], greedy_params(480), loop=loop)
        return results, h, orphan

    results, h, orphan = asyncio.run(main())
    assert results == expected
    assert wait_for(lambda: h.seq.status.value == "finished")
    # A closed event loop cancels the request instead of killing the engine thread.
    assert wait_for(lambda: orphan.seq.status.value == "finished")
    assert orphan.seq.num_generated < 480
    assert tokens_of(eng.submit(prompts[2], greedy_params(6))) == expected[2]


@pytest.mark.parametrize("family", ["qwen3"])
def test_a_first_token_wakes_its_loop_before_the_next_forward(make_engine):
    """A server stream's first token is handed to its event loop before the next step's
    forward is submitted (MLX's CPU backend blocks that submit until most of it ran), not
    at that step's end."""
    eng = make_engine()
    owed: list[int] = []  # event loops owed a wake-up when each forward is built
    forward = eng._forward

    def spy(seqs, n):
        with eng.outbox._lock:
            owed.append(len(eng.outbox._due))
        return forward(seqs, n)

    eng._forward = spy

    async def main():
        h = eng.submit(prompt_of(9), greedy_params(4), loop=asyncio.get_running_loop())
        return [c.token async for c in h.astream() if c.token is not None]

    assert len(asyncio.run(main())) == 4
    assert len(owed) >= 4 and not any(owed), owed
    assert_no_leak(eng)


# --- 11. errors -------------------------------------------------------------------------------------
def test_capacity_error_at_submit(make_engine):
    eng = make_engine(kv_blocks=2)
    with pytest.raises(OutOfCapacity):
        eng.submit(prompt_of(40), greedy_params(4))
    assert len(tokens_of(eng.submit(prompt_of(20), greedy_params(4)))) == 4


def test_full_kv_pool_ends_reply_with_kv_cache_cause(make_engine):
    """Alone and out of blocks: "length", blamed on the pool, not on max_tokens or context."""
    eng = make_engine(kv_blocks=2)
    stats = list(eng.submit(prompt_of(20), greedy_params(40)))[-1].stats
    assert (stats.finish_reason, stats.truncated_by) == ("length", "kv_cache")
    assert 0 < stats.completion_tokens and stats.prompt_tokens + stats.completion_tokens <= 2 * BS + 1


def test_step_exception_fails_in_flight_and_engine_recovers(make_engine):
    eng = make_engine()
    expected = tokens_of(eng.submit(prompt_of(12), greedy_params(6)))
    eng.call(eng.blocks.clear_prefix_cache)
    forward, calls = eng._forward, []

    def broken(seqs, n):
        calls.append(n)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return forward(seqs, n)

    eng._forward = broken
    with paused(eng):
        h1 = eng.submit(prompt_of(12), greedy_params(6))
        h2 = eng.submit(prompt_of(30, shift=1), greedy_params(6))
    for h in (h1, h2):
        with pytest.raises(RuntimeError, match="boom"):
            tokens_of(h)
    assert idle(eng)["blocks_used"] == 0
    assert tokens_of(eng.submit(prompt_of(12), greedy_params(6))) == expected
    assert_no_leak(eng)


def test_single_sequence_slice_paths_equal_scatter_and_gather():
    """One sequence on consecutive blocks: the slice update / slice read the CPU path takes
    give what the scatter and the block-table gather give."""
    from mlxlocal.cache import KVPools, StepBatch
    from mlxlocal.metal.paged_attention import paged_attention_reference

    mx.random.seed(3)
    shapes = KVPools.uniform(1, 2, 16)
    fast, slow = KVPools(shapes, 8, 4, mx.float32), KVPools(shapes, 8, 4, mx.float32)
    for pools in (fast, slow):
        pools.k[0] = mx.random.normal(pools.k[0].shape, key=mx.random.key(1))
        pools.v[0] = mx.random.normal(pools.v[0].shape, key=mx.random.key(2))
    k, v = mx.random.normal((1, 2, 1, 16)), mx.random.normal((1, 2, 1, 16))
    common = dict(positions=9, slot_blocks=mx.array([5]), slot_offsets=mx.array([1]),
                  block_tables=mx.array([[3, 4, 5]]), context_lens=mx.array([10]), host_context_lens=[10])
    fast.write(0, StepBatch(**common, host_slot=(5, 1), host_run=3), k, v)
    slow.write(0, StepBatch(**common), k, v)
    assert mx.array_equal(fast.k[0], slow.k[0]) and mx.array_equal(fast.v[0], slow.v[0])
    q = mx.random.normal((1, 4, 1, 16))
    args = (q, slow.k[0], slow.v[0], mx.array([[3, 4, 5]]), mx.array([10]), 0.25)
    assert mx.allclose(paged_attention_reference(*args, first_block=3), paged_attention_reference(*args))
    assert not mx.allclose(paged_attention_reference(*args, first_block=2), paged_attention_reference(*args))
