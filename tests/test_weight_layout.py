"""Projection weights stored column-major where the reference matmul runs faster that way
(metal/layout.py): same values and logits, the measured choice, the kernel modes, and what
reads weights afterwards (saving, quantizing) still sees the checkpoint's values."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlxlocal.metal import dispatch, layout
from mlxlocal.models.kernel_sites import projection_weights
from mlxlocal.models.kv import DenseKV
from mlxlocal.source.loader import load

no_metal = pytest.mark.skipif(mx.metal.is_available(),
                              reason="on Metal weights keep their mapped layout")


def column(w: mx.array) -> bool:
    """w's memory is column-major: w.T is a row-contiguous array."""
    return memoryview(w).strides == (w.dtype.size, w.shape[0] * w.dtype.size)


def logits(model) -> mx.array:
    cache = [DenseKV() for _ in model.layers]
    model(mx.array([[5, 9, 200, 17, 3]], mx.uint32), cache)
    return model(mx.array([[12]], mx.uint32), cache)


@pytest.fixture
def kernels(monkeypatch):
    monkeypatch.delenv(dispatch.ENV, raising=False)
    saved = dict(layout.layouts.made)
    yield dispatch.set_mode
    dispatch.set_mode(None)
    layout.layouts.made.clear()
    layout.layouts.made.update(saved)


def test_column_major_is_the_same_array():
    w = mx.random.normal((48, 32), key=mx.random.key(0))
    c = layout.column_major(w)
    assert c.shape == w.shape and mx.array_equal(c, w).item() and column(c) and not column(w)
    x = mx.random.normal((3, 32), key=mx.random.key(1))
    assert mx.allclose(x @ c.T, x @ w.T, atol=1e-5).item()


@no_metal
def test_ours_stores_every_projection_column_major_with_the_same_logits(kernels, tiny_model):
    kernels("mlx")
    plain = load(str(tiny_model))
    assert not any(column(m[n]) for m, n in projection_weights(plain.model))
    kernels("ours")
    moved = load(str(tiny_model))
    owners = projection_weights(moved.model)
    # 7 projections a layer, and the tied head's embedding (the tiny qwen3 ties it).
    assert len(owners) == 7 * len(moved.model.layers) + 1
    assert all(column(m[n]) for m, n in owners)
    before = dict(tree_flatten(plain.model.parameters()))
    after = dict(tree_flatten(moved.model.parameters()))
    assert before.keys() == after.keys()
    assert all(mx.array_equal(before[k], after[k]).item() for k in before)
    assert mx.allclose(logits(moved.model), logits(plain.model), atol=1e-5, rtol=1e-5).item()


@no_metal
def test_saving_and_quantizing_a_column_major_weight_see_its_values(tmp_path):
    w = mx.random.normal((64, 64), key=mx.random.key(2))
    c = layout.column_major(w)
    mx.save_safetensors(str(tmp_path / "w.safetensors"), {"w": c})
    assert mx.array_equal(mx.load(str(tmp_path / "w.safetensors"))["w"], w).item()
    assert all(mx.array_equal(a, b).item() for a, b in zip(mx.quantize(c, 64, 4), mx.quantize(w, 64, 4)))


def test_the_choice_follows_the_timer_once_per_shape():
    calls = []

    def timer(fn):
        calls.append(fn)
        return 1.0 if len(calls) % 2 else 2.0  # column-major timed first in each pair: faster

    chooser = layout.Layouts(timer)
    assert chooser.column(mx.zeros((16, 8)))
    n = len(calls)
    assert n == 2 * layout.REPEATS * len(layout.ROWS)
    assert chooser.column(mx.zeros((16, 8))) and len(calls) == n  # remembered
    seen = []

    def column_slower(fn):
        seen.append(fn)
        return 2.0 if len(seen) % 2 else 1.0

    slower = layout.Layouts(column_slower)
    assert not slower.column(mx.zeros((4, 8), mx.float16))
    assert slower.plan() == [{"op": "weight_layout", "key": {"N": 4, "K": 8, "dtype": "float16"},
                              "path": layout.ROW, "how": "measured",
                              "ours_us": 2e6 * len(layout.ROWS), "mlx_us": 1e6 * len(layout.ROWS)}]


@no_metal
def test_auto_measures_and_the_plan_says_so(kernels, tiny_model):
    from mlxlocal.engine import EngineConfig, kernel_plan

    kernels("auto")
    layout.layouts.made.clear()
    loaded = load(str(tiny_model))
    plan = kernel_plan(loaded, EngineConfig(max_num_seqs=2))
    rows = [c for c in plan if c["op"] == "weight_layout"]
    shapes = {(m[n].shape[0], m[n].shape[1]) for m, n in projection_weights(loaded.model)}
    assert {(c["key"]["N"], c["key"]["K"]) for c in rows} == shapes
    for c in rows:  # each weight follows its shape's measured choice
        want = c["path"] == layout.COLUMN
        assert all(column(m[n]) == want for m, n in projection_weights(loaded.model)
                   if (m[n].shape[0], m[n].shape[1]) == (c["key"]["N"], c["key"]["K"]))
