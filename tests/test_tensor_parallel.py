"""Tensor parallelism over MLX's ring backend, on loopback (issue 20).

The oracle is the same model loaded whole (tp=1) in rank 0's own process: a different code path
(no sharding, no collectives, no followers). Ranks are real processes started by `mlx.launch`
(tests/tp_driver.py) or by `mlxlocal launch-cluster` (the CLI and the server).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest
from cluster_util import mlx_launch
from conftest import BASE, FAMILY_CONFIGS, TEMPLATES, build_tiny

from mlxlocal.distributed.processes import free_ports
from mlxlocal.distributed.tensor import TensorPlan
from mlxlocal.errors import ModelLoadError
from mlxlocal.models.config import parse_config

# Real ranks are subprocesses: out of the quick subset; the plan tests below are quick but tiny.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
ENV = dict(os.environ, PYTHONPATH=str(ROOT), MLXLOCAL_LOG_LEVEL="WARNING")


def launch(n: int, *args: str, timeout: float = 240) -> list[dict]:
    """tests/tp_driver.py on n ranks; rank 0's JSON lines."""
    out = subprocess.run([*mlx_launch(n),
                          str(ROOT / "tests" / "tp_driver.py"), *args],
                         capture_output=True, text=True, timeout=timeout, env=ENV)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def weight_share(config: dict, ranks: int) -> float:
    """Bytes of one rank's weights over the whole model's (float32, no biases), from the config:
    q/o and the MLP split N ways, k/v split N ways or held whole per group of ranks when there are
    fewer KV heads than ranks; embeddings, head and norms on every rank."""
    h, i, hq, hkv, d = (config[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                             "num_key_value_heads", "head_dim"))
    v, layers = config["vocab_size"], config["num_hidden_layers"]
    kv_share = 1 / ranks if hkv % ranks == 0 else 1 / hkv
    split = layers * (2 * hq * d * h / ranks + 2 * hkv * d * h * kv_share + 3 * h * i / ranks)
    whole = v * h * (1 if config.get("tie_word_embeddings") else 2) + layers * 2 * h + h
    whole += layers * 2 * d if config["model_type"] == "qwen3" else 0
    if config["model_type"] == "qwen2":  # q/k/v biases, split like their rows
        split += layers * (hq * d / ranks + 2 * hkv * d * kv_share)
    full = whole + layers * (2 * hq * d * h + 2 * hkv * d * h + 3 * h * i)
    full += layers * (hq * d + 2 * hkv * d) if config["model_type"] == "qwen2" else 0
    return (whole + split) / full


# --- the plan, no ranks needed ---------------------------------------------------------------

def cfg_of(**kw):
    return parse_config(dict(FAMILY_CONFIGS["llama"], **kw), "config.json")


@pytest.mark.parametrize("hq,hkv,ranks,q,kv", [
    (4, 2, 2, [(0, 2), (2, 4)], [(0, 1), (1, 2)]),
    (4, 2, 4, [(0, 1), (1, 2), (2, 3), (3, 4)], [(0, 1), (0, 1), (1, 2), (1, 2)]),  # KV replicated in pairs
    (8, 8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)], [(0, 2), (2, 4), (4, 6), (6, 8)]),
    (8, 1, 2, [(0, 4), (4, 8)], [(0, 1), (0, 1)]),  # MQA: every rank keeps the one KV head
])
def test_plan_heads(hq, hkv, ranks, q, kv):
    cfg = cfg_of(num_attention_heads=hq, num_key_value_heads=hkv, head_dim=8)
    plans = [TensorPlan.of(cfg, r, ranks) for r in range(ranks)]
    assert [p.q[:2] for p in plans] == q and [p.kv[:2] for p in plans] == kv
    # Every query head reads the KV head it reads in the whole model.
    for p in plans:
        for head in range(*p.q[:2]):
            assert p.kv[0] <= head // (hq // hkv) < p.kv[1]


def test_plan_refuses_what_does_not_split():
    with pytest.raises(ModelLoadError, match=r"divisible by 3: 4 attention heads, 2 KV heads.*intermediate_size 128"):
        TensorPlan.of(cfg_of(), 0, 3)


def test_slices_put_back_together_are_the_tensor():
    """Each rank's slice of every split tensor, concatenated in rank order (numpy, not the
    loader), is the whole tensor; KV heads replicated in groups repeat."""
    cfg = cfg_of()
    rng = np.random.default_rng(0)
    shapes = {"model.layers.0.self_attn.q_proj.weight": (64, 64), "model.layers.0.self_attn.o_proj.weight": (64, 64),
              "model.layers.0.mlp.down_proj.weight": (64, 128), "model.layers.0.mlp.up_proj.scales": (128, 2),
              "model.layers.1.self_attn.k_proj.bias": (32,), "model.embed_tokens.weight": (384, 64)}
    for name, shape in shapes.items():
        full = rng.standard_normal(shape)
        parts = [TensorPlan.of(cfg, r, 2).slicer(name, shape) for r in range(2)]
        if parts[0] is None:
            assert "embed" in name and parts[1] is None
            continue
        axis = -1 if ("o_proj" in name or "down_proj" in name) else 0
        assert np.array_equal(np.concatenate([full[p] for p in parts], axis=axis), full), name
    parts = [TensorPlan.of(cfg, r, 4).slicer("model.layers.0.self_attn.v_proj.weight", (32, 64)) for r in range(4)]
    assert [p[0] for p in parts] == [slice(0, 16), slice(0, 16), slice(16, 32), slice(16, 32)]


def test_quantization_group_straddling_ranks_is_refused():
    plan = TensorPlan.of(cfg_of(), 0, 2)  # o_proj input 64 = one group of 64: it cannot be cut
    with pytest.raises(ModelLoadError, match=r"o_proj.scales.*straddle two ranks"):
        plan.slicer("model.layers.0.self_attn.o_proj.scales", (64, 1))


def test_tp_without_a_launch_names_the_ranks(tiny_model):
    from mlxlocal.source.loader import load

    with pytest.raises(ModelLoadError, match=r"--tp 2 asks for 2 ranks.*group of 1.*mlx.launch -n 2"):
        load(str(tiny_model), tp=2)


# --- real ranks --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def quantized_tp_model(tmp_path_factory) -> tuple[Path, dict]:
    """4-bit, group 64: head_dim 32 so each rank's o_proj input (64) is whole groups."""
    config = dict(FAMILY_CONFIGS["qwen3"], hidden_size=128, head_dim=32, intermediate_size=256)
    return build_tiny(tmp_path_factory.mktemp("tpq") / "qwen3q", config, bits=4), config


def test_two_ranks_every_family_matches_the_whole_model(tiny_models, quantized_tp_model):
    """Greedy tokens, batch 1 and 8 over two engines, a prefix-cache hit: equal to tp=1, for
    each native family and a 4-bit model; weights per rank as the plan says (~1/2 + shared)."""
    families = list(FAMILY_CONFIGS)
    rows = launch(2, *[str(tiny_models[f]) for f in families], str(quantized_tp_model[0]))
    assert len(rows) == len(families) + 1
    for family, row in zip(families + ["qwen3-4bit"], rows):
        assert row["batch1"] and row["batch8"] and row["prefix"], (family, row)
        assert row["prefix_hit_tokens"] >= 16, row
        assert row["heads"] == [2, 1]
    for family, row in zip(families, rows):
        share = row["bytes_rank0"] / row["bytes_whole"]
        assert share == pytest.approx(weight_share(FAMILY_CONFIGS[family], 2), rel=1e-6), family
    q = rows[-1]
    assert q["bytes_rank0"] < 0.75 * q["bytes_whole"], q


def test_two_ranks_with_kv_bits_and_speculation(quantized_tp_model):
    """8-bit KV pools (group 32: head_dim 32), prompt lookup and a draft model on a tensor-parallel
    4-bit target: the tokens of the whole model (the drafts must have been accepted)."""
    (row,) = launch(2, str(quantized_tp_model[0]), "--features")
    assert row["kv8"] and row["lookup"] and row["draft"], row
    assert row["draft_accepted"] > 0 and row["lookup_accepted"] > 0, row


def test_two_ranks_keep_the_disk_tier_each_its_part(tiny_model, tmp_path):
    """--kv-disk in a cluster: each rank writes its KV heads of the prompt's blocks to a store of
    its own; a new engine reads them back on both ranks and answers as the whole model. When
    rank 1's file is damaged, rank 0's verified copy is not used either: the prompt is
    prefilled, and written again on both ranks, so the next engine restores it."""
    (row,) = launch(2, str(tiny_model), f"--disk={tmp_path}")
    assert row["disk_first"] and row["disk_restored"], row
    # 9 full blocks on every rank, and the 5 tokens of the partial last block but the last
    # token (a prompt's last token is always computed).
    assert (row["disk_tokens"], row["disk_hits"]) == (149, 10), row  # the tail is a block too
    assert row["disk_stores"] == ["0/2", "1/2"]
    assert row["damaged_same"] and row["damaged_disk_tokens"] == 0, row
    assert row["damaged_removed"] == 1  # rank 0's copy of the run, not used without rank 1's
    assert row["healed_same"] and row["healed_disk_tokens"] == 149, row
    # Rank 1's tail file damaged: the full blocks come back, the tail is prefilled.
    assert row["tail_damaged_same"] and row["tail_damaged_disk_tokens"] == 144, row
    assert row["logprob_error"] < 1e-4, row  # every serve: the whole model's logprobs


def test_two_ranks_keep_window_blocks_on_disk(tmp_path):
    """A model with sliding-window layers beside full ones: every rank writes its part of the
    window block kept at each block's position with the block, and reads its rows back into
    the window blocks rank 0 took; the restored tokens are the whole model's, and a damaged
    rank-1 file is prefilled instead."""
    windowed = dict(FAMILY_CONFIGS["llama"], sliding_window=32,
                    layer_types=["sliding_attention", "full_attention"])
    (row,) = launch(2, str(build_tiny(tmp_path / "window", windowed, template="llama3", seed=1)),
                    f"--disk={tmp_path / 'kv'}")
    assert row["batch1"] and row["batch8"] and row["prefix"], row
    assert row["disk_first"] and row["disk_restored"], row
    assert (row["disk_tokens"], row["disk_hits"]) == (144, 9), row
    assert row["damaged_same"] and row["damaged_disk_tokens"] == 0, row
    assert row["healed_same"] and row["healed_disk_tokens"] == 144, row
    assert row["logprob_error"] < 1e-4, row


MOE = dict(BASE, model_type="qwen3_moe", rope_theta=1e6, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False)


def test_mlx_lm_model_split_by_its_own_shard(tmp_path):
    """An mlx-lm-path MoE model (qwen3_moe: mlx-lm's code, split by its own shard()) on 2 ranks:
    the tokens of the whole model, batch 1 and 8 over two engines, a prefix hit; a rank holds
    less than the whole."""
    (row,) = launch(2, str(build_tiny(tmp_path / "qwen3moe", MOE)))
    assert row["batch1"] and row["batch8"] and row["prefix"] and row["prefix_hit_tokens"] >= 16, row
    assert row["bytes_rank0"] < 0.8 * row["bytes_whole"], row


def test_mlx_lm_model_without_shard_is_refused(mlx_lm_models):
    """The split each rank's loader decides (before any group is needed): an mlx-lm model class
    without shard() cannot be split."""
    from mlxlocal.source.loader import _tensor_parallel

    config = json.loads((mlx_lm_models["gemma3"] / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=r"--tp needs a native model .* or an mlx-lm model with shard\(\); "
                                             r"model_type 'gemma3_text' has none"):
        _tensor_parallel(config, "config.json", 2, False)


def test_four_ranks_replicate_kv_heads(tiny_models):
    """4 ranks, 2 KV heads: pairs of ranks share one; tokens still those of the whole model."""
    (row,) = launch(4, str(tiny_models["llama"]))
    assert row["batch1"] and row["batch8"] and row["prefix"], row
    assert row["heads"] == [1, 1]
    assert row["bytes_rank0"] / row["bytes_whole"] == pytest.approx(weight_share(FAMILY_CONFIGS["llama"], 4), rel=1e-6)


# --- the CLI and the server -------------------------------------------------------------------

def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "mlxlocal", *args], capture_output=True, text=True,
                          timeout=timeout, env=ENV)


@pytest.mark.parametrize("how", [[], ["--pp"]])
def test_launch_cluster_generate_equals_one_process(tiny_model, how):
    """`launch-cluster -n 2` (heads) and `-n 2 --pp` (layers): the one-process greedy tokens."""
    args = ["generate", "-m", str(tiny_model), "--max-tokens", "12", "--temp", "0", "-p", "hello there", "--json"]
    one = cli(*args)
    two = cli("launch-cluster", "-n", "2", *how, "--", *args)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    assert json.loads(two.stdout)["tokens"] == json.loads(one.stdout)["tokens"]
    assert len(json.loads(one.stdout)["tokens"]) == 12


@pytest.mark.parametrize("args,message", [
    ([], "needs the command to run after --"),
    (["-n", "1", "--", "generate"], "-n must be at least 2"),
    (["--", "generate"], "give either -n N"),
    (["-n", "2", "--hostfile", "h.json", "--", "generate"], "give either -n N"),
])
def test_launch_cluster_refuses_bad_usage(args, message):
    out = cli("launch-cluster", *args)
    assert out.returncode == 2 and message in out.stderr


def test_show_prints_the_plan(tiny_models):
    """`show --tp 2`: each rank's heads and weight bytes, the share the config implies."""
    out = cli("show", str(tiny_models["llama"]), "--tp", "2")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    share = f"{weight_share(FAMILY_CONFIGS['llama'], 2):.0%}"
    assert "rank 0 q heads 0..1, kv heads 0..0, mlp columns 0..63; weights" in text
    assert "rank 1 q heads 2..3, kv heads 1..1, mlp columns 64..127; weights" in text and f"({share} of" in text
    pp = " ".join(cli("show", str(tiny_models["llama"]), "--pp", "2").stdout.split())
    # One layer each; rank 0 also the embeddings, norm and head (344,832 and 147,968 bytes: what
    # launched stages of this model held when measured; test_pipeline_parallel checks the shares).
    assert "rank 0 layers 0..0 + embeddings, final norm, head; weights 336.75 KiB" in pp
    assert "rank 1 layers 1..1; weights 144.50 KiB" in pp
    bad = cli("show", str(tiny_models["llama"]), "--tp", "3")
    assert bad.returncode == 1 and "divisible by 3: 4 attention heads" in bad.stderr


@pytest.mark.parametrize("how", [[], ["--pp"]])
def test_bench_under_a_cluster_reports_ranks_and_links(tiny_models, how):
    out = cli("launch-cluster", "-n", "2", *how, "--", "bench", "-m", str(tiny_models["qwen3"]), "-p", "32",
              "-g", "16", "--repeats", "1", "--warmup", "0", "--json", timeout=240)
    assert out.returncode == 0, out.stderr[-3000:]
    speed = json.loads(out.stdout)["speed"]
    c = speed["cluster"]
    assert c["ranks"] == 2 and all(w > 0 for w in c["weight_bytes"])
    assert all(p > 0 for p in c["peak_memory_bytes"]) and c["comm_s_per_step"] > 0
    if how:  # one layer each: rank 0 also holds the (tied) embedding
        assert c["mode"] == "pipeline" and c["weight_bytes"][0] > c["weight_bytes"][1]
        assert c["collectives_per_step"] == 1 and c["link_bytes_per_step"] == 1 * 64 * 4  # [1, 64] fp32 per link
    else:
        assert c["mode"] == "tensor" and c["weight_bytes"][0] == c["weight_bytes"][1]
        assert c["collectives_per_step"] == 2 * FAMILY_CONFIGS["qwen3"]["num_hidden_layers"]
        assert c["link_bytes_per_step"] == 4 * 1 * 64 * 4 * 2 * 1 // 2  # 4 all_sums of [1, 64] fp32, ring halves
    roof = speed["roofline"]
    assert roof["comm_s_per_token"] == c["comm_s_per_step"] and roof["weight_bytes"] == c["weight_bytes"][0]


@contextmanager
def served(tiny_model: Path, launcher: list[str], **env: str):
    """`serve` on 2 ranks started by `launcher`; yields (base URL, the follower's pid)."""
    port = free_ports(1)[0]
    server = subprocess.Popen([*launcher, "serve", "-m", str(tiny_model), "--port", str(port)],
                              env=dict(ENV, **env), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                              start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline and server.poll() is None, "the cluster never answered /health"
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        ranks = [p for p in _descendants(server.pid) if b"MLX_RANK=" in _environ(p) and b"serve" in _cmdline(p)]
        yield base, next(p for p in ranks if b"MLX_RANK=1" in _environ(p))
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:  # ending must not hang either, whatever happened to a rank
            os.killpg(server.pid, signal.SIGKILL)
            raise AssertionError("the cluster did not exit within 30 s of SIGTERM") from None


def ask(base: str, tiny_model: Path, **kw):
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=60)
    return client, client.chat.completions.create(model=tiny_model.name, messages=[{"role": "user", "content": "hi"}],
                                                  max_tokens=8, temperature=0, **kw)


def test_serve_under_mlx_launch_answers_openai(tiny_model):
    """`mlx.launch -n 2 -- mlxlocal serve`: the official client gets the one-process reply."""
    mlxlocal = [*mlx_launch(2), "-m", "mlxlocal"]
    one = cli("generate", "-m", str(tiny_model), "--max-tokens", "8", "--temp", "0", "-p", "hi", "--json")
    with served(tiny_model, mlxlocal) as (base, _):
        _, r = ask(base, tiny_model)
        assert r.choices[0].message.content == json.loads(one.stdout)["text"] and r.usage.completion_tokens == 8


@pytest.fixture(scope="module")
def long_model(tmp_path_factory) -> Path:
    """The tiny qwen3 with an 8k context: a 4000-token stream outlasts the follower's loss (at
    512 tokens the stream could end before the signal landed, and nothing was lost)."""
    return build_tiny(tmp_path_factory.mktemp("long") / "qwen3",
                      dict(FAMILY_CONFIGS["qwen3"], max_position_embeddings=8192), template=TEMPLATES["qwen3"])


def _stream_until_error(client, model: Path, lose) -> tuple[float, str]:
    """Streams until the server ends the stream with an error; `lose()` runs on the first chunk."""
    stream = client.chat.completions.create(model=model.name, max_tokens=4000, temperature=0, stream=True,
                                            messages=[{"role": "user", "content": "go on"}],
                                            extra_body={"ignore_eos": True})
    t0 = time.monotonic()
    with pytest.raises(openai.APIError) as e:
        for i, _ in enumerate(stream):
            if i == 0:
                lose()
                t0 = time.monotonic()
    return time.monotonic() - t0, str(e.value)


@pytest.mark.parametrize("how,split", [("killed", []), ("stopped", []), ("killed", ["--pp"])])
def test_a_lost_rank_ends_requests_and_health_says_why(long_model, how, split):
    """launch-cluster serve (heads, or --pp layers): a follower killed (its sockets close) or
    stopped (SIGSTOP: nothing closes, as when a link drops) mid-stream ends that stream with the
    reason within seconds; /health then answers 503 with it and later requests fail within
    seconds (nothing hangs)."""
    launcher = [PYTHON, "-m", "mlxlocal", "launch-cluster", "-n", "2", *split, "--"]
    reason = "a rank of the cluster is gone" if how == "killed" else "did not answer within 3 s"
    with served(long_model, launcher, MLXLOCAL_CLUSTER_TIMEOUT="3") as (base, follower):
        client, _ = ask(base, long_model)
        lose = lambda: os.kill(follower, signal.SIGKILL if how == "killed" else signal.SIGSTOP)  # noqa: E731
        seconds, error = _stream_until_error(client, long_model, lose)
        assert reason in error and seconds < 30, (seconds, error)
        health = httpx.get(base + "/health", timeout=5)
        assert health.status_code == 503 and reason in health.json()["reason"]
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError, match=reason):
            ask(base, long_model)
        assert time.monotonic() - t0 < 20
        if how == "stopped":
            os.kill(follower, signal.SIGKILL)


def _descendants(pid: int) -> list[int]:
    out = [int(p) for p in subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()]
    return out + [d for p in out for d in _descendants(p)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


assert BASE and TEMPLATES and mx  # fixtures' configs are shared with conftest
