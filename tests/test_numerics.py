"""Numerics that cannot go wrong: a sampled id is always in the vocabulary, and a request
whose logits go NaN or infinite ends with NonFiniteLogitsError while the engine and the
other requests go on (paged engine, speculative verify, dense engine on mlx-lm's sampler).

Non-finite logits are injected with a hook on the model's forward for one request.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from engine_util import drain as drain_chunks
from engine_util import tokens

from mlxlocal.engine import (
    PagedEngine,
    SamplingParams,
    SimpleEngine,
    SpeculativeConfig,
    open_engine,
)
from mlxlocal.engine.sampling import Sampler, _draw, sample_batch
from mlxlocal.errors import NonFiniteLogitsError
from mlxlocal.source.loader import load_from_dir

POISON = 4242  # the seed of the request whose logits the hook spoils
V = 384  # the tiny models' vocabulary


def prompt_of(n: int, shift: int = 0) -> list[int]:
    return [(i * 37 + 11 + shift * 101) % 300 for i in range(n)]


def drain(handle, timeout: float = 30.0):
    """(token ids, error) of a handle, consumed on another thread (a hang fails the test)."""
    chunks, error = drain_chunks(handle, timeout)
    return tokens(chunks), error


def spoil(logits: mx.array, rows: list[bool], value: float) -> mx.array:
    """The marked rows' logits replaced: NaN or +inf everywhere, or (-inf) all -inf."""
    return mx.where(mx.array(rows)[:, None], mx.array(value, logits.dtype), logits)


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return load_from_dir(tiny_model)


# --- the sampler --------------------------------------------------------------------------
def unchecked(**kw) -> SamplingParams:
    return SamplingParams(seed=1, temperature=1.0, **kw)  # not validated: the engine's last line


def test_a_zero_penalty_row_draws_an_id_in_the_vocabulary_and_is_flagged():
    """repetition_penalty 0 (what 1e-39 is in float32) makes a positive logit inf: that row's
    draw used to be 2**32 - 1, which the next forward read as an embedding row."""
    logits = mx.random.normal((2, V), key=mx.random.key(3)) + 1.0
    samplers = [Sampler(unchecked(repetition_penalty=0.0)), Sampler(unchecked())]
    history = list(range(20))
    tokens, _ = sample_batch(samplers, logits, [history, history], [None, None])
    assert all(0 <= t < V for t in tokens.tolist())
    assert [math.isfinite(s.lse[0][s.lse[1]].item()) for s in samplers] == [False, True]
    token, _ = Sampler(unchecked(repetition_penalty=0.0))(logits[:1], history)
    assert 0 <= token.item() < V
    x = mx.array([[float("nan")] * V, [0.0] * V])
    assert all(0 <= t < V for t in _draw(x, mx.array([[0.5], [0.5]])).tolist())


def test_a_tiny_temperature_on_float16_logits_is_still_the_argmax():
    """1/T for T < 1.5e-5 is inf in float16: the scaled logprobs were NaN or all -inf and
    the draw a random id. Scaled in float32, such a T picks the most likely token."""
    for seed in range(4):
        logits = (mx.random.normal((1, V), key=mx.random.key(seed)) * 3).astype(mx.float16)
        want = int(mx.argmax(logits).item())
        for t in (1.01e-5, 1.2e-5, 1.6e-5):
            params = SamplingParams(seed=seed, temperature=t)
            assert Sampler(params)(logits, [1])[0].item() == want
            assert sample_batch([Sampler(params)], logits, [[1]], [None])[0].item() == want


# --- the paged engine ---------------------------------------------------------------------
@pytest.fixture
def engine(loaded):
    eng = open_engine(loaded, block_size=16, kv_blocks=64)
    assert isinstance(eng, PagedEngine)
    yield eng
    eng.shutdown(timeout=5)


def hook_forward(monkeypatch, runner, value: float, after: int = 3) -> None:
    """Spoil the POISON request's logits once it has `after` tokens out."""
    forward = runner.forward

    def spoiled(pools, seqs, n, **kw):
        rows = [s.params.seed == POISON and s.num_generated >= after for s in seqs]
        logits = forward(pools, seqs, n, **kw)
        return spoil(logits, rows, value) if any(rows) else logits
    monkeypatch.setattr(runner, "forward", spoiled)


@pytest.mark.parametrize(("value", "temperature"), [(float("nan"), 1.0), (float("inf"), 1.0),
                                                    (float("nan"), 0.0), (-float("inf"), 0.7)])
def test_non_finite_logits_end_that_request_alone(engine, monkeypatch, value, temperature):
    def params(seed: int) -> SamplingParams:
        return SamplingParams(max_tokens=12, ignore_eos=True, temperature=temperature, seed=seed)
    solo, _ = drain(engine.submit(prompt_of(30), params(1)))
    hook_forward(monkeypatch, engine.runner, value)
    good, bad = engine.submit(prompt_of(30), params(1)), engine.submit(prompt_of(30, 1), params(POISON))
    (bad_tokens, error), (good_tokens, good_error) = drain(bad), drain(good)
    assert isinstance(error, NonFiniteLogitsError) and "non-finite" in str(error), error
    assert 3 <= len(bad_tokens) <= 4 and all(0 <= t < V for t in bad_tokens)
    assert good_error is None and good_tokens == solo  # its batch-mate saw nothing
    monkeypatch.undo()
    assert engine.dead_reason is None and drain(engine.submit(prompt_of(30), params(1)))[0] == solo
    stats = engine.stats()
    assert stats["running"] == stats["waiting"] == 0 and stats["blocks_used"] == 0


def test_non_finite_logits_in_speculative_verify_end_that_request(loaded, monkeypatch):
    eng = open_engine(loaded, block_size=16, kv_blocks=64, speculative=SpeculativeConfig("lookup"))
    try:
        prompt = [5, 6, 7, 8] * 8  # lookup finds drafts
        solo, _ = drain(eng.submit(prompt, SamplingParams(max_tokens=10, ignore_eos=True)))
        run, verified = eng.runner.run, []

        def spoiled(pools, seqs, starts, inputs, every=False):
            logits = run(pools, seqs, starts, inputs, every)
            if every and any(s.params.seed == POISON for s in seqs):
                verified.append(1)
                rows = [s.params.seed == POISON for s in seqs]
                return spoil(logits.reshape(len(seqs), -1), rows, float("nan")).reshape(logits.shape)
            return logits
        monkeypatch.setattr(eng.runner, "run", spoiled)
        bad = eng.submit(prompt, SamplingParams(max_tokens=10, ignore_eos=True, seed=POISON))
        good = eng.submit(prompt, SamplingParams(max_tokens=10, ignore_eos=True, seed=1))
        (_, error), (good_tokens, good_error) = drain(bad), drain(good)
        assert verified and isinstance(error, NonFiniteLogitsError), error
        assert good_error is None and good_tokens == solo
        monkeypatch.undo()
        assert drain(eng.submit(prompt, SamplingParams(max_tokens=10, ignore_eos=True)))[0] == solo
    finally:
        eng.shutdown(timeout=5)


# --- the dense engine (mlx-lm's sampler) -------------------------------------------------
def test_dense_engine_non_finite_logits_end_the_request_and_it_serves_on(gemma_model, monkeypatch):
    eng = SimpleEngine(load_from_dir(gemma_model))
    try:
        params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=1.0, seed=3)
        solo, _ = drain(eng.submit(prompt_of(20), params))
        forward, calls = eng._forward, []

        def spoiled(tokens, cache):
            calls.append(1)
            logits = forward(tokens, cache)
            return spoil(logits, [True] * logits.shape[0], float("nan")) if len(calls) == 3 else logits
        monkeypatch.setattr(eng, "_forward", spoiled)
        got, error = drain(eng.submit(prompt_of(20), params))
        assert isinstance(error, NonFiniteLogitsError), error
        assert len(got) == 2 and all(0 <= t < V for t in got)
        monkeypatch.undo()
        assert drain(eng.submit(prompt_of(20), params))[0] == solo
    finally:
        eng.shutdown(timeout=5)


def test_a_top_p_below_float32_is_refused_and_the_smallest_allowed_keeps_the_top_token():
    """top_p 5e-324 is 0 in float32: nucleus sampling kept no token, and the draw among all
    -inf logits was a uniformly random token."""
    with pytest.raises(ValueError, match=r"top_p must be a finite number in \[1e-08, 1\]"):
        SamplingParams(top_p=5e-324).validate()
    for seed in range(4):
        logits = mx.random.normal((1, V), key=mx.random.key(seed)) * 3
        params = SamplingParams(seed=seed, temperature=1.0, top_p=1e-8)
        params.validate()
        assert Sampler(params)(logits, [1])[0].item() == mx.argmax(logits).item()
        assert sample_batch([Sampler(params)], logits, [[1]], [None])[0].item() == mx.argmax(logits).item()


def test_validation_keeps_repetition_penalty_finite_in_float32():
    for bad in (1e-39, 5e-324, 1e-4, 0.0009, 100.5, 1e39):
        with pytest.raises(ValueError, match=r"repetition_penalty must be a finite number in \[0.001, 100\]"):
            SamplingParams(repetition_penalty=bad).validate()
    for ok in (1e-3, 0.5, 1.0, 1.3, 100):
        SamplingParams(repetition_penalty=ok).validate()
        # its reciprocal and its products with a large logit stay finite in float32
        assert np.isfinite(np.float32(1) / np.float32(ok)) and np.isfinite(np.float32(1e4) / np.float32(ok))
