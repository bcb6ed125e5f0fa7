"""Paged KV cache: block allocation, the radix prefix cache, and K/V pools in MLX arrays."""

from mlxlocal.cache.blocks import BlockManager, OutOfBlocks
from mlxlocal.cache.paged import KVPools, KVShape, PagedLayerView, StepBatch
from mlxlocal.cache.radix import RadixCache

__all__ = ["BlockManager", "KVPools", "KVShape", "OutOfBlocks", "PagedLayerView", "RadixCache", "StepBatch"]
