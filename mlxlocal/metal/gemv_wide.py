"""y = x @ W.T (+ bias): the dense projection every native Linear calls."""

from __future__ import annotations

import mlx.core as mx


def linear_reference(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    if bias is None:
        return x @ weight.T
    return mx.addmm(bias, x, weight.T)


def linear(x: mx.array, weight: mx.array, bias: mx.array | None = None) -> mx.array:
    """Dispatch point for dense projections (decode rows M <= 8 are the Metal kernel's case)."""
    return linear_reference(x, weight, bias)
