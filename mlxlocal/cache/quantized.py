"""Quantized K/V storage: each pool is the triple `mx.quantize` makes over the last axis.

With kv_bits set, a layer's K (and V) pool is (packed uint32 [heads, num_blocks, block_size,
dim * bits / 32], scales and biases [heads, num_blocks, block_size, dim / group_size] in the
model dtype): mlx-lm's QuantizedKVCache rows, per token, so a row quantized on its own
(one new token) equals the same row quantized with its prompt. An unquantized pool is one
array; the helpers below take either as a tuple of parts, so KVPools treats both alike.
"""

from __future__ import annotations

import mlx.core as mx

from mlxlocal.errors import MlxLocalError

KV_BITS = (4, 8)
KV_GROUP_SIZES = (32, 64, 128)  # what mx.quantize supports


class KVPrecisionError(MlxLocalError, ValueError):
    """kv_bits / kv_group_size this model's K/V cannot be stored in; the message names them."""


def check(dims: list[int], bits: int | None, group_size: int) -> None:
    """KVPrecisionError naming the option for a precision these K/V rows cannot be stored in."""
    if bits is None:
        return
    if bits not in KV_BITS:
        raise KVPrecisionError(f"kv_bits (--kv-bits) must be 8 or 4, not {bits!r}")
    if group_size not in KV_GROUP_SIZES:
        raise KVPrecisionError(f"kv_group_size (--kv-group-size) must be one of "
                               f"{', '.join(map(str, KV_GROUP_SIZES))}, not {group_size!r}")
    bad = sorted({d for d in dims if d % group_size})
    if bad:
        fits = [str(g) for g in KV_GROUP_SIZES if bad[0] % g == 0]
        raise KVPrecisionError(
            f"kv_group_size (--kv-group-size) {group_size} does not divide the model's head_dim {bad[0]}, "
            f"so its K/V cannot be stored with kv_bits (--kv-bits) "
            + (f"at that group size (use {' or '.join(fits)})" if fits else "at any group size MLX supports"))


def empty(n: int, block_size: int, heads: int, dim: int, dtype: mx.Dtype, bits: int | None,
          group_size: int) -> mx.array | tuple[mx.array, mx.array, mx.array]:
    """A zeroed pool [heads, n, block_size, ...]: one array, or the (packed, scales, biases) triple."""
    if bits is None:
        return mx.zeros((heads, n, block_size, dim), dtype)
    groups = dim // group_size
    return (mx.zeros((heads, n, block_size, dim * bits // 32), mx.uint32),
            mx.zeros((heads, n, block_size, groups), dtype), mx.zeros((heads, n, block_size, groups), dtype))


def parts(pool) -> tuple[mx.array, ...]:
    return pool if isinstance(pool, tuple) else (pool,)


def encode(x: mx.array, bits: int | None, group_size: int) -> tuple[mx.array, ...]:
    """Rows [..., dim] as the pool stores them."""
    return (x,) if bits is None else tuple(mx.quantize(x, group_size=group_size, bits=bits))


def decode(xs, bits: int | None, group_size: int) -> mx.array:
    """Stored rows back as values (the scales' dtype: the model's)."""
    return xs[0] if bits is None else mx.dequantize(*xs, group_size=group_size, bits=bits)


def bytes_per_row(heads: int, dim: int, dtype: mx.Dtype, bits: int | None, group_size: int) -> int:
    """Bytes one token's K (or V) row of one layer takes, scales and biases included."""
    if bits is None:
        return heads * dim * dtype.size
    return heads * (dim * bits // 8 + 2 * (dim // group_size) * dtype.size)
