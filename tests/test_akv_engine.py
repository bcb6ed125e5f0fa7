"""Cache edits on the paged engine (issue 17): drop and reposition against a reference
built by another code path (tests/akv_reference.py), sessions, history, no leaked blocks."""

from __future__ import annotations

import mlx.core as mx
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
