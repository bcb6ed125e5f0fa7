"""Measured dispatch (issue 19 item 3): the chooser, its cache, the modes, the warm-up plan,
and the commands that report them (`show`, `bench`, `bench kernels`).

Off a Mac, Metal is faked (each module's metal_available patched) and the timer injected;
the kernel launch itself (`run`) is replaced where a test lets ours run. The warm-up plan is
checked against the shapes a real greedy decode passes to the dispatch functions.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import threading

import mlx.core as mx
import pytest
from conftest import FAMILY_CONFIGS, build_tiny
from engine_util import prompt_of
from typer.testing import CliRunner

from mlxlocal.engine import SamplingParams, open_engine
from mlxlocal.metal import dispatch, kernel, measure
from mlxlocal.metal.dispatch import MLX, OURS, REFERENCE, Chooser, KernelModeError
from mlxlocal.source.loader import load

MODULES = {op: importlib.import_module(spec.module) for op, spec in measure.OPS.items()}
# Where each op's launches go through `run` (the quantized paged kernel launches through
# paged_attention's run_launches).
LAUNCHERS = {op: importlib.import_module(m.run_launches.__module__) if hasattr(m, "run_launches") else m
             for op, m in MODULES.items()}
needs_metal = pytest.mark.skipif(not mx.metal.is_available(), reason="needs Metal (Apple Silicon)")
CHIP = "Apple M-test"


class FakeTimer:
    """Seconds per call from a table (op, M or None, side) -> s; records every call."""

    def __init__(self, times: dict):
        self.times, self.calls = times, []

    def __call__(self, op, key, side):
        self.calls.append((op, dict(key).get("M"), side))
        return self.times[(op, dict(key).get("M"), side)]


class Refuses:
    def __call__(self, op, key, side):
        raise AssertionError(f"timed {op} {key} {side} although the choice was cached")


@pytest.fixture
def fake_metal(monkeypatch, tmp_path):
    """Metal 'available', auto mode, a fresh chooser on a cache under tmp_path."""
    monkeypatch.setattr(kernel, "metal_available", lambda: True)
    for mod in MODULES.values():
        monkeypatch.setattr(mod, "metal_available", lambda: True)
    monkeypatch.delenv(dispatch.ENV, raising=False)
    monkeypatch.setenv("MLXLOCAL_HOME", str(tmp_path))
    dispatch.set_mode(None)
    yield tmp_path / dispatch.CACHE_NAME
    dispatch.set_mode(None)
    dispatch.reset()


def fresh(path, timer=None, chip=CHIP) -> Chooser:
    """A new process-like state: nothing in memory, the file read on first use."""
    c = Chooser(path, chip=chip, timer=timer, repeats=3)
    dispatch.reset(c)
    return c


def lin(M: int, N: int = 32, K: int = 64):
    return (mx.zeros((M, K)), mx.zeros((N, K)), None)


def gate(op, *args) -> bool:
    return dispatch.use_kernel(op, measure.OPS[op].kernel_supports(), *args)


def test_chooser_picks_the_faster_records_it_and_reads_it_back(fake_metal):
    timer = FakeTimer({("linear", 1, OURS): 1e-5, ("linear", 1, MLX): 3e-5,
                       ("linear", 2, OURS): 4e-5, ("linear", 2, MLX): 2e-5})
    fresh(fake_metal, timer)
    assert gate("linear", *lin(1)) is True
    assert gate("linear", *lin(2)) is False
    # Ours and the built-in alternate, three repeats each, per shape.
    assert [c[2] for c in timer.calls] == [OURS, MLX] * 6
    assert [c[1] for c in timer.calls] == [1] * 6 + [2] * 6
    assert gate("linear", *lin(1)) is True and len(timer.calls) == 12  # from memory
    saved = json.loads(fake_metal.read_text())["chips"][CHIP]
    one = saved[measure.key_text("linear", measure.linear_key(*lin(1)))]
    assert (one["path"], one["ours_us"], one["mlx_us"]) == (OURS, 10.0, 30.0)
    assert saved[measure.key_text("linear", measure.linear_key(*lin(2)))]["path"] == MLX

    c = fresh(fake_metal, Refuses())  # a new process: the file answers, nothing is timed
    assert gate("linear", *lin(1)) is True and gate("linear", *lin(2)) is False
    assert c.choose("linear", measure.linear_key(*lin(1))).how == "cached"

    other = FakeTimer({("linear", 1, OURS): 5e-5, ("linear", 1, MLX): 1e-5})
    fresh(fake_metal, other, chip="Apple M-other")  # keyed by chip: measured again there
    assert gate("linear", *lin(1)) is False and len(other.calls) == 6
    chips = json.loads(fake_metal.read_text())["chips"]
    assert set(chips) == {CHIP, "Apple M-other"} and len(chips[CHIP]) == 2


@pytest.mark.parametrize("op", list(measure.OPS))
def test_every_dispatch_gate_runs_what_the_chooser_picked(fake_metal, monkeypatch, op):
    launched = []

    def fake_run(spec, tensors):
        launched.append(spec.name)
        return [mx.full(spec.output_shapes[0], 7.0, mx.float32)]

    monkeypatch.setattr(LAUNCHERS[op], "run", fake_run)
    q = mx.random.normal((1, 2, 1, 64))
    if op == "linear":
        args, kw = (mx.ones((1, 64)), mx.ones((32, 64)) / 64), {}
    elif op == "quantized_linear":
        args, kw = (mx.ones((1, 64)), *mx.quantize(mx.ones((32, 64)) / 64, group_size=64, bits=4), 64, 4), {}
    else:
        pools = [mx.random.normal((1, 2, 16, 64)) for _ in range(2)]
        if op == "paged_attention_quantized":
            pools = [tuple(mx.quantize(p, group_size=64, bits=8)) for p in pools]
        extra = (64, 8) if op == "paged_attention_quantized" else ()
        args, kw = (q, *pools, mx.array([[0, 1]], mx.int32), mx.array([20], mx.int32), 0.125, *extra), {}
    fn = getattr(MODULES[op], measure.OPS[op].function)
    for side in (OURS, MLX):
        t = {(op, 1 if "linear" in op else None, s): (1e-5 if s == side else 2e-5) for s in (OURS, MLX)}
        fresh(fake_metal.with_name(side + ".json"), FakeTimer(t))
        launched.clear()
        out = fn(*args, **kw)
        if side == OURS:
            assert len(launched) == 1
            assert mx.all(out == 7.0).item()
        else:
            assert launched == [] and not mx.all(out == 7.0).item()


def test_modes_force_either_side_without_timing(fake_metal, monkeypatch):
    fresh(fake_metal, Refuses())
    monkeypatch.setenv(dispatch.ENV, "ours")
    dispatch.set_mode(None)  # (MLXLOCAL_KERNELS is read once; set_mode and reset read it again)
    assert gate("linear", *lin(1)) is True
    monkeypatch.setenv(dispatch.ENV, "MLX")
    dispatch.set_mode(None)
    assert gate("linear", *lin(1)) is False
    dispatch.set_mode("ours")  # --kernels wins over the variable
    assert gate("linear", *lin(1)) is True
    monkeypatch.setenv(dispatch.ENV, "fastest")
    dispatch.set_mode(None)
    with pytest.raises(KernelModeError, match="MLXLOCAL_KERNELS must be auto, ours or mlx, not 'fastest'"):
        gate("linear", *lin(1))
    with pytest.raises(KernelModeError, match="--kernels must be auto, ours or mlx"):
        dispatch.set_mode("both")
    assert not fake_metal.exists()  # nothing measured, nothing written


def test_unsupported_shapes_take_the_builtin_untimed(fake_metal):
    fresh(fake_metal, Refuses())
    assert gate("linear", *lin(9)) is False  # more rows than the kernel's tiles
    assert gate("linear", mx.zeros((1, 64), mx.float16), mx.zeros((32, 64)), None) is False  # mixed dtypes
    plan = dispatch.warm_up([("linear", lin(9)), ("linear", lin(9))])
    assert [(c.path, c.how) for c in plan] == [(MLX, "unsupported shape")]


@pytest.mark.parametrize("content", [b"{not json", b"\xff\xfe\x00garbage",
                                     b'{"format": 1, "chips": {"Apple M-test": {"linear M=1": {"path": "fast"}}}}',
                                     b'{"format": 99, "chips": {}}', "directory"])
def test_a_bad_cache_file_is_kept_aside_with_a_warning_and_remeasured(fake_metal, caplog, content):
    if content == "directory":
        fake_metal.mkdir()
    else:
        fake_metal.write_bytes(content)
    timer = FakeTimer({("linear", 1, OURS): 1e-5, ("linear", 1, MLX): 2e-5})
    fresh(fake_metal, timer)
    with caplog.at_level(logging.WARNING, logger="mlxlocal.metal.dispatch"):
        assert gate("linear", *lin(1)) is True
    assert len(timer.calls) == 6  # measured again
    (aside,) = fake_metal.parent.glob(dispatch.CACHE_NAME + ".bad-*")
    text = caplog.text
    assert str(fake_metal) in text and str(aside) in text
    if content != "directory":
        assert aside.read_bytes() == content  # the bad file is kept as it was
    assert json.loads(fake_metal.read_text())["chips"][CHIP]  # and a good one written


def test_concurrent_first_sight_measures_once(fake_metal):
    timer = FakeTimer({("linear", 1, OURS): 1e-5, ("linear", 1, MLX): 2e-5})
    fresh(fake_metal, timer)
    threads = [threading.Thread(target=gate, args=("linear", *lin(1))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(timer.calls) == 6


def test_warm_up_launches_the_kernels_that_will_run(fake_metal, monkeypatch):
    launched = []

    def fake_run(spec, tensors):
        launched.append(dict(spec.template).get("M"))
        return [mx.zeros(spec.output_shapes[0])]

    monkeypatch.setattr(MODULES["linear"], "run", fake_run)
    sites = [("linear", lin(m)) for m in (1, 2, 9)]
    dispatch.set_mode("ours")
    plan = dispatch.warm_up(sites)
    assert [(dict(c.key)["M"], c.path, c.how) for c in plan] == [
        (1, OURS, "forced (--kernels ours)"), (2, OURS, "forced (--kernels ours)"), (9, MLX, "unsupported shape")]
    assert launched == [1, 2]  # compiled ahead, the unsupported shape not
    launched.clear()
    dispatch.set_mode(None)
    monkeypatch.setenv(dispatch.ENV, "mlx")
    assert {c.how for c in dispatch.warm_up(sites)} == {"forced (MLXLOCAL_KERNELS=mlx)"} and launched == []


def test_default_timer_times_every_op(tmp_path):
    """measure.Timer and the inputs it builds, on whatever backend runs (here: both sides are the
    reference); the chooser keeps the faster of its medians."""
    keys = {"linear": measure.shape_key("linear", M=2, N=32, K=64, dtype="float32", bias=1),
            "quantized_linear": measure.shape_key("quantized_linear", M=1, N=32, K=64, dtype="float32", bits=4,
                                                  group=64, bias=0),
            "paged_attention": measure.shape_key("paged_attention", Hq=4, Hkv=2, D=64, block=16, dtype="float32"),
            "paged_attention_quantized": measure.shape_key("paged_attention_quantized", Hq=4, Hkv=2, D=64,
                                                           block=16, dtype="float32", bits=8, group=64)}
    c = Chooser(tmp_path / "k.json", chip=CHIP, timer=measure.Timer(context=48, copies=2), repeats=2)
    for op, key in keys.items():
        choice = c.choose(op, key)
        assert choice.how == "measured" and choice.ours_us > 0 and choice.mlx_us > 0
        assert choice.path == (OURS if choice.ours_us < choice.mlx_us else MLX)
    assert measure.nbytes("paged_attention", keys["paged_attention"], 48) == 2 * 48 * 2 * 64 * 4
    # Warm-up times M = 1..8 of one projection in a row: the weights are built once.
    timer = measure.Timer(copies=2)
    timer("linear", keys["linear"], OURS)
    weights = [a[1] for a, _ in timer._calls]
    timer("linear", measure.shape_key("linear", **dict(keys["linear"], M=5)), MLX)
    assert all(a[1] is w for (a, _), w in zip(timer._calls, weights, strict=True))
    assert timer._calls[0][0][0].shape == (5, 64)


@pytest.mark.parametrize("op", list(measure.OPS))
def test_the_timer_times_our_kernel_launch_and_the_builtin(fake_metal, monkeypatch, op):
    """Under fake Metal the timed 'ours' side is the gate's kernel launch, the other side is not."""
    launched = []

    def fake_run(spec, tensors):
        launched.append(spec.name)
        return [mx.zeros(spec.output_shapes[0], mx.float32)]

    monkeypatch.setattr(LAUNCHERS[op], "run", fake_run)
    key = {"linear": measure.shape_key("linear", M=3, N=32, K=64, dtype="float16", bias=0),
           "quantized_linear": measure.shape_key("quantized_linear", M=3, N=32, K=64, dtype="float16", bits=8,
                                                 group=32, bias=1),
           "paged_attention": measure.shape_key("paged_attention", Hq=4, Hkv=2, D=64, block=16, dtype="float16"),
           "paged_attention_quantized": measure.shape_key("paged_attention_quantized", Hq=4, Hkv=2, D=64, block=16,
                                                          dtype="float16", bits=4, group=32)}[op]
    timer = measure.Timer(warmup=1, context=40, copies=2)
    assert timer(op, key, OURS) > 0 and len(launched) == 4  # a warm-up chain and a timed one, 2 copies
    launched.clear()
    assert timer(op, key, MLX) > 0 and launched == []


def test_the_path_table_folds_rows_that_take_the_same_path():
    def c(m, path, how, times=(None, None)):
        return dispatch.Choice("linear", measure.shape_key("linear", M=m, N=32, K=64, dtype="float16", bias=0),
                               path, how, *times)

    plan = [c(1, OURS, "measured", (11.0, 20.0)), c(2, MLX, "measured", (25.0, 20.0)),
            *(c(m, MLX, "unsupported shape") for m in range(9, 17))]
    assert dispatch.describe(plan) == [
        ("linear", "M=1 N=32 K=64 bias=0", "float16", "ours (measured: ours 11.0 us, mlx 20.0 us)"),
        ("linear", "M=2 N=32 K=64 bias=0", "float16", "mlx built-in (measured: ours 25.0 us, mlx 20.0 us)"),
        ("linear", "M=9-16 N=32 K=64 bias=0", "float16", "mlx built-in (unsupported shape)")]


# ---------------------------------------------------------------- warm-up vs a real decode
def _recorded_decode_keys(monkeypatch, eng, prompts, max_tokens):
    """Shapes each dispatch function receives during a greedy decode (computed here from the
    arrays, not through measure's key functions)."""
    import mlxlocal.cache.paged as cache_paged
    import mlxlocal.metal as metal

    seen = set()
    dt = lambda a: str(a.dtype).rsplit(".", 1)[-1]  # noqa: E731

    def wrap(mod, name, record):
        real = getattr(mod, name)

        def wrapper(*args, **kw):
            record(*args)
            return real(*args, **kw)

        monkeypatch.setattr(mod, name, wrapper)

    def lin_rec(x, w, bias=None):
        seen.add(("linear", (("M", math.prod(x.shape[:-1])), ("N", w.shape[0]), ("K", w.shape[1]),
                             ("dtype", dt(x)), ("bias", int(bias is not None)))))

    def qlin_rec(x, w, scales, biases, gs, bits, mode="affine", bias=None):
        seen.add(("quantized_linear", (("M", math.prod(x.shape[:-1])), ("N", w.shape[0]), ("K", x.shape[-1]),
                                       ("dtype", dt(x)), ("bits", bits), ("group", gs),
                                       ("bias", int(bias is not None)))))

    def att_rec(q, k, v, *rest):
        if q.shape[2] == 1:  # decode; prefill chunks (L > 1) are never the kernel's
            seen.add(("paged_attention", (("Hq", q.shape[1]), ("Hkv", k.shape[0]), ("D", q.shape[3]),
                                          ("block", k.shape[2]), ("dtype", dt(q)))))

    def qatt_rec(q, k, v, tables, lens, scale, gs, bits, *rest):
        if q.shape[2] == 1:
            seen.add(("paged_attention_quantized", (("Hq", q.shape[1]), ("Hkv", k[0].shape[0]), ("D", q.shape[3]),
                                                    ("block", k[0].shape[2]), ("dtype", dt(q)), ("bits", bits),
                                                    ("group", gs))))

    wrap(metal, "linear", lin_rec)
    wrap(metal, "quantized_linear", qlin_rec)
    wrap(cache_paged, "paged_attention", att_rec)
    wrap(cache_paged, "paged_attention_quantized", qatt_rec)
    handles = [eng.submit(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p, n in zip(prompts, max_tokens)]
    for h in handles:
        assert len([c for c in h if c.token is not None]) > 0
    return seen


@pytest.fixture(scope="module")
def quant_model(tmp_path_factory):
    cfg = dict(FAMILY_CONFIGS["qwen3"], head_dim=32)
    return build_tiny(tmp_path_factory.mktemp("dispatch") / "q4", cfg, bits=4)


@pytest.mark.parametrize("which", ["dense", "quantized"])
def test_warm_up_plan_is_exactly_what_decode_calls(monkeypatch, tiny_model, quant_model, which):
    options = dict(max_num_seqs=2, kv_blocks=32)
    if which == "quantized":
        options.update(kv_bits=8, kv_group_size=32)
    eng = open_engine(load(str(tiny_model if which == "dense" else quant_model)), **options)
    try:
        plan = {(c["op"], tuple(c["key"].items())) for c in eng.kernel_plan}
        if not mx.metal.is_available():  # nothing compiled or measured: the reference everywhere
            assert {c["path"] for c in eng.kernel_plan} == {REFERENCE}
        ops = {op for op, _ in plan}
        assert ops == ({"linear", "paged_attention"} if which == "dense"
                       else {"quantized_linear", "paged_attention_quantized"})
        # Prompts longer than the rows: their prefill (M = 12) is not a decode shape. The
        # shorter request ends first, so decode runs with 2 rows and then 1.
        seen = _recorded_decode_keys(monkeypatch, eng, [prompt_of(12), prompt_of(12, 1)], [6, 3])
    finally:
        eng.shutdown()
    decode = {s for s in seen if dict(s[1]).get("M", 1) <= 2}
    assert {dict(k)["M"] for op, k in seen if "linear" in op} == {1, 2, 12}
    assert decode == plan


# ---------------------------------------------------------------- commands
def cli_app():
    from mlxlocal.cli import app

    return app


@pytest.mark.skipif(mx.metal.is_available(), reason="on Metal bench kernels runs")
def test_bench_kernels_without_metal_exits_2():
    out = CliRunner().invoke(cli_app(), ["bench", "kernels", "--rows", "1", "--models", "qwen3-0.6b"])
    assert out.exit_code == 2
    assert "bench kernels needs Metal (Apple Silicon)" in " ".join(out.output.split())


@pytest.mark.parametrize("args, words", [
    (["bench", "kernels", "--rows", "1,zero"], "--rows: expected positive integers"),
    (["bench", "kernels", "--models", "gpt-5"], "--models: unknown gpt-5"),
    (["bench", "kernels", "--kernels", "ours"], "--kernels"),  # not one of its options
    (["bench", "--rows", "1"], "--rows"),  # bench kernels' option only
    (["bench", "kernel"], "kernel"),  # no such benchmark
    (["bench", "--kernels", "fast"], "--kernels must be auto, ours or mlx, not 'fast'"),
    (["generate", "-m", "synthetic:tiny", "-p", "hi", "--kernels", "fast"], "--kernels must be auto, ours or mlx"),
    (["serve", "-m", "synthetic:tiny", "--kernels", "x"], "--kernels must be auto, ours or mlx"),
    (["run", "task", "-m", "synthetic:tiny", "--mcp", "none.json", "--kernels", "x"], "--kernels must be"),
    (["chat", "-m", "synthetic:tiny", "--kernels", "x"], "--kernels must be auto, ours or mlx"),
])
def test_bad_kernel_options_exit_2_naming_the_option(args, words):
    out = CliRunner().invoke(cli_app(), args)
    assert out.exit_code == 2, out.output
    assert words in " ".join(out.output.split())


def test_show_prints_the_path_of_each_op(tiny_model, monkeypatch, tmp_path):
    monkeypatch.setenv("MLXLOCAL_HOME", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setenv(dispatch.ENV, "mlx")  # on a Mac: no measuring in this test
    dispatch.reset()
    out = CliRunner().invoke(cli_app(), ["show", str(tiny_model)])
    assert out.exit_code == 0, out.output
    text = out.output
    assert str(tmp_path / dispatch.CACHE_NAME) in " ".join(text.split())
    path = "mlx built-in (forced (MLXLOCAL_KERNELS=mlx))" if mx.metal.is_available() else "reference (no Metal)"
    assert mx.metal.is_available() or "kernels: reference (no Metal)" in text
    # qwen3 tiny: hidden 64, 4 / 2 heads x 16, intermediate 128, tied head of 384: 6 projections.
    for shape in ("M=1-16 N=64 K=64 bias=0", "M=1-16 N=32 K=64 bias=0", "M=1-16 N=128 K=64 bias=0",
                  "M=1-16 N=64 K=128 bias=0", "M=1-16 N=384 K=64 bias=0", "Hq=4 Hkv=2 D=16 block=16"):
        assert any(shape in line and path in line for line in text.splitlines()), shape
    dispatch.reset()


def test_bench_reports_the_paths(tiny_model, fake_metal, monkeypatch):
    """bench (local) on fake Metal with --kernels mlx: the plan says forced, the run uses the
    built-in everywhere (so the CPU backend can run it)."""
    dispatch.reset()
    out = CliRunner().invoke(cli_app(), ["bench", "-m", str(tiny_model), "-p", "8", "-g", "2", "-n", "1",
                                         "--warmup", "0", "--kernels", "mlx", "--json"])
    assert out.exit_code == 0, out.output
    k = json.loads(out.stdout.strip().splitlines()[-1])["kernels"]
    assert k["mode"] == "mlx" and k["metal"] is True and k["cache"] == str(fake_metal)
    assert k["plan"] and {(c["path"], c["how"]) for c in k["plan"]} == {(MLX, "forced (--kernels mlx)")}
    assert {c["op"] for c in k["plan"]} == {"linear", "paged_attention"}


# ---------------------------------------------------------------- real Metal
@needs_metal
def test_metal_chooser_times_both_sides_and_keeps_the_faster(tmp_path):
    c = Chooser(tmp_path / "k.json", repeats=3)
    for op, key in (("linear", measure.shape_key("linear", M=1, N=4096, K=4096, dtype="float16", bias=0)),
                    ("paged_attention", measure.shape_key("paged_attention", Hq=32, Hkv=8, D=128, block=16,
                                                          dtype="float16"))):
        choice = c.choose(op, key)
        assert choice.how == "measured" and choice.path == (OURS if choice.ours_us < choice.mlx_us else MLX)
    assert len(json.loads((tmp_path / "k.json").read_text())["chips"][c.chip]) == 2


@needs_metal
def test_metal_bench_kernels_json():
    out = CliRunner().invoke(cli_app(), ["bench", "kernels", "--models", "qwen3-0.6b", "--rows", "1",
                                         "--contexts", "1024", "-n", "3", "--json"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.stdout)["results"]
    assert {r["baseline"] for r in rows} == {"mx.matmul", "mx.quantized_matmul", "gather+sdpa", "sdpa (contiguous)"}
    assert all(r["speedup"] > 0 and r["ours_gbs"] > 0 for r in rows)
