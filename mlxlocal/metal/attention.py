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

import math
from functools import reduce

import mlx.core as mx

from mlxlocal.metal.kernel import metal_available

# Without Metal: from this many keys, a decode query's keys are split in two halves on two CPU
# streams (MLX runs each stream on a thread of its own: two cores). One layer at 16k keys
# here: 2.8 -> 1.8 ms; at 4k, 0.94 -> 0.72 ms; below, the streams' hand-over costs more.
SPLIT_KEYS = 4096


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


def key_slices(runs: list[tuple[int, int]], n_keys: int, bs: int) -> tuple[list, int]:
    """segment_attention's slices of a sequence's first n_keys positions held in `runs`
    [(first block, blocks), ...]: (first block, keys) each, and the index of the first one
    on the second CPU stream (without Metal, from SPLIT_KEYS keys: the keys split in halves).
    The same for every layer of a step: worked out once (StepBatch.slices)."""
    return _pieces(runs, n_keys, bs, not metal_available() and n_keys >= SPLIT_KEYS)


def segment_attention(q: mx.array, k_pool, v_pool, slices: tuple[list, int], scale: float,
                      group_size: int = 0, bits: int | None = None) -> mx.array:
    """One sequence's decode attention, q [1, Hq, 1, D], over its keys held in the pools'
    blocks as key_slices' `slices` (pools [Hkv, NB, BS, last], or with `bits` the (packed,
    scales, biases) triples of them): each slice is a view, never gathered, and the slices'
    partial softmaxes are merged by their maxima and sums; those from key_slices' index on
    run on a second CPU stream."""
    k_parts, v_parts = (pool if bits is not None else (pool,) for pool in (k_pool, v_pool))
    bs = k_parts[0].shape[2]
    pieces, second = slices
    Hkv, Hq = k_parts[0].shape[0], q.shape[1]
    qg = (q * scale).reshape(Hkv, Hq // Hkv, q.shape[3])
    if len(pieces) == 1:  # one slice: attention as over contiguous K/V
        k, v = ([_rows(p, *pieces[0], bs) for p in parts] for parts in (k_parts, v_parts))
        if bits is None and _powers_of_two(qg, k[0]):
            out, _, total = partial_powers_of_two(qg, k[0], v[0])
            return (out / total).reshape(1, Hq, 1, -1).astype(q.dtype)
        k, v = [x[None] for x in k], [x[None] for x in v]
        if bits is None:
            return sdpa(q, k[0], v[0], scale)
        return quantized_sdpa(q, tuple(k), tuple(v), scale, None, group_size, bits)
    partials = []
    for j, piece in enumerate(pieces):
        if j < second:
            partials.append(_partial(qg, k_parts, v_parts, piece, bs, group_size, bits))
        else:
            from mlxlocal.metal.fused import _second_stream  # fused -> dispatch -> this module

            with mx.stream(_second_stream()):
                partials.append(_partial(qg, k_parts, v_parts, piece, bs, group_size, bits))
    top = reduce(mx.maximum, [m for _, m, _ in partials])
    weights = [mx.exp(m - top) for _, m, _ in partials]
    out = sum(o * w for (o, _, _), w in zip(partials, weights))
    total = sum(n * w for (_, _, n), w in zip(partials, weights))
    return (out / total).reshape(1, Hq, 1, -1).astype(q.dtype)


def _pieces(runs: list[tuple[int, int]], n_keys: int, bs: int,
            halves: bool) -> tuple[list[tuple[int, int]], int]:
    """(first block, keys) of each slice the first n_keys positions take, and the index of the
    first slice of the second half (halves: one run cut at the block where half the keys are
    passed; else every slice is in the first)."""
    pieces, left = [], n_keys
    for first, blocks in runs:
        if left <= 0:
            break
        pieces.append((first, min(blocks * bs, left)))
        left -= pieces[-1][1]
    if not halves:
        return pieces, len(pieces)
    half, passed = n_keys // 2 // bs * bs, 0  # every slice but the last is whole blocks
    for j, (first, keys) in enumerate(pieces):
        if passed + keys > half:
            cut = half - passed
            if not cut:
                return pieces, j
            pieces[j:j + 1] = [(first, cut), (first + cut // bs, keys - cut)]
            return pieces, j + 1
        passed += keys
    return pieces, len(pieces)


def _rows(part: mx.array, first: int, keys: int, bs: int) -> mx.array:
    """[H, keys, last]: `keys` positions of a pool part from block `first` on (a view)."""
    blocks = -(-keys // bs)
    rows = part[:, first:first + blocks].reshape(part.shape[0], blocks * bs, part.shape[3])
    return rows if keys == blocks * bs else rows[:, :keys]


def _partial(qg: mx.array, k_parts, v_parts, piece: tuple[int, int], bs: int, group_size: int,
             bits: int | None) -> tuple[mx.array, mx.array, mx.array]:
    """One slice's (weighted sum of values, max score, sum of exponentials), float32: qg
    [Hkv, G, D] (scaled), each [Hkv, G, .]."""
    k, v = ([_rows(p, *piece, bs) for p in parts] for parts in (k_parts, v_parts))
    if bits is None and _powers_of_two(qg, k[0]):
        return partial_powers_of_two(qg, k[0], v[0])
    if bits is None:
        return partial_matmul(qg, k[0], v[0])
    scores = mx.quantized_matmul(qg, *k, transpose=True, group_size=group_size, bits=bits)
    scores = scores.astype(mx.float32)
    top = scores.max(axis=-1, keepdims=True)
    e = mx.exp(scores - top)
    out = mx.quantized_matmul(e.astype(qg.dtype), *v, transpose=False, group_size=group_size,
                              bits=bits)
    return out.astype(mx.float32), top, e.sum(axis=-1, keepdims=True)


def partial_matmul(qg: mx.array, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """_partial over plain K/V [Hkv, n, D] by matmuls and mx.exp (mx.fast's definition)."""
    scores = (qg @ k.swapaxes(-1, -2)).astype(mx.float32)
    top = scores.max(axis=-1, keepdims=True)
    e = mx.exp(scores - top)
    return (e.astype(qg.dtype) @ v).astype(mx.float32), top, e.sum(axis=-1, keepdims=True)


_LOG2E, _LN2 = 1 / math.log(2), math.log(2)


def partial_powers_of_two(qg: mx.array, k: mx.array, v: mx.array
                          ) -> tuple[mx.array, mx.array, mx.array]:
    """partial_matmul's numbers with the exponentials as powers of two: MLX's CPU backend runs
    exp as scalar code, pow ~2.5x faster (a 16k-token decode's attention -10% here). The max is
    returned in natural units, so slices of either kind merge. (Scores as products summed
    skip the BLAS's slow transposed operand, but their [Hkv, G, n, D] temporary faults in
    fresh pages on a restarted process's first request: +4 ms at 16k keys.)"""
    if qg.dtype == mx.float32:  # log2(e) folded into the queries: one multiply fewer
        scores = (qg * _LOG2E) @ k.swapaxes(-1, -2)
    else:
        scores = (qg @ k.swapaxes(-1, -2)).astype(mx.float32) * _LOG2E
    top = scores.max(axis=-1, keepdims=True)
    e = mx.power(2.0, scores - top)
    return (e.astype(qg.dtype) @ v).astype(mx.float32), top * _LN2, e.sum(axis=-1, keepdims=True)


def _powers_of_two(qg: mx.array, k: mx.array) -> bool:
    """Whether decode attention over plain K/V [Hkv, n, D] takes partial_powers_of_two: never
    on Metal, else the measured choice for the shape (fused.py)."""
    if metal_available():
        return False
    from mlxlocal.metal import fused  # fused -> dispatch -> measure -> this module

    return fused.decode_attention(qg, k)


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
