"""Linear layers whose math goes through the mlxlocal.metal dispatch points.

Parameter names (weight, bias, scales, biases) match nn.Linear / nn.QuantizedLinear,
so mlx-community and HF checkpoints load unchanged.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxlocal import metal


class Linear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        # Item lookups, as nn.Linear: Module attribute access costs a __getattr__ per call.
        return metal.linear(x, self["weight"], self["bias"] if "bias" in self else None)

    def to_quantized(self, group_size=None, bits=None, mode="affine", quantize_input=False):
        if mode != "affine" or quantize_input:
            return super().to_quantized(group_size, bits, mode, quantize_input)
        return QuantizedLinear.from_linear(self, group_size, bits, mode)


class QuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        return metal.quantized_linear(
            x, self.weight, self.scales, self.get("biases"),
            self.group_size, self.bits, self.mode, self.get("bias"),
        )


def embedding_as_linear(embed: nn.Module, x: mx.array) -> mx.array:
    """Tied output head: logits = x @ E.T, through the same dispatch points."""
    if isinstance(embed, nn.QuantizedEmbedding):
        return metal.quantized_linear(
            x, embed.weight, embed.scales, embed.get("biases"),
            embed.group_size, embed.bits, embed.mode,
        )
    return metal.linear(x, embed.weight)


class RMSNorm(nn.RMSNorm):
    def __call__(self, x: mx.array) -> mx.array:
        return metal.rms_norm(x, self["weight"], self.eps)
