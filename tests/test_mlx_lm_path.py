"""Models on the mlx-lm path with configs as transformers 5 writes them.

Each config is transformers' own Config(...).save_pretrained (no torch needed); the random
weights come from mlx-lm's model built from the normalised config. mlxlocal must load the
directory and generate mlx-lm's own greedy tokens on the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlxlocal.engine import SamplingParams, open_engine
from mlxlocal.models.hf_compat import normalize_for_mlx_lm
from mlxlocal.source.loader import load_from_dir

transformers = pytest.importorskip("transformers")

SMALL = dict(vocab_size=384, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]
N_TOKENS = 6


def _configs():
    t = transformers
    return {
        "qwen3_moe": lambda: t.Qwen3MoeConfig(
            **SMALL, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
            num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
        "lfm2": lambda: t.Lfm2Config(**SMALL, intermediate_size=128, layer_types=["conv", "full_attention"]),
        "granitemoehybrid": lambda: t.GraniteMoeHybridConfig(
            **SMALL, intermediate_size=128, shared_intermediate_size=64, num_local_experts=4,
            num_experts_per_tok=2, layer_types=["linear_attention", "full_attention"],
            mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1,
            position_embedding_type="rope"),
        "nemotron_h": lambda: t.NemotronHConfig(
            vocab_size=384, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=512, intermediate_size=128, mamba_num_heads=8, mamba_head_dim=16,
            ssm_state_size=16, n_groups=1, layers_block_type=["linear_attention", "full_attention", "mlp"]),
        "falcon_h1": lambda: t.FalconH1Config(
            **SMALL, intermediate_size=128, head_dim=16, mamba_n_heads=8, mamba_d_head=16,
            mamba_d_ssm=128, mamba_d_state=16, mamba_n_groups=1),
    }


def _mlx_lm_model(config: dict):
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(config)
    return model_cls(args_cls.from_dict(config))


def write_hf5_model(path: Path, model_type: str, seed: int = 0) -> tuple[Path, dict]:
    """transformers-5 config.json, a tokenizer, mlx-lm-built random weights; returns the
    directory and the weights (to give mlx-lm's reference model the same ones)."""
    from mlxlocal.source.synthetic.tokenizer import write_tokenizer

    path.mkdir(parents=True)
    _configs()[model_type]().save_pretrained(path)
    config = json.loads((path / "config.json").read_text())
    assert "rope_theta" not in config  # really the transformers-5 layout
    ids = write_tokenizer(path, SMALL["vocab_size"], "chatml", 512)
    config["eos_token_id"] = ids["eos_token_id"]
    config.pop("bos_token_id", None)
    (path / "config.json").write_text(json.dumps(config))
    mx.random.seed(seed)
    model = _mlx_lm_model(normalize_for_mlx_lm(config))
    # Some default inits (lfm2, falcon_h1) make a tiny model repeat one token: spread them
    # so greedy tokens vary and a mismatch shows.
    weights = {k: v + 0.3 * mx.random.normal(v.shape, dtype=v.dtype) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    return path, weights


def mlx_lm_greedy(config: dict, weights: dict, prompt: list[int], n: int) -> list[int]:
    """mlx-lm's own generate_step (greedy) on its own model object with `weights`."""
    from mlx_lm.generate import generate_step

    model = _mlx_lm_model(normalize_for_mlx_lm(config))
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    steps = generate_step(mx.array(prompt, mx.uint32), model, max_tokens=n)
    return [int(tok) for tok, _ in steps]


def engine_run(engine, prompt, n, session=None):
    """(greedy tokens, the final chunk's stats)."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    chunks = list(engine.generate(prompt, params, session=session))
    return [c.token for c in chunks if c.token is not None], chunks[-1].stats


def engine_tokens(engine, prompt, n, session=None) -> list[int]:
    return engine_run(engine, prompt, n, session)[0]


@pytest.mark.parametrize("model_type", ["qwen3_moe", "lfm2", "granitemoehybrid", "nemotron_h", "falcon_h1"])
def test_transformers5_config_generates_mlx_lm_tokens(tmp_path, model_type):
    path, weights = write_hf5_model(tmp_path / model_type, model_type)
    loaded = load_from_dir(path)
    assert not loaded.info.native
    engine = open_engine(loaded)
    got = engine_tokens(engine, PROMPT, N_TOKENS)
    config = json.loads((path / "config.json").read_text())
    assert got == mlx_lm_greedy(config, weights, PROMPT, N_TOKENS)


@pytest.mark.parametrize("model_type", ["nemotron_h", "falcon_h1"])
def test_hybrid_session_two_turns(tmp_path, model_type):
    """Recurrent caches have no offset and cannot be trimmed: a turn that extends the last
    one continues the state; one that diverges starts over on a fresh cache."""
    path, weights = write_hf5_model(tmp_path / model_type, model_type)
    config = json.loads((path / "config.json").read_text())
    # A small prefill step, so prompts also go through the chunked prefill.
    engine = open_engine(load_from_dir(path), max_step_tokens=3)
    session = engine.new_session()

    turn1 = engine_tokens(engine, PROMPT, N_TOKENS, session)
    assert turn1 == mlx_lm_greedy(config, weights, PROMPT, N_TOKENS)

    # Turn 2 extends turn 1 (prompt + reply + new message): the state is kept.
    prompt2 = PROMPT + turn1 + [8, 9, 10]
    turn2, stats2 = engine_run(engine, prompt2, N_TOKENS, session)
    assert turn2 == mlx_lm_greedy(config, weights, prompt2, N_TOKENS)
    assert stats2.cached_tokens == len(PROMPT) + N_TOKENS - 1  # the last reply token was never fed

    # Turn 3 diverges inside the cached prefix: no trim possible, so it starts fresh.
    prompt3 = PROMPT[:4] + [12, 13]
    turn3, stats3 = engine_run(engine, prompt3, N_TOKENS, session)
    assert turn3 == mlx_lm_greedy(config, weights, prompt3, N_TOKENS)
    assert stats3.cached_tokens == 0


def test_normalize_maps_transformers5_fields():
    qwen = normalize_for_mlx_lm(_configs()["qwen3_moe"]().to_dict())
    assert qwen["num_experts"] == 4 and qwen["rope_theta"] == 1e6 and qwen["head_dim"] == 16
    assert qwen.get("rope_scaling") is None  # default rope: no scaling
    lfm = normalize_for_mlx_lm(_configs()["lfm2"]().to_dict())
    assert lfm["block_dim"] == 64 and lfm["block_ff_dim"] == 128
    granite = normalize_for_mlx_lm(_configs()["granitemoehybrid"]().to_dict())
    assert granite["layer_types"] == ["mamba", "attention"]
    yarn = normalize_for_mlx_lm({"model_type": "phi3", "rope_parameters": {
        "rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0, "partial_rotary_factor": 0.5}})
    assert yarn["rope_theta"] == 5e5 and yarn["partial_rotary_factor"] == 0.5
    assert yarn["rope_scaling"]["rope_type"] == "yarn" and yarn["rope_scaling"]["factor"] == 4.0
    # transformers-4 names win: an mlx-community config comes back unchanged.
    old = {"model_type": "qwen3_moe", "rope_theta": 1e4, "num_experts": 8, "head_dim": 32,
           "mlp_only_layers": [], "rope_parameters": {"rope_theta": 1e6}}
    assert normalize_for_mlx_lm(old) == old
