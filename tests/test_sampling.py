"""Sampler penalties and logit_bias against a numpy reference; SamplingParams and engine validation."""

from __future__ import annotations

import math
from collections import Counter

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from mlxlocal.engine import PagedEngine, SamplingParams, open_engine
from mlxlocal.engine.sampling import Sampler
from mlxlocal.source.loader import load_from_dir

V = 64


def reference_logprobs(logits: np.ndarray, prompt: list[int], generated: list[int], p: SamplingParams) -> np.ndarray:
    """The documented order over the full vocabulary, with explicit counts: repetition
    penalty (last 20 tokens, prompt included), frequency/presence (generated only), bias."""
    x = logits.astype(np.float64).copy()
    if p.repetition_penalty != 1.0:
        for t in set((prompt + generated)[-20:]):
            x[t] = x[t] * p.repetition_penalty if x[t] < 0 else x[t] / p.repetition_penalty
    counts = np.zeros(len(x))
    for t in generated:
        counts[t] += 1
    x -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
    for t, b in (p.logit_bias or {}).items():
        if t < len(x):
            x[t] += b
    return x - np.log(np.exp(x - x.max()).sum()) - x.max()


def lazy(token: int) -> mx.array:
    """A token the way the paged engine hands it over: an unevaluated array."""
    return mx.argmax(mx.array([[0.0] * token + [1.0] + [0.0] * (V - token - 1)]), axis=-1)


CASES = [
    SamplingParams(frequency_penalty=0.7),
    SamplingParams(presence_penalty=1.3),
    SamplingParams(frequency_penalty=-0.5, presence_penalty=2.0),
    SamplingParams(frequency_penalty=1.1, presence_penalty=-0.4, repetition_penalty=1.3,
                   logit_bias={3: 5.0, 9: -100.0, 40: 0.25, V + 5: 50.0}),
    SamplingParams(logit_bias={0: 1.5, 63: -2.0}),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_sampler_matches_numpy_reference_over_a_pipelined_run(case):
    """Called as the paged engine calls it: the history only grows, and from the second
    step on the last token is still a lazy `pending` array not yet in the history."""
    p = CASES[case]
    rng = np.random.default_rng(case)
    prompt = [int(t) for t in rng.integers(0, V, 30)]
    # Few distinct ids, so tokens repeat (and repeat prompt tokens, which must not count).
    generated = [int(t) for t in rng.choice([1, 3, 9, int(prompt[0]), 40], 25)]
    sampler = Sampler(p)
    history = list(prompt)
    for step in range(len(generated) + 1):
        logits = rng.normal(0, 3, (1, V)).astype(np.float32)
        pending = lazy(generated[step - 1]) if step else None
        token, logprobs = sampler(mx.array(logits), history, pending)
        expected = reference_logprobs(logits[0], prompt, generated[:step], p)
        np.testing.assert_allclose(np.array(logprobs[0]), expected, atol=2e-4)
        assert int(token.item()) == int(np.argmax(expected))  # temperature 0: greedy
        if step:
            history.append(generated[step - 1])


def test_sampler_counts_from_a_given_prompt_length_and_without_pending():
    """prompt_len marks where generation starts; a history handed over whole (no pending,
    as after a preemption or from a non-pipelined caller) counts the same."""
    p = SamplingParams(frequency_penalty=0.9, presence_penalty=0.6)
    prompt, generated = [5, 5, 6, 7], [5, 8, 8, 8, 2]
    logits = np.random.default_rng(7).normal(0, 2, (1, V)).astype(np.float32)
    _, got = Sampler(p, prompt_len=len(prompt))(mx.array(logits), prompt + generated)
    np.testing.assert_allclose(np.array(got[0]), reference_logprobs(logits[0], prompt, generated, p), atol=2e-4)


def test_pending_token_already_seen_gets_frequency_but_not_presence_twice():
    p = SamplingParams(frequency_penalty=1.0, presence_penalty=10.0)
    sampler = Sampler(p)
    zeros = mx.zeros((1, V))
    sampler(zeros, [1, 2])  # the prompt
    _, lp = sampler(zeros, [1, 2, 4], lazy(4))  # 4 generated twice: the known one and the pending one
    _, lp2 = Sampler(p, prompt_len=2)(zeros, [1, 2, 4, 4])
    raw = np.array(lp[0]) - np.array(lp[0])[0]  # relative to an untouched id
    assert raw[4] == pytest.approx(-(2 * 1.0 + 10.0), abs=1e-4)
    assert raw[1] == pytest.approx(0.0, abs=1e-5) and raw[2] == pytest.approx(0.0, abs=1e-5)  # prompt only
    np.testing.assert_allclose(np.array(lp[0]), np.array(lp2[0]), atol=1e-5)


def test_logit_bias_decides_greedy_choice():
    logits = mx.array(np.random.default_rng(3).normal(0, 3, (1, V)).astype(np.float32))
    best = int(mx.argmax(logits).item())
    worst = int(mx.argmin(logits).item())
    token, _ = Sampler(SamplingParams(logit_bias={worst: 100.0}))(logits, [1])
    assert int(token.item()) == worst
    token, _ = Sampler(SamplingParams(logit_bias={best: -100.0}))(logits, [1])
    assert int(token.item()) != best
    # Sampling too: with the bias the forbidden token never comes up.
    sampler = Sampler(SamplingParams(temperature=1.0, seed=1, logit_bias={best: -100.0}))
    assert all(int(sampler(logits, [1])[0].item()) != best for _ in range(50))


def test_sampler_never_raises_for_extreme_valid_params():
    logits = mx.array(np.random.default_rng(4).normal(0, 3, (1, V)).astype(np.float32))
    extremes = [
        SamplingParams(seed=2**63 - 1, temperature=1.0, top_k=2**31 - 1),
        SamplingParams(seed=0, temperature=1e-30, top_p=1e-9, min_p=1.0),
        SamplingParams(temperature=100.0, frequency_penalty=2.0, presence_penalty=-2.0,
                       logit_bias={V - 1: 100.0, 10**9: -100.0}),
    ]
    for p in extremes:
        p.validate()
        sampler = Sampler(p)
        for step in range(3):
            token, logprobs = sampler(logits, [1, 2, 3] + [5] * step, lazy(5))
            t = int(token.item())
            assert 0 <= t < V and not np.isnan(np.array(logprobs)).any(), p


# --- validation ------------------------------------------------------------------------
BAD = [
    (dict(seed=-1), "seed"), (dict(seed=2**63), "seed"), (dict(seed=2**64), "seed"),
    (dict(seed=True), "seed"), (dict(seed=1.5), "seed"),
    (dict(temperature=math.nan), "temperature"), (dict(temperature=math.inf), "temperature"),
    (dict(temperature=-0.1), "temperature"), (dict(temperature=101), "temperature"),
    (dict(temperature=True), "temperature"),
    (dict(top_p=0), "top_p"), (dict(top_p=1.01), "top_p"), (dict(top_p=math.nan), "top_p"),
    (dict(min_p=-0.1), "min_p"), (dict(min_p=1.5), "min_p"),
    (dict(top_k=-1), "top_k"), (dict(top_k=2**70), "top_k"), (dict(top_k=2.0), "top_k"),
    (dict(top_k=False), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=2**31), "max_tokens"),
    (dict(max_tokens=True), "max_tokens"),
    (dict(repetition_penalty=0), "repetition_penalty"), (dict(repetition_penalty=math.inf), "repetition_penalty"),
    (dict(frequency_penalty=2.5), "frequency_penalty"), (dict(frequency_penalty=math.nan), "frequency_penalty"),
    (dict(presence_penalty=-2.01), "presence_penalty"), (dict(presence_penalty=True), "presence_penalty"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"), (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(logit_bias={True: 1.0}), "logit_bias"), (dict(logit_bias={5: 101.0}), "logit_bias"),
    (dict(logit_bias={5: math.nan}), "logit_bias"), (dict(logit_bias={5: True}), "logit_bias"),
    (dict(logit_bias={i: 1.0 for i in range(1025)}), "logit_bias"), (dict(logit_bias=[(5, 1.0)]), "logit_bias"),
    (dict(stop=[str(i) for i in range(17)]), "stop"), (dict(stop=[""]), "stop"), (dict(stop="abc"), "stop"),
    (dict(stop=[None]), "stop"),
    (dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"), (dict(logprobs=True), "logprobs"),
    (dict(ignore_eos="yes"), "ignore_eos"),
]


@pytest.mark.parametrize(("bad", "field"), BAD, ids=[f"{k}" for k, _ in BAD])
def test_bad_params_raise_naming_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad).validate()


def test_edge_values_pass():
    SamplingParams(seed=0, temperature=100, top_p=1, min_p=1, top_k=2**31 - 1, max_tokens=2**31 - 1,
                   frequency_penalty=-2, presence_penalty=2, logprobs=20, stop=["x"] * 16,
                   logit_bias={i: (-100 if i % 2 else 100) for i in range(1024)}).validate()
    SamplingParams(seed=2**63 - 1, logprobs=0, logit_bias={}).validate()


# --- on an engine -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def loaded(tiny_model):
    return load_from_dir(tiny_model)


@pytest.fixture
def engine(loaded):
    eng = open_engine(loaded, block_size=16, kv_blocks=64)
    assert isinstance(eng, PagedEngine)
    yield eng
    eng.shutdown()


@pytest.fixture(params=["paged", "mlx-lm path"])
def any_engine(request, tiny_model, gemma_model):
    """(engine, model dir) for both engines."""
    path = tiny_model if request.param == "paged" else gemma_model
    eng = open_engine(load_from_dir(path), block_size=16, kv_blocks=64)
    assert isinstance(eng, PagedEngine)  # mlx-lm models run paged too
    yield eng, path
    eng.shutdown()


def greedy(engine, prompt, n=40, **kw) -> list[int]:
    chunks = list(engine.submit(prompt, SamplingParams(max_tokens=n, ignore_eos=True, **kw)))
    assert chunks[-1].finish_reason == "length"
    return [c.token for c in chunks if c.token is not None]


PROMPT = [(i * 37 + 11) % 300 for i in range(12)]


def test_frequency_penalty_reduces_repeats_on_a_real_model(any_engine):
    engine, _ = any_engine
    plain = greedy(engine, PROMPT)
    penalized = greedy(engine, PROMPT, frequency_penalty=2.0)
    top = Counter(plain).most_common(1)[0][1]
    assert top >= 4, plain  # the random model loops without a penalty
    assert Counter(penalized).most_common(1)[0][1] < top, (plain, penalized)
    # (presence_penalty is checked against mlx-lm below: on the gemma model, whose logits are
    # larger, 2.0 alone does not break the loop.)
    assert len(set(penalized)) > len(set(plain))


def test_engine_penalties_match_mlx_lm_with_a_reference_processor(any_engine):
    """End to end through each engine (the paged one pipelined, pending tokens and all)
    against mlx-lm's plain loop with the penalties written as a logits processor."""
    engine, path = any_engine
    model = mlx_lm.load(str(path))[0]
    freq, pres, bias = 0.8, 0.5, {17: 3.0, 200: -4.0}
    # The prompt ends with what the model likes to say next: counting it would show.
    prompt = PROMPT + greedy(engine, PROMPT, n=8)

    def processor(tokens: mx.array, logits: mx.array) -> mx.array:
        gen = np.array(tokens)[len(prompt):]
        counts = np.bincount(gen, minlength=logits.shape[-1]).astype(np.float32)
        adj = -(freq * counts + pres * (counts > 0))
        for t, b in bias.items():
            adj[t] += b
        return logits + mx.array(adj)

    expected = [int(t) for t, _ in generate_step(
        mx.array(prompt), model, max_tokens=30, sampler=lambda x: mx.argmax(x, axis=-1),
        logits_processors=[processor])]
    got = greedy(engine, prompt, n=30, frequency_penalty=freq, presence_penalty=pres, logit_bias=bias)
    assert got == expected


def test_logit_bias_on_the_engine(any_engine):
    engine, _ = any_engine
    assert greedy(engine, PROMPT, n=6, logit_bias={123: 100.0}) == [123] * 6
    plain = greedy(engine, PROMPT, n=6)
    assert plain[0] not in greedy(engine, PROMPT, n=6, logit_bias={plain[0]: -100.0})


@pytest.mark.parametrize(("prompt", "kw", "message"), [
    (PROMPT, dict(top_k=385), "top_k.*384"),
    (PROMPT, dict(logit_bias={384: 1.0}), "logit_bias.*384"),
    ([1, 2, 384], {}, "prompt token ids.*384"),
    ([1, -1, 2], {}, "prompt token ids"),
    (PROMPT, dict(seed=-1), "seed"),
    (PROMPT, dict(seed=2**64), "seed"),
    (PROMPT, dict(temperature=math.nan), "temperature"),
])
def test_engine_rejects_at_submit_and_keeps_running(engine, prompt, kw, message):
    with pytest.raises(ValueError, match=message):
        engine.submit(prompt, SamplingParams(max_tokens=3, ignore_eos=True, **kw))
    # Rejected before queueing: no engine thread was started, nothing is waiting.
    assert engine._thread is None and engine._queued == 0
    assert len(greedy(engine, PROMPT, n=3, top_k=384, logit_bias={383: 1.0})) == 3
    with pytest.raises(ValueError, match=message):
        engine.submit(prompt, SamplingParams(max_tokens=3, ignore_eos=True, **kw))
    assert engine.stats()["waiting"] == 0 and len(greedy(engine, PROMPT, n=3)) == 3
