"""RMSNorm and RoPE as compiled kernels (metal/fused.py): the same numbers as mx.fast's, the
measured choice, the kernel modes, and the native model on either path.

On MLX's CPU backend mx.fast falls back to exactly the compositions fused.py compiles, so
there the outputs must be bitwise equal; on Metal (a real fused kernel) within rounding.
"""

from __future__ import annotations

import re
import time

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.rope_utils import initialize_rope

from mlxlocal.metal import dispatch, fused
from mlxlocal.models.kv import DenseKV
from mlxlocal.source.loader import load

DTYPES = [mx.float32, mx.float16, mx.bfloat16]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
ROPES = {
    "default": lambda: initialize_rope(64, 1e6, False),
    "traditional, linear scale": lambda: initialize_rope(64, 1e4, True, {"type": "linear",
                                                                           "factor": 2.0}),
    "partial rotary": lambda: nn.RoPE(32, traditional=False, base=5e5),
    "llama3": lambda: initialize_rope(64, 5e5, False, LLAMA3, 131072),
}


def same(a: mx.array, b: mx.array) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    if mx.metal.is_available():
        tol = 1e-5 if a.dtype == mx.float32 else 1e-2
        assert mx.allclose(a.astype(mx.float32), b.astype(mx.float32), atol=tol, rtol=tol).item()
    else:
        gap = float(mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max())
        assert mx.array_equal(a, b).item(), gap


def labels(*arrays: mx.array, tmp_path) -> list[str]:
    path = tmp_path / "graph.dot"
    mx.export_to_dot(str(path), *arrays)
    return re.findall(r'label\s*=\s*"([A-Za-z_]+)', path.read_text())


@pytest.fixture
def mode(monkeypatch):
    """Set the kernel mode for one test; the choices start empty and are put back after."""
    monkeypatch.delenv(dispatch.ENV, raising=False)
    saved = dict(fused.choices.made)
    fused.reset()
    yield dispatch.set_mode
    dispatch.set_mode(None)
    fused.reset()
    fused.choices.made.update(saved)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 128), (8, 1, 64), (1, 37, 128), (2, 4, 3, 32)])
def test_rms_norm_matches_mx_fast(dtype, shape):
    x = (mx.random.normal(shape, key=mx.random.key(1)) * 3).astype(dtype)
    w = mx.random.normal(shape[-1:], key=mx.random.key(2)).astype(dtype)
    same(fused._compiled_rms(x, w, mx.array(1e-6, mx.float32)), mx.fast.rms_norm(x, w, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", list(ROPES))
def test_rope_matches_mx_fast(kind, dtype):
    module = ROPES[kind]()
    args = fused.RopeArgs.of(module)
    assert args is not None
    x = mx.random.normal((3, 4, 5, 64), key=mx.random.key(3)).astype(dtype)
    # An int offset, one offset per row, then the same values in a new array, then another int:
    # the angles are kept per step, and a stale one must never be reused.
    for offset in (7, mx.array([3, 100, 5000]), mx.array([4, 0, 9]), 7, 11):
        same(args.fused(x, offset), module(x, offset=offset))


def test_layers_with_equal_ropes_share_the_angles_of_a_step(tmp_path):
    a, b = fused.RopeArgs.of(nn.RoPE(32, base=1e6)), fused.RopeArgs.of(nn.RoPE(32, base=1e6))
    assert a is b and fused.RopeArgs.of(nn.RoPE(32, base=1e4)) is not a
    offset = mx.array([5, 9])
    q, k = mx.zeros((2, 4, 1, 32)), mx.zeros((2, 2, 1, 32))
    ops = labels(a.fused(q, offset), b.fused(k, offset), tmp_path=tmp_path)
    assert ops.count("Cos") + sum("Cos" in o for o in ops if o.startswith("Compiled")) == 1


def test_ropes_we_do_not_rotate_stay_with_their_module():
    yarn = initialize_rope(64, 1e4, False, {"type": "yarn", "factor": 4.0,
                                             "original_max_position_embeddings": 4096}, 16384)
    assert fused.RopeArgs.of(yarn) is None

    class Shifted(nn.RoPE):  # a subclass may change how positions become angles
        pass
    assert fused.RopeArgs.of(Shifted(32)) is None


def test_the_choice_is_measured_once_and_follows_the_faster(mode):
    mode(None)
    calls = []

    def timer(fn):
        calls.append(fn)
        return 1e-5 if len(calls) % 2 else 3e-5  # the first of each pair (compiled) is faster

    choices = fused.Choices(timer)
    assert choices.fused(("rms_norm", 64, "float32", 1), lambda: mx.zeros(1), lambda: mx.zeros(1))
    assert len(calls) == 2 * fused.REPEATS
    assert choices.fused(("rms_norm", 64, "float32", 1), lambda: mx.zeros(1), lambda: mx.zeros(1))
    assert len(calls) == 2 * fused.REPEATS  # remembered, not timed again
    slow = fused.Choices(lambda fn: 1.0 if fn.__name__ == "compiled" else 0.5)

    def compiled():
        return mx.zeros(1)
    assert not slow.fused(("rope", 32, "float16", 8), compiled, lambda: mx.zeros(1))
    plan = slow.plan()
    assert plan == [{"op": "rope", "key": {"M": 8, "D": 32, "dtype": "float16"},
                     "path": fused.BUILTIN, "how": "measured", "ours_us": 1e6, "mlx_us": 5e5}]


def test_a_slow_op_is_timed_a_few_calls_not_dozens(mode):
    """Prefill-sized ops take milliseconds a call: timed 8 x 3 times per repeat, the first
    request of a server waited seconds for the choice (4.5 s on the tiny model here)."""
    mode(None)
    made = {"slow": 0, "fast": 0}

    def op(name: str, ms: float):
        def fn():
            made[name] += 1
            time.sleep(ms / 1e3)  # at build time: the call's cost, whatever the backend
            return mx.zeros(1)
        return fn
    fused.Choices().fused(("sdpa", 32, "float32", 4, 2, 128, 512), op("slow", 3), op("fast", 2))
    assert made["slow"] == made["fast"] == 1 + fused.REPEATS  # warmed once, then once a repeat
    assert fused.seconds(op("fast", 0)) < fused.SLOW_CALL_S
    assert made["fast"] == (1 + fused.REPEATS) + (1 + 1 + 8 * 3)  # a fast one: batched, as before


@pytest.mark.parametrize("forced", ["ours", "mlx"])
def test_kernel_modes_force_a_side_without_measuring(mode, forced, tmp_path):
    mode(forced)
    x, w = mx.ones((2, 1, 64)), mx.ones((64,))
    args = fused.RopeArgs.of(nn.RoPE(64))
    ops = labels(fused.rms_norm(x, w, 1e-5), fused.rope(args, mx.ones((2, 4, 1, 64)), 3),
                 tmp_path=tmp_path)
    compiled = [o for o in ops if o.startswith("Compiled")]
    assert bool(compiled) == (forced == "ours")
    assert fused.choices.made == {}


def test_auto_measures_per_width_dtype_and_rows(mode):
    mode("auto")
    w = mx.ones((64,))
    for rows in (1, 2, 3, 4):
        fused.rms_norm(mx.ones((rows, 64)), w, 1e-5)
    fused.rms_norm(mx.ones((1, 64), mx.float16), w.astype(mx.float16), 1e-5)
    assert sorted(fused.choices.made) == [("rms_norm", 64, "float16", 1),
                                          ("rms_norm", 64, "float32", 1),
                                          ("rms_norm", 64, "float32", 2),
                                          ("rms_norm", 64, "float32", 4)]


def test_native_model_gives_the_same_logits_on_either_path(mode, tiny_model):
    model = load(str(tiny_model)).model
    tokens = mx.array([[5, 9, 200, 17, 3, 3, 41]], mx.uint32)
    out = {}
    for forced in ("mlx", "ours"):
        mode(forced)
        cache = [DenseKV() for _ in model.layers]
        prefill = model(tokens, cache)
        decode = model(mx.array([[12]], mx.uint32), cache)  # offset 7: one rope per layer and step
        out[forced] = (prefill, decode)
    for a, b in zip(out["ours"], out["mlx"]):
        same(a, b)


def test_the_engine_plan_lists_the_norms_and_ropes(mode, tiny_model):
    from mlxlocal.engine import EngineConfig, kernel_plan

    mode("auto")
    plan = kernel_plan(load(str(tiny_model)), EngineConfig(max_num_seqs=4))
    got = {(c["op"], c["key"]["M"], c["key"]["D"]) for c in plan if c["op"] in ("rms_norm", "rope")}
    # The tiny qwen3: hidden 64 and head_dim norms (q/k norm), 4 query heads of 16 dims.
    assert {(op, m) for op, m, _ in got} >= {("rms_norm", 1), ("rms_norm", 2), ("rms_norm", 4),
                                            ("rope", 4), ("rope", 8), ("rope", 16)}
    assert all(c["path"] in (fused.FUSED, fused.BUILTIN) and c["ours_us"] > 0 for c in plan
               if c["op"] in ("rms_norm", "rope"))


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (8, 2)])
def test_attention_with_keys_transposed_matches_mx_fast(heads, dtype):
    from mlxlocal.metal.attention import step_mask

    (hq, hkv), B, L, S = heads, 2, 6, 40
    q, k, v = (mx.random.normal(shape, key=mx.random.key(i)).astype(dtype)
               for i, shape in enumerate([(B, hq, L, 16), (B, hkv, S, 16), (B, hkv, S, 16)]))
    lens = mx.array([S, S - 9])  # the second sequence's last keys are padding: masked
    for mask in (None, "causal", step_mask(lens, L, S, None), step_mask(lens, L, S, 7),
                 mx.where(step_mask(lens, L, S, None), 0.0, -1e4).astype(dtype)):
        same(fused.sdpa_keys_transposed(q, k, v, 0.25, mask),
             fused.sdpa_reference(q, k, v, 0.25, mask))


def test_a_decode_step_never_copies_its_keys(mode, monkeypatch):
    from mlxlocal.metal import attention

    mode("ours")

    def refuse(*args):
        raise AssertionError("the keys were transposed")
    monkeypatch.setattr(fused, "sdpa_keys_transposed", refuse)
    k = mx.zeros((1, 2, 64, 16))
    attention.sdpa(mx.zeros((1, 4, 1, 16)), k, k, 0.25, None)  # one query: mx.fast as it is
    with pytest.raises(AssertionError, match="transposed"):
        attention.sdpa(mx.zeros((1, 4, 3, 16)), k, k, 0.25, "causal")


def test_attention_choice_is_per_size_class(mode):
    from mlxlocal.metal import attention

    mode("auto")
    k = mx.zeros((1, 2, 3000, 16))
    for L in (2, 100, 130, 4000):
        attention.sdpa(mx.zeros((1, 4, L, 16)), k, k, 0.25, "causal")
    keys = sorted(key for key in fused.choices.made if key[0] == "sdpa")
    # Queries and keys by powers of two, capped where the timing stops growing with them.
    assert keys == [("sdpa", 16, "float32", 4, 2, 2, fused.SDPA_TIMED_KEYS),
                    ("sdpa", 16, "float32", 4, 2, fused.SDPA_TIMED_QUERIES, fused.SDPA_TIMED_KEYS)]
    assert {c["op"] for c in fused.choices.plan()} == {"sdpa"}


def test_split_attention_runs_from_any_thread():
    """The second CPU stream is per thread (an MLX stream belongs to the thread that made it):
    the engine thread and another both attend, each on streams of its own."""
    import threading

    q, k = mx.random.normal((1, 4, 9, 16), key=mx.random.key(5)), mx.random.normal((1, 2, 30, 16))
    mx.eval(q, k)
    want = fused.sdpa_reference(q, k, k, 0.25, "causal")
    got: list = []

    def attend():  # evaluated where it was built, as the engine thread does
        try:
            out = fused.sdpa_keys_transposed(q, k, k, 0.25, "causal")
            mx.eval(out)
            got.append(out)
        except Exception as e:
            got.append(e)
    worker = threading.Thread(target=attend)
    worker.start()
    worker.join()
    same(fused.sdpa_keys_transposed(q, k, k, 0.25, "causal"), want)
    assert isinstance(got[0], mx.array), got[0]
    same(got[0], want)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [5, 16, 1000, 4100])
def test_decode_attention_powers_of_two_equals_the_matmul_composition(dtype, n):
    """partial_powers_of_two (the CPU composition) gives partial_matmul's (weighted values,
    max in natural units, sum of exponentials) on strided pool views: slices of either kind
    merge into one softmax."""
    from mlxlocal.metal.attention import partial_matmul, partial_powers_of_two

    hkv, g, d, bs = 2, 3, 32, 16
    pool = [mx.random.normal((hkv, 300, bs, d), key=mx.random.key(i)).astype(dtype) for i in (1, 2)]
    blocks = -(-n // bs)
    k, v = (p[:, 7:7 + blocks].reshape(hkv, blocks * bs, d)[:, :n] for p in pool)
    qg = (mx.random.normal((hkv, g, d), key=mx.random.key(3)) * 0.3).astype(dtype)
    tol = 1e-5 if dtype == mx.float32 else 2e-2
    for a, b in zip(partial_powers_of_two(qg, k, v), partial_matmul(qg, k, v)):
        assert a.dtype == b.dtype == mx.float32 and a.shape == b.shape
        assert mx.allclose(a, b, rtol=tol, atol=tol).item(), float(mx.abs(a - b).max())


@pytest.mark.parametrize("runs", [[(3, 40)], [(3, 300)], [(3, 200), (250, 1), (260, 120)]])
def test_decode_attention_over_pool_slices_equals_mx_fast(mode, runs):
    """segment_attention under either composition (forced) equals mx.fast's attention over the
    same keys gathered: one slice, a long run split over two CPU streams, scattered runs."""
    from mlxlocal.metal.attention import key_slices, segment_attention

    hkv, hq, d, bs = 2, 4, 32, 16
    kp, vp = (mx.random.normal((hkv, 600, bs, d), key=mx.random.key(i)) for i in (4, 5))
    q = mx.random.normal((1, hq, 1, d), key=mx.random.key(6))
    n = sum(b for _, b in runs) * bs - 9  # the last block partly filled
    def rows(p):
        return mx.concatenate([p[:, f:f + b] for f, b in runs], 1).reshape(hkv, -1, d)[:, :n]

    want = mx.fast.scaled_dot_product_attention(q, rows(kp)[None], rows(vp)[None], scale=0.2)
    for forced in ("ours", "mlx"):
        mode(forced)
        got = segment_attention(q, kp, vp, key_slices(runs, n, bs), 0.2)
        assert mx.allclose(got, want, rtol=1e-5, atol=1e-5).item(), forced


@pytest.mark.skipif(mx.metal.is_available(), reason="Metal: the paged kernel or mx.fast runs")
def test_the_engine_plan_decides_decode_attention_at_both_size_classes(mode, tiny_model):
    from mlxlocal.engine import EngineConfig, kernel_plan

    mode("auto")
    plan = kernel_plan(load(str(tiny_model)), EngineConfig(max_num_seqs=4))
    got = [c for c in plan if c["op"] == "decode_attention"]
    small = fused.DECODE_SMALL_KEYS
    assert sorted(c["key"]["S"] for c in got) == [small, 4 * small]
    assert all(c["path"] in (fused.COMPOSED, fused.BUILTIN) and c["ours_us"] > 0
               and c["mlx_us"] > 0 for c in got)
    assert all(c["key"]["Hq"] == 4 and c["key"]["L"] == 1 for c in got)  # the tiny qwen3's heads
