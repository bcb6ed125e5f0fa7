"""The engine: requests in, streamed tokens out. Front ends use only this package.

Native models run on the paged engine (paged KV, prefix cache, continuous batching);
models that run on mlx-lm's code use the simple one-sequence engine. Both implement
the `Engine` protocol (contract.py), the whole of what front ends may use.
"""

from __future__ import annotations

from mlxlocal.engine.contract import STATS_KEYS, Engine, EngineSession
from mlxlocal.engine.handle import EngineDeadError, RequestHandle
from mlxlocal.engine.paged import CapacityError, EngineConfig, PagedEngine
from mlxlocal.engine.simple import SimpleEngine
from mlxlocal.engine.types import Chunk, GenerationStats, SamplingParams
from mlxlocal.source.loader import LoadedModel

__all__ = [
    "STATS_KEYS", "CapacityError", "Chunk", "Engine", "EngineConfig", "EngineDeadError", "EngineSession",
    "GenerationStats", "PagedEngine", "RequestHandle", "SamplingParams", "SimpleEngine", "open_engine",
]


def open_engine(loaded: LoadedModel, **config) -> Engine:
    """The engine for a loaded model; keyword arguments are EngineConfig fields."""
    if loaded.info.native:
        return PagedEngine(loaded, EngineConfig(**config))
    return SimpleEngine(loaded, **config)
