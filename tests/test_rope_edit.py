"""Re-rotating cached keys to new rope positions (mlxlocal.cache.rope_edit).

The reference is always the rope module itself (mlx-lm's class, as the model calls it):
keys it produces at the old positions, re-rotated, must equal the keys it produces at the new
positions. Positions differ per row, so a re-rotation that put one offset on a whole block of
tokens fails; they reach past 100k, where fp32 angle rounding is visible.
"""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import hunyuan
from mlx_lm.models.rope_utils import initialize_rope

from mlxlocal.cache.rope_edit import RepositionError, RopeSpec, layer_ropes, rerotate, rope_spec
from mlxlocal.models import build_model

MAX_POS = 131072
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


def _longrope(d: int) -> dict:
    rng = np.random.default_rng(d)
    return {"rope_type": "longrope", "original_max_position_embeddings": 4096,
            "short_factor": [1.0] * (d // 2), "long_factor": (1.0 + 40 * rng.random(d // 2)).tolist()}


# name -> head_dim -> the rope module a model would build for that head_dim.
VARIANTS = {
    "default": lambda d: initialize_rope(d, 1e6, False, None, MAX_POS),
    "default-traditional": lambda d: initialize_rope(d, 1e4, True, None, MAX_POS),
    "linear": lambda d: initialize_rope(d, 1e4, False, {"rope_type": "linear", "factor": 4.0}, MAX_POS),
    "llama3": lambda d: initialize_rope(d, 5e5, False, LLAMA3, MAX_POS),
    "yarn": lambda d: initialize_rope(d, 1e6, False, YARN, MAX_POS),
    "yarn-traditional": lambda d: initialize_rope(d, 1e4, True, dict(YARN, mscale=0.707), MAX_POS),
    "longrope": lambda d: initialize_rope(d, 1e4, False, _longrope(d), MAX_POS),
    "partial": lambda d: nn.RoPE(d // 4, base=1e4),  # only the first quarter of the head rotates
    "proportional": lambda d: initialize_rope(
        d, 1e6, False, {"rope_type": "proportional", "partial_rotary_factor": 0.25}, MAX_POS),
    "ntk-alpha": lambda d: hunyuan.DynamicNTKAlphaRoPE(d, 1e4, scaling_alpha=1000.0),
}
KINDS = {"default-traditional": "default", "yarn-traditional": "yarn", "partial": "default"}
DTYPES = {"fp32": mx.float32, "fp16": mx.float16, "bf16": mx.bfloat16}
N, H = 64, 2


def _positions(seed: int) -> tuple[mx.array, mx.array]:
    """Old and new position per row: random over [0, 131072), plus fixed large and small
    moves (down from ~100k, up to ~100k, short moves at the far end)."""
    rng = np.random.default_rng(seed)
    old = rng.integers(0, MAX_POS, N)
    new = rng.integers(0, MAX_POS, N)
    old[:6] = [99_999, 100_000, 131_071, 3, 0, 77_777]
    new[:6] = [17, 100_001, 65_536, 99_998, 100_000, 77_776]
    return mx.array(old, dtype=mx.int32), mx.array(new, dtype=mx.int32)


def _apply(module, x: mx.array, positions: mx.array) -> mx.array:
    """The module on rows x [N, H, D], row n at positions[n] (tokens on the batch axis)."""
    return module(x[:, :, None, :], offset=positions)[:, :, 0, :]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("variant", VARIANTS)
def test_rerotated_keys_equal_fresh_keys(variant, head_dim, dtype):
    module = VARIANTS[variant](head_dim)
    spec = rope_spec(module)
    assert spec.kind == KINDS.get(variant, variant)
    dt = DTYPES[dtype]
    x = mx.random.normal((N, H, head_dim), key=mx.random.key(head_dim)).astype(dt)
    old, new = _positions(head_dim)
    stored = _apply(module, x, old)
    got = rerotate(stored, old, new, spec)
    fresh = _apply(module, x, new)
    assert got.dtype == dt and got.shape == x.shape
    err = mx.abs(got.astype(mx.float32) - fresh.astype(mx.float32)).max().item()
    if dt == mx.float32:
        # Measured ~5e-7: inverse and forward share their cos/sin, so only rounding remains.
        assert err <= 1e-5, err
    else:
        # stored and fresh each round the rotated value once or twice (the CPU rope computes in
        # the input dtype), and ours rounds once: a few ULP of the largest value, 4 ULP allowed.
        # Measured ~1-2 ULP. A wrong position or a re-applied mscale is off by tens of ULP.
        ulp = 2.0 ** -(10 if dt == mx.float16 else 7)
        bound = 4 * ulp * mx.abs(fresh.astype(mx.float32)).max().item()
        assert err <= bound, (err, bound)


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_half_precision_keys_move_in_fp32(dtype):
    """Half-precision keys are rotated in fp32 and rounded once at the end: bit-identical to
    moving the upcast keys (the tolerance above could not tell fp16 arithmetic apart)."""
    module = VARIANTS["llama3"](128)
    spec = rope_spec(module)
    x = mx.random.normal((N, H, 128), key=mx.random.key(5)).astype(DTYPES[dtype])
    old, new = _positions(5)
    stored = _apply(module, x, old)
    expected = rerotate(stored.astype(mx.float32), old, new, spec).astype(DTYPES[dtype])
    assert mx.array_equal(rerotate(stored, old, new, spec), expected).item()


def test_prefill_block_keys_rerotate():
    """Keys written the way a prefill writes them (one int offset, positions offset + t along
    T) move like keys written one by one."""
    module = VARIANTS["yarn"](128)
    T = 48
    x = mx.random.normal((1, H, T, 128), key=mx.random.key(1))
    stored = module(x, offset=99_000)[0].transpose(1, 0, 2)  # [T, H, D] as the pools hold them
    old = mx.arange(99_000, 99_000 + T, dtype=mx.int32)
    new = mx.arange(12, 12 + T, dtype=mx.int32)
    fresh = module(x, offset=12)[0].transpose(1, 0, 2)
    assert mx.abs(rerotate(stored, old, new, rope_spec(module)) - fresh).max().item() <= 1e-5
    # One offset for the whole block would be the wrong rotation: these rows must each move.
    assert mx.abs(rerotate(stored, old, mx.full((T,), 12), rope_spec(module)) - fresh).max().item() > 0.1


def test_magnitude_factor_is_not_reapplied():
    """YaRN and longrope scale their input; the stored keys carry the factor exactly once."""
    for variant in ("yarn", "longrope"):
        module = VARIANTS[variant](64)
        spec = rope_spec(module)
        assert spec.mscale > 1.05
        x = mx.random.normal((N, H, 64), key=mx.random.key(2))
        old, new = _positions(2)
        stored = _apply(module, x, old)
        # Rotation keeps norms: the stored rows are the inputs scaled by mscale, once.
        ratio = mx.linalg.norm(stored, axis=-1) / mx.linalg.norm(x, axis=-1)
        assert mx.abs(ratio - spec.mscale).max().item() < 1e-5
        moved = rerotate(stored, old, new, spec)
        assert mx.abs(mx.linalg.norm(moved, axis=-1) / mx.linalg.norm(x, axis=-1) - spec.mscale).max().item() < 1e-5


def test_one_delta_rotation_drifts_at_large_positions():
    """Why rerotate undoes and redoes the rotation instead of rotating once by new - old: the
    model's angle is the fp32 product position * frequency, and (new - old) * f is not
    fl(new * f) - fl(old * f). Measured on the CPU backend (head_dim 128, positions <= 131071,
    fp32): inverse + forward max error ~5e-7, one delta rotation ~6e-3."""
    module = VARIANTS["default"](128)
    spec = rope_spec(module)
    x = mx.random.normal((N, H, 128), key=mx.random.key(3))
    old, new = _positions(3)
    stored = _apply(module, x, old)
    fresh = _apply(module, x, new)
    ours = mx.abs(rerotate(stored, old, new, spec) - fresh).max().item()
    delta = mx.abs(_apply(module, stored, new - old) - fresh).max().item()
    assert ours <= 1e-5 and delta > 1e-3 and delta > 100 * ours, (ours, delta)


def test_positions_as_lists_and_validation():
    module = VARIANTS["llama3"](64)
    spec = rope_spec(module)
    x = mx.random.normal((3, H, 64), key=mx.random.key(4))
    stored = _apply(module, x, mx.array([5, 70_000, 9]))
    got = rerotate(stored, [5, 70_000, 9], [0, 1, 2], spec)
    assert mx.abs(got - _apply(module, x, mx.array([0, 1, 2]))).max().item() <= 1e-5
    with pytest.raises(ValueError, match="one position per key row"):
        rerotate(stored, [5, 70_000], [0, 1, 2], spec)
    with pytest.raises(ValueError, match="D >= 64"):
        rerotate(stored[..., :32], [5, 70_000, 9], [0, 1, 2], spec)
    assert rerotate(stored[:0], [], [], spec).shape == (0, H, 64)


def test_dynamic_rope_is_refused():
    from mlx_lm.models import internlm3

    dynamic = initialize_rope(64, 1e4, False, {"rope_type": "dynamic", "factor": 2.0}, 4096)
    for module in (dynamic, internlm3.DynamicNTKScalingRoPE(64, 4096, False, 1e4, 2.0)):
        with pytest.raises(RepositionError, match="DynamicNTKScalingRoPE.*reposition is not possible") as e:
            rope_spec(module)
        assert "sequence length" in str(e.value) and "without reposition still is" in str(e.value)
    assert issubclass(RepositionError, ValueError)


def test_unknown_rope_is_refused():
    class HomegrownRoPE(nn.Module):
        def __call__(self, x, offset=0):
            return x

    class ScaledRoPE(nn.RoPE):  # a subclass may change how positions become angles
        pass

    for module in (HomegrownRoPE(), ScaledRoPE(64)):
        with pytest.raises(RepositionError, match=f"unknown rope module .*{type(module).__name__}"):
            rope_spec(module)


def test_spec_fields():
    s = rope_spec(VARIANTS["linear"](128))
    assert (s.dims, s.traditional, s.base, s.scale, s.freqs) == (128, False, 1e4, 0.25, None)
    s = rope_spec(VARIANTS["llama3"](64))
    assert s.base is None and s.freqs.shape == (32,) and s.scale == 1.0
    s = rope_spec(VARIANTS["yarn-traditional"](64))
    assert s.traditional and s.mscale == pytest.approx((0.1 * 0.707 * math.log(4) + 1))


# Tiny models (random weights, never loaded from disk) for layer_ropes.
BASE = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5, vocab_size=128,
            max_position_embeddings=MAX_POS, tie_word_embeddings=True)
SCALINGS = {"default": None, "linear": {"rope_type": "linear", "factor": 4.0}, "llama3": LLAMA3, "yarn": YARN}


class ShiftedKV:
    """A fresh cache whose first token sits at `offset`: the native LayerKV and mlx-lm's
    KVCache interface at once. Keeps the roped keys [H, T, D] it was handed."""

    def __init__(self, offset: int):
        self.offset = offset
        self.keys: mx.array | None = None

    def attend(self, q, k, v, scale):
        self.keys = k[0]
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal")

    def update_and_fetch(self, k, v):
        self.keys = k[0]
        return k, v

    def make_mask(self, N, return_array=False, window_size=None, **_):
        return nn.MultiHeadAttention.create_additive_causal_mask(N) if return_array else "causal"


def _keys_at(model, tokens: mx.array, offset: int) -> list[mx.array]:
    caches = [ShiftedKV(offset) for _ in model.layers]
    mx.eval(model(tokens[None], cache=caches))
    return [c.keys.transpose(1, 0, 2) for c in caches]  # [T, H, D] rows, as the pools hold them


def _check_model_shift(model, specs: list[RopeSpec | None]) -> None:
    """The whole prompt moved from position 0 to 300: attention scores depend only on position
    differences, so every layer's pre-rope keys are the same and its stored keys must be the
    re-rotated ones (up to the fp32 noise of two forwards)."""
    T, shift = 12, 300
    tokens = mx.arange(3, 3 + T)
    at0, moved = _keys_at(model, tokens, 0), _keys_at(model, tokens, shift)
    old, new = mx.arange(T, dtype=mx.int32), mx.arange(shift, shift + T, dtype=mx.int32)
    for spec, k0, k1 in zip(specs, at0, moved, strict=True):
        # Relative to the keys' size: later layers' keys (|k| up to ~5) carry two forwards' noise.
        bound = 5e-5 * max(1.0, mx.abs(k1).max().item())
        assert mx.abs(rerotate(k0, old, new, spec) - k1).max().item() < bound
        assert mx.abs(k0 - k1).max().item() > 1e-2  # the move itself is not a no-op


@pytest.mark.parametrize("scaling", SCALINGS)
def test_layer_ropes_native(scaling):
    config = dict(BASE, model_type="llama", rope_theta=5e5, rope_scaling=SCALINGS[scaling])
    model, _ = build_model(config, {}, "tiny")
    specs = layer_ropes(model)
    assert len(specs) == 2 and all(s.kind == scaling and s.dims == 32 for s in specs)
    _check_model_shift(model, specs)


def test_layer_ropes_native_dynamic_refused():
    config = dict(BASE, model_type="qwen2", rope_theta=1e6, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    model, _ = build_model(config, {}, "tiny")
    with pytest.raises(RepositionError, match="DynamicNTKScalingRoPE"):
        layer_ropes(model)


def test_layer_ropes_mlx_lm_gemma3():
    """mlx-lm's gemma3: sliding layers rotate with base 1e4, the global layer with 1e6."""
    config = dict(BASE, num_hidden_layers=3, model_type="gemma3_text", sliding_window=32,
                  sliding_window_pattern=3, query_pre_attn_scalar=32, rope_theta=1e6,
                  rope_local_base_freq=1e4)
    model, _ = build_model(config, {}, "tiny")
    specs = layer_ropes(model)
    assert [s.base for s in specs] == [1e4, 1e4, 1e6]
    _check_model_shift(model, specs)


def test_layer_ropes_mlx_lm_nope_layers():
    config = dict(BASE, num_hidden_layers=4, model_type="smollm3", rope_theta=1e6, no_rope_layer_interval=2)
    model, _ = build_model(config, {}, "tiny")
    specs = layer_ropes(model)
    assert [s is None for s in specs] == [False, True, False, True]


def test_layer_ropes_refuses_unmappable_models():
    config = dict(model_type="nemotron_h", vocab_size=128, hidden_size=64, intermediate_size=128,
                  max_position_embeddings=512, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  attention_bias=False, mamba_num_heads=8, mamba_head_dim=16, mamba_proj_bias=False,
                  ssm_state_size=16, conv_kernel=4, n_groups=1, mlp_bias=False, layer_norm_epsilon=1e-5,
                  use_bias=False, use_conv_bias=True, hybrid_override_pattern=["M", "*", "M", "-"])
    model, _ = build_model(config, {}, "tiny")
    with pytest.raises(RepositionError, match="nemotron_h.*reposition is not possible"):
        layer_ropes(model)
