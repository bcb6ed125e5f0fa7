"""Attention in plain MLX: over contiguous K/V (prefill, dense caches) and the reference path
of the paged kernels (the MLX built-in one the dispatch may choose).

Paged pools are head-major: [kv_heads, num_blocks, block_size, last] (last = head_dim, or the
packed words / groups of a quantized triple), so key j of block b for head h is row
(h * NB + b) * BS + j of the pool seen as [H * NB * BS, last]. A sequence's keys per head are
then whole blocks: a consecutive run of blocks is a strided view [1, H, W * BS, last] (no
copy), a scattered table one gather through the flat row-block index, and neither needs a
transpose before attention.
"""

from __future__ import annotations

import mlx.core as mx


def sdpa(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    scale: float,
    mask: mx.array | str | None = None,
) -> mx.array:
    """q [B, Hq, L, D], k/v [B, Hkv, S, D] -> [B, Hq, L, D]; GQA handled by MLX (or, several
    queries where it measures faster, metal/fused.py's keys-transposed composition)."""
    if q.shape[2] == 1:
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)
    from mlxlocal.metal import fused  # fused -> dispatch -> measure -> this module

    return fused.sdpa(q, k, v, scale, mask)


def rows_index(block_tables: mx.array, H: int, NB: int) -> mx.array:
    """[B, H, W] int32 flat row-block index h * NB + block_tables[b, w]: what sequence_rows
    gathers through; built once per step, it serves every layer with H heads and NB blocks."""
    heads = mx.arange(H, dtype=mx.int32)[None, :, None] * NB
    return heads + block_tables.astype(mx.int32)[:, None, :]


def sequence_rows(
    pool: mx.array,
    block_tables: mx.array,
    n_keys: int | None = None,
    index: mx.array | None = None,
    first_block: int | None = None,
) -> mx.array:
    """[B, H, n_keys, last]: the first n_keys positions of each sequence from one pool part
    [H, NB, BS, last]. Only the blocks holding those positions are read; `first_block` (B = 1,
    the table a run first_block, first_block + 1, ...) reads them by a slice (a view);
    otherwise one gather through `index` (rows_index's, built here when None)."""
    H, NB, bs, last = pool.shape
    B, W = block_tables.shape
    if n_keys is not None:
        W = min(W, -(-n_keys // bs))
    if first_block is not None:
        rows = pool[:, first_block:first_block + W].reshape(1, H, W * bs, last)
    else:
        index = rows_index(block_tables[:, :W], H, NB) if index is None else index[:, :, :W]
        rows = pool.reshape(H * NB, bs, last)[index].reshape(B, H, W * bs, last)
    return rows if n_keys is None or n_keys == W * bs else rows[:, :, :n_keys]


def step_mask(context_lens: mx.array, L: int, n_keys: int, window: int | None,
              first_key: int = 0) -> mx.array:
    """[B, 1, L, n_keys - first_key]: sequence b's query i sits at position
    context_lens[b] - L + i; the keys are positions first_key .. n_keys - 1."""
    k_pos = mx.arange(first_key, n_keys)[None, None, :]
    q_pos = (context_lens[:, None] - L + mx.arange(L)[None, :])[:, :, None]
    mask = k_pos <= q_pos
    if window is not None:
        mask = mask & (k_pos > q_pos - window)
    return mask[:, None]


def quantized_sdpa(
    q: mx.array,
    k: tuple[mx.array, mx.array, mx.array],
    v: tuple[mx.array, mx.array, mx.array],
    scale: float,
    mask: mx.array | str | None,
    group_size: int,
    bits: int,
) -> mx.array:
    """q [B, Hq, L, D]; k / v mx.quantize triples of [B, Hkv, S, D] -> [B, Hq, L, D].

    Scores and the weighted sum by mx.quantized_matmul straight on the packed keys and values
    (as mlx-lm's quantized_scaled_dot_product_attention): nothing is dequantized. A KV head's
    G query heads are folded into the rows ([B, Hkv, G * L, D]), so the matmuls' batches match
    the pools' exactly: no stride-0 broadcast of the weights (the vector kernel misread those:
    mlx#3497)."""
    B, Hq, L, D = q.shape
    Hkv = k[0].shape[1]
    G = Hq // Hkv
    qs = (q * scale).reshape(B, Hkv, G * L, D)
    scores = mx.quantized_matmul(qs, *k, transpose=True, group_size=group_size, bits=bits)
    S = scores.shape[-1]
    scores = scores.reshape(B, Hkv, G, L, S)
    if isinstance(mask, str):  # "causal": the L queries are the last L of the S keys
        mask = mx.arange(S - L, S)[:, None] >= mx.arange(S)[None]
    if mask is not None:
        if mask.ndim == 4:  # [B | 1, 1 | Hq, L, S]: per sequence, shared by the heads
            mb, mh = mask.shape[:2]
            mask = mask[:, :, None] if mh == 1 else mask.reshape(mb, Hkv, G, *mask.shape[2:])
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.finfo(scores.dtype).min)
        else:
            scores = scores + mask
    probs = mx.softmax(scores, axis=-1, precise=True).reshape(B, Hkv, G * L, S)
    out = mx.quantized_matmul(probs, *v, transpose=False, group_size=group_size, bits=bits)
    return out.reshape(B, Hq, L, -1).astype(q.dtype)
