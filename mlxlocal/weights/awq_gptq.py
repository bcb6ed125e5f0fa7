"""AutoAWQ (GEMM) and GPTQ checkpoints -> MLX affine quantization, exact where possible.

Both formats store, per linear layer, integer codes q, a zero point z and a scale s per
group of `group_size` input channels, with w = s * (q - z). MLX affine stores
w = scale * q + bias, so the repack is `scale = s`, `bias = -s * z` and a re-layout of q:

- AWQ GEMM: qweight int32 [K, N/pack], packed along N in the interleaved order
  [0, 2, 4, 6, 1, 3, 5, 7]; qzeros [K/g, N/pack] packed the same way; scales [K/g, N].
  Only 4-bit GEMM exists in AutoAWQ (mlx-lm's `_unpack_awq_weights` is reused).
- GPTQ: qweight int32 [K*bits/32, N], a little-endian bit stream along K (this covers the
  2/4/8-bit and the straddling 3-bit AutoGPTQ packing); qzeros [K/g, N*bits/32] packed
  the same way along N. The old format (checkpoint_format "gptq", the default) stores
  zero - 1; "gptq_v2" stores the zero itself.
- Group sizes MLX lacks but that are multiples of 128/64/32 (256, per-channel -1 with
  K % 128 == 0, ...) are split into MLX groups sharing the scale: still exact.
- Act-order (desc_act) checkpoints whose g_idx is not the trivial `k // g`: the groups are
  scattered over K and do not map onto MLX's contiguous groups. Permuting this layer's
  K would need the previous layer's outputs permuted too, which is not cheap in general,
  so such a layer is dequantized exactly with g_idx and requantized with MLX affine RTN at
  the same bits and group size. This is lossy; the layers are reported in `notes`.

Exactness: the integer codes are preserved bit for bit; `bias = -s * z` is computed in
float32 and cast to the scales' dtype (one rounding in fp16/bf16 checkpoints, none in
float32 ones).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import numpy as np

from mlxlocal.errors import ModelLoadError

MLX_GROUP_SIZES = (128, 64, 32)
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_EXL2_KEYS = (".q_perm", ".q_invperm", ".q_scale", ".q_scale_max", ".q_groups", ".q_weight")
_MARLIN_KEYS = (".B", ".s", ".workspace")


@dataclass
class Converted:
    weights: dict[str, mx.array]
    quantization: dict[str, Any]
    notes: list[str] = field(default_factory=list)


def _np(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        a = a.astype(mx.float32)
    return np.array(a, copy=False)


def unpack_bitstream(packed: np.ndarray, bits: int, count: int, axis: int) -> np.ndarray:
    """int32 words packed as a little-endian bit stream along `axis` -> `count` codes."""
    packed = np.moveaxis(np.ascontiguousarray(packed).view(np.uint32), axis, -1)
    lead = packed.shape[:-1]
    if 32 % bits == 0:  # whole codes per word: shifts, no bit-level temporaries
        shifts = np.arange(0, 32, bits, dtype=np.uint32)
        codes = ((packed[..., None] >> shifts) & np.uint32((1 << bits) - 1)).reshape(*lead, -1)[..., :count]
        return np.moveaxis(codes, -1, axis)
    raw = np.ascontiguousarray(packed.astype("<u4")).view(np.uint8)
    bitarr = np.unpackbits(raw.reshape(*lead, -1), axis=-1, bitorder="little")
    bitarr = bitarr[..., : count * bits].reshape(*lead, count, bits)
    weights = (1 << np.arange(bits, dtype=np.uint32)).astype(np.uint32)
    codes = (bitarr.astype(np.uint32) * weights).sum(-1, dtype=np.uint32)
    return np.moveaxis(codes, -1, axis)


def pack_mlx(q: np.ndarray, bits: int) -> np.ndarray:
    """Codes [N, K] -> MLX's packed uint32 [N, K*bits/32] (a little-endian bit stream)."""
    n, k = q.shape
    if (k * bits) % 32:
        raise ModelLoadError(f"cannot pack {k} inputs at {bits} bits into 32-bit words")
    if 32 % bits == 0:
        shifts = np.arange(0, 32, bits, dtype=np.uint32)
        words = q.astype(np.uint32).reshape(n, k * bits // 32, 32 // bits) << shifts
        return np.bitwise_or.reduce(words, axis=-1).astype(np.uint32)
    bitarr = ((q[..., None].astype(np.uint32) >> np.arange(bits, dtype=np.uint32)) & 1).astype(np.uint8)
    raw = np.packbits(bitarr.reshape(n, k * bits), axis=-1, bitorder="little")
    return np.ascontiguousarray(raw).view("<u4").astype(np.uint32)


def unpack_awq(packed: np.ndarray, bits: int = 4) -> np.ndarray:
    """AutoAWQ GEMM int32 [R, C] -> codes [R, C*8] (undoing the interleaved order)."""
    from mlx_lm.utils import _unpack_awq_weights  # noqa: PLC0415 (reuse mlx-lm's unpacker)

    if bits != 4:
        raise ModelLoadError(f"AWQ {bits}-bit packing is not supported (AutoAWQ GEMM is 4-bit only)")
    return np.array(_unpack_awq_weights(mx.array(packed.view(np.uint32))), copy=False).astype(np.uint32)


def _mlx_group(group_size: int, k: int) -> int:
    g = k if group_size in (-1, 0, None) else int(group_size)
    if g in MLX_GROUP_SIZES:
        return g
    for cand in MLX_GROUP_SIZES:
        if g % cand == 0 and k % cand == 0:
            return cand
    raise ModelLoadError(
        f"group size {group_size} (K={k}) does not split into MLX groups of {MLX_GROUP_SIZES}"
    )


def _to_mlx(q_nk: np.ndarray, scales_gn: np.ndarray, zeros_gn: np.ndarray, group_size: int,
            bits: int, dtype) -> tuple[mx.array, mx.array, mx.array, int]:
    """Codes [N, K], per-group scales/zeros [G, N] -> MLX (w, scales, biases, group)."""
    n, k = q_nk.shape
    g = k if group_size in (-1, 0, None) else int(group_size)
    mg = _mlx_group(group_size, k)
    rep = g // mg
    s = np.repeat(scales_gn.astype(np.float32).T, rep, axis=1)  # [N, K/mg]
    z = np.repeat(zeros_gn.astype(np.float32).T, rep, axis=1)
    w = pack_mlx(q_nk, bits)
    return mx.array(w), mx.array(s).astype(dtype), mx.array(-s * z).astype(dtype), mg


def _quant_settings(qc: dict[str, Any]) -> tuple[str, int, int]:
    method = str(qc.get("quant_method", "")).lower()
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    group = qc.get("group_size", qc.get("q_group_size", 128))
    return method, bits, int(group if group is not None else -1)


def _check_format(method: str, qc: dict[str, Any], weights: dict[str, mx.array], bits: int) -> str:
    keys = list(weights)
    if any(k.endswith(_EXL2_KEYS) for k in keys):
        raise ModelLoadError("EXL2 / exllama v2 packed checkpoints are not supported; use a GPTQ or AWQ GEMM export")
    if any(k.endswith(_MARLIN_KEYS) for k in keys):
        raise ModelLoadError("Marlin-packed checkpoints are not supported; use a GPTQ or AWQ GEMM export")
    if method == "awq":
        version = str(qc.get("version", "gemm")).lower()
        if version != "gemm":
            raise ModelLoadError(
                f"AWQ '{version}' packing is not supported (only AutoAWQ GEMM; GEMV, GEMV_fast, "
                "marlin, exllama and ipex layouts are not)"
            )
        if bits != 4:
            raise ModelLoadError(f"AWQ {bits}-bit is not supported (AutoAWQ GEMM is 4-bit only)")
        if qc.get("zero_point") is False:
            raise ModelLoadError("AWQ without zero points is not supported")
        return "awq"
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ModelLoadError(f"GPTQ checkpoint_format '{fmt}' is not supported (only 'gptq' and 'gptq_v2')")
    if bits not in (2, 3, 4, 8):
        raise ModelLoadError(f"GPTQ {bits}-bit is not supported (2, 3, 4 or 8)")
    return fmt


def convert_awq_gptq(weights: dict[str, mx.array], config: dict[str, Any]) -> Converted:
    """Repack every `*.qweight` layer of an AWQ/GPTQ checkpoint into MLX affine tensors."""
    qc = config.get("quantization_config") or {}
    method, bits, group_size = _quant_settings(qc)
    if method not in ("awq", "gptq"):
        raise ModelLoadError(f"quant_method '{method}' is not AWQ or GPTQ")
    fmt = _check_format(method, qc, weights, bits)
    prefixes = sorted(k[: -len(".qweight")] for k in weights if k.endswith(".qweight"))
    if not prefixes:
        raise ModelLoadError(f"{method.upper()} checkpoint has no '*.qweight' tensors")
    packed = {f"{p}.{s}" for p in prefixes for s in ("qweight", "qzeros", "scales", "g_idx")}
    out = {k: v for k, v in weights.items() if k not in packed}
    notes: list[str] = []
    overrides: dict[str, Any] = {}
    default_group = None
    mask = (1 << bits) - 1
    for p in prefixes:
        try:
            qweight = _np(weights[f"{p}.qweight"])
            scales_mx = weights[f"{p}.scales"]
            scales = _np(scales_mx).astype(np.float32)
            qzeros = _np(weights[f"{p}.qzeros"]) if f"{p}.qzeros" in weights else None
        except KeyError as e:
            raise ModelLoadError(f"{method.upper()} layer '{p}' is missing {e}") from None
        n = scales.shape[1]
        if method == "awq":
            k = qweight.shape[0]
            q_kn = unpack_awq(qweight, bits)
            zeros = unpack_awq(qzeros, bits) if qzeros is not None else np.full(scales.shape, 1 << (bits - 1), np.uint32)
        else:
            k = qweight.shape[0] * 32 // bits
            q_kn = unpack_bitstream(qweight, bits, k, axis=0)
            if qzeros is None:
                zeros = np.full(scales.shape, 1 << (bits - 1), np.uint32)
            else:
                zeros = unpack_bitstream(qzeros, bits, n, axis=1)
                if fmt == "gptq":  # old format stores zero - 1 (AutoGPTQ masks after the +1)
                    zeros = (zeros + 1) & mask
        if q_kn.shape != (k, n):
            raise ModelLoadError(f"layer '{p}': qweight unpacks to {q_kn.shape}, scales imply N={n}")
        g = k if group_size in (-1, 0) else group_size
        if scales.shape[0] * g != k and group_size not in (-1, 0):
            raise ModelLoadError(f"layer '{p}': {scales.shape[0]} groups of {g} do not cover K={k}")
        g_idx = weights.get(f"{p}.g_idx")
        trivial = g_idx is None or np.array_equal(_np(g_idx).astype(np.int64), np.arange(k) // g)
        dtype = scales_mx.dtype
        if trivial:
            w, s, b, mg = _to_mlx(q_kn.T, scales, zeros, group_size, bits, dtype)
        else:
            gi = _np(g_idx).astype(np.int64)
            deq = scales[gi] * (q_kn.astype(np.float32) - zeros[gi].astype(np.float32))  # [K, N]
            mg = _mlx_group(group_size, k)
            w, s, b = mx.quantize(mx.array(deq.T), group_size=mg, bits=bits)
            s, b = s.astype(dtype), b.astype(dtype)
            notes.append(f"{p}: act-order (desc_act) groups were dequantized and requantized (lossy RTN)")
        out[f"{p}.weight"], out[f"{p}.scales"], out[f"{p}.biases"] = w, s, b
        if default_group is None:
            default_group = mg
        if mg != default_group:
            overrides[p] = {"group_size": mg, "bits": bits, "mode": "affine"}
    quantization = {"group_size": default_group, "bits": bits, "mode": "affine", **overrides}
    if any("act-order" in n for n in notes):
        notes.insert(0, f"{sum('act-order' in n for n in notes)} act-order layers requantized")
    return Converted(out, quantization, notes)


def convert_config(config: dict[str, Any], quantization: dict[str, Any]) -> dict[str, Any]:
    """config.json with `quantization_config` (AWQ/GPTQ) replaced by MLX `quantization`."""
    config = dict(config)
    config.pop("quantization_config", None)
    config["quantization"] = quantization
    return config


def is_awq_gptq(config: dict[str, Any]) -> bool:
    qc = config.get("quantization_config")
    return isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() in ("awq", "gptq")
