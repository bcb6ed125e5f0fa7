"""Weight loading: safetensors files -> dict[str, mx.array], validated before allocation."""

from mlxlocal.weights.files import (
    INDEX_NAME,
    WeightsReport,
    load_model_weights,
    weights_summary,
)
from mlxlocal.weights.safetensors import (
    DTYPES,
    MAX_HEADER_BYTES,
    LoadResult,
    SafetensorsHeader,
    TensorInfo,
    load_file,
    load_tensors,
    metal_available,
    read_header,
)

__all__ = [
    "DTYPES",
    "INDEX_NAME",
    "MAX_HEADER_BYTES",
    "LoadResult",
    "SafetensorsHeader",
    "TensorInfo",
    "WeightsReport",
    "load_file",
    "load_model_weights",
    "load_tensors",
    "metal_available",
    "read_header",
    "weights_summary",
]
