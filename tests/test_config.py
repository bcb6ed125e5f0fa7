"""Config parsing: transformers 4 and 5 layouts, fields that change the math, clear errors."""

from __future__ import annotations

import json

import pytest

from mlxlocal.errors import ConfigError, ModelLoadError, UnsupportedModelError
from mlxlocal.models.config import parse_config, read_config_file
from mlxlocal.source.loader import load_from_dir

V4 = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
          num_attention_heads=4, num_key_value_heads=2, vocab_size=100, rms_norm_eps=1e-5,
          rope_theta=500000.0, max_position_embeddings=4096,
          rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})


def v5_of(v4: dict) -> dict:
    v5 = {k: v for k, v in v4.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = {**(v4.get("rope_scaling") or {"rope_type": "default"}), "rope_theta": v4["rope_theta"]}
    return v5


def test_transformers_4_and_5_layouts_parse_the_same():
    a, b = parse_config(V4), parse_config(v5_of(V4))
    assert (a.rope_theta, a.rope_scaling) == (b.rope_theta, b.rope_scaling)
    assert a.rope_scaling["rope_type"] == "llama3" and a.rope_theta == 500000.0
    assert a.head_dim == 16 and a.num_key_value_heads == 2


def test_transformers5_written_config_parses():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=128, vocab_size=300,
                                   head_dim=16, rope_theta=123456.0)
    parsed = parse_config(cfg.to_dict())
    assert parsed.rope_theta == 123456.0 and parsed.qk_norm and parsed.head_dim == 16


def test_yarn_and_legacy_type_key():
    cfg = dict(V4, rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768})
    assert parse_config(cfg).rope_scaling["rope_type"] == "yarn"


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(rope_scaling={"rope_type": "longrope-xyz", "factor": 2.0}), ["rope type", "longrope-xyz"]),
        (dict(rope_scaling={"rope_type": "linear"}), ["factor"]),
        (dict(hidden_size=None), ["hidden_size"]),
        (dict(num_hidden_layers="2"), ["num_hidden_layers", "integer"]),
        (dict(num_key_value_heads=3), ["num_key_value_heads", "multiple"]),
        (dict(hidden_act="gelu"), ["hidden_act"]),
        (dict(rope_traditional=True), ["rope_traditional"]),
        (dict(layer_types=["full_attention"]), ["layer_types", "2 layers"]),
        (dict(layer_types=["sliding_attention"] * 2), ["sliding_window"]),
    ],
)
def test_math_changing_fields_are_clear_errors(change, words):
    with pytest.raises(ConfigError) as e:
        parse_config({**V4, **change}, "x/config.json")
    for word in words:
        assert word in str(e.value)
    assert "x/config.json" in str(e.value)


def test_eos_ids_from_generation_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(V4, eos_token_id=2)))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert parse_config(read_config_file(tmp_path)).eos_token_ids == [2, 7]


def test_qwen_sliding_window_respects_max_window_layers():
    cfg = dict(V4, model_type="qwen2", num_hidden_layers=4, use_sliding_window=True,
               sliding_window=64, max_window_layers=2, rope_scaling=None)
    assert parse_config(cfg).layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2


def test_bad_config_json_file(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="config.json"):
        read_config_file(tmp_path)


def test_unknown_model_type_lists_supported(tmp_path, tiny_model):
    import shutil

    shutil.copytree(tiny_model, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["model_type"] = "not_a_model"
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError) as e:
        load_from_dir(tmp_path / "m")
    assert "not_a_model" in str(e.value) and "qwen3" in str(e.value) and "gemma" in str(e.value)


def test_weights_not_matching_config(tmp_path, tiny_model):
    import shutil

    shutil.copytree(tiny_model, tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="missing"):
        load_from_dir(tmp_path / "m")
