"""Attention over contiguous K/V (prefill and dense-cache decode)."""

from __future__ import annotations

import mlx.core as mx


def sdpa(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask: mx.array | str | None = None,
) -> mx.array:
    """q [B, Hq, L, D], k/v [B, Hkv, S, D] -> [B, Hq, L, D]; GQA handled by MLX."""
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
