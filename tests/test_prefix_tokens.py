"""Prefix reuse to the token: partial leaves in the radix tree, copy-on-write on admission."""

from __future__ import annotations

import pytest
from engine_util import assert_no_leak, idle

from mlxlocal.cache import BlockManager, RadixCache
from mlxlocal.engine import PagedEngine, SamplingParams, open_engine
from mlxlocal.source.loader import load_from_dir

BS = 16


def prompt_of(n: int, shift: int = 0, vocab: int = 300) -> list[int]:
    return [(i * 37 + 11 + shift * 101) % vocab for i in range(n)]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def tokens_of(handle) -> list[int]:
    chunks = list(handle)
    assert chunks[-1].finish_reason is not None
    return [c.token for c in chunks if c.token is not None]


def partial_nodes(eng: PagedEngine) -> dict[int, int]:
    """block -> tokens held, for the partial leaves in the tree."""
    radix = eng.blocks.radix
    return eng.call(lambda: {b: len(radix.chunk(b)) for b in radix.by_block if len(radix.chunk(b)) < BS})


@pytest.fixture(scope="module")
def loaded(tiny_models):
    return load_from_dir(tiny_models["qwen3"])


@pytest.fixture
def make_engine(loaded):
    engines = []

    def make(**kw) -> PagedEngine:
        kw.setdefault("block_size", BS)
        kw.setdefault("kv_blocks", 256)
        eng = open_engine(loaded, **kw)
        assert isinstance(eng, PagedEngine)
        engines.append(eng)
        return eng

    yield make
    for eng in engines:
        eng.shutdown()


# --- unit: the tree and the block manager ------------------------------------------------------
def test_radix_partial_leaf_match_upgrade_and_evict():
    r = RadixCache(4)
    r.insert([1, 1, 1, 1, 2, 2], [10, 11], partial=True)  # a full node and a partial leaf of 2
    assert r.match([1, 1, 1, 1, 2, 2, 3]) == [10]  # full blocks only
    assert r.match_partial([1, 1, 1, 1, 2, 2, 3]) == ([10], (11, 2))
    assert r.match_partial([1, 1, 1, 1, 2, 9]) == ([10], (11, 1))
    assert r.match_partial([1, 1, 1, 1, 9]) == ([10], None)
    assert r.match_partial([1, 1, 5]) == ([], (10, 2))  # a full child matches partially too
    # The same block grown full: its partial leaf is replaced by a full node.
    r.insert([1, 1, 1, 1, 2, 2, 2, 2, 3], [10, 11, 12], partial=True)
    assert len(r.chunk(11)) == 4 and len(r.chunk(12)) == 1 and len(r) == 3
    assert r.match_partial([1, 1, 1, 1, 2, 2, 2, 2, 3, 3]) == ([10, 11], (12, 1))
    # Partial leaves are evictable leaves like any other.
    assert r.evict(1, lambda b: True) == [12]
    assert r.clear(lambda b: True) == [11, 10] and len(r) == 0


def _tree(r: RadixCache) -> dict:
    """A tree as plain data: each node's blocks, tokens, tags, key and parent's blocks."""
    return {b: (tuple(n.blocks), tuple(n.tokens), tuple(n.tags), n.key, tuple(n.parent.blocks))
            for b, n in r.by_block.items()}


def test_radix_insert_below_held_chain_equals_the_walk_from_the_root(monkeypatch):
    """insert() goes on below the blocks a sequence holds as the tree's chain (checked up the
    parents): over random prompts, growth, tags, partial leaves, evictions and tables that
    hold some other chain's blocks, it builds the tree the walk from the root builds."""
    import random

    rng = random.Random(3)
    fast, walk = RadixCache(4), RadixCache(4)
    monkeypatch.setattr(walk, "_held_chain", lambda *a: (0, walk.root, 0))
    held = []

    def held_chain(*a):
        held.append(RadixCache._held_chain(fast, *a))
        return held[-1]
    monkeypatch.setattr(fast, "_held_chain", held_chain)
    # (tokens, blocks, the chunk its tags start at or None) inserted so far
    tables: list[tuple[list[int], list[int], int | None]] = []
    next_block = 0
    for step in range(400):
        if tables and rng.random() < 0.6:  # a sequence grows: its table (and tags) go on
            tokens, blocks, tagged = rng.choice(tables)
            tokens = tokens + [rng.randrange(3) for _ in range(rng.randrange(1, 9))]
            blocks = blocks + list(range(next_block, next_block + 3))
        else:  # a new prompt, sharing a cached prefix's blocks or not
            tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 20))]
            blocks = list(range(next_block, next_block + 6))
            if tables and rng.random() < 0.3:  # another chain's blocks up front: not a chain here
                blocks = rng.choice(tables)[1][:2] + blocks
            tagged = rng.randrange(4) if rng.random() < 0.2 else None
        next_block += 9
        need = len(tokens) // 4 + 1
        blocks = blocks[:need]
        # An edit history tags the chunks from the edit on (the same ones as the table grows).
        tags = None if tagged is None else [None] * tagged + [("t", 1)] * max(0, need - tagged)
        partial = rng.random() < 0.5
        got = fast.insert(tokens, blocks, partial, tags)
        want = walk.insert(tokens, blocks, partial, tags)
        assert got == want and _tree(fast) == _tree(walk), step
        tables.append((tokens, got + blocks[len(got):], tagged))
        if rng.random() < 0.1:
            assert fast.evict(3, lambda b: True) == walk.evict(3, lambda b: True)
            tables = [(t, b, g) for t, b, g in tables
                      if all(x in fast.by_block for x in b[: len(t) // 4])]
    assert sum(k[0] > 0 for k in held) > 50  # the fast path was taken, often


def test_radix_runs_match_what_a_tree_of_single_blocks_holds():
    """The tree keeps runs of blocks as one node, split where prefixes branch: over random
    prompts sharing prefixes, growth, partial leaves, detaches and evictions, every match is
    the longest prefix a plain map of cached block paths holds, each block holds its
    chunk, and every node's blocks point back at it."""
    import random

    rng = random.Random(5)
    r, bs = RadixCache(4), 4
    path_of: dict[int, tuple] = {}  # cached full block -> the chunks up to and with it
    seqs: list[list[int]] = []
    next_block = 0

    def key(tokens: list[int], i: int) -> tuple:
        return tuple(tuple(tokens[x * bs:(x + 1) * bs]) for x in range(i + 1))

    def longest(tokens: list[int]) -> int:
        cached, n = set(path_of.values()), 0
        while n < len(tokens) // bs and key(tokens, n) in cached:
            n += 1
        return n

    for step in range(600):
        roll = rng.random()
        if roll < 0.5 or not seqs:  # a prompt: a cached one's start, then its own tokens
            base = rng.choice(seqs)[: rng.randrange(0, 40)] if seqs and rng.random() < 0.7 else []
            tokens = base + [rng.randrange(2) for _ in range(rng.randrange(1, 30))]
            shared = r.match(tokens)
            blocks = shared + list(range(next_block, next_block + len(tokens) // bs + 1))
            next_block += len(blocks)
            held = r.insert(tokens, blocks[: len(tokens) // bs + 1], partial=rng.random() < 0.5)
            for i, b in enumerate(held):
                assert path_of.setdefault(b, key(tokens, i)) == key(tokens, i), step
            seqs.append(tokens)
        elif roll < 0.8:  # a lookup
            tokens = rng.choice(seqs)[: rng.randrange(1, 60)] + [rng.randrange(2)] * rng.randrange(3)
            got, part = r.match_partial(tokens)
            assert len(got) == longest(tokens), step
            assert all(path_of[b] == key(tokens, i) for i, b in enumerate(got)), step
            if part is not None:
                block, k = part
                rest = tokens[len(got) * bs:]
                assert 0 < k and tuple(rest[:k]) == r.chunk(block)[:k], step
        elif roll < 0.9:  # a block rewritten: out, with what hangs below it
            if path_of:
                b = rng.choice(sorted(path_of))
                gone = {b, *r.detach([b])}
                for x in gone:
                    path_of.pop(x, None)
        else:
            for b in r.evict(rng.randrange(1, 6), lambda b: True):
                path_of.pop(b, None)
        assert set(path_of) == {b for b, n in r.by_block.items() if not n.partial}, step
        for b, n in r.by_block.items():
            assert b in n.blocks and n.parent.children[n.key] is n, step
            if not n.partial:
                assert r.chunk(b) == path_of[b][-1], step


def test_block_manager_match_tokens_copies_and_pins_source():
    bm = BlockManager(3, 4)
    a = bm.allocate(2)
    bm.cache_prefix([1, 1, 1, 1, 2, 2], a, partial=True)
    bm.release(a)
    assert bm.num_cached == 2 and len(bm.free) == 1
    copies = []
    table, n = bm.match_tokens([1, 1, 1, 1, 2, 7], lambda s, d: copies.append((s, d)))
    assert n == 5 and table[0] == a[0] and copies == [(a[1], table[1])] and table[1] != a[1]
    assert bm.radix.contains(a[1])  # the source stayed cached: it was pinned while allocating
    bm.release(table)
    # No room for the copy: the full blocks alone.
    b = bm.allocate(1)
    table, n = bm.match_tokens([1, 1, 1, 1, 2, 7], lambda s, d: copies.append((s, d)))
    assert n == 4 and table == [a[0]]
    bm.release(table + b)
    assert bm.clear_prefix_cache() == 2 and len(bm.free) == 3 and bm.num_referenced == 0


# --- (a) a prompt diverging mid-block ---------------------------------------------------------
@pytest.mark.parametrize("first_len", [40, 60])  # the shared 37 tokens end in a partial leaf / a full block
def test_mid_block_divergence_reuses_exact_prefix(make_engine, first_len):
    warm, cold = make_engine(), make_engine(prefix_cache=False)
    common = prompt_of(37, shift=3)
    pa = common + prompt_of(first_len - 37, shift=8)
    pb = common + [299, 298, 297, 296, 5, 6]
    assert pa[37] != pb[37]
    assert tokens_of(warm.submit(pa, greedy(2))) == tokens_of(cold.submit(pa, greedy(2)))
    hb = warm.submit(pb, greedy(12))
    assert tokens_of(hb) == tokens_of(cold.submit(pb, greedy(12)))
    assert hb.seq.stats.cached_tokens == 37  # not 32
    assert_no_leak(warm)


def test_copy_from_a_block_its_owner_is_still_writing(make_engine):
    warm, cold = make_engine(), make_engine(prefix_cache=False)
    pa = prompt_of(41, shift=9)  # the prompt's partial last block enters the tree after prefill
    pb = pa[:38] + [1, 2, 3]
    ha = warm.submit(pa, greedy(40))
    ia = iter(ha)
    next(ia)
    assert partial_nodes(warm)  # the prompt's tail is a partial leaf, still written by pa
    hb = warm.submit(pb, greedy(20))
    assert tokens_of(hb) == tokens_of(cold.submit(pb, greedy(20)))
    assert hb.seq.stats.cached_tokens == 38
    rest = [c.token for c in ia if c.token is not None]
    assert ha.seq.tokens[len(pa):] == tokens_of(cold.submit(pa, greedy(40)))
    assert len(rest) == 39
    assert_no_leak(warm)


# --- (b) multi-turn: prompt + reply + new tokens ----------------------------------------------
def test_next_turn_reuses_prompt_and_reply(make_engine):
    warm, cold = make_engine(), make_engine(prefix_cache=False)
    prompt, reused = prompt_of(45, shift=1), 0
    for turn in range(3):
        h = warm.submit(prompt, greedy(7))
        reply = tokens_of(h)
        assert reply == tokens_of(cold.submit(prompt, greedy(7)))
        assert h.seq.stats.cached_tokens >= reused
        reused = len(prompt) + len(reply) - 1  # the last reply token was never fed
        prompt = prompt + reply + prompt_of(9 + turn, shift=20 + turn)
    assert_no_leak(warm)


# --- (c) a small pool: partial leaves get evicted, nothing leaks -------------------------------
def test_small_pool_evicts_partial_leaves_without_leaks(make_engine):
    warm, cold = make_engine(kv_blocks=8), make_engine(prefix_cache=False)
    first = prompt_of(37, shift=30)
    assert tokens_of(warm.submit(first, greedy(3))) == tokens_of(cold.submit(first, greedy(3)))
    radix = warm.blocks.radix
    chunks = lambda: warm.call(lambda: {radix.chunk(b) for b in radix.by_block})  # noqa: E731
    leaf = tuple(first[32:])
    assert any(len(c) < BS and c[:5] == leaf[:5] for c in chunks())  # first's partial leaf
    for i in range(6):
        p = prompt_of(37 + i, shift=40 + i)
        assert tokens_of(warm.submit(p, greedy(5))) == tokens_of(cold.submit(p, greedy(5)))
    assert not any(c[:5] == leaf[:5] for c in chunks())  # evicted
    assert any(len(c) < BS for c in chunks())  # newer partial leaves are there
    # Concurrent requests sharing mid-block prefixes, with preemption in a pool this small.
    base = prompt_of(21, shift=50)
    prompts = [base + prompt_of(3 + i, shift=60 + i) for i in range(4)]
    handles = [warm.submit(p, greedy(30)) for p in prompts]
    outs = [tokens_of(h) for h in handles]
    assert outs == [tokens_of(cold.submit(p, greedy(30))) for p in prompts]
    assert any(h.seq.preemptions for h in handles)
    assert sum(h.seq.stats.cached_tokens for h in handles) > 0
    st = idle(warm)
    assert st["blocks_used"] == 0
    assert_no_leak(warm)


def test_cancel_and_session_release_everything(make_engine):
    eng = make_engine(kv_blocks=16)
    p = prompt_of(35, shift=70)
    tokens_of(eng.submit(p, greedy(4)))
    h = eng.submit(p[:30] + [7, 7], greedy(200))
    it = iter(h)
    next(it)
    h.cancel()
    list(it)
    s = eng.new_session()
    tokens_of(eng.generate(p[:33] + [8], greedy(3), session=s))
    tokens_of(eng.generate(p[:33] + [8, 9], greedy(3), session=s))
    s.reset()
    assert_no_leak(eng)
