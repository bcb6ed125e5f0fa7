"""Which mlxlocal.metal dispatch points a model calls, at which shapes: for the kernel warm-up.

A site is (op, gate arguments) as the dispatch function's gate sees them, built from the
model's own weights and lazily made activations (mx.zeros is never evaluated here), so the
chooser derives exactly the key the real call will.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxlocal.models.layers import Linear, QuantizedLinear, RMSNorm
from mlxlocal.models.llama import Attention


def _head(model: nn.Module) -> nn.Module | None:
    """The embedding a native model's tied output head multiplies by (embedding_as_linear)."""
    # A pipeline stage without the head holds no embedding either (distributed/stages.py).
    if getattr(model, "native", False) and "lm_head" not in model and "embed_tokens" in model.model:
        return model.model.embed_tokens
    return None


def projection_sites(model: nn.Module, rows: range, dtype: mx.Dtype) -> list[tuple[str, tuple]]:
    """Every distinct projection (our Linear / QuantizedLinear layers and a tied head) at each
    row count M in `rows`, activations in `dtype`. Models on mlx-lm's code have none."""
    layers = [m for _, m in model.named_modules() if isinstance(m, (Linear, QuantizedLinear))]
    head = _head(model)
    distinct = {}  # one module per weight layout: a model repeats the same few projections per layer
    for m in layers + ([head] if head is not None else []):
        sig = (type(m), m is head, *((a.shape, a.dtype) for a in m.parameters().values() if isinstance(a, mx.array)))
        distinct.setdefault(sig, m)
    sites = []
    for m in distinct.values():
        for M in rows:
            quantized = isinstance(m, (QuantizedLinear, nn.QuantizedEmbedding))
            K = m.weight.shape[1] * 32 // m.bits if quantized else m.weight.shape[1]
            x = mx.zeros((M, K), dtype)
            bias = m.get("bias") if m is not head else None
            if quantized:
                sites.append(("quantized_linear", (x, m.weight, m.scales, m.get("biases"), m.group_size,
                                                   m.bits, m.mode, bias)))
            else:
                sites.append(("linear", (x, m.weight, bias)))
    return sites


def attention_heads(model: nn.Module) -> list[tuple[int, int]]:
    """(query heads, head dim of the queries) per attention layer of a native model that this
    process holds (a pipeline stage holds a range; the others are emptied: distributed/stages.py)."""
    return [(layer.self_attn.n_heads, layer.self_attn.head_dim) for layer in model.layers if "self_attn" in layer]


def fused_sites(model: nn.Module) -> tuple[list[tuple[mx.array, float]], list[tuple]]:
    """The norms (weight, eps: one per distinct width) and ropes (args, heads, head dim) of a
    native model, for metal.fused.warm_up; nothing for models on mlx-lm's code."""
    norms: dict[int, tuple[mx.array, float]] = {}
    ropes: dict[tuple, tuple] = {}
    if not getattr(model, "native", False):
        return [], []
    for _, m in model.named_modules():
        if isinstance(m, RMSNorm):
            norms.setdefault(m.weight.shape[0], (m.weight, m.eps))
        if isinstance(m, Attention) and m.rope_args is not None:
            site = (m.rope_args, m.n_heads, m.head_dim)
            ropes.setdefault((id(m.rope_args), *site[1:]), site)
    return list(norms.values()), list(ropes.values())


def projection_weights(model: nn.Module) -> list[tuple[nn.Module, str]]:
    """(module, "weight") of every float projection a native model multiplies by through
    metal.linear (its Linear layers and a tied head's embedding): metal.layout.relayout."""
    if not getattr(model, "native", False):
        return []
    owners: list[tuple[nn.Module, str]] = [(m, "weight") for _, m in model.named_modules()
                                           if type(m) is Linear]
    head = _head(model)
    if head is not None and not isinstance(head, nn.QuantizedEmbedding):
        owners.append((head, "weight"))
    return owners
