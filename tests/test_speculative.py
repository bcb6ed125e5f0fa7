"""Speculative decoding in the paged engine: greedy outputs identical to plain decoding for
every drafter, batch 1 and 8, native and mlx-lm-path models; self-draft accepts everything;
the sampler keeps the target distribution (chi-square against the model's own
probabilities, computed by mlx-lm's model code); rollback leaves the pool as it was."""

from __future__ import annotations

import math
import threading

import mlx.core as mx
import mlx_lm
import pytest
from conftest import FAMILY_CONFIGS, build_tiny
from engine_util import assert_no_leak, prompt_of

from mlxlocal.engine import SamplingParams, SpeculativeConfig, open_engine
from mlxlocal.engine.speculative import PAUSE, LookupIndex, SpecState, accept_drafts
from mlxlocal.source.loader import load

REPEAT = [5, 6, 7, 8, 9, 10, 11, 12] * 6  # lookup finds its continuation
N = 32


def gen(eng, prompt, n=N, **kw):
    chunks = list(eng.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True, **kw)))
    return [c.token for c in chunks if c.token is not None], chunks[-1].stats


def gen_many(eng, prompts, n=N, **kw):
    """All prompts submitted at once (one decode batch), tokens per prompt."""
    handles = [eng.submit(p, SamplingParams(max_tokens=n, ignore_eos=True, **kw)) for p in prompts]
    return [[c.token for c in h if c.token is not None] for h in handles]


@pytest.fixture(scope="module")
def target(tiny_models):
    return load(str(tiny_models["qwen3"]))


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """Same tokenizer, other weights: a draft that is often wrong."""
    return load(str(build_tiny(tmp_path_factory.mktemp("draft") / "d", FAMILY_CONFIGS["qwen3"], seed=7)))


@pytest.fixture(scope="module")
def plain(target):
    eng = open_engine(target, kv_blocks=256)
    yield eng
    eng.shutdown()


def drafters(target, other_draft):
    return {
        "lookup": SpeculativeConfig("lookup"),
        "self-draft": SpeculativeConfig("draft", draft=target),
        "other-draft": SpeculativeConfig("draft", draft=other_draft, num_draft_tokens=3),
    }


@pytest.mark.parametrize("drafter", ["lookup", "self-draft", "other-draft"])
def test_greedy_identical_batch_1_and_8(target, other_draft, plain, drafter):
    eng = open_engine(target, kv_blocks=256, speculative=drafters(target, other_draft)[drafter])
    prompts = [REPEAT] + [prompt_of(20 + 7 * i, shift=i) for i in range(7)]
    want = [gen(plain, p)[0] for p in prompts]
    for p, w in zip(prompts[:2], want):
        got, stats = gen(eng, p)
        assert got == w
        assert stats.draft_tokens > 0 and 0 <= stats.accepted_tokens <= stats.draft_tokens
        if drafter == "self-draft":
            assert stats.accepted_tokens == stats.draft_tokens  # the target drafting for itself
    assert gen_many(eng, prompts) == want
    st = eng.stats()
    assert st["spec_steps"] > 0 and st["spec_drafted"] >= st["spec_accepted"] > 0
    if drafter == "self-draft":
        assert st["spec_accepted"] == st["spec_drafted"]
    if drafter == "other-draft":
        assert st["spec_accepted"] < st["spec_drafted"]  # rejections happened and were rolled back
    assert_no_leak(eng)
    eng.shutdown()


def test_speculation_verifies_several_tokens_per_forward(target, plain):
    """Mechanism, not speed: on repeated text each verify forward yields more than one token."""
    eng = open_engine(target, kv_blocks=256, speculative=SpeculativeConfig("lookup", num_draft_tokens=6))
    tokens, stats = gen(eng, REPEAT, n=48)
    assert tokens == gen(plain, REPEAT, n=48)[0]
    st = eng.stats()
    assert (stats.accepted_tokens + st["spec_steps"]) / st["spec_steps"] > 2
    eng.shutdown()


@pytest.mark.parametrize("model", ["llama", "mistral"])
def test_native_families(tiny_models, model):
    loaded = load(str(tiny_models[model]))
    plain, eng = open_engine(loaded, kv_blocks=128), open_engine(loaded, kv_blocks=128,
                                                                 speculative=SpeculativeConfig("draft", draft=loaded))
    prompts = [REPEAT, prompt_of(33)]
    assert gen_many(eng, prompts) == gen_many(plain, prompts)
    assert eng.stats()["spec_accepted"] == eng.stats()["spec_drafted"] > 0
    plain.shutdown()
    eng.shutdown()


@pytest.mark.parametrize("name", ["gemma", "gemma3", "hybrid"])
def test_mlx_lm_path_models(gemma_model, mlx_lm_models, name):
    """mlx-lm's model code: plain (gemma), sliding-window layers (gemma3), and a hybrid whose
    recurrent state is rolled back to before the verify forward when a draft is rejected."""
    path = gemma_model if name == "gemma" else mlx_lm_models[name]
    loaded = load(str(path))
    plain = open_engine(loaded, kv_blocks=128)
    prompts = [REPEAT] + [prompt_of(19 + 3 * i, shift=i) for i in range(7)]  # a decode batch of 8
    want = gen_many(plain, prompts)
    for cfg in (SpeculativeConfig("lookup"), SpeculativeConfig("draft", draft=loaded)):
        if name != "gemma" and cfg.method == "draft":  # a draft must be plain attention
            with pytest.raises(ValueError, match="recurrent or sliding-window"):
                open_engine(loaded, kv_blocks=128, speculative=cfg)
            continue
        eng = open_engine(loaded, kv_blocks=128, speculative=cfg)
        assert gen_many(eng, prompts) == want
        assert [gen(eng, p)[0] for p in prompts[:3]] == want[:3]
        assert eng.stats()["spec_steps"] > 0
        assert_no_leak(eng)
        eng.shutdown()
    plain.shutdown()


def test_opt_out_logprobs_stops_and_limits(target, plain):
    eng = open_engine(target, kv_blocks=256, speculative=SpeculativeConfig("lookup"))
    tokens, stats = gen(eng, REPEAT, speculative=False)
    assert tokens == gen(plain, REPEAT)[0] and stats.draft_tokens == 0 and eng.stats()["spec_steps"] == 0
    # Logprobs of accepted drafts are the target's own at their positions.
    a = list(eng.generate(REPEAT, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3)))
    b = list(plain.generate(REPEAT, SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3)))
    assert a[-1].stats.accepted_tokens > 0
    for x, y in zip(a, b):
        assert x.token == y.token
        if x.token is not None:
            assert x.logprob == pytest.approx(y.logprob, abs=1e-4)
            assert [t for t, _ in x.top_logprobs] == [t for t, _ in y.top_logprobs]
    # max_tokens and stop strings cut inside an accepted draft exactly where plain decoding stops.
    for n in (1, 2, 5, 7):
        assert gen(eng, REPEAT, n=n)[0] == gen(plain, REPEAT, n=n)[0]
    full = "".join(c.text for c in plain.generate(REPEAT, SamplingParams(max_tokens=N, ignore_eos=True)))
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    if stop.strip():
        texts = ["".join(c.text for c in e.generate(REPEAT, SamplingParams(max_tokens=N, ignore_eos=True,
                                                                         stop=[stop]))) for e in (eng, plain)]
        assert texts[0] == texts[1]
    assert_no_leak(eng)
    eng.shutdown()


def test_draft_with_another_vocabulary_is_refused(target, tmp_path):
    other = load(str(build_tiny(tmp_path / "v", dict(FAMILY_CONFIGS["qwen3"], vocab_size=320))))
    with pytest.raises(ValueError, match="cannot draft for"):
        open_engine(target, speculative=SpeculativeConfig("draft", draft=other))


def test_prefix_cache_sessions_and_preemption(target, plain):
    """The draft's K/V follows the target's blocks: shared prefixes, copied partial blocks,
    session turns and recomputation after preemption all keep self-draft acceptance at 100%."""
    eng = open_engine(target, kv_blocks=20, max_num_seqs=8, speculative=SpeculativeConfig("draft", draft=target))
    prompts = [prompt_of(40 + i, shift=i % 3) for i in range(8)]  # shared prefixes, partial blocks
    assert gen_many(eng, prompts, n=24) == gen_many(plain, prompts, n=24)
    session = eng.new_session()
    chunks = list(eng.generate(REPEAT, SamplingParams(max_tokens=10, ignore_eos=True), session=session))
    turn1 = [c.token for c in chunks if c.token is not None]
    turn2_prompt = REPEAT + turn1 + [3, 4, 5]
    chunks = list(eng.generate(turn2_prompt, SamplingParams(max_tokens=10, ignore_eos=True), session=session))
    assert chunks[-1].stats.cached_tokens > 0
    assert [c.token for c in chunks if c.token is not None] == gen(plain, turn2_prompt, n=10)[0]
    session.reset()
    st = eng.stats()
    assert st["spec_accepted"] == st["spec_drafted"] > 0
    assert_no_leak(eng)
    eng.shutdown()


def test_draft_length_adapts_and_pauses_after_misses():
    state = SpecState(4)
    state.adapt(4, 4, 6)
    assert state.k == 6  # all accepted: doubles, up to the maximum
    state.adapt(6, 2, 6)
    assert state.k == 3  # one more than was accepted
    for _ in range(3):
        state.adapt(state.k, 0, 6)
    assert state.k == 1 and state.pause == PAUSE  # three misses in a row: plain steps for a while


def test_a_missing_drafter_pauses_and_keeps_outputs(target, other_draft, plain):
    """A draft that is (almost) never right stops drafting for PAUSE steps after MISSES misses:
    fewer verify steps than tokens, outputs unchanged."""
    eng = open_engine(target, kv_blocks=128, speculative=SpeculativeConfig("draft", draft=other_draft))
    prompt = prompt_of(30)  # on this prompt the other draft's guesses all miss
    tokens, stats = gen(eng, prompt, n=64)
    assert tokens == gen(plain, prompt, n=64)[0]
    assert stats.draft_tokens > 0 and stats.accepted_tokens == 0
    # Three misses, PAUSE plain steps, three misses, ...: about 3 verify steps in every 19.
    assert eng.stats()["spec_steps"] <= 64 * 3 // (3 + PAUSE) + 3
    eng.shutdown()


def test_lookup_index():
    idx = LookupIndex(1, 3)  # one sequence's index, extended as its tokens grow
    assert idx.propose([1, 2, 3, 4], 3) == []
    assert idx.propose([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]  # the suffix [1, 2] was followed by 3, 4
    assert idx.propose([1, 2, 3, 4, 1, 2, 5, 1, 2], 2) == [5, 1]  # the latest earlier occurrence
    assert LookupIndex(1, 3).propose([7, 7, 7, 7], 4) == [7, 7, 7, 7]  # a short period repeats
    assert LookupIndex(2, 3).propose([4, 7, 9, 7], 3) == []  # 1-grams are below the minimum


# --- the sampler keeps the distribution ----------------------------------------------------
# Chi-square critical values at p = 0.001 (df 1..30): a correct sampler fails one run in 1000.
CHI2_999 = [10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26, 32.91, 34.53,
            36.12, 37.70, 39.25, 40.79, 42.31, 43.82, 45.31, 46.80, 48.27, 49.73, 51.18, 52.62, 54.05,
            55.48, 56.89, 58.30, 59.70]


def chi_square(counts: dict[int, int], probs: dict[int, float]) -> tuple[float, int]:
    """Goodness of fit, outcomes with expected count < 5 pooled into one bin."""
    total = sum(counts.values())
    stat, df, rest_o, rest_e = 0.0, -1, 0.0, 0.0
    for t, p in probs.items():
        e = p * total
        if e < 5:
            rest_o, rest_e = rest_o + counts.get(t, 0), rest_e + e
            continue
        stat += (counts.get(t, 0) - e) ** 2 / e
        df += 1
    if rest_e > 0:
        stat += (rest_o - rest_e) ** 2 / rest_e
        df += 1
    return stat, df


@pytest.mark.parametrize("q_kind", ["one-hot", "draft"])
def test_rejection_sampler_keeps_p(q_kind):
    """accept_drafts alone: emitted token 1 and 2 over many draws follow p exactly (the
    second conditionally on the first), with a draft distribution q far from p."""
    V, K, trials = 6, 2, 20000
    p = mx.array([[0.05, 0.4, 0.1, 0.2, 0.15, 0.1], [0.3, 0.1, 0.1, 0.1, 0.2, 0.2], [0.1] * 5 + [0.5]])[None]
    q = mx.array([[0.6, 0.05, 0.05, 0.1, 0.1, 0.1], [0.1, 0.1, 0.5, 0.1, 0.1, 0.1]])[None]
    key = mx.random.key(3)
    k1, k2, k3 = mx.random.split(key, 3)
    if q_kind == "draft":
        drafts = mx.stack([mx.random.categorical(mx.log(q[0, j]), shape=(trials,), key=k) for j, k in
                           enumerate(mx.random.split(k1, K))], axis=1)
        qb = mx.broadcast_to(q, (trials, K, V))
    else:  # a deterministic proposal: always 0 then 2
        drafts, qb = mx.broadcast_to(mx.array([[0, 2]]), (trials, K)), None
    pb = mx.broadcast_to(p, (trials, K + 1, V))
    accepted, token = accept_drafts(pb, qb, drafts, [K] * trials, mx.random.uniform(shape=(trials, K), key=k2),
                                    mx.random.uniform(shape=(trials, K + 1), key=k3))
    accepted, token, drafts = accepted.tolist(), token.tolist(), drafts.tolist()
    first, second = {}, {}
    for a, t, d in zip(accepted, token, drafts):
        one = d[0] if a[0] else t[0]
        first[one] = first.get(one, 0) + 1
        if a[0]:  # a rejected first draft ends the step: its second token comes next step
            two = d[1] if a[1] else t[1]
            second[two] = second.get(two, 0) + 1
    p1 = dict(enumerate(p[0, 0].tolist()))
    stat, df = chi_square(first, p1)
    assert stat < CHI2_999[df - 1], (stat, df, first)
    # Given the first token was the accepted draft, the second follows p's second row.
    stat, df = chi_square(second, dict(enumerate(p[0, 1].tolist())))
    assert stat < CHI2_999[df - 1], (stat, df, second)


@pytest.mark.slow
@pytest.mark.parametrize("drafter", ["lookup", "other-draft"])
def test_engine_sampling_keeps_the_model_distribution(target, other_draft, tiny_models, drafter):
    """Sampled through the speculative engine (seeds 0..N), the 2nd and 3rd tokens given the
    ones before follow the model's own distribution, computed by mlx-lm's code on the same
    weights (top_k 4 and temperature 0.8 keep each conditional small enough to count)."""
    cfg = drafters(target, other_draft)[drafter]
    eng = open_engine(target, kv_blocks=256, max_num_seqs=16, speculative=cfg)
    model = mlx_lm.load(str(tiny_models["qwen3"]))[0]
    prompt = REPEAT[:20]
    params = dict(temperature=0.8, top_k=4)
    outs = []
    for start in range(0, 600, 16):
        handles = [eng.submit(prompt, SamplingParams(max_tokens=3, ignore_eos=True, seed=s, **params))
                   for s in range(start, start + 16)]
        outs += [[c.token for c in h if c.token is not None] for h in handles]
    assert eng.stats()["spec_drafted"] > 0
    assert_follows_the_model(model, prompt, outs, params["temperature"], params["top_k"])
    eng.shutdown()


def assert_follows_the_model(model, prompt: list[int], outs: list[list[int]], temperature: float,
                             top_k: int) -> None:
    """The 2nd and 3rd sampled tokens, given the ones before, follow the model's own top-k
    distribution at `temperature` (each conditional seen >= 40 times counts)."""
    stat, df = 0.0, 0
    by_prefix: dict[tuple, dict[int, int]] = {}
    for out in outs:
        for j in (1, 2):
            counts = by_prefix.setdefault(tuple(out[:j]), {})
            counts[out[j]] = counts.get(out[j], 0) + 1
    for prefix, counts in by_prefix.items():
        if sum(counts.values()) < 40:
            continue
        logits = model(mx.array([prompt + list(prefix)]))[0, -1].astype(mx.float32) / temperature
        top = mx.argsort(-logits)[:top_k].tolist()
        w = mx.softmax(logits[mx.array(top)]).tolist()
        s, d = chi_square(counts, dict(zip(top, w)))
        assert set(counts) <= set(top)
        stat, df = stat + s, df + d
    assert df > 0
    # Sum of independent chi-squares: df adds; normal approximation for the 0.001 bound.
    assert stat < df + 3.1 * math.sqrt(2 * df), (stat, df)


def test_cancel_mid_speculation_frees_blocks(target):
    eng = open_engine(target, kv_blocks=64, speculative=SpeculativeConfig("lookup"))
    cancel = threading.Event()
    handle = eng.submit(REPEAT, SamplingParams(max_tokens=400, ignore_eos=True), cancel=cancel)
    chunks = []
    for chunk in handle:
        chunks.append(chunk)
        if len(chunks) == 20:
            cancel.set()
    assert chunks[-1].finish_reason == "cancelled" and len(chunks) < 400
    assert_no_leak(eng)
    eng.shutdown()


@pytest.mark.parametrize("bits", [8, 4])
def test_speculation_over_quantized_kv(tmp_path_factory, bits):
    """Verify forwards read and write quantized pools like any prefill chunk: greedy outputs
    equal plain decoding on the same quantized pools, batch 1 and 8."""
    target = load(str(build_tiny(tmp_path_factory.mktemp("q") / "q", dict(FAMILY_CONFIGS["qwen3"], head_dim=32))))
    q = dict(kv_bits=bits, kv_group_size=32)
    plain = open_engine(target, kv_blocks=128, **q)
    prompts = [REPEAT] + [prompt_of(20 + 5 * i, shift=i) for i in range(7)]
    want = gen_many(plain, prompts)
    for cfg in (SpeculativeConfig("lookup"), SpeculativeConfig("draft", draft=target)):
        eng = open_engine(target, kv_blocks=128, speculative=cfg, **q)
        assert gen_many(eng, prompts) == want
        assert [gen(eng, p)[0] for p in prompts[:2]] == want[:2]
        assert eng.stats()["spec_accepted"] > 0
        assert_no_leak(eng)
        eng.shutdown()
    plain.shutdown()
