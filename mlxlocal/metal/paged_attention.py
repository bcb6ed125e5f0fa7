"""Attention straight from paged K/V pools, through block tables and context lengths.

Pools are [num_blocks, block_size, n_kv_heads, head_dim]. Sequence b's queries are its
last L positions: q_pos = context_lens[b] - L + i; it sees keys at positions <= q_pos
(and > q_pos - window for sliding-window layers).
"""

from __future__ import annotations

import mlx.core as mx

from mlxlocal.metal.attention import sdpa


def paged_attention_reference(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
    window: int | None = None,
) -> mx.array:
    """q [B, Hq, L, D]; block_tables [B, max_blocks] int32; context_lens [B] -> [B, Hq, L, D]."""
    B, _, L, _ = q.shape
    _, bs, H, D = k_pool.shape
    keys = k_pool[block_tables].reshape(B, -1, H, D).transpose(0, 2, 1, 3)
    values = v_pool[block_tables].reshape(B, -1, H, D).transpose(0, 2, 1, 3)
    k_pos = mx.arange(keys.shape[2])[None, None, :]
    q_pos = (context_lens[:, None] - L + mx.arange(L)[None, :])[:, :, None]
    mask = k_pos <= q_pos
    if window is not None:
        mask = mask & (k_pos > q_pos - window)
    return sdpa(q, keys, values, scale, mask[:, None])


def paged_attention(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
    window: int | None = None,
) -> mx.array:
    """Dispatch point for paged attention (decode, L = 1, is the Metal kernel's case)."""
    return paged_attention_reference(q, k_pool, v_pool, block_tables, context_lens, scale, window)
