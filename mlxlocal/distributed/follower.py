"""A rank other than 0: it loads what rank 0 loads (its shards) and repeats each step it is told."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlxlocal.cache import KVPools
from mlxlocal.cache.mlx_lm_views import CacheLayout
from mlxlocal.distributed import tier
from mlxlocal.distributed.channel import Channel, world
from mlxlocal.distributed.leader import _Rows, local_shapes
from mlxlocal.distributed.messages import (
    Copy,
    Exit,
    Load,
    Message,
    Noop,
    Pools,
    Probe,
    ProbeCache,
    Report,
    Run,
    Stop,
    TierOpen,
    TierRead,
    TierReadTail,
    TierSave,
    TierSaveTail,
)
from mlxlocal.distributed.report import all_sum_probe, gather_rank_numbers
from mlxlocal.distributed.tensor import weight_bytes
from mlxlocal.engine import MlxLmRunner, NativeRunner, layer_windows
from mlxlocal.errors import ClusterError

log = logging.getLogger("mlxlocal.engine")


class Follower:
    """A follower rank: the models rank 0 loaded (this rank's shards), the pools of each engine
    rank 0 opened on them, and the step it is told to repeat."""

    def __init__(self, group: mx.distributed.Group):
        self.group, self.channel = group, Channel.of(group)
        self.runners: dict[int, NativeRunner] = {}  # by model id
        self.loaded: dict = {}  # mlx-lm models loaded, waiting for their cache probe
        self.pools: dict[int, tuple[NativeRunner, KVPools]] = {}  # by engine id
        self.tiers: dict[int, tier.RankTier] = {}  # by engine id: its disk tier's store on this rank
        self.forwards = 0
        # What each kind of message does here (bound now: a subclass's handlers count).
        self.handlers: dict[type[Message], Callable[[Any], None]] = {
            Load: self._load, Pools: self._pools, Copy: self._copy, Stop: self._stop,
            ProbeCache: self._probe_cache, Noop: self._noop, Probe: self._probe, Report: self._report,
            Run: self._run, TierOpen: self._tier_open, TierSave: self._tier_save,
            TierRead: self._tier_read, TierSaveTail: self._tier_save_tail,
            TierReadTail: self._tier_read}

    def serve(self) -> int:
        """Repeat rank 0's messages until it exits; returns the number of forwards run."""
        while not isinstance(msg := self.channel.recv(), Exit):
            handler = self.handlers.get(type(msg))
            if handler is None:
                raise ClusterError(f"rank 0 sent a {msg.op!r} message, which this rank does not follow")
            handler(msg)
        return self.forwards

    def _load(self, msg: Load) -> None:
        from mlxlocal.source.loader import load

        if msg.pp:  # a pipeline stage: pipeline.py
            from mlxlocal.distributed.pipeline import StageRunner

            self.runners[msg.model] = StageRunner(load(msg.spec, pp=msg.pp))
            return
        loaded = load(msg.spec, tp=self.group.size(), pp=1)  # as rank 0 decided
        if not loaded.info.native:  # its runner comes with rank 0's cache probe (_probe_cache)
            self.loaded[msg.model] = loaded
            return
        self.runners[msg.model] = NativeRunner(loaded.model, local_shapes(loaded), layer_windows(loaded.model_config))

    def _pools(self, msg: Pools) -> None:
        runner = self.runners[msg.model]
        pools = KVPools(runner.shapes, msg.num_blocks, msg.block_size, getattr(mx, msg.dtype),
                        msg.windowed, msg.window_blocks, msg.bits, msg.group_size)
        self.pools[msg.engine] = (runner, pools)

    def _copy(self, msg: Copy) -> None:
        self.pools[msg.engine][1].copy_block(msg.src, msg.dst)

    def _stop(self, msg: Stop) -> None:
        self.pools.pop(msg.engine, None)
        disk = self.tiers.pop(msg.engine, None)
        if disk is not None:  # its queued writes finish first
            disk.close()

    def _tier_open(self, msg: TierOpen) -> None:
        pools = self.pools[msg.engine][1]
        self.tiers[msg.engine] = tier.open_store(msg, pools, self.group.rank(), self.group.size())

    def _tier_save(self, msg: TierSave) -> None:
        if not self.tiers[msg.engine].write_run(msg.keys, msg.blocks, msg.windows):
            log.debug("disk tier: this rank's writer is behind; a run was dropped")

    def _tier_save_tail(self, msg: TierSaveTail) -> None:
        if not self.tiers[msg.engine].write_tail(msg.key, msg.block, msg.rows):
            log.debug("disk tier: this rank's writer is behind; a prompt's tail was dropped")

    def _tier_read(self, msg: TierRead | TierReadTail) -> None:
        tier.read(self.tiers.get(msg.engine), msg, self.group)

    def _probe_cache(self, msg: ProbeCache) -> None:
        """An mlx-lm model's runner: its cache probe runs a forward, with rank 0's."""
        loaded = self.loaded[msg.model]  # each engine rank 0 opens probes again
        self.runners[msg.model] = MlxLmRunner(loaded.model, CacheLayout(loaded.model))

    def _noop(self, msg: Noop) -> None:
        pass

    def _probe(self, msg: Probe) -> None:
        all_sum_probe(self.group, msg.shape, msg.dtype, msg.count, msg.ring)

    def _report(self, msg: Report) -> None:
        gather_rank_numbers(self.group, self._numbers())

    def _numbers(self) -> list[int]:
        weights = sum(weight_bytes(r.model) for r in self.runners.values())
        return [mx.get_peak_memory(), weights]

    def _run(self, msg: Run) -> None:
        runner, pools = self.pools[msg.engine]
        if msg.pp:  # a pipeline stage: its layers, hidden states from/to its neighbours
            runner.follow(pools, msg)
            self.forwards += 1
            return
        windows = msg.windows or [[] for _ in msg.tables]
        seqs = [_Rows(t, w) for t, w in zip(msg.tables, windows)]
        tokens = mx.array(msg.tokens, mx.uint32)
        if msg.mlx_lm:
            logits = runner._run(pools, seqs, msg.starts, 0, tokens, msg.every, False)
        else:
            logits = runner.run(pools, seqs, msg.starts, tokens, msg.every)
        # Everything up to the logits: rank 0 waits in each of this forward's all_sums.
        self.channel.evaluate(logits, pools.state(), watch=False)
        self.forwards += 1


def follower_main() -> int:
    """The whole life of a rank other than 0 of a launch: follow rank 0 until it exits."""
    follower = Follower(world())
    try:
        forwards = follower.serve()
    except ClusterError as e:
        print(f"rank {follower.group.rank()}: {e}", file=sys.stderr)
        return 1
    log.info("tensor parallel rank %d: %d forwards, released by rank 0", follower.group.rank(), forwards)
    return 0


__all__ = ["Follower", "follower_main"]
