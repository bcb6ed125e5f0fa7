"""Hybrid SSM/attention models on the paged engine: recurrent-state snapshots at block
boundaries, restored by later requests and by sessions whose turn was edited.

The oracle is mlx-lm's own generate_step on its own cache (a fresh model run over the
whole prompt), never the engine's cache code.
"""

from __future__ import annotations

import pytest
from engine_util import mlx_lm_greedy, prompt_of, run

from mlxlocal.cache.states import StateSnapshots
from mlxlocal.engine import PagedEngine, open_engine
from mlxlocal.source.loader import load_from_dir

BS = 16


@pytest.fixture(scope="module")
def ref(mlx_lm_models):
    return mlx_lm_greedy(mlx_lm_models["hybrid"])


@pytest.fixture
def eng(mlx_lm_models):
    engine = open_engine(load_from_dir(mlx_lm_models["hybrid"]), block_size=BS, kv_blocks=128)
    assert isinstance(engine, PagedEngine) and engine.runner.recurrent
    yield engine
    engine.shutdown()


def test_a_shared_prefix_resumes_from_a_snapshot(eng, ref):
    system = prompt_of(45, shift=1)
    a, b, c = system + [3, 4, 5], system + [9, 9], system + [1, 2, 3, 4]
    assert run(eng, a, 6)[0] == ref(a, 6)
    # a's state was kept at its prompt's end (48); b shares a's first two blocks but no
    # state at 32, so it recomputes them and keeps the state at 32 on the way.
    tokens, stats = run(eng, b, 6)
    assert tokens == ref(b, 6) and stats.cached_tokens == 0
    restored = eng.runner.snapshots.restored
    tokens, stats = run(eng, c, 6)
    assert tokens == ref(c, 6)
    assert stats.cached_tokens == 2 * BS
    assert eng.runner.snapshots.restored == restored + 1
    # The whole of a again: resumed from the state at 48 (its last token is fed again).
    tokens, stats = run(eng, a + [5], 3)
    assert tokens == ref(a + [5], 3) and stats.cached_tokens == 48


def test_decode_crossing_a_boundary_leaves_a_snapshot(eng, ref):
    p = prompt_of(10, shift=2)
    out, _ = run(eng, p, 30)  # positions 10..39: boundaries 16 and 32 are crossed decoding
    follow = p + out[:25] + [7, 7]
    tokens, stats = run(eng, follow, 5)
    assert tokens == ref(follow, 5)
    assert stats.cached_tokens == 2 * BS


def test_session_turn_extends_the_live_state(eng, ref):
    session = eng.new_session()
    p1 = prompt_of(21, shift=3)
    out1, _ = run(eng, p1, 8, session)
    assert out1 == ref(p1, 8)
    p2 = p1 + out1 + [11, 12, 13]
    out2, stats = run(eng, p2, 8, session)
    assert out2 == ref(p2, 8)
    # The session held the state after exactly p1 + out1[:-1] (the last token was never fed).
    assert stats.cached_tokens == len(p1) + len(out1) - 1
    session.reset()


def test_edited_turn_rolls_back_to_the_deepest_snapshot(eng, ref):
    session = eng.new_session()
    p1 = prompt_of(70, shift=4)  # prefill stops at 64 (snapshot), then 6 more
    run(eng, p1, 4, session)
    edited = p1[:50] + [1, 2, 3, 4, 5]  # diverges inside block 3 (48..63)
    tokens, stats = run(eng, edited, 6, session)
    assert tokens == ref(edited, 6)
    # No state at 48 (the prefill chunk ran 0..64 in one go): back to the start, keeping
    # the state at 48 this time, so a second edit there rolls back only to 48.
    assert stats.cached_tokens == 0
    again = p1[:52] + [9, 9, 9]
    tokens, stats = run(eng, again, 6, session)
    assert tokens == ref(again, 6) and stats.cached_tokens == 48
    # An edit past the snapshot at 64 keeps it.
    p3 = p1 + [6, 6]
    run(eng, p3, 3, session)
    edited2 = p3[:66] + [8, 8, 8]
    tokens, stats = run(eng, edited2, 6, session)
    assert tokens == ref(edited2, 6)
    assert stats.cached_tokens == 64
    session.reset()


def test_snapshots_go_with_their_blocks_and_respect_the_budget(eng):
    run(eng, prompt_of(40, shift=5), 3)
    assert eng.call(lambda: len(eng.runner.snapshots)) >= 1
    eng.call(eng.blocks.clear_prefix_cache)
    assert eng.call(lambda: len(eng.runner.snapshots)) == 0

    snaps = StateSnapshots(budget_bytes=300, state_bytes=100)
    for block in range(5):
        snaps.put(block, [block])
    assert len(snaps) == 3 and snaps.get(0) is None and snaps.get(2) == [2]
    snaps.put(9, [9])  # 2 was just used: 3 is the oldest
    assert snaps.get(3) is None and snaps.get(2) == [2]
    snaps.drop(2)
    assert snaps.get(2) is None
