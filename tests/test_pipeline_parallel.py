"""Pipeline parallelism: ranks launched with `mlx.launch --backend ring` on loopback
(tests/pp_driver.py), greedy tokens checked against the single-process path (load(path,
tp=1)); the plan and its refusals checked in process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from cluster_util import mlx_launch
from conftest import FAMILY_CONFIGS, build_tiny

from mlxlocal.distributed.stages import PipelinePlan
from mlxlocal.errors import ModelLoadError
from mlxlocal.models.config import parse_config
from mlxlocal.weights.safetensors import SKIP, load_tensors

REPO = Path(__file__).resolve().parents[1]
LAUNCH = Path(sys.executable).parent / "mlx.launch"
FOUR = dict(FAMILY_CONFIGS["llama"], num_hidden_layers=4)

needs_launch = pytest.mark.skipif(not LAUNCH.exists() or not mx.distributed.is_available(),
                                  reason="mlx.launch / mx.distributed not available")


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory) -> Path:
    return build_tiny(tmp_path_factory.mktemp("pp") / "llama4", FOUR, template="llama3")


def launch(tmp: Path, ranks: int, pp: int, paths: list[Path], n1: int, n8: int, timeout: float = 240) -> tuple[list[dict], list[dict]]:
    """Run the driver on `ranks` ranks; (rank 0's line per model, the followers' lines).
    The whole process group is killed on timeout: a stuck rank never hangs the suite."""
    cmd = [*mlx_launch(ranks),
           str(REPO / "tests" / "pp_driver.py"), str(tmp), str(pp), str(n1), str(n8), *map(str, paths)]
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, errs = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, errs = proc.communicate()
        pytest.fail(f"{ranks} ranks did not finish within {timeout} s:\n{out[-2000:]}\n{errs[-4000:]}")
    lines = [json.loads(line) for f in sorted(tmp.glob("rank*.jsonl")) for line in f.read_text().splitlines()]
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out[-2000:]}\n{errs[-4000:]}"
    models = [x for x in lines if "model" in x]
    assert len(models) == len(paths), f"rank 0 reported {len(models)} models:\n{out[-2000:]}\n{errs[-4000:]}"
    models[0].update(next((x for x in lines if "lookup" in x), {}))  # the first model's speculative run
    return models, sorted((x for x in lines if "rank" in x), key=lambda x: x["rank"])


def check(models: list[dict], followers: list[dict], ranks: int, layers: dict[str, int], n1: int, n8: int,
          lookup: bool = True) -> None:
    for m in models:
        name = m["model"]
        staged, whole = m["batch1"]
        assert staged == whole and len(staged) == n1, name
        # Prompt lookup's verification: several tokens fed, every position's logits back.
        if lookup and m is models[0]:
            assert m["lookup"] == whole and m["spec_accepted"] > 0, name
        staged, whole = m["batch8"]
        assert staged == whole and all(len(t) == n8 for t in staged), name
        assert m["prefix_hit_tokens"] > 0, name  # the shared prefix was reused
        assert m["micro_batches"] > m["forwards"], name  # some decode batches were cut
        # Weights per rank: the stages' bytes add up to the whole model's, and each
        # follower holds exactly its layers' share (one layer's bytes times its count).
        held = [m["weight_bytes"]] + [f["weight_bytes"][str(m["model_id"])] for f in followers]
        assert sum(held) == m["whole_bytes"], name
        n = layers[name]
        per_layer = held[-1] / (n // ranks if n % ranks == 0 else n - n * (ranks - 1) // ranks)
        spans = [m["layers"]] + [f["layers"][str(m["model_id"])] for f in followers]
        assert [a for a, _ in spans] == [r * n // ranks for r in range(ranks)] and spans[-1][1] == n
        for (a, b), got in zip(spans[1:], held[1:]):
            assert got == per_layer * (b - a), name
        assert held[0] > per_layer * (spans[0][1] - spans[0][0])  # rank 0 also has the ends
        assert m["pool_layers"] == spans[0][1] - spans[0][0], name  # K/V pools of its layers only
    # Each follower's pools (every engine of every model) hold its layers only.
    for f in followers:
        assert f["pool_layers"] == sorted({b - a for a, b in f["layers"].values()})


@pytest.mark.slow  # launched ranks are subprocesses, like the other slow tests
@needs_launch
def test_two_ranks_match_single_process(tiny_models, four_layers, tmp_path):
    paths = [tiny_models[f] for f in FAMILY_CONFIGS] + [four_layers]
    models, followers = launch(tmp_path, 2, 2, paths, 10, 6)
    assert [m["model"] for m in models] == [p.name for p in paths]
    assert len(followers) == 1 and followers[0]["forwards"] > 0
    check(models, followers, 2, {**{f: 2 for f in FAMILY_CONFIGS}, "llama4": 4}, 10, 6)


@pytest.mark.slow  # launched ranks are subprocesses, like the other slow tests
@needs_launch
def test_four_ranks_one_layer_each(four_layers, tmp_path):
    # Four ranks on this 2-core machine are slow (each Channel message is two all_sums
    # around the ring, each hop a context switch): fewer tokens.
    models, followers = launch(tmp_path, 4, 4, [four_layers], 3, 3)
    assert [f["rank"] for f in followers] == [1, 2, 3]
    check(models, followers, 4, {"llama4": 4}, 3, 3, lookup=False)  # too few tokens to draft


def test_plan_splits_contiguously_and_refuses_more_ranks_than_layers():
    cfg = parse_config(dict(FAMILY_CONFIGS["llama"], num_hidden_layers=7), "config.json")
    plans = [PipelinePlan.of(cfg, r, 3) for r in range(3)]
    assert [(p.start, p.stop) for p in plans] == [(0, 2), (2, 4), (4, 7)]
    assert plans[1].slicer("model.layers.3.mlp.up_proj.weight", (8, 8)) is None
    assert plans[1].slicer("model.layers.4.mlp.up_proj.weight", (8, 8)) is SKIP
    assert plans[1].slicer("model.embed_tokens.weight", (8, 8)) is SKIP
    assert plans[0].slicer("lm_head.weight", (8, 8)) is None
    with pytest.raises(ModelLoadError, match=r"8 ranks \(--pp 8\) needs at least 8 layers.*has 7"):
        PipelinePlan.of(cfg, 0, 8)


def test_load_refuses_pp_with_tp_a_wrong_group_size_and_mlx_lm_models(tiny_model, gemma_model):
    from mlxlocal.source.loader import load

    with pytest.raises(ModelLoadError, match=r"--pp 2 with --tp 2"):
        load(str(tiny_model), tp=2, pp=2)
    with pytest.raises(ModelLoadError, match=r"--pp 2 asks for 2 ranks.*group of 1"):
        load(str(tiny_model), pp=2)
    with pytest.raises(ModelLoadError, match=r"--pp needs a native model.*'gemma'"):
        load(str(gemma_model), pp=2)


def test_selector_skip_leaves_tensors_out(tmp_path):
    a, b = np.arange(12, dtype=np.float32).reshape(3, 4), np.ones((2, 2), np.float32)
    path = tmp_path / "w.safetensors"
    mx.save_safetensors(str(path), {"keep": mx.array(a), "drop": mx.array(b)})
    seen = []
    res = load_tensors(path, adopt=False, select=lambda name, shape: seen.append(name) or (SKIP if name == "drop" else None))
    assert sorted(seen) == ["drop", "keep"] and list(res.arrays) == ["keep"] and res.n_copied == 1
    assert np.array_equal(np.array(res.arrays["keep"]), a)
