"""Model config: read what transformers 4 and 5 write, for every field that changes the math.

An option we do not implement is an error here, never a silent default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlxlocal.errors import ConfigError

# The rope types mlx-lm's initialize_rope implements and we accept for native models.
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic")

# Fields whose presence with a non-default value would change the math in ways the
# native llama family does not implement.
_UNSUPPORTED_IF_SET = {
    "pretraining_tp": lambda v: v not in (None, 1),
    "hidden_act": lambda v: v not in (None, "silu"),
}


@dataclass
class ModelConfig:
    """The fields of config.json that the native llama-family models use."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    # Per layer: "full_attention" or "sliding_attention"; sliding layers see `sliding_window` keys.
    layer_types: list[str] = field(default_factory=list)
    sliding_window: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    quantization: dict[str, Any] | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def context_length(self) -> int:
        return self.max_position_embeddings


def read_config_file(model_dir: Path) -> dict[str, Any]:
    """config.json plus the eos ids from generation_config.json (which wins, as in transformers)."""
    path = model_dir / "config.json"
    if not path.is_file():
        raise ConfigError(f"{model_dir}: no config.json")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: expected a JSON object at the top level")
    gen_path = model_dir / "generation_config.json"
    if gen_path.is_file():
        try:
            gen = json.loads(gen_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{gen_path}: not valid JSON ({e})") from None
        if isinstance(gen, dict) and gen.get("eos_token_id") is not None:
            config["eos_token_id"] = gen["eos_token_id"]
    # Multimodal wrappers nest the language model's config.
    if "text_config" in config and "hidden_size" not in config:
        merged = dict(config["text_config"])
        for key in ("quantization", "quantization_config", "eos_token_id"):
            if key in config and key not in merged:
                merged[key] = config[key]
        merged.setdefault("model_type", config.get("model_type"))
        config = merged
    return config


def _require(config: dict, key: str, kind: type, path: str) -> Any:
    if key not in config or config[key] is None:
        raise ConfigError(f"{path}: missing required field '{key}'")
    value = config[key]
    if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{path}: field '{key}' must be an integer, got {value!r}")
    if kind is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
        raise ConfigError(f"{path}: field '{key}' must be a number, got {value!r}")
    if kind is int and value <= 0:
        raise ConfigError(f"{path}: field '{key}' must be positive, got {value}")
    return value


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope(config: dict, path: str) -> tuple[float, dict | None]:
    """transformers 5 nests theta and scaling under rope_parameters; 4 has them at the top."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or None
    theta = config.get("rope_theta", params.get("rope_theta", 10000.0))
    if scaling is None and params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    if scaling is not None:
        rope_type = scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ConfigError(
                f"{path}: rope type '{rope_type}' is not implemented "
                f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
            )
        if rope_type != "default" and "factor" not in scaling:
            raise ConfigError(f"{path}: rope scaling '{rope_type}' needs a 'factor'")
        if rope_type == "default":
            scaling = None
        else:
            scaling = {**scaling, "rope_type": rope_type}
    return float(theta), scaling


def parse_config(config: dict[str, Any], path: str = "config.json") -> ModelConfig:
    """Validate a llama-family config dict into a ModelConfig, naming the field at fault."""
    for key, is_bad in _UNSUPPORTED_IF_SET.items():
        if key in config and is_bad(config[key]):
            raise ConfigError(f"{path}: {key}={config[key]!r} is not implemented")
    model_type = config.get("model_type")
    hidden = _require(config, "hidden_size", int, path)
    n_heads = _require(config, "num_attention_heads", int, path)
    n_kv = config.get("num_key_value_heads") or n_heads
    if n_heads % n_kv:
        raise ConfigError(
            f"{path}: num_attention_heads ({n_heads}) must be a multiple of "
            f"num_key_value_heads ({n_kv})"
        )
    head_dim = config.get("head_dim") or hidden // n_heads
    n_layers = _require(config, "num_hidden_layers", int, path)
    theta, scaling = _rope(config, path)
    if config.get("rope_traditional"):
        raise ConfigError(f"{path}: rope_traditional=true is not implemented for native models")

    sliding_window = config.get("sliding_window")
    layer_types = config.get("layer_types")
    if layer_types is None:
        uses_window = sliding_window is not None and (
            model_type == "mistral" or config.get("use_sliding_window", False)
        )
        layer_types = ["sliding_attention" if uses_window else "full_attention"] * n_layers
        if uses_window and model_type in ("qwen2", "qwen3"):
            # Qwen: layers below max_window_layers use full attention.
            first = config.get("max_window_layers", n_layers)
            layer_types = ["full_attention" if i < first else "sliding_attention" for i in range(n_layers)]
    if len(layer_types) != n_layers:
        raise ConfigError(
            f"{path}: layer_types has {len(layer_types)} entries for {n_layers} layers"
        )
    for lt in set(layer_types):
        if lt not in ("full_attention", "sliding_attention"):
            raise ConfigError(f"{path}: layer type '{lt}' is not implemented")
    if "sliding_attention" in layer_types and not sliding_window:
        raise ConfigError(f"{path}: sliding_attention layers need 'sliding_window'")

    attention_bias = config.get("attention_bias")
    if attention_bias is None:
        attention_bias = model_type == "qwen2"  # Qwen2 has q/k/v biases and no flag for them
    return ModelConfig(
        model_type=model_type,
        hidden_size=hidden,
        num_hidden_layers=n_layers,
        intermediate_size=_require(config, "intermediate_size", int, path),
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        vocab_size=_require(config, "vocab_size", int, path),
        rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=int(config.get("max_position_embeddings") or 4096),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", model_type != "llama")),
        attention_bias=bool(attention_bias),
        mlp_bias=bool(config.get("mlp_bias", False)),
        qk_norm=model_type == "qwen3",
        layer_types=list(layer_types),
        sliding_window=sliding_window if "sliding_attention" in layer_types else None,
        eos_token_ids=_as_id_list(config.get("eos_token_id")),
        bos_token_id=config.get("bos_token_id"),
        quantization=config.get("quantization"),
        raw=config,
    )
