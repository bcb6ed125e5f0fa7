"""The paged engine's configuration and how big its K/V pools are made."""

from __future__ import annotations

import os
from dataclasses import dataclass

from mlxlocal.cache import KVPools
from mlxlocal.engine.types import SpeculativeConfig


@dataclass
class EngineConfig:
    block_size: int = 16
    kv_blocks: int | None = None  # exact pool size; else from kv_memory / kv_tokens
    kv_memory: int | None = None  # bytes for the K/V pools
    kv_tokens: int | None = None  # size the pool for this many tokens (e.g. one CLI request)
    max_num_seqs: int = 16
    max_step_tokens: int = 512  # per-step token budget: decodes + one prefill chunk
    prefix_cache: bool = True
    max_waiting: int = 256  # requests queued beyond this are refused (QueueFull)
    speculative: SpeculativeConfig | None = None  # draft tokens and verify them in one forward
    kv_bits: int | None = None  # 8 or 4: K/V stored quantized in the pools (None: model dtype)
    kv_group_size: int = 64  # elements sharing one scale and bias in quantized K/V
    kv_disk: int = 0  # bytes of block files the disk tier may keep (0: no disk tier)
    kv_disk_dir: str | None = None  # where (default: $MLXLOCAL_HOME/kv)
    kv_shrink_idle_s: float = 60.0  # pools grown on demand shrink back after this long idle


def default_kv_memory() -> int:
    """15% of physical memory: room for weights, activations and the rest of the system."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.15)
    except (ValueError, OSError, AttributeError):
        return 2 << 30


START_TOKENS = 8192  # a pool that grows on demand starts with room for this many (or a context)


@dataclass(frozen=True)
class PoolSize:
    num_blocks: int  # blocks of the full-attention pools at most (the engine's block ids)
    window_blocks: int  # blocks of the sliding-window layers' own pools
    window: int  # the widest sliding window (0: none)
    start_blocks: int = 0  # what they start with, growing on demand (0: all of num_blocks)


def size_pools(cfg: EngineConfig, runner, context: int, draft_bytes_per_block: int = 0) -> PoolSize:
    """Pool sizes for a runner's layers within cfg's budget: quantized pools hold more blocks
    per byte; a draft model's pools (same block ids) share the budget of the full ones."""
    bs = cfg.block_size
    windowed = [w is not None for w in runner.windows]
    full = [sh for sh, w in zip(runner.shapes, windowed) if not w]
    q = dict(bits=cfg.kv_bits, group_size=cfg.kv_group_size)
    per_full = KVPools.bytes_per_block(full, bs, runner.dtype, **q)
    per_window = KVPools.bytes_per_block(runner.shapes, bs, runner.dtype, **q) - per_full
    per_full += draft_bytes_per_block
    window = max((w for w in runner.windows if w is not None), default=0)
    # Sliding-window layers hold each running sequence's window, a prefill chunk, and
    # as much again for window blocks kept with cached prefixes.
    window_need = 2 * (cfg.max_num_seqs * (-(-window // bs) + 2) + -(-cfg.max_step_tokens // bs)) if window else 0
    num_blocks = _pool_blocks(cfg, per_full, per_window, window_need, context)
    # A budget, not a size (unless the caller gave one): start with room for one context
    # (at most START_TOKENS) and a prefill chunk, so a server starts light.
    start = 0 if cfg.kv_blocks or cfg.kv_tokens else min(
        num_blocks, -(-(min(context, START_TOKENS) + cfg.max_step_tokens) // bs) + 1)
    return PoolSize(num_blocks, min(num_blocks, window_need), window, start)


def _pool_blocks(cfg: EngineConfig, per_full: int, per_window: int, window_blocks: int, context: int) -> int:
    """Blocks of the full-attention pools; the window layers' pools take window_blocks
    (at most as many) out of the same memory budget."""
    if cfg.kv_blocks:
        return cfg.kv_blocks
    per_block = max(per_full, 1)  # a model with window layers only: block ids are bookkeeping
    budget = (cfg.kv_memory or default_kv_memory()) - window_blocks * per_window
    if cfg.kv_memory:
        return max(1, budget // per_block)
    tokens = cfg.kv_tokens or cfg.max_num_seqs * context
    wanted = -(-tokens // cfg.block_size) + 1
    return max(1, min(wanted, budget // per_block))
