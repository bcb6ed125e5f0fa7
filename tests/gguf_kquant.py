"""Random but valid k-quant blocks (the gguf package cannot quantize to k-quants)."""

from __future__ import annotations

import numpy as np

# Where each format keeps its fp16 super-block scale(s): byte offsets of d (and dmin).
_D_OFFSETS = {"Q2_K": (-4, -2), "Q3_K": (-2,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (-2,)}


def random_kquant(kind: str, rows: int, k: int, rng: np.random.Generator, scale: float = 0.002) -> np.ndarray:
    """uint8 (rows, k/256*block_bytes) of `kind` blocks with random quants and sub-scales."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    block_elems, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows * k // block_elems, block_bytes), dtype=np.uint8)
    for off in _D_OFFSETS[kind]:
        d = (rng.uniform(0.5, 1.5, size=blocks.shape[0]) * scale).astype(np.float16)
        end = off + 2 if off + 2 != 0 else None
        blocks[:, off:end] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)
