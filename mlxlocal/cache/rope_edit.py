"""Re-rotating cached keys to new rope positions (cache edits: reposition).

Keys sit in the pools after rope: a key stored for position p is R(θ(p))·k. Moving the token
to position q needs R(θ(q))·k, so we undo the rotation at p and apply the one at q, both in
float32 with mx.fast.rope and the layer's own frequencies, so the angles are computed exactly
as the model's forward computes them. One delta rotation R(θ(q) - θ(p)) is not used: its angle
(q - p)·f is not the difference of the two rounded angles p·f and q·f the model computes, and
at positions near 100k that costs ~5e-3 of absolute error in fp32 (see tests/test_rope_edit.py).

The inverse is the same rotation conjugated: R(-θ) = C·R(θ)·C, where C negates the second
element of every rotated pair; negation is exact, so inverse and forward share every cos/sin.
Tokens go on the batch axis with one offset each (mx.fast.rope rotates `offset + t` along T,
so a block of tokens with one offset would all get consecutive positions).

Ropes whose frequencies depend on the sequence length (dynamic NTK) cannot be moved: a key's
rotation depends on the length when it was written. Those, and rope modules we do not know,
raise RepositionError; dropping tokens without reposition still works for them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import rope_utils


class RepositionError(ValueError):
    """The model's rope (or layout) does not allow moving cached keys; the message says why."""


_DROP_ONLY = "reposition is not possible (dropping tokens without reposition still is)"


@dataclass(frozen=True, eq=False)  # eq=False: `freqs` is an array, == would be elementwise
class RopeSpec:
    """One attention layer's rope, as mx.fast.rope takes it.

    Exactly one of `base` and `freqs` is set. `mscale` is the magnitude factor the layer
    multiplies its input by before rotating (YaRN, longrope): the stored keys already carry it
    and rerotate never applies it; it is recorded for reference only.
    """

    kind: str  # "default" | "linear" | "llama3" | "yarn" | "longrope" | "proportional" | "ntk-alpha"
    dims: int
    traditional: bool
    base: float | None
    scale: float
    freqs: mx.array | None = None
    mscale: float = 1.0


# Ropes whose frequencies are fixed at construction though the class name says "dynamic":
# hunyuan scales its base by a constant alpha once.
_STATIC_BY_NAME = {
    ("mlx_lm.models.hunyuan", "DynamicNTKAlphaRoPE"),
    ("mlx_lm.models.hunyuan_v1_dense", "DynamicNTKAlphaRoPE"),
}


def _class_name(module: object) -> str:
    cls = type(module)
    return f"{cls.__module__}.{cls.__qualname__}"


def rope_spec(module: nn.Module) -> RopeSpec:
    """The RopeSpec of a rope module our models use; RepositionError for the others.

    Exact types only: a subclass may change how positions become angles.
    """
    cls = type(module)
    if cls is nn.RoPE:  # initialize_rope's "default", "linear" (scale = 1/factor) and "mrope"
        kind = "default" if module.scale == 1.0 else "linear"
        return RopeSpec(kind, module.dims, module.traditional, module.base, module.scale)
    if cls is rope_utils.Llama3RoPE:
        return RopeSpec("llama3", module.dims, module.traditional, None, 1.0, module._freqs)
    if cls is rope_utils.YarnRoPE:
        return RopeSpec("yarn", module.dims, module.traditional, None, 1.0, module._freqs, module.mscale)
    if cls is rope_utils.SuScaledRoPE:
        # mlx-lm's longrope always uses the long factors, fixed at construction: exact.
        return RopeSpec("longrope", module.dim, False, None, 1.0, module._freqs, module._scale)
    if cls is rope_utils.ProportionalRoPE:
        # Its unrotated dims have infinite wavelength (angle 0): re-rotating them is the identity.
        return RopeSpec("proportional", module.dims, module.traditional, None, 1.0, module._freqs)
    if (cls.__module__, cls.__qualname__) in _STATIC_BY_NAME:
        return RopeSpec("ntk-alpha", module.dims, False, None, 1.0, module._freqs)
    if cls is rope_utils.DynamicNTKScalingRoPE or "dynamic" in cls.__name__.lower():
        raise RepositionError(
            f"{_class_name(module)} (dynamic NTK) rope: its frequencies depend on the sequence "
            f"length, so a cached key cannot be moved to a new position exactly; {_DROP_ONLY}")
    raise RepositionError(f"unknown rope module {_class_name(module)}: {_DROP_ONLY}")


def _positions(positions: mx.array | Sequence[int], n: int, name: str) -> mx.array:
    p = positions if isinstance(positions, mx.array) else mx.array(list(positions), dtype=mx.int32)
    if p.shape != (n,):
        raise ValueError(f"{name}: one position per key row ({n}), got shape {p.shape}")
    return p.astype(mx.int32)


def _conjugator(spec: RopeSpec, head_dim: int) -> mx.array:
    """C: -1 on the second element of every rotated pair, +1 elsewhere (float32, [head_dim])."""
    i = mx.arange(head_dim)
    if spec.traditional:  # pairs are (2j, 2j + 1)
        second = (i % 2 == 1) & (i < spec.dims)
    else:  # pairs are (j, j + dims/2)
        second = (i >= spec.dims // 2) & (i < spec.dims)
    return mx.where(second, -1.0, 1.0).astype(mx.float32)


def _rope(x: mx.array, positions: mx.array, spec: RopeSpec) -> mx.array:
    return mx.fast.rope(x, spec.dims, traditional=spec.traditional, base=spec.base,
                        scale=spec.scale, offset=positions, freqs=spec.freqs)


def rerotate(keys: mx.array, old_positions: mx.array | Sequence[int],
             new_positions: mx.array | Sequence[int], spec: RopeSpec) -> mx.array:
    """Keys [N, H, D] stored after rope at `old_positions` -> the same keys at `new_positions`.

    One old and one new position per row. Only the first `spec.dims` of D rotate (partial
    rotary), as in the forward. Computed in float32, returned in the keys' dtype.
    """
    if keys.ndim != 3 or keys.shape[-1] < spec.dims:
        raise ValueError(f"keys must be [N, H, D] with D >= {spec.dims}, got shape {keys.shape}")
    n = keys.shape[0]
    old = _positions(old_positions, n, "old_positions")
    new = _positions(new_positions, n, "new_positions")
    if n == 0:
        return keys
    c = _conjugator(spec, keys.shape[-1])
    x = keys.astype(mx.float32)[:, :, None, :]  # [N, H, 1, D]: token n at its own offset
    x = _rope(x * c, old, spec) * c  # R(-θ(old)) = C·R(θ(old))·C
    x = _rope(x, new, spec)
    return x[:, :, 0, :].astype(keys.dtype)


def _is_nope(module: object) -> bool:
    # smollm3 / kimi / muse models put an identity module named NoPE on their no-rope layers.
    cls = type(module)
    return cls.__name__ == "NoPE" and cls.__module__.startswith("mlx_lm.models.")


def _layer_rope(layer: nn.Module, model_type: str) -> RopeSpec | None:
    attn = getattr(layer, "self_attn", None)
    rope = getattr(attn, "rope", None)
    if rope is None:
        raise RepositionError(f"{model_type}: an attention layer has no self_attn.rope to read; {_DROP_ONLY}")
    if hasattr(attn, "kv_lora_rank"):
        # MLA: the cached key puts its rope part after the un-rotated part (or is a latent).
        raise RepositionError(f"{model_type}: multi-head latent attention keys; {_DROP_ONLY}")
    if _is_nope(rope):
        return None
    return rope_spec(rope)


def layer_ropes(model: nn.Module) -> list[RopeSpec | None]:
    """The rope of every attention layer in the order of the model's KV pools (None: no rope).

    Native models hold one pool per layer. On the mlx-lm path the pools follow the attention
    entries of model.make_cache(), which we map to model.layers one to one; models whose
    cache does not line up with their layers are refused.
    """
    model_type = str(getattr(model, "model_type", None) or type(model).__module__)
    if getattr(model, "native", False):
        return [_layer_rope(layer, model_type) for layer in model.layers]
    from mlxlocal.cache.mlx_lm_views import CacheLayout, NotPageable

    try:
        slots = CacheLayout(model).slots
    except NotPageable as e:
        raise RepositionError(f"{model_type}: {e}") from None
    layers = list(getattr(model, "layers", None) or [])
    if len(slots) != len(layers) or any(s.kind == "list" for s in slots):
        raise RepositionError(
            f"{model_type}: its cache entries do not map one to one onto its layers; {_DROP_ONLY}")
    return [_layer_rope(layer, model_type) for slot, layer in zip(slots, layers) if slot.kind == "kv"]


__all__ = ["RepositionError", "RopeSpec", "layer_ropes", "rerotate", "rope_spec"]
