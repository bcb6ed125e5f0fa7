"""Cache edits on the paged engine (issue 17): drop and reposition against a reference
built by another code path (tests/akv_reference.py), sessions, history, no leaked blocks."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from akv_reference import Reference
from engine_util import assert_no_leak

from mlxlocal.engine import CacheEdit, EngineConfig, PagedEngine, SamplingParams
from mlxlocal.source.loader import load

PROMPT = [(i * 37 + 11) % 300 for i in range(90)]


@pytest.fixture(scope="module")
def loaded(tiny_models):
    return load(str(tiny_models["llama"]))


def engine(loaded, **kw):
    return PagedEngine(loaded, EngineConfig(**{"block_size": 16, "kv_blocks": 64, **kw}))


def greedy_with_logprobs(eng, prompt, n, edits=None, session=None):
    params = SamplingParams(max_tokens=n, ignore_eos=True, logprobs=5)
    chunks = [c for c in eng.generate(prompt, params, session=session, edits=edits)]
    toks = [c for c in chunks if c.token is not None]
    return [c.token for c in toks], [c.top_logprobs for c in toks], chunks[-1].stats


def reference_greedy(ref: Reference, logits: mx.array, n: int):
    tokens, tops = [], []
    for _ in range(n):
        lp = logits - mx.logsumexp(logits)
        order = mx.argsort(-lp)[:5].tolist()
        tops.append([(t, lp[t].item()) for t in order])
        tokens.append(order[0])
        logits = ref.feed([order[0]])
    return tokens, tops


def assert_same(got, want, tol=2e-4):
    (gt, gl), (wt, wl) = got, want
    assert gt == wt
    for a, b in zip(gl, wl):
        assert [t for t, _ in a] == [t for t, _ in b]
        assert max(abs(x - y) for (_, x), (_, y) in zip(a, b)) < tol


@pytest.mark.parametrize("spans", [((20, 37),), ((5, 9), (33, 64)), ((16, 32),), ((40, 58),)])
def test_drop_equals_masking_dropped_keys(loaded, spans):
    at = 70
    eng = engine(loaded)
    try:
        toks, tops, stats = greedy_with_logprobs(eng, PROMPT, 6, [CacheEdit(at=at, drop=spans)])
        ref = Reference(loaded.model)
        ref.feed(PROMPT[:at])
        ref.drop([s for a, b in spans for s in range(a, b)])
        want = reference_greedy(ref, ref.feed(PROMPT[at:]), 6)
        assert_same((toks, tops), want)
        assert stats.dropped_tokens == sum(b - a for a, b in spans)
        assert stats.prompt_tokens == len(PROMPT)
        # The plain run differs: the drop changed what the model saw (the test can fail).
        plain = greedy_with_logprobs(eng, PROMPT, 6)
        with pytest.raises(AssertionError):
            assert_same(plain[:2], want)
        assert eng.stats()["tokens_dropped"] == sum(b - a for a, b in spans)
        assert_no_leak(eng)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("repos", [False, True])
def test_session_turns_reuse_the_edited_cache(loaded, repos):
    """Turn 2 drops a span of turn 1's cached prompt at the start of its new message: it
    reuses the session's cache; turn 3 adds a second drop on top. Each equals a fresh
    engine given the whole prompt and every edit at once (no session)."""
    eng, fresh = engine(loaded), engine(loaded)
    try:
        s = eng.new_session()
        t1, _, st1 = greedy_with_logprobs(eng, PROMPT[:60], 4, session=s)
        convo = PROMPT[:60] + t1
        p2 = convo + PROMPT[60:90]
        e1 = CacheEdit(at=len(convo), drop=((10, 30),), reposition=((30, len(convo)),) if repos else (),
                       close_tail=repos)
        t2, l2, st2 = greedy_with_logprobs(eng, p2, 4, [e1], session=s)
        assert st2.cached_tokens == len(convo) - 1  # all the session held (its last reply token was never fed)
        assert st2.dropped_tokens == 20 and s.dropped_len == 20
        assert s.cached_len == len(p2) + 4 - 20 - 1  # the last reply token is never computed
        want2 = greedy_with_logprobs(fresh, p2, 4, [e1])
        assert_same((t2, l2), want2[:2])

        p3 = p2 + t2 + PROMPT[:25]
        e2 = CacheEdit(at=len(p2 + t2), drop=((40, 50), (70, 80)),
                       reposition=((50, 70), (80, len(p2 + t2))) if repos else (), close_tail=repos)
        t3, l3, st3 = greedy_with_logprobs(eng, p3, 4, [e1, e2], session=s)
        assert st3.cached_tokens > 60 and st3.dropped_tokens == 40
        # Computed: neither the cached tokens nor the 20 turn 2 dropped (not cached, not fed).
        assert st3.prefill_tokens == len(p3) - st3.cached_tokens - 20
        want3 = greedy_with_logprobs(fresh, p3, 4, [e1, e2])
        assert_same((t3, l3), want3[:2])
        # The session forgotten (evicted): the prefix cache still holds its blocks under
        # their history, and a new session picks the conversation up from there.
        s.reset()
        s2 = eng.new_session()
        again = greedy_with_logprobs(eng, p3, 4, [e1, e2], session=s2)
        assert again[2].cached_tokens >= 64
        assert_same(again[:2], want3[:2])
        s2.reset()

        # A history the session did not go through (e1 left out): it starts over, same answer.
        t4, l4, st4 = greedy_with_logprobs(eng, p3, 4, [e2], session=s)
        assert st4.cached_tokens < 48  # at most the blocks before the first touched token
        assert_same((t4, l4), greedy_with_logprobs(fresh, p3, 4, [e2])[:2])
        # And a plain request on the session forgets the edits too.
        t5, _, st5 = greedy_with_logprobs(eng, p3, 4, session=s)
        assert st5.dropped_tokens == 0 and s.dropped_len == 0
        assert t5 == greedy_with_logprobs(fresh, p3, 4)[0]
        s.reset()
        assert_no_leak(eng)
        assert_no_leak(fresh)
    finally:
        eng.shutdown()
        fresh.shutdown()


def test_prefix_cache_matches_tokens_and_history(loaded):
    """Blocks an edit touched enter the prefix cache keyed by their edit history: a request
    with the same prompt and edits reuses them; a plain request, or one that dropped other
    text at the same span, or the same text at another point, reuses only the untouched
    prefix. Every answer equals a fresh engine's."""
    eng, fresh = engine(loaded), engine(loaded)
    try:
        edit = [CacheEdit(at=70, drop=((40, 60),))]
        greedy_with_logprobs(eng, PROMPT, 3, edit)

        def check(prompt, edits, most, least=0):
            toks, tops, st = greedy_with_logprobs(eng, prompt, 3, edits)
            assert least <= st.cached_tokens <= most, st
            assert_same((toks, tops), greedy_with_logprobs(fresh, prompt, 3, edits)[:2])

        check(PROMPT, edit, 64, 64)  # the same history: every full block of its kept view
        check(PROMPT, None, 40)  # plain: what precedes the first dropped token
        other = PROMPT[:40] + [(t + 1) % 300 for t in PROMPT[40:60]] + PROMPT[60:]
        check(other, edit, 40)  # other dropped text, same kept tokens and spans
        check(PROMPT, [CacheEdit(at=75, drop=((40, 60),))], 40)  # the same drop, later
        check(PROMPT, edit, 64, 64)
        assert_no_leak(eng)
    finally:
        eng.shutdown()
        fresh.shutdown()


def test_batch_and_preemption_replay_edits(loaded):
    """Eight requests with different edits in one batch, on a pool too small for all:
    preempted ones recompute their history; every output equals the request run alone."""
    prompts = [[(i * 31 + k * 7 + 5) % 300 for i in range(80)] for k in range(8)]
    # Odd ones also reposition what follows each gap (and the tokens after the edit).
    edits = [[CacheEdit(at=50 + k, drop=((k + 3, k + 20),), reposition=((k + 20, 50 + k),) if k % 2 else (),
                        close_tail=bool(k % 2)),
              CacheEdit(at=70, drop=((55, 58 + k),), reposition=((58 + k, 70),) if k % 2 else ())]
             for k in range(8)]
    solo = engine(loaded)
    try:
        want = [greedy_with_logprobs(solo, p, 40, e)[0] for p, e in zip(prompts, edits)]
    finally:
        solo.shutdown()
    eng = engine(loaded, kv_blocks=20, max_num_seqs=8, prefix_cache=False)
    try:
        handles = [eng.submit(p, SamplingParams(max_tokens=40, ignore_eos=True), edits=e)
                   for p, e in zip(prompts, edits)]
        got = [[c.token for c in h if c.token is not None] for h in handles]
        assert got == want
        assert any(h.seq.preemptions for h in handles)  # the pool forced recomputation
        assert_no_leak(eng)
    finally:
        eng.shutdown()


@pytest.mark.parametrize("edits, message", [
    ([CacheEdit(at=95, drop=((1, 2),))], "inside the prompt"),
    ([CacheEdit(at=50, drop=((40, 60),))], "before `at`"),
    ([CacheEdit(at=50, drop=())], "drops nothing"),
    ([CacheEdit(at=60, drop=((10, 20),)), CacheEdit(at=50, drop=((30, 40),))], "sorted"),
    ([CacheEdit(at=50, drop=((10, 20),)), CacheEdit(at=60, drop=((15, 25),))], "overlaps"),
    ([CacheEdit(at=50, drop=((10, 20),), reposition=((15, 30),))], "dropped tokens"),
])
def test_bad_edits_are_refused_before_anything_runs(loaded, edits, message):
    eng = engine(loaded)
    try:
        with pytest.raises(ValueError, match=message):
            eng.submit(PROMPT, SamplingParams(max_tokens=2), edits=edits)
        assert eng.stats()["running"] == 0
    finally:
        eng.shutdown()


def test_models_whose_state_cannot_drop_refuse(mlx_lm_models):
    for name in ("gemma3", "hybrid"):
        eng = PagedEngine(load(str(mlx_lm_models[name])), EngineConfig(block_size=16, kv_blocks=64))
        try:
            with pytest.raises(ValueError, match="sliding-window or recurrent"):
                eng.submit(PROMPT, SamplingParams(max_tokens=2), edits=[CacheEdit(at=50, drop=((1, 9),))])
        finally:
            eng.shutdown()


def test_drop_on_the_mlx_lm_path(gemma_model):
    """mlx-lm's model code reads the same positions and pools: drop there matches its own
    reference (the same model, masked dense cache on the native side is not available, so:
    a session turn with the edit equals a fresh request with it)."""
    ld = load(str(gemma_model))
    eng, fresh = PagedEngine(ld, EngineConfig(block_size=16, kv_blocks=64)), PagedEngine(ld, EngineConfig(block_size=16, kv_blocks=64))
    try:
        s = eng.new_session()
        t1 = greedy_with_logprobs(eng, PROMPT[:60], 3, session=s)[0]
        p2 = PROMPT[:60] + t1 + PROMPT[60:80]
        e = [CacheEdit(at=63, drop=((20, 41),), reposition=((41, 63),), close_tail=True)]
        got = greedy_with_logprobs(eng, p2, 5, e, session=s)
        want = greedy_with_logprobs(fresh, p2, 5, e)
        assert_same(got[:2], want[:2])
        assert got[2].dropped_tokens == 21 and got[2].cached_tokens > 40 and got[2].repositioned_tokens == 22
        plain = greedy_with_logprobs(fresh, p2, 5)
        with pytest.raises(AssertionError):
            assert_same(plain[:2], want[:2])
    finally:
        eng.shutdown()
        fresh.shutdown()


def inv_freq_of(model) -> np.ndarray:

    rope = model.layers[0].self_attn.rope
    if hasattr(rope, "_freqs"):  # llama3 / yarn / longrope: mx.fast.rope's freqs are wavelengths
        return 1.0 / np.array(rope._freqs, dtype=np.float64)
    d = rope.dims
    return rope.scale * rope.base ** (-np.arange(0, d, 2, dtype=np.float64) / d)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("moved, close_tail", [(((37, 70),), True), (((37, 70),), False), (((37, 50),), False)])
def test_drop_and_reposition_equal_an_independent_reference(tiny_models, family, moved, close_tail):
    """Decode after drop + reposition equals the model over a dense cache whose kept keys
    were un-rotated and re-rotated in float64 numpy (not the engine's rerotate)."""
    ld = load(str(tiny_models[family]))
    eng = engine(ld)
    try:
        drop, at = ((20, 37),), 70
        edit = CacheEdit(at=at, drop=drop, reposition=moved, close_tail=close_tail)
        toks, tops, st = greedy_with_logprobs(eng, PROMPT, 6, [edit])
        n_moved = sum(b - a for a, b in moved)
        assert st.repositioned_tokens == n_moved and st.dropped_tokens == 17
        ref = Reference(ld.model)
        ref.feed(PROMPT[:at])
        ref.drop(list(range(20, 37)))
        new = {s: s - 17 for a, b in moved for s in range(a, b)}
        last = max(new.values()) if close_tail else None
        ref.reposition(new, inv_freq_of(ld.model), next_pos=None if last is None else last + 1)
        want = reference_greedy(ref, ref.feed(PROMPT[at:]), 6)
        assert_same((toks, tops), want, tol=5e-4)
        assert_no_leak(eng)
    finally:
        eng.shutdown()


def test_dynamic_ntk_refuses_reposition_but_drops(tmp_path):
    from conftest import BASE, build_tiny

    ld = load(str(build_tiny(tmp_path / "dyn", dict(BASE, model_type="llama", rope_theta=10000.0,
                                                     rope_scaling={"rope_type": "dynamic", "factor": 2.0}))))
    eng = engine(ld)
    try:
        with pytest.raises(ValueError, match="(?i)dynamic.*reposition is not possible"):
            eng.submit(PROMPT, SamplingParams(max_tokens=2), edits=[CacheEdit(at=70, drop=((20, 37),),
                                                                               reposition=((37, 70),))])
        toks, _, st = greedy_with_logprobs(eng, PROMPT, 3, [CacheEdit(at=70, drop=((20, 37),))])
        assert st.dropped_tokens == 17 and len(toks) == 3
    finally:
        eng.shutdown()


def test_an_edit_needs_no_room_beyond_what_it_frees(loaded):
    """A pool just large enough for the prompt: the edit rewrites the sequence's own blocks
    in place (copies into fresh blocks would not fit), with the answer a roomy pool gives."""
    edits = [CacheEdit(at=70, drop=((20, 37),), reposition=((37, 70),), close_tail=True)]
    roomy = engine(loaded)
    try:
        want = greedy_with_logprobs(roomy, PROMPT, 6, edits)
    finally:
        roomy.shutdown()
    tight = engine(loaded, kv_blocks=5)  # 80 slots: the 70 before the edit, 79 after it
    try:
        got = greedy_with_logprobs(tight, PROMPT, 6, edits)
        assert got[2].finish_reason == "length" and got[2].truncated_by == "max_tokens"
        assert_same(got[:2], want[:2])
        assert_no_leak(tight)
    finally:
        tight.shutdown()
