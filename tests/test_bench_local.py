"""`mlxlocal bench` (local part): JSON fields, mlx-lm comparison, scenarios, roofline, plot."""

from __future__ import annotations

import json
import math
import statistics
import sys
import types

import pytest
import typer
from conftest import FAMILY_CONFIGS, build_tiny
from typer.testing import CliRunner

from mlxlocal.bench import roofline
from mlxlocal.cli.bench import register

app = typer.Typer()
register(app)


@app.callback()
def _root() -> None:  # keeps `bench` a subcommand, as in the real CLI
    pass


def bench(*args: str) -> dict:
    result = CliRunner().invoke(app, ["bench", *args])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """The tiny qwen3 with a 4096-token context: the agent trace (tool schemas) is ~1.3k tokens."""
    cfg = dict(FAMILY_CONFIGS["qwen3"], max_position_embeddings=4096)
    return build_tiny(tmp_path_factory.mktemp("bench") / "qwen3-long", cfg)


def test_speed_json_fields(tiny_model):
    res = bench("-m", str(tiny_model), "-p", "16", "-g", "4", "-n", "2", "--warmup", "1",
                "--bandwidth", "1000", "--json")
    s = res["speed"]
    assert res["model"] == str(tiny_model) and "given" in res["model_note"]
    assert res["weight_bytes"] > 0
    for key in ("prefill_tps", "decode_tps", "ttft_s", "peak_memory_bytes"):
        assert s["mlxlocal"][key]["n"] == 2 and s["mlxlocal"][key]["mean"] > 0
        assert s["mlxlocal"][key]["sd"] >= 0
    assert s["prompt_tokens"] == 16 and s["gen_tokens"] == 4 and s["prefix_cache"] is False
    assert all(r["generated"] == 4 for r in s["runs"])
    r = s["roofline"]
    assert r["bandwidth_gbps"] == 1000 and r["bandwidth_source"] == "--bandwidth"
    assert r["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4  # K+V, 2 layers, 2 kv heads, dim 16, fp32
    assert r["bytes_per_token"] == pytest.approx(res["weight_bytes"] + r["kv_bytes_per_token"] * (16 + 2))
    assert r["bound_tps"] == pytest.approx(1000e9 / r["bytes_per_token"])
    # A tiny model on the CPU may beat a naive bound (it sits in cache): just check the arithmetic.
    assert r["fraction"] == pytest.approx(s["mlxlocal"]["decode_tps"]["mean"] / r["bound_tps"])


def test_batch_aggregate(tiny_model):
    s = bench("-m", str(tiny_model), "-p", "16", "-g", "6", "-b", "3", "-n", "1", "--warmup", "0",
              "--bandwidth", "100", "--json")["speed"]
    assert s["batch"] == 3 and s["mlxlocal"]["aggregate"] is True
    assert s["mlxlocal"]["decode_tps"]["mean"] > 0
    assert s["runs"][0]["generated"] == 18


def test_compare_mlx_lm_ratios_and_alternation(tiny_model):
    s = bench("-m", str(tiny_model), "-p", "16", "-g", "4", "-n", "2", "--warmup", "1",
              "--bandwidth", "100", "--compare", "mlx-lm", "--json")["speed"]
    assert s["order"] == ["mlxlocal", "mlx-lm", "mlxlocal", "mlx-lm"]
    assert len(s["mlx_lm_runs"]) == 2 and all(r["generated"] == 4 for r in s["mlx_lm_runs"])
    for key in ("prefill_tps", "decode_tps", "ttft_s", "peak_memory_bytes"):
        assert s["ratios"][key] == pytest.approx(s["mlxlocal"][key]["mean"] / s["mlx_lm"][key]["mean"])
        assert s["ratios"][key] > 0


def test_agent_scenario_cache_on_off(long_model):
    res = bench("agent", "-m", str(long_model), "--turns", "3", "-g", "2", "-n", "1",
                "--compare", "mlx-lm", "--json")
    a = res["agent"]
    assert a["modes"] == ["on", "off", "mlx_lm"]
    on, off = a["cached_tokens_per_turn"]["on"], a["cached_tokens_per_turn"]["off"]
    assert on[0] == 0 and all(c > 0 for c in on[1:])
    assert off == [0, 0, 0]
    assert all(c > 0 for c in a["cached_tokens_per_turn"]["mlx_lm"][1:])
    assert a["prompt_tokens"] == sorted(a["prompt_tokens"]) and len(set(a["prompt_tokens"])) == 3
    assert all(t > 0 for m in a["modes"] for t in a["ttft_per_turn_s"][m])
    assert a["ratios_last_turn"]["off_over_on"] > 0 and "mlx_lm_over_on" in a["ratios_last_turn"]
    assert a["greedy_tokens_match_off"] == {"on": True, "off": True, "mlx_lm": True}
    # mlx-lm's prompt cache takes each turn between ours, not all its turns after ours.
    assert a["order"] == ["on", "off", "mlx_lm"] * 3


def test_agent_no_prefix_cache(long_model):
    a = bench("agent", "-m", str(long_model), "--turns", "2", "-g", "1", "-n", "1",
              "--no-prefix-cache", "--json")["agent"]
    assert a["modes"] == ["off"] and a["cached_tokens_per_turn"]["off"] == [0, 0]


def test_concurrent_scenario(tiny_model):
    c = bench("concurrent", "-m", str(tiny_model), "-c", "3", "-p", "8", "-g", "6",
              "-n", "1", "--json")["concurrent"]
    assert [r["streams"] for r in c["levels"]] == [1, 2, 3]
    assert all(r["decode_tps"] > 0 and r["e2e_tps"] > 0 for r in c["levels"])
    assert c["decode_ratio"] == pytest.approx(c["levels"][-1]["decode_tps"] / c["levels"][0]["decode_tps"])
    assert c["e2e_ratio"] > 0


def assert_median_of_known(value: float, runs: list) -> None:
    known = [x for x in runs if x is not None]
    assert all(x > 0 for x in known)
    assert value == pytest.approx(statistics.median(known)) if known else math.isnan(value)


def test_concurrent_compare_mlx_lm(tiny_model):
    c = bench("concurrent", "-m", str(tiny_model), "-c", "2", "-p", "8", "-g", "5",
              "-n", "2", "--warmup", "0", "--compare", "mlx-lm", "--json")["concurrent"]
    assert "BatchGenerator" in c["mlx_lm_method"]
    # A B A B: each of ours directly followed by mlx-lm's on the same stream count; levels
    # reversed on the second repeat.
    assert c["order"] == ["mlxlocal:1", "mlx-lm:1", "mlxlocal:2", "mlx-lm:2",
                          "mlxlocal:2", "mlx-lm:2", "mlxlocal:1", "mlx-lm:1"]
    for row in c["levels"]:
        k = row["streams"]
        assert row["generated"] == row["mlx_lm_generated"] == 5 * k  # same lengths, EOS ignored
        assert len(row["decode_tps_runs"]) == len(row["mlx_lm_decode_tps_runs"]) == 2
        # A run has no decode rate when no moment had every stream decoding (a loaded machine can
        # serialise 5-token streams): the row is the median of the runs that have one.
        assert_median_of_known(row["decode_tps"], row["decode_tps_runs"])
        assert_median_of_known(row["mlx_lm_decode_tps"], row["mlx_lm_decode_tps_runs"])
        assert row["mlx_lm_e2e_tps"] > 0
        if math.isfinite(row["decode_tps"]) and math.isfinite(row["mlx_lm_decode_tps"]):
            assert row["decode_ratio_vs_mlx_lm"] == pytest.approx(row["decode_tps"] / row["mlx_lm_decode_tps"])
        assert row["e2e_ratio_vs_mlx_lm"] == pytest.approx(row["e2e_tps"] / row["mlx_lm_e2e_tps"])


def test_concurrent_without_compare_has_no_mlx_lm_fields(tiny_model):
    c = bench("concurrent", "-m", str(tiny_model), "-c", "1", "-p", "8", "-g", "3",
              "-n", "1", "--warmup", "0", "--json")["concurrent"]
    assert c["order"] == ["mlxlocal:1"] and "mlx_lm_method" not in c
    assert "mlx_lm_decode_tps" not in c["levels"][0]


def test_sessions_scenario_compare(tiny_model):
    res = bench("sessions", "-m", str(tiny_model), "-c", "2", "-p", "40", "-g", "3",
                "-n", "2", "--warmup", "0", "--compare", "mlx-lm", "--json")
    s = res["sessions"]
    assert s["sessions"] == 2 and s["prompt_tokens"] == 40 and s["clip_note"] is None
    assert s["order"] == ["mlxlocal", "mlx-lm", "mlxlocal", "mlx-lm"]
    ours, theirs = s["summary"]["mlxlocal"], s["summary"]["mlx_lm"]
    for v in (ours, theirs):
        assert v["peak_over_baseline_bytes"] > 0 and v["peak_memory_bytes"] > v["baseline_bytes"] > 0
        assert v["peak_over_baseline_bytes"] == pytest.approx(v["peak_memory_bytes"] - v["baseline_bytes"], abs=1)
        assert v["second_turn_ttft_s"] > 0 and len(v["second_turn_cached_tokens"]) == 2
    # Both models stay loaded during either run: the baseline is more than one weight copy.
    assert ours["baseline_bytes"] > res["weight_bytes"]
    assert ours["baseline_bytes"] == pytest.approx(theirs["baseline_bytes"], abs=1 << 20)
    # The second turn reuses the first turn's prompt + reply through the pinned session.
    assert all(c >= 40 for c in ours["second_turn_cached_tokens"])
    assert all(c >= 40 for c in theirs["second_turn_cached_tokens"])
    assert ours["kv_pool_bytes"] > 0 and theirs["kv_cache_bytes"] > 0
    assert s["ratios"]["peak_over_baseline"] == pytest.approx(
        ours["peak_over_baseline_bytes"] / theirs["peak_over_baseline_bytes"])
    assert s["ratios"]["second_turn_ttft"] == pytest.approx(ours["second_turn_ttft_s"] / theirs["second_turn_ttft_s"])
    assert len(s["runs"]["mlxlocal"]) == len(s["runs"]["mlx_lm"]) == 2


def test_sessions_prompt_clipped_to_context(tiny_model):
    s = bench("sessions", "-m", str(tiny_model), "-c", "1", "-p", "5000", "-g", "2",
              "-n", "1", "--warmup", "0", "--json")["sessions"]
    assert s["context_length"] == 512 and s["prompt_tokens"] == 512 - 2 * 2 - s["new_turn_tokens"] - 1
    assert "clipped from 5000" in s["clip_note"] and s["ratios"] is None
    assert s["summary"]["mlxlocal"]["second_turn_cached_tokens"][0] > 0


def test_plot_writes_png(tiny_model, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench.png"
    res = bench("concurrent", "-m", str(tiny_model), "-c", "2", "-p", "8", "-g", "4",
                "-n", "1", "--plot", str(out), "--json")
    assert res["plot"] == str(out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bad_options():
    runner = CliRunner()
    for args in (["--compare", "llama.cpp"], ["chat"], ["-b", "0"], ["--bandwidth", "-1"],
                 ["sessions", "-c", "0"]):
        result = runner.invoke(app, ["bench", *args])
        assert result.exit_code == 2, (args, result.output)


def test_url_delegates_to_endpoint(monkeypatch):
    seen = {}
    fake = types.ModuleType("mlxlocal.bench.endpoint")
    fake.run_endpoint_bench = lambda **kw: seen.update(kw)
    monkeypatch.setitem(sys.modules, "mlxlocal.bench.endpoint", fake)
    result = CliRunner().invoke(app, ["bench", "endpoint", "--url", "http://127.0.0.1:9/v1", "-c", "4", "--requests", "8",
                                      "-p", "64", "-g", "16", "--json"])
    assert result.exit_code == 0, result.output
    assert seen == dict(url="http://127.0.0.1:9/v1", model=None, concurrency=4, requests=8, prompt_tokens=64,
                        gen_tokens=16, prompt_file=None, as_json=True, plot=None)


def test_url_without_endpoint_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "mlxlocal.bench.endpoint", None)  # import raises ImportError
    result = CliRunner().invoke(app, ["bench", "endpoint", "--url", "http://127.0.0.1:9/v1"])
    assert result.exit_code == 1
    assert "endpoint benchmark" in result.output


@pytest.mark.parametrize("brand,cores,chip,gbps", [
    ("Apple M1", None, "M1", 68.25),
    ("Apple M1 Pro", 10, "M1 Pro", 200.0),
    ("Apple M2 Ultra", 24, "M2 Ultra", 800.0),
    ("Apple M3 Pro", 12, "M3 Pro", 150.0),
    ("Apple M3 Max", 14, "M3 Max (14-core CPU)", 300.0),
    ("Apple M3 Max", 16, "M3 Max (16-core CPU)", 400.0),
    ("Apple M4 Max", 14, "M4 Max (14-core CPU)", 410.0),
    ("Apple M4 Max", 16, "M4 Max (16-core CPU)", 546.0),
    ("Apple M4 Pro", 14, "M4 Pro", 273.0),
    ("Apple M3 Ultra", 32, "M3 Ultra", 819.0),
])
def test_chip_table(brand, cores, chip, gbps):
    assert roofline.chip_bandwidth(brand, cores) == (chip, gbps)


def test_chip_table_unknown():
    assert roofline.chip_bandwidth("Intel(R) Core(TM) i9-9980HK CPU @ 2.40GHz") is None
    assert roofline.chip_bandwidth("Apple M9 Hyper") is None
    assert roofline.chip_bandwidth("Apple M3 Max")[1] == 400.0  # unknown bin: the full chip, said so


def test_detect_bandwidth_sources(monkeypatch):
    assert roofline.detect_bandwidth(123.0).source == "--bandwidth"
    monkeypatch.setattr(roofline.platform, "system", lambda: "Darwin")
    answers = {"machdep.cpu.brand_string": "Apple M2 Pro", "hw.physicalcpu": "12"}
    monkeypatch.setattr(roofline, "_sysctl", answers.get)
    bw = roofline.detect_bandwidth()
    assert bw.gbps == 200.0 and "M2 Pro" in bw.source
    monkeypatch.setattr(roofline.platform, "system", lambda: "Linux")
    monkeypatch.setattr(roofline, "measure_copy_bandwidth", lambda: 12.5)
    bw = roofline.detect_bandwidth()
    assert bw.gbps == 12.5 and bw.source.startswith("measured")


def test_roofline_arithmetic():
    bw = roofline.Bandwidth(100.0, "x")
    r = roofline.decode_roofline(bw, weight_bytes=1_000_000_000, kv_per_token=100_000, mean_context=1000,
                                 measured_tps=50.0)
    assert r.bytes_per_token == 1.1e9
    assert r.bound_tps == pytest.approx(100e9 / 1.1e9)
    assert r.fraction == pytest.approx(50.0 / r.bound_tps)


def test_structured_output_bench(tiny_model, tmp_path):
    """bench structured: free and constrained runs at batch 1 and the given batch, with the
    ratio, tokens per document and the shares of forced tokens and complete documents."""
    schema = tmp_path / "s.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"k": {"enum": ["a", "bb"]}, "n": {
        "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3}},
        "required": ["k", "n"], "additionalProperties": False}))
    res = bench("structured", str(schema), "--model", str(tiny_model), "-p", "16", "-g", "40", "-n", "2",
                "--warmup", "0", "-b", "3", "--json")["structured"]
    assert [r["batch"] for r in res["batches"]] == [1, 3]
    for row in res["batches"]:
        assert row["free_decode_tps"] > 0 and row["constrained_decode_tps"] > 0
        assert row["ratio"] == pytest.approx(row["constrained_decode_tps"] / row["free_decode_tps"])
        assert row["complete_share"] == 1.0  # the schema is short: every document finishes
        assert 0 < row["constrained_tokens"] < 40 and 0 <= row["forced_share"] < 1
        assert len(row["runs"]["free"]) == len(row["runs"]["constrained"]) == 2
    assert res["batches"][0]["forced_share"] > 0  # alone: the keys are forced, fed in one forward
    bad = CliRunner().invoke(app, ["bench", "structured", str(tmp_path / "missing.json")])
    assert bad.exit_code == 2 and "missing.json" in bad.output


# --- bench --profile ----------------------------------------------------------------------------
def test_step_profile_counts_the_decode_steps(tiny_model):
    """The hook records one entry per step; the decode rows add up to the tokens generated
    (a pipelined step may compute one wasted token per sequence)."""
    from mlxlocal.bench.common import random_prompt, run_streams
    from mlxlocal.engine import SamplingParams, StepProfile, open_engine
    from mlxlocal.source.loader import load

    engine = open_engine(load(str(tiny_model)), prefix_cache=False, max_num_seqs=2)
    try:
        assert engine.profile is None
        engine.profile = prof = StepProfile()
        streams = run_streams(engine, [random_prompt(16, 200, seed=s) for s in (1, 2)],
                              SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))
        engine.profile = None
    finally:
        engine.shutdown()
    assert [len(s.times) for s in streams] == [8, 8]
    prefilled = sum(s["prefill"] for s in prof.steps)
    decoded = sum(s["decode"] for s in prof.steps)
    assert prefilled == 32 and 2 * 7 <= decoded <= 2 * 8 + 2
    for s in prof.steps:
        assert s["t1"] >= s["t0"]
        assert sum(s[p] for p in ("schedule", "build", "sample", "output", "submit", "wait")) == \
            pytest.approx(s["t1"] - s["t0"], rel=1e-6, abs=1e-9)


def test_profile_phases_ours_and_mlx_lm(tiny_model):
    res = bench("profile", "-m", str(tiny_model), "-p", "16", "-g", "12", "-b", "4", "-n", "2",
                "--warmup", "1", "--json")
    p = res["profile"]
    assert [row["batch"] for row in p["rows"]] == [1, 4]
    assert p["order"] == ["mlxlocal:1", "mlx-lm:1", "mlxlocal:4", "mlx-lm:4",
                          "mlxlocal:4", "mlx-lm:4", "mlxlocal:1", "mlx-lm:1"]
    for row in p["rows"]:
        for who in ("mlxlocal", "mlx_lm"):
            s = row[who]
            assert s["steps"] >= 12 - 6, (who, row["batch"], s)
            for phase in ("schedule", "build", "sample", "submit", "wait", "output"):
                assert s[phase] > 0, (who, phase)
            assert s["host"] == pytest.approx(s["schedule"] + s["build"] + s["sample"] + s["output"])
            assert s["eval"] == pytest.approx(s["submit"] + s["wait"])
            # The phases cover the step: what is left is the engine loop between steps.
            assert 0.8 * s["wall"] <= s["host"] + s["eval"] <= s["wall"] * (1 + 1e-6)
            assert 0 < s["host_share"] < 1
        assert row["host_ratio_vs_mlx_lm"] == pytest.approx(row["mlxlocal"]["host"] / row["mlx_lm"]["host"])


def test_profile_report_says_how_host_compares(tiny_model):
    from mlxlocal.bench.profile import profile_lines

    res = bench("profile", "-m", str(tiny_model), "-p", "16", "-g", "10", "-b", "2", "-n", "1",
                "--warmup", "0", "--json")
    lines = profile_lines(res["profile"])
    assert sum("host" in line and "µs step" in line for line in lines) == 4
    assert sum("ours ÷ mlx-lm" in line for line in lines) == 2


# --- bench --contexts ---------------------------------------------------------------------------
def test_contexts_table_one_row_per_context(tiny_model):
    res = bench("contexts", "64,160", "-m", str(tiny_model), "-g", "4", "-n", "2", "--warmup", "1",
                "--compare", "mlx-lm", "--json")
    c = res["contexts"]
    assert [row["context"] for row in c["rows"]] == [64, 160]
    for row in c["rows"]:
        assert row["prompt_tokens"] == row["context"] - 4
        assert row["order"] == ["mlxlocal", "mlx-lm", "mlxlocal", "mlx-lm"]
        assert [r["generated"] for r in row["runs"] + row["mlx_lm_runs"]] == [4] * 4
        for key in ("prefill_tps", "decode_tps", "peak_memory_bytes"):
            assert row[key] == pytest.approx(statistics.median(r[key] for r in row["runs"]))
            assert row[f"mlx_lm_{key}"] > 0
            assert row["ratios"][key] == pytest.approx(row[key] / row[f"mlx_lm_{key}"])
    # a longer context holds more K/V: ours peaks higher at 160 than at 64
    assert c["rows"][1]["peak_memory_bytes"] > c["rows"][0]["peak_memory_bytes"]


def test_contexts_refused_past_the_model():
    result = CliRunner().invoke(app, ["bench", "contexts", "4k,x"])
    assert result.exit_code == 2 and "'x' is not a token count" in result.output
    result = CliRunner().invoke(app, ["bench", "contexts", "64", "--plot", "x.png"])  # not one of its options
    assert result.exit_code == 2 and "--plot" in result.output


def test_contexts_over_the_model_context(tiny_model):
    result = CliRunner().invoke(app, ["bench", "contexts", "1024", "-m", str(tiny_model), "--json"])
    assert result.exit_code == 1 and "over the model's context of 512" in result.output


def test_speed_plot_gives_prefill_and_decode_their_own_linear_axes(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from mlxlocal.bench.report import write_plot

    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    rate = lambda v: {"mean": v}  # noqa: E731
    res = {"model": "m", "speed": {"prompt_tokens": 256, "gen_tokens": 64,
                                   "mlxlocal": {"prefill_tps": rate(4500.0), "decode_tps": rate(450.0)},
                                   "mlx_lm": {"prefill_tps": rate(2100.0), "decode_tps": rate(500.0)}}}
    out = write_plot(res, str(tmp_path / "speed.png"))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (fig,) = figs
    assert [ax.get_title() for ax in fig.axes] == ["prefill (prompt 256)", "decode (generate 64)"]
    assert all(ax.get_yscale() == "linear" for ax in fig.axes)
    decode = fig.axes[1]
    assert [round(p.get_height()) for p in decode.patches] == [450, 500]  # bars to scale, from 0


def test_restart_scenario_restores_from_disk_and_reports_both_bandwidths(tiny_model):
    """`bench restart`: a new engine on the store serves the prefix from disk (all of
    it but the last token), and the report splits the read (and check) from the whole restore."""
    res = bench("restart", "-m", str(tiny_model), "-p", "200", "-n", "1", "--compare", "mlx-lm",
                "--json")["restart"]
    ours, run = res["ours"], res["runs"][0]["ours"]
    # All but the last token: 12 full blocks of 16 and 7 of the partial last block.
    assert res["prompt_tokens"] == 200 and ours["disk_tokens"] == 199
    assert ours["read_bytes"] > 0 and 0 < ours["read_s"] <= ours["restore_s"]
    assert run["read_gbps"] == pytest.approx(run["read_bytes"] / run["read_s"] / 1e9)
    assert res["read_over_plain_read"] == pytest.approx(ours["read_gbps"] / ours["plain_gbps"])
    assert res["mlx_lm"]["file_bytes"] > 0 and res["mlx_lm_restore_over_ours"] > 0
    # mlx-lm's restore both after a restart (fresh memory) and into its reused buffers.
    mlx = res["mlx_lm"]
    assert mlx["reused_s"] > 0 and res["mlx_lm_reused_over_ours"] == pytest.approx(
        mlx["reused_s"] / ours["disk_s"])
