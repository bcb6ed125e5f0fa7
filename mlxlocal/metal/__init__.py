"""Decode ops and their single dispatch points.

Each op has a plain-MLX reference. The dispatch function is the one place a Metal
kernel (registered with mx.fast.metal_kernel) is chosen when Metal is available and
the shape is supported; everywhere else the reference runs. RMSNorm and RoPE (fused.py)
run as compiled kernels where that measures faster than mx.fast (MLX's CPU backend).
"""

from mlxlocal.metal.attention import sdpa
from mlxlocal.metal.fused import RopeArgs, rms_norm, rope
from mlxlocal.metal.gemv_wide import linear
from mlxlocal.metal.paged_attention import paged_attention
from mlxlocal.metal.paged_attention_quant import paged_attention_quantized
from mlxlocal.metal.qgemv_wide import quantized_linear

__all__ = ["RopeArgs", "linear", "paged_attention", "paged_attention_quantized", "quantized_linear",
           "rms_norm", "rope", "sdpa"]
