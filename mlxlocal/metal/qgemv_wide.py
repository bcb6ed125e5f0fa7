"""y = x @ dequant(W).T (+ bias) over MLX affine-quantized weights (w, scales, biases)."""

from __future__ import annotations

import mlx.core as mx


def quantized_linear_reference(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
    mode: str = "affine",
    bias: mx.array | None = None,
) -> mx.array:
    y = mx.quantized_matmul(
        x, w, scales=scales, biases=biases, transpose=True,
        group_size=group_size, bits=bits, mode=mode,
    )
    return y if bias is None else y + bias


def quantized_linear(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    group_size: int,
    bits: int,
    mode: str = "affine",
    bias: mx.array | None = None,
) -> mx.array:
    """Dispatch point for quantized projections."""
    return quantized_linear_reference(x, w, scales, biases, group_size, bits, mode, bias)
