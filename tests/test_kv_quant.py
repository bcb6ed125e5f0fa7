"""Quantized KV pools (--kv-bits): storage against mx.quantize, greedy parity with mlx-lm's
QuantizedKVCache, batching / prefix sharing / sessions / preemption / cache edits against
runs built another way, capacity, perplexity and the CLI options."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from akv_reference import MaskedKV, Reference
from conftest import BASE, FAMILY_CONFIGS, build_tiny
from engine_util import assert_no_leak, prompt_of
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache, make_prompt_cache
from test_akv_engine import inv_freq_of
from test_paged import paused, tokens_of
from typer.testing import CliRunner

from mlxlocal.cache import KVPools, KVShape, StepBatch
from mlxlocal.cli import app
from mlxlocal.engine import (
    CacheEdit,
    EngineConfig,
    OutOfCapacity,
    PagedEngine,
    SamplingParams,
    open_engine,
)
from mlxlocal.source.loader import load_from_dir

# head_dim 64: the group sizes MLX quantizes by (32 / 64 / 128) must divide it.
WIDE = dict(hidden_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=64)
PROMPT = [(i * 37 + 11) % 300 for i in range(40)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kvq")
    # seed 1: this llama's greedy text varies (and 4-bit K/V changes it), a stronger check
    # than a model repeating one token.
    return {"native": build_tiny(root / "llama", dict(FAMILY_CONFIGS["llama"], **WIDE), template="llama3", seed=1),
            "mlx_lm": build_tiny(root / "gemma", dict(BASE, **WIDE, model_type="gemma", rope_theta=10000.0), seed=1)}


@pytest.fixture(scope="module")
def native(models):
    return load_from_dir(models["native"])


def greedy(eng, prompt, n, session=None, edits=None):
    """(tokens, logprobs of the chosen tokens)."""
    chunks = list(eng.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0),
                               session=session, edits=edits))
    toks = [c for c in chunks if c.token is not None]
    return [c.token for c in toks], [c.logprob for c in toks]


def engine(loaded, **kw):
    return PagedEngine(loaded, EngineConfig(**{"block_size": 16, "kv_blocks": 64, **kw}))


# --- (a) storage --------------------------------------------------------------------------
def one_step(blocks: list[int], L: int, bs: int = 16) -> StepBatch:
    return StepBatch(positions=0, slot_blocks=mx.array([blocks[t // bs] for t in range(L)]),
                     slot_offsets=mx.array([t % bs for t in range(L)]),
                     block_tables=mx.array([blocks]), context_lens=mx.array([L]), host_context_lens=[L])


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group_size", [32, 64])
def test_write_gather_round_trip_equals_mx_quantize(bits, group_size):
    H, D, L = 2, 64, 20
    pools = KVPools(KVPools.uniform(1, H, D), 8, 16, mx.float16, bits=bits, group_size=group_size)
    k = mx.random.normal((1, H, L, D), key=mx.random.key(1)).astype(mx.float16)
    v = mx.random.normal((1, H, L, D), key=mx.random.key(2)).astype(mx.float16)
    batch = one_step([5, 2], L)  # not a run: the gather goes through the table
    pools.write(0, batch, k, v)
    # One more token through the single-token (host slot) path.
    k1 = mx.random.normal((1, H, 1, D), key=mx.random.key(3)).astype(mx.float16)
    pools.write(0, StepBatch(positions=L, slot_blocks=mx.array([2]), slot_offsets=mx.array([L - 16]),
                             block_tables=mx.array([[5, 2]]), context_lens=mx.array([L + 1]),
                             host_context_lens=[L + 1], host_slot=(2, L - 16)), k1, k1)
    gk, gv = pools.gather(0, one_step([5, 2], L + 1))
    want = lambda x: mx.dequantize(*mx.quantize(x, group_size=group_size, bits=bits),  # noqa: E731
                                   group_size=group_size, bits=bits)
    assert gk.shape == (1, H, L + 1, D) and gk.dtype == mx.float16
    assert mx.array_equal(gk, want(mx.concatenate([k, k1], axis=2)))
    assert mx.array_equal(gv[:, :, :L], want(v))
    # ... and it is lossy: not the fp16 rows themselves.
    assert not mx.array_equal(gk[:, :, :L], k)
    packed, scales, biases = pools.k[0]
    assert packed.dtype == mx.uint32 and packed.shape == (H, 8, 16, D * bits // 32)
    assert scales.shape == biases.shape == (H, 8, 16, D // group_size) and scales.dtype == mx.float16


@pytest.mark.parametrize("bits, limit", [(8, 0.532), (4, 0.30)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_memory_per_token_against_fp16(bits, limit, head_dim):
    # 8-bit group 64: (64 bytes + fp16 scale + bias) / 128 bytes = 0.53125 of fp16, whatever D.
    shapes = KVPools.uniform(2, 4, head_dim)
    fp = KVPools(shapes, 10, 16, mx.float16)
    q = KVPools(shapes, 10, 16, mx.float16, bits=bits, group_size=64)
    assert q.nbytes / fp.nbytes <= limit
    assert q.nbytes == 10 * KVPools.bytes_per_block(shapes, 16, mx.float16, bits, 64)
    assert fp.nbytes == 10 * KVPools.bytes_per_block(shapes, 16, mx.float16)


@pytest.mark.parametrize("kw, names", [
    (dict(bits=3), ["kv_bits", "--kv-bits"]),
    (dict(bits=8, group_size=48), ["kv_group_size", "--kv-group-size"]),
    (dict(bits=4, group_size=64, dim=16), ["kv_group_size", "head_dim 16"]),
    (dict(bits=8, group_size=128, dim=96), ["head_dim 96", "use 32"]),
])
def test_bad_precision_raises_naming_the_option(kw, names):
    dim = kw.pop("dim", 64)
    with pytest.raises(ValueError) as e:
        KVPools(KVPools.uniform(1, 2, dim), 4, 16, mx.float32, **kw)
    assert all(n in str(e.value) for n in names), str(e.value)


def test_copy_block_and_move_rows_with_rotation():
    H, D = 2, 64
    pools = KVPools([KVShape(H, D, H, D)] * 2, 6, 16, mx.float32, bits=8, group_size=64)
    k = mx.random.normal((1, H, 32, D), key=mx.random.key(4))
    for layer in range(2):
        pools.write(layer, one_step([1, 3], 32), k * (layer + 1), -k)
    pools.copy_block(3, 5)
    for layer in range(2):
        for a, b in zip(pools.k[layer] + pools.v[layer], pools.k[layer] + pools.v[layer]):
            assert mx.array_equal(a[:, 5], b[:, 3])
    before = [pools.gather(i, one_step([1, 3], 32)) for i in range(2)]
    # Move rows 0..3 of block 1 to block 4, re-rotating rows 1 and 2 by a known function.
    fn = lambda layer, keys, old, new: keys * 2 + new[:, None, None]  # noqa: E731
    src = mx.array([1, 1, 1, 1])
    pools.move_rows(src, mx.arange(4), mx.array([4] * 4), mx.array([7, 8, 9, 10]),
                    rotate=(mx.array([1, 2]), mx.array([1, 2]), mx.array([5, 6]), fn))
    for layer in range(2):
        ks, vs = pools.gather(layer, one_step([4], 11))
        old_k, old_v = before[layer]
        assert mx.array_equal(ks[:, :, 7], old_k[:, :, 0]) and mx.array_equal(ks[:, :, 10], old_k[:, :, 3])
        rotated = fn(layer, old_k[0, :, 1:3].transpose(1, 0, 2), None, mx.array([5, 6]))
        want = mx.dequantize(*mx.quantize(rotated, group_size=64, bits=8), group_size=64, bits=8)
        assert mx.array_equal(ks[0, :, 8:10].transpose(1, 0, 2), want)
        assert mx.array_equal(vs[:, :, 7:11], old_v[:, :, :4])  # values are copied as they are


# --- (b) parity with mlx-lm's quantized KV cache --------------------------------------------
def mlx_lm_quantized(model_dir: Path, prompt: list[int], n: int, bits: int | None):
    """mlx-lm's own model over QuantizedKVCaches from the first token on. (generate_step's
    kv_bits converts its cache after the first prefill chunk, so that chunk would attend to
    unquantized keys; our pools store every row quantized, so the caches are given here.)"""
    model = mlx_lm.load(str(model_dir))[0]
    cache = [QuantizedKVCache(64, bits) for _ in make_prompt_cache(model)] if bits else None
    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1),
                          prompt_cache=cache)
    out = [(int(t), lp) for t, lp in steps]
    return [t for t, _ in out], [lp[t].item() for t, lp in out]


@pytest.mark.parametrize("which", ["native", "mlx_lm"])
@pytest.mark.parametrize("bits", [8, 4])
def test_greedy_parity_with_mlx_lm_quantized_kv(models, which, bits):
    want, want_lp = mlx_lm_quantized(models[which], PROMPT, 16, bits)
    eng = open_engine(load_from_dir(models[which]), kv_bits=bits, kv_group_size=64, kv_tokens=256)
    try:
        assert eng.kv_pool["kv_bits"] == bits
        got, got_lp = greedy(eng, PROMPT, 16)
    finally:
        eng.shutdown()
    assert got == want
    # Same stored values; mlx-lm attends with quantized matmuls, we dequantize then sdpa.
    assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) < 2e-3


def test_mlx_lm_path_attends_over_packed_kv(models, monkeypatch):
    """An mlx-lm model whose attention takes a cache with `bits` gets its K/V packed (mlx-lm's
    quantized sdpa), never dequantized per step; one that cannot, dequantized ones."""
    from mlxlocal.cache import KVPools

    decoded = []
    real = KVPools._decode
    monkeypatch.setattr(KVPools, "_decode", lambda self, xs: decoded.append(1) or real(self, xs))
    want, _ = mlx_lm_quantized(models["mlx_lm"], PROMPT, 8, 8)
    eng = open_engine(load_from_dir(models["mlx_lm"]), kv_bits=8, kv_group_size=64, kv_tokens=256)
    try:
        assert greedy(eng, PROMPT, 8)[0] == want
        assert eng.runner.layout.takes_packed(8, 64) and not decoded
    finally:
        eng.shutdown()
    # A model whose code handles the keys as arrays: the probe says so, and they are decoded.
    eng = open_engine(load_from_dir(models["mlx_lm"]), kv_bits=8, kv_group_size=64, kv_tokens=256)
    try:
        eng.runner.layout._packed[(8, 64)] = False
        assert greedy(eng, PROMPT, 8)[0] == want and decoded
    finally:
        eng.shutdown()


def test_quantization_changes_the_output(models):
    """The parity above is not vacuous: 4-bit K/V moves this model's logprobs far more than
    the parity tolerance (and its greedy text within 24 tokens)."""
    fp, fp_lp = mlx_lm_quantized(models["native"], PROMPT, 24, None)
    q4, q4_lp = mlx_lm_quantized(models["native"], PROMPT, 24, 4)
    assert fp != q4
    k = next(i for i, (a, b) in enumerate(zip(fp, q4)) if a != b)
    assert max(abs(a - b) for a, b in zip(fp_lp[:k], q4_lp[:k])) > 1e-2


class FakeQuantRotating(RotatingKVCache):
    """mlx-lm cannot quantize a RotatingKVCache: this one stores each row quantized and
    dequantized (what our window layers' pools give back), for the gemma3 reference."""

    kv_bits = 8  # not `bits`: mlx-lm takes a cache with `bits` for a quantized one

    def update_and_fetch(self, keys, values):
        fake = lambda x: mx.dequantize(*mx.quantize(x, group_size=64, bits=self.kv_bits),  # noqa: E731
                                       group_size=64, bits=self.kv_bits)
        return super().update_and_fetch(fake(keys), fake(values))


@pytest.mark.parametrize("bits", [8, 4])
def test_sliding_window_layers_are_quantized_too(tmp_path, bits):
    """gemma3 (sliding-window layers of 32 tokens and global ones) with kv_bits: every pool is
    a triple, and greedy tokens equal mlx-lm's model over QuantizedKVCache (global layers) and
    fake-quantized rotating caches (window layers), past several window lengths."""
    d = build_tiny(tmp_path / "gemma3", dict(BASE, **WIDE, model_type="gemma3_text", sliding_window=32,
                                             sliding_window_pattern=2, query_pre_attn_scalar=64,
                                             rope_theta=1e6, rope_local_base_freq=1e4), seed=1)
    model = mlx_lm.load(str(d))[0]
    caches = []
    for c in model.make_cache():
        if isinstance(c, RotatingKVCache):
            caches.append(FakeQuantRotating(max_size=c.max_size, keep=c.keep))
            caches[-1].kv_bits = bits
        else:
            caches.append(QuantizedKVCache(64, bits))
    prompt = [(i * 37 + 11) % 300 for i in range(100)]
    steps = generate_step(mx.array(prompt), model, max_tokens=40, sampler=lambda x: mx.argmax(x, axis=-1),
                          prompt_cache=caches)
    want = [(int(t), lp[int(t)].item()) for t, lp in steps]
    eng = open_engine(load_from_dir(d), kv_bits=bits, kv_tokens=512)
    try:
        assert any(eng.pools.windowed) and all(isinstance(p, tuple) for p in eng.pools.k + eng.pools.v)
        got = greedy(eng, prompt, 40)
        assert_no_leak(eng)
    finally:
        eng.shutdown()
    assert got[0] == [t for t, _ in want]
    assert max(abs(a - b) for a, (_, b) in zip(got[1], want)) < 2e-3


# --- (c) batching, prefix sharing, sessions, preemption, cache edits --------------------------
def prompts_of(n: int) -> list[list[int]]:
    return [prompt_of(20 + 3 * s, shift=s) for s in range(n)]


def each_alone(native, bits: int, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Greedy tokens of each prompt run alone on a fresh engine without sharing (the reference)."""
    solo = []
    for p in prompts:
        fresh = engine(native, kv_bits=bits, prefix_cache=False)
        solo.append(greedy(fresh, p, n)[0])
        fresh.shutdown()
    return solo


def test_batch_of_8_equals_each_alone(native):
    prompts = prompts_of(8)
    solo = each_alone(native, 8, prompts, 12)
    eng = engine(native, kv_bits=8, max_num_seqs=8)
    try:
        with paused(eng):
            handles = [eng.submit(p, SamplingParams(max_tokens=12, ignore_eos=True)) for p in prompts]
        assert [tokens_of(h) for h in handles] == solo
        assert_no_leak(eng)
    finally:
        eng.shutdown()


def test_prefix_sharing_with_a_partial_block_copy(native):
    first = PROMPT + [7, 8, 9]  # 43 tokens: its reply leaves a partial last block cached
    second = PROMPT[:37] + [200, 201, 202, 203]  # matches 2 full blocks + 5 rows of the third
    eng = engine(native, kv_bits=4)
    try:
        greedy(eng, first, 8)
        chunks = list(eng.generate(second, SamplingParams(max_tokens=10, ignore_eos=True)))
        assert chunks[-1].stats.cached_tokens == 37  # 32 shared + 5 copied from a partial block
        got = [c.token for c in chunks if c.token is not None]
        assert_no_leak(eng)
    finally:
        eng.shutdown()
    cold = engine(native, kv_bits=4, prefix_cache=False)
    try:
        assert got == greedy(cold, second, 10)[0]
    finally:
        cold.shutdown()


def test_session_turns_equal_the_whole_conversation_cold(native):
    eng = engine(native, kv_bits=8)
    try:
        session = eng.new_session()
        t1, _ = greedy(eng, PROMPT, 6, session=session)
        turn2 = PROMPT + t1 + [55, 66, 77]
        t2, _ = greedy(eng, turn2, 8, session=session)
        assert eng.stats()["prefix_hit_tokens"] >= len(PROMPT)
        session.reset()
    finally:
        eng.shutdown()
    cold = engine(native, kv_bits=8, prefix_cache=False)
    try:
        assert t2 == greedy(cold, turn2, 8)[0]
    finally:
        cold.shutdown()


def test_preemption_on_a_small_quantized_pool(native):
    prompts = prompts_of(6)
    solo = each_alone(native, 4, prompts, 30)
    eng = engine(native, kv_bits=4, kv_blocks=8)
    try:
        with paused(eng):
            handles = [eng.submit(p, SamplingParams(max_tokens=30, ignore_eos=True)) for p in prompts]
        assert [tokens_of(h) for h in handles] == solo
        assert sum(h.seq.preemptions for h in handles) > 0
        assert_no_leak(eng)
    finally:
        eng.shutdown()


class QuantizedMaskedKV(MaskedKV):
    """The AKV reference's dense cache, its K/V rows quantized and dequantized as they arrive
    (per token over the head dim: what the pools store)."""

    bits = 8

    def attend(self, q, k, v, scale):
        fake = lambda x: mx.dequantize(*mx.quantize(x, group_size=64, bits=self.bits),  # noqa: E731
                                       group_size=64, bits=self.bits)
        return super().attend(q, fake(k), fake(v), scale)


@pytest.mark.parametrize("bits", [8, 4])
def test_drop_and_reposition_equal_a_quantized_dense_reference(native, bits):
    """Drop + reposition on quantized pools equals a dense cache of fake-quantized rows whose
    moved keys were re-rotated in float64 numpy, then quantized again (as the pools do)."""
    prompt = [(i * 37 + 11) % 300 for i in range(90)]
    drop, at, moved = (20, 37), 70, (37, 70)
    eng = engine(native, kv_bits=bits)
    try:
        got = greedy(eng, prompt, 6, edits=[CacheEdit(at=at, drop=(drop,), reposition=(moved,), close_tail=True)])
        assert_no_leak(eng)
    finally:
        eng.shutdown()
    ref = Reference(native.model)
    ref.kv = [QuantizedMaskedKV() for _ in native.model.layers]
    for kv in ref.kv:
        kv.bits = bits
    ref.feed(prompt[:at])
    ref.drop(list(range(*drop)))
    new = {s: s - (drop[1] - drop[0]) for s in range(*moved)}
    ref.reposition(new, inv_freq_of(native.model), next_pos=max(new.values()) + 1)
    for kv in ref.kv:  # the re-rotated keys stored quantized again
        rows = mx.array(sorted(new))
        kv.k[:, :, rows] = mx.dequantize(*mx.quantize(kv.k[:, :, rows], group_size=64, bits=bits),
                                         group_size=64, bits=bits)
    logits = ref.feed(prompt[at:])
    toks, lps = [], []
    for _ in range(6):
        lp = logits - mx.logsumexp(logits)
        toks.append(int(mx.argmax(lp)))
        lps.append(lp[toks[-1]].item())
        logits = ref.feed([toks[-1]])
    assert got[0] == toks
    assert max(abs(a - b) for a, b in zip(got[1], lps)) < 1e-2


# --- (d) capacity ---------------------------------------------------------------------------
def test_same_memory_holds_more_blocks_and_sequences(native):
    budget = 64 * KVPools.bytes_per_block(KVPools.uniform(2, 1, 64), 16, mx.float32) // 4  # 16 fp blocks
    blocks = {}
    for bits in (None, 8, 4):
        eng = engine(native, kv_blocks=None, kv_memory=budget, kv_bits=bits)
        blocks[bits] = eng.num_blocks
        assert eng.pools.nbytes <= budget
        eng.shutdown()
    assert blocks[8] >= 1.8 * blocks[None] and blocks[4] >= 3 * blocks[None]
    # One long request: refused unquantized, served at 8 bits in the same memory.
    long = [(i * 7 + 3) % 300 for i in range(300)]
    fp = engine(native, kv_blocks=None, kv_memory=budget)
    with pytest.raises(OutOfCapacity):
        fp.submit(long, SamplingParams(max_tokens=4))
    fp.shutdown()
    # Four concurrent sequences of 4 blocks each: preempted unquantized, all resident at 4 bits.
    preempted = {}
    for bits in (None, 4):
        eng = engine(native, kv_blocks=None, kv_memory=budget, kv_bits=bits, max_num_seqs=4)
        with paused(eng):
            hs = [eng.submit(p, SamplingParams(max_tokens=40, ignore_eos=True)) for p in prompts_of(4)]
        [tokens_of(h) for h in hs]
        preempted[bits] = sum(h.seq.preemptions for h in hs)
        eng.shutdown()
    assert preempted[None] > 0 and preempted[4] == 0
    q8 = engine(native, kv_blocks=None, kv_memory=budget, kv_bits=8)
    try:
        assert len(greedy(q8, long, 4)[0]) == 4
    finally:
        q8.shutdown()


# --- (e) perplexity -----------------------------------------------------------------------------
def test_perplexity_with_quantized_kv(models):
    runner = CliRunner()
    out = {}
    for bits in (None, 8, 4):
        args = ["perplexity", "-m", str(models["native"]), "--seq-len", "64", "--batch-size", "4", "--json"]
        res = runner.invoke(app, args + (["--kv-bits", str(bits)] if bits else []))
        assert res.exit_code == 0, res.output
        out[bits] = json.loads(res.stdout.strip().splitlines()[-1])
        assert out[bits]["kv_bits"] == bits
    assert all(np.isfinite(o["perplexity"]) for o in out.values())
    d8 = abs(out[8]["nll"] - out[None]["nll"])
    d4 = abs(out[4]["nll"] - out[None]["nll"])
    assert 0 < d8 < d4


def test_paged_perplexity_scores_as_mlx_lm_caches_do(models):
    """The pools path with no bits scores as the model's own cache does (so the --kv-bits
    delta is the quantization's alone), and with bits as mlx-lm's QuantizedKVCache does, for
    a native and an mlx-lm-path model."""
    from mlxlocal.engine import PagedScorer

    for which in ("native", "mlx_lm"):
        loaded = load_from_dir(models[which])
        windows = mx.array([[(i * 13 + s) % 300 for i in range(40)] for s in range(3)])
        dense = loaded.model(windows, loaded.make_cache())
        paged = PagedScorer(loaded, 3, 40, None).logits(windows)
        assert mx.allclose(dense, paged, atol=1e-4).item(), which
        # With bits: mlx-lm's model over its QuantizedKVCache, the whole batch of windows.
        model = mlx_lm.load(str(models[which]))[0]
        for bits in (8, 4):
            want = model(windows, cache=[QuantizedKVCache(64, bits) for _ in make_prompt_cache(model)])
            got = PagedScorer(loaded, 3, 40, bits).logits(windows)
            assert mx.allclose(got, want, atol=2e-3).item(), (which, bits)
            assert not mx.allclose(got, dense, atol=2e-3).item(), (which, bits)


# --- (f) CLI ------------------------------------------------------------------------------------
@pytest.mark.parametrize("cmd", [["generate", "-p", "hi"], ["chat"], ["serve"], ["bench"], ["perplexity"],
                                 ["run", "--mcp", "mcp.json", "task"]])
@pytest.mark.parametrize("opt, value", [("--kv-bits", "3"), ("--kv-group-size", "48")])
def test_bad_kv_options_exit_2_naming_the_option(models, cmd, opt, value):
    args = [*cmd[:1], "-m", str(models["native"]), *cmd[1:], opt, value]
    if opt == "--kv-group-size":
        args += ["--kv-bits", "8"]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2, res.output
    assert opt in res.output


def test_head_dim_the_group_size_does_not_divide_exits_2(tiny_model):
    res = CliRunner().invoke(app, ["generate", "-m", str(tiny_model), "-p", "hi", "-n", "2", "--kv-bits", "8"])
    assert res.exit_code == 2, res.output
    assert "--kv-group-size" in res.output and "head_dim 16" in res.output


def test_generate_json_reports_the_kv_precision(models):
    res = CliRunner().invoke(app, ["generate", "-m", str(models["native"]), "-p", "hello", "-n", "3",
                                   "--kv-bits", "4", "--kv-group-size", "32", "--json", "--ignore-eos"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["kv_bits"] == 4 and len(out["tokens"]) == 3


def test_show_lists_kv_bytes_per_token_per_precision(models, tiny_model):
    res = CliRunner().invoke(app, ["show", str(models["native"])])
    assert res.exit_code == 0, res.output
    # 2 layers x K and V x 1 kv head x head_dim 64: fp32 1 KiB; 8-bit 64 B + fp32 scale and
    # bias per row = 72 B (x4 = 288 B); 4-bit 32 + 8 = 40 B (x4 = 160 B).
    row = next(line for line in res.output.splitlines() if "KV per token" in line)
    assert "1.00 KiB" in row and "288 B" in row and "160 B" in row, row
    res = CliRunner().invoke(app, ["show", str(tiny_model)])  # head_dim 16: no group divides it
    assert "8-bit: not with this model" in res.output


def test_bench_kv_bits_reads_quantized_kv_per_token(models):
    """bench --kv-bits runs the speed section on quantized pools: its roofline counts the
    quantized bytes per token (2 layers x K and V x 72 B at 8 bits, fp32 scales)."""
    args = ["bench", "-m", str(models["native"]), "-p", "16", "-g", "4", "-n", "1", "--warmup", "0",
            "--bandwidth", "100", "--json"]
    out = {}
    for bits in (None, 8):
        res = CliRunner().invoke(app, args + (["--kv-bits", str(bits)] if bits else []))
        assert res.exit_code == 0, res.output
        out[bits] = json.loads(res.stdout.strip().splitlines()[-1])
    assert out[8]["kv_bits"] == 8 and out[None]["kv_bits"] is None
    assert out[None]["speed"]["roofline"]["kv_bytes_per_token"] == 2 * 2 * 64 * 4
    assert out[8]["speed"]["roofline"]["kv_bytes_per_token"] == 2 * 2 * 72
