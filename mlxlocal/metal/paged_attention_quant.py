"""Paged attention over quantized K/V pools (issue 18: --kv-bits).

Each of K and V is a triple laid out exactly as `mx.quantize(x, group_size, bits)` over the
last axis of x [num_blocks, block_size, n_kv_heads, head_dim]: packed uint32
[NB, BS, H, D * bits / 32], scales and biases [NB, BS, H, D / group_size] in the model dtype;
x = scale * q + bias per group. Semantics (positions, causal-per-sequence mask, windows, GQA,
the n_keys / mask / first_block / window_start hints) are paged_attention_reference's.
"""

from __future__ import annotations

import mlx.core as mx

from mlxlocal.metal.attention import sdpa
from mlxlocal.metal.paged_attention import step_mask

QuantPool = tuple[mx.array, mx.array, mx.array]  # (packed uint32, scales, biases)


def _check_pool(name: str, pool: QuantPool, D: int, group_size: int, bits: int) -> None:
    if not isinstance(pool, (tuple, list)) or len(pool) != 3:
        raise ValueError(f"{name}: expected a (packed, scales, biases) triple")
    packed, scales, biases = pool
    if packed.ndim != 4 or packed.dtype != mx.uint32:
        raise ValueError(f"{name}: packed must be uint32 [num_blocks, block_size, heads, "
                         f"head_dim*bits/32], got {packed.dtype} {tuple(packed.shape)}")
    if D % group_size or packed.shape[-1] * 32 != D * bits:
        raise ValueError(f"{name}: head_dim {D} with bits={bits}, group_size={group_size} needs "
                         f"{D * bits // 32} packed words, pool has {packed.shape[-1]}")
    want = (*packed.shape[:3], D // group_size)
    if tuple(scales.shape) != want or tuple(biases.shape) != want:
        raise ValueError(f"{name}: scales / biases must be {want}, got {tuple(scales.shape)} / "
                         f"{tuple(biases.shape)}")


def paged_attention_quantized_reference(
    q: mx.array,
    k: QuantPool,
    v: QuantPool,
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
    group_size: int,
    bits: int,
    window: int | None = None,
    *,
    n_keys: int | None = None,
    mask: mx.array | str | None | bool = False,
    first_block: int | None = None,
    window_start: int = 0,
) -> mx.array:
    """q [B, Hq, L, D] -> [B, Hq, L, D]: gather the blocks the tables name (packed, scales and
    biases alike), keep the first n_keys positions, dequantize only those, then masked sdpa."""
    B, _, L, D = q.shape
    _check_pool("k", k, D, group_size, bits)
    _check_pool("v", v, D, group_size, bits)
    bs = k[0].shape[1]
    if window_start:
        block_tables = block_tables[:, window_start:]
        n_keys = None if n_keys is None else n_keys - window_start * bs

    def gather(pool: QuantPool) -> mx.array:
        parts = []
        for a in pool:
            H, last = a.shape[2], a.shape[3]
            if first_block is not None:  # B = 1, contiguous run of blocks: a slice
                a = a[first_block:first_block + block_tables.shape[1]].reshape(B, -1, H, last)
            else:
                a = a[block_tables].reshape(B, -1, H, last)
            parts.append(a if n_keys is None else a[:, :n_keys])
        x = mx.dequantize(*parts, group_size=group_size, bits=bits)
        return x.astype(q.dtype).transpose(0, 2, 1, 3)

    keys, values = gather(k), gather(v)
    if mask is False:
        mask = step_mask(context_lens, L, keys.shape[2], window)
    return sdpa(q, keys, values, scale, mask)


def paged_attention_quantized(
    q: mx.array,
    k: QuantPool,
    v: QuantPool,
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
    group_size: int,
    bits: int,
    window: int | None = None,
    *,
    n_keys: int | None = None,
    mask: mx.array | str | None | bool = False,
    first_block: int | None = None,
    window_start: int = 0,
) -> mx.array:
    """Dispatch point for paged attention over quantized pools (the Metal kernel: decode, L = 1).

    n_keys / mask / first_block / window_start are hints for the reference path; the kernel
    finds a window's start itself.
    """
    return paged_attention_quantized_reference(
        q, k, v, block_tables, context_lens, scale, group_size, bits, window, n_keys=n_keys,
        mask=mask, first_block=first_block, window_start=window_start)
