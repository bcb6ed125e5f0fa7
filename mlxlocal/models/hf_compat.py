"""transformers-5 config.json fields -> the names mlx-lm 0.32's ModelArgs read.

transformers 5 nests rope settings under `rope_parameters` and renamed some MoE and hybrid
fields; mlx-lm 0.32 still reads the transformers-4 names for most model types, so a
config saved by transformers 5 either fails to build or silently loses its rope theta.
"""

from __future__ import annotations

import copy
from typing import Any

# transformers 5 writes non-JSON floats as {"__float__": "Infinity"} (e.g. time_step_limit).
_FLOAT_TAGS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}

# transformers 5 layer-type names -> granitemoehybrid's names in mlx-lm 0.32.
_GRANITE_LAYER_TYPES = {"linear_attention": "mamba", "full_attention": "attention"}


def normalize_for_mlx_lm(config: dict[str, Any]) -> dict[str, Any]:
    """A copy of `config` with the transformers-5 fields also under their mlx-lm names.

    Only fills in what is missing: a config that already has the transformers-4 names
    (e.g. an mlx-community conversion) comes back unchanged.
    """
    config = _decode_floats(copy.deepcopy(config))
    _rope(config)
    fix = _BY_TYPE.get(config.get("model_type"))
    if fix is not None:
        fix(config)
    return config


def _decode_floats(obj: Any) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__float__"} and obj["__float__"] in _FLOAT_TAGS:
            return _FLOAT_TAGS[obj["__float__"]]
        return {k: _decode_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode_floats(v) for v in obj]
    return obj


def _rope(config: dict[str, Any]) -> None:
    # {"rope_theta": .., "rope_type": .., <scaling fields>} -> rope_theta + rope_scaling.
    params = config.get("rope_parameters")
    if not isinstance(params, dict):
        return
    if "rope_theta" in params and config.get("rope_theta") is None:
        config["rope_theta"] = params["rope_theta"]
    if "partial_rotary_factor" in params and config.get("partial_rotary_factor") is None:
        config["partial_rotary_factor"] = params["partial_rotary_factor"]
    scaling = {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}
    rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
    # "default" means no scaling: mlx-lm's models expect rope_scaling absent / None then.
    if rope_type != "default" and config.get("rope_scaling") is None:
        config["rope_scaling"] = {**scaling, "rope_type": rope_type, "type": rope_type}


def _qwen3_moe(config: dict[str, Any]) -> None:
    # transformers 5 serialises num_experts as num_local_experts (its attribute_map) and
    # drops head_dim when it equals hidden_size // num_attention_heads.
    if config.get("num_experts") is None and config.get("num_local_experts") is not None:
        config["num_experts"] = config["num_local_experts"]
    if config.get("head_dim") is None and config.get("hidden_size") and config.get("num_attention_heads"):
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    if config.get("mlp_only_layers") is None:
        config["mlp_only_layers"] = []
    config.setdefault("rope_theta", 10000.0)  # transformers' default when rope_parameters is absent too


def _lfm2(config: dict[str, Any]) -> None:
    # transformers 5 dropped block_dim (always hidden_size) and renamed block_ff_dim to
    # intermediate_size (mlx-lm falls back to the latter itself).
    if config.get("block_dim") is None and config.get("hidden_size") is not None:
        config["block_dim"] = config["hidden_size"]
    if config.get("block_ff_dim") is None and config.get("intermediate_size") is not None:
        config["block_ff_dim"] = config["intermediate_size"]


def _granitemoehybrid(config: dict[str, Any]) -> None:
    # transformers 5 spells the layer types linear_attention / full_attention (and
    # reads the old layers_block_type through an alias); mlx-lm wants mamba / attention.
    types = config.get("layer_types") or config.get("layers_block_type")
    if types is not None:
        config["layer_types"] = [_GRANITE_LAYER_TYPES.get(t, t) for t in types]
    if config.get("mamba_d_head") == "auto" and config.get("mamba_n_heads"):
        # transformers resolves "auto" in __post_init__; a hand-written config may still hold it.
        inner = config.get("mamba_expand", 2) * config["hidden_size"]
        config["mamba_d_head"] = inner // config["mamba_n_heads"]


_BY_TYPE = {
    "qwen3_moe": _qwen3_moe,
    "lfm2": _lfm2,
    "granitemoehybrid": _granitemoehybrid,
}
