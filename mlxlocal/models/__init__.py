"""Model construction: native llama-family models, mlx-lm's models for everything else."""

from __future__ import annotations

import pkgutil
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxlocal.errors import ModelLoadError, UnsupportedModelError
from mlxlocal.models import llama
from mlxlocal.models.config import ModelConfig, parse_config
from mlxlocal.models.hf_compat import normalize_for_mlx_lm
from mlxlocal.models.kv import DenseKV, LayerKV

__all__ = [
    "DenseKV",
    "LayerKV",
    "ModelConfig",
    "build_model",
    "is_native",
    "mlx_lm_model_types",
    "mlx_lm_shardable",
    "quantize_for_checkpoint",
]

NATIVE_TYPES = {family: llama for family in llama.FAMILIES}


def is_native(model_type: str | None) -> bool:
    return model_type in NATIVE_TYPES


def mlx_lm_model_types() -> list[str]:
    import mlx_lm.models as pkg

    skip = {"base", "cache", "rope_utils", "activations", "switch_layers", "pipeline"}
    return sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if m.name not in skip)


def _mlx_lm_classes(config: dict[str, Any]):
    from mlx_lm.utils import _get_classes

    try:
        return _get_classes(config)
    except ValueError:
        native = ", ".join(sorted(NATIVE_TYPES))
        raise UnsupportedModelError(
            f"model_type '{config.get('model_type')}' is not supported. Native: {native}; "
            f"through mlx-lm: {', '.join(mlx_lm_model_types())}"
        ) from None


def mlx_lm_shardable(config: dict[str, Any]) -> bool:
    """An mlx-lm model class with its own tensor-parallel `shard(group)`."""
    model_cls, _ = _mlx_lm_classes(normalize_for_mlx_lm(config))
    return hasattr(model_cls, "shard")


def build_model(config: dict[str, Any], weights: dict[str, mx.array], path: str) -> tuple[nn.Module, ModelConfig | None]:
    """Instantiate the model for `config` (native when we have it), not yet loaded."""
    model_type = config.get("model_type")
    if not model_type:
        raise ModelLoadError(f"{path}: config.json has no 'model_type'")
    if is_native(model_type):
        cfg = parse_config(config, path)
        if config.get("tie_word_embeddings") is None:
            # Configs that omit the flag: the checkpoint itself says whether a head exists.
            cfg.tie_word_embeddings = "lm_head.weight" not in weights
        return NATIVE_TYPES[model_type].Model(cfg), cfg
    # mlx-lm 0.32 reads transformers-4 field names; configs saved by transformers 5 need mapping.
    config = normalize_for_mlx_lm(config)
    model_cls, args_cls = _mlx_lm_classes(config)
    try:
        return model_cls(args_cls.from_dict(config)), None
    except (TypeError, ValueError, KeyError) as e:
        raise ModelLoadError(f"{path}: config.json does not fit mlx-lm's {model_type}: {e}") from None


def quantize_for_checkpoint(model: nn.Module, config: dict[str, Any], weights: dict[str, mx.array]) -> None:
    """Swap in quantized layers exactly where the checkpoint holds quantized tensors.

    config["quantization"] holds the defaults plus per-layer overrides keyed by module
    path (a dict of group_size/bits, or false for a layer kept in full precision).
    """
    quant = config.get("quantization")
    if not quant:
        return
    if not isinstance(quant, dict) or "bits" not in quant or "group_size" not in quant:
        raise ModelLoadError(f"config.json: 'quantization' needs 'bits' and 'group_size', got {quant!r}")

    def predicate(path: str, module: nn.Module):
        if path in quant:
            return quant[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        # Layers the defaults do not describe: read group size and bits off the tensors.
        in_dims = module.weight.shape[-1]
        group_size = in_dims // weights[f"{path}.scales"].shape[-1]
        bits = weights[f"{path}.weight"].shape[-1] * 32 // in_dims
        return {"group_size": group_size, "bits": bits, "mode": quant.get("mode", "affine")}

    nn.quantize(
        model,
        group_size=quant["group_size"],
        bits=quant["bits"],
        mode=quant.get("mode", "affine"),
        class_predicate=predicate,
    )

