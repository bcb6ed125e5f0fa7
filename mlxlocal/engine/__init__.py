"""The engine: requests in, streamed tokens out. Front ends use only this package."""

from mlxlocal.engine.generator import Engine, Session
from mlxlocal.engine.types import Chunk, GenerationStats, SamplingParams

__all__ = ["Chunk", "Engine", "GenerationStats", "SamplingParams", "Session"]
