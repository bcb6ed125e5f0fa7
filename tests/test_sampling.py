"""Sampler penalties and logit_bias against a numpy reference; sample_batch against the Sampler; SamplingParams and engine validation."""

from __future__ import annotations

import math
import random
from collections import Counter

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import generate_step

from mlxlocal.engine import PagedEngine, SamplingParams, open_engine, sampling
from mlxlocal.engine.sampling import MIN_TEMPERATURE, Sampler, sample_batch
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
        SamplingParams(seed=0, temperature=1e-30, top_p=1e-8, min_p=1.0),
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


# --- sample_batch against the per-request Sampler ----------------------------------------
def one_by_one(samplers, logits, histories, pendings):
    """What the per-request path gives: (tokens, logprob lists) as plain Python values."""
    tokens, lps = [], []
    for i, s in enumerate(samplers):
        token, lp = s(logits[i : i + 1], histories[i], pendings[i])
        tokens.append(int(token.item()))
        k = s.params.logprobs
        row = []
        if k is not None:
            row.append(mx.take_along_axis(lp, token.reshape(1, 1), axis=-1).item())
            if k:
                top = mx.argsort(-lp, axis=-1)[:, :k]
                row += [top.tolist(), mx.take_along_axis(lp, top, axis=-1).tolist()]
        lps.append(row)
    return tokens, lps


def batched(samplers, logits, histories, pendings):
    tokens, lps = sample_batch(samplers, logits, histories, pendings)
    assert tokens.shape == (len(samplers),)
    return tokens.tolist(), [[a.item() if j == 0 else a.tolist() for j, a in enumerate(row)] for row in lps]


def mixed_params(seed: int, vocab: int) -> SamplingParams:
    r = random.Random(seed)
    kw: dict = dict(seed=seed, temperature=r.choice([0.0, 1e-6, 0.3, 0.7, 1.0, 1.5, 5.0]))
    if r.random() < 0.5:
        kw["top_p"] = r.choice([0.1, 0.5, 0.9, 0.99, 1.0])
    if r.random() < 0.3:
        kw["min_p"] = r.choice([0.01, 0.1, 0.5, 1.0])
    if r.random() < 0.4:
        kw["top_k"] = r.choice([1, 5, 40, vocab - 1, vocab, vocab + 10])
    if r.random() < 0.2:
        kw["repetition_penalty"] = 1.3
    if r.random() < 0.2:
        kw.update(frequency_penalty=0.7, presence_penalty=0.4)
    if r.random() < 0.2:
        kw["logit_bias"] = {3: 5.0, 7: -100.0}
    if r.random() < 0.4:
        kw["logprobs"] = r.choice([0, 1, 5, 20])
    return SamplingParams(**kw)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_sample_batch_matches_per_request_samplers(dtype):
    """Mixed batches (greedy, sampled, filters, penalties, bias, logprobs) over pipelined
    steps; each step a different subset in a different order, as requests come and go, so
    keys are gathered from several earlier batches. Tokens and logprobs must be equal."""
    vocab, n = 256, 24
    rng = random.Random(dtype == mx.bfloat16)
    params = [mixed_params(1000 * (dtype == mx.bfloat16) + i, vocab) for i in range(n)]
    assert {p.temperature < MIN_TEMPERATURE for p in params} == {True, False}
    alone, together = [Sampler(p) for p in params], [Sampler(p) for p in params]
    histories = [[rng.randrange(vocab) for _ in range(8)] for _ in range(n)]
    pendings: list = [None] * n
    for step in range(12):
        rows = rng.sample(range(n), rng.randint(1, n)) if step % 3 else list(range(n))
        scale = rng.choice([1.0, 4.0, 10.0])
        logits = (mx.random.normal((len(rows), vocab), key=mx.random.key(step)) * scale).astype(dtype)
        if step % 4 == 2:
            logits = mx.round(logits)  # ties, which top-k and argsort must break alike
        args = ([histories[i] for i in rows], [pendings[i] for i in rows])
        expected = one_by_one([alone[i] for i in rows], logits, *args)
        got = batched([together[i] for i in rows], logits, *args)
        assert got == expected, (step, [params[i] for i in rows])
        for i, t in zip(rows, got[0]):
            if pendings[i] is not None:
                histories[i].append(int(pendings[i].item()))
            pendings[i] = lazy(t) if t < V else mx.array([t], mx.uint32)


def test_sample_batch_many_seeds_at_a_large_vocabulary():
    vocab = 32000
    params = [SamplingParams(seed=s, temperature=0.7, top_p=0.9) for s in range(12)]
    params += [SamplingParams(seed=s, temperature=1.0, logprobs=3) for s in range(12, 20)]
    params += [SamplingParams(logprobs=2), SamplingParams(seed=5, temperature=0.8, top_k=50, min_p=0.05)]
    alone, together = [Sampler(p) for p in params], [Sampler(p) for p in params]
    history = [[1, 2, 3]] * len(params)
    for step in range(3):
        logits = mx.random.normal((len(params), vocab), key=mx.random.key(50 + step)) * 3
        expected = one_by_one(alone, logits, history, [None] * len(params))
        assert batched(together, logits, history, [None] * len(params)) == expected
        assert len(set(expected[0][:20])) > 10  # really sampled, not one token for all


def test_seeded_request_samples_the_same_alone_and_in_any_batch():
    p = SamplingParams(seed=77, temperature=1.0, top_p=0.95)
    others = [SamplingParams(seed=s, temperature=t) for s, t in ((1, 0.5), (2, 0.0), (3, 2.0), (4, 0.7))]
    solo, crowd = Sampler(p), [Sampler(q) for q in others]
    crowd.insert(2, Sampler(p))
    seq_alone, seq_batched = [], []
    for step in range(20):
        row = mx.random.normal((1, V), key=mx.random.key(step))
        seq_alone.append(batched([solo], row, [[1]], [None])[0][0])
        logits = mx.concatenate([mx.random.normal((2, V), key=mx.random.key(99 + step)), row,
                                 mx.random.normal((2, V), key=mx.random.key(199 + step))])
        seq_batched.append(batched(crowd, logits, [[1]] * 5, [None] * 5)[0][2])
    assert seq_alone == seq_batched
    assert len(set(seq_alone)) > 5
    other = Sampler(SamplingParams(seed=78, temperature=1.0, top_p=0.95))
    assert [batched([other], mx.random.normal((1, V), key=mx.random.key(s)), [[1]], [None])[0][0]
            for s in range(20)] != seq_alone  # the seed matters


def test_filter_edges_match_their_plain_counterparts():
    """top_k >= vocab and top_p = 1 filter nothing; min_p = 1 keeps only the best; a
    temperature below MIN_TEMPERATURE is greedy and leaves the key where it was."""
    logits = mx.random.normal((1, V), key=mx.random.key(3))
    best = int(mx.argmax(logits).item())

    def draws(**kw):
        s = Sampler(SamplingParams(seed=11, **kw))
        return [batched([s], logits, [[1]], [None])[0][0] for _ in range(30)]
    plain = draws(temperature=1.0)
    assert len(set(plain)) > 5
    assert draws(temperature=1.0, top_k=V) == plain
    assert draws(temperature=1.0, top_k=V + 100) == plain
    assert draws(temperature=1.0, top_p=1.0) == plain
    assert draws(temperature=1.0, min_p=1.0) == [best] * 30
    assert draws(temperature=1.0, top_k=1) == [best] * 30
    assert set(draws(temperature=1.0, top_k=3)) <= set(np.argsort(-np.array(logits[0]))[:3].tolist())
    s = Sampler(SamplingParams(seed=11, temperature=MIN_TEMPERATURE / 2))
    key = np.array(s.key)
    assert [batched([s], logits, [[1]], [None])[0][0] for _ in range(5)] == [best] * 5
    assert (np.array(s.key) == key).all()


def test_draw_at_the_ends_of_the_unit_interval():
    """u = 0 picks the first token with any weight (masked ones before it are skipped),
    u -> 1 the last; a row of all-equal infinite maxima draws among them."""
    ninf = -float("inf")
    x = mx.array([[ninf, ninf, 0.5, ninf, 0.1, ninf], [ninf, ninf, 0.5, ninf, 0.1, ninf],
                  [ninf, float("inf"), 0.0, float("inf"), 1.0, ninf]])
    u = mx.array([[0.0], [1.0 - 2**-24], [0.9]])
    assert sampling._draw(x, u).tolist() == [2, 4, 3]


def test_steady_batch_reuses_its_keys_and_a_failed_call_keeps_them(monkeypatch):
    samplers = [Sampler(SamplingParams(seed=s, temperature=0.9)) for s in range(4)]
    logits = mx.random.normal((4, V), key=mx.random.key(0))
    sample_batch(samplers, logits, [[1]] * 4, [None] * 4)
    keys = samplers[0]._keys
    assert all(s._keys is keys for s in samplers) and [s._row for s in samplers] == [0, 1, 2, 3]
    # The same batch next step hands that array on as is (no gather, no per-row slice);
    # a batch of another order or subset gathers it.
    monkeypatch.setattr(Sampler, "key", property(lambda s: pytest.fail("per-row key slice")))
    assert sampling._stack_keys(samplers) is keys
    assert np.array(sampling._stack_keys(samplers[::-1])).tolist() == np.array(keys)[::-1].tolist()
    monkeypatch.undo()

    def boom(*args):
        raise RuntimeError("late failure")
    before = [np.array(s.key).tolist() for s in samplers]
    monkeypatch.setattr(sampling, "_logprob_rows", boom)
    with pytest.raises(RuntimeError, match="late failure"):
        sample_batch(samplers, logits, [[1]] * 4, [None] * 4)
    assert [np.array(s.key).tolist() for s in samplers] == before


def test_engine_batched_sampling_matches_one_by_one(engine, monkeypatch):
    """Concurrent mixed requests through the engine: the batched path (Sampler.__call__
    made to fail, so nothing falls back unseen) against the one-by-one fallback."""
    kinds = [dict(), dict(temperature=0.8, seed=1, logprobs=3), dict(temperature=1.2, top_p=0.9, seed=2),
             dict(temperature=0.7, top_k=20, min_p=0.05, seed=3, logprobs=0),
             dict(frequency_penalty=1.0, logit_bias={5: 2.0}, temperature=0.9, seed=4), dict(logprobs=2)]

    def run() -> list:
        handles = [engine.submit([(i * 31 + j * 7) % 300 for j in range(10)],
                                 SamplingParams(max_tokens=16, ignore_eos=True, **kw))
                   for i, kw in enumerate(kinds)]
        return [[(c.token, c.logprob, c.top_logprobs) for c in h if c.token is not None] for h in handles]

    def refuse(*args, **kwargs):
        raise AssertionError("per-request path used")
    with monkeypatch.context() as m:
        m.setattr(Sampler, "__call__", refuse)
        got = run()
    with monkeypatch.context() as m:
        m.setattr(sampling, "sample_batch", refuse)  # the engine falls back to one by one
        expected = run()
    assert got == expected
    assert all(len(r) == 16 for r in got) and got[1][0][1] is not None and len(got[1][0][2]) == 3


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
    before = engine.tokens_in
    with pytest.raises(ValueError, match=message):
        engine.submit(prompt, SamplingParams(max_tokens=3, ignore_eos=True, **kw))
    # Rejected before queueing: nothing reached the engine thread (stats() is a round trip
    # through it, after anything posted before), nothing is waiting.
    assert engine.stats()["waiting"] == 0 and engine.tokens_in == before and engine._queued == 0
    assert len(greedy(engine, PROMPT, n=3, top_k=384, logit_bias={383: 1.0})) == 3
    with pytest.raises(ValueError, match=message):
        engine.submit(prompt, SamplingParams(max_tokens=3, ignore_eos=True, **kw))
    assert engine.stats()["waiting"] == 0 and len(greedy(engine, PROMPT, n=3)) == 3
