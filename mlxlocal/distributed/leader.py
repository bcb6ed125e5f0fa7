"""Tensor-parallel serving: rank 0 leads, the other ranks follow its step plan.

Rank 0 runs the whole engine (scheduler, prefix cache, sampling, front ends) on its shard of
the model. Whatever changes the KV pools is first sent to the followers as a small message,
then done locally: a forward (which writes the step's K/V) and a copy-on-write block copy.
Each follower repeats it on its own shard (its KV heads, its weights); the all_sums inside
the forward keep the ranks in step, so a follower that dies surfaces on rank 0 as an error
from the next forward (the engine then stops with that reason) rather than as a hang.

Messages (messages.py) are broadcast (an all_sum) on the channel of the group the model was
loaded with: a length, then that many bytes of JSON. Cache edits (KV compaction) are refused under
tensor parallelism: their re-rotation would have to be mirrored too.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass, field

import mlx.core as mx

from mlxlocal.cache import KVPools, KVShape
from mlxlocal.cache.mlx_lm_views import CacheLayout
from mlxlocal.distributed.channel import Channel
from mlxlocal.distributed.messages import Copy, Pools, ProbeCache, Run, Stop
from mlxlocal.engine import MlxLmRunner, NativeRunner, layer_windows, step_inputs
from mlxlocal.errors import ModelLoadError

log = logging.getLogger("mlxlocal.engine")


def local_shapes(loaded) -> list[KVShape]:
    """This rank's K/V shapes: its own KV heads of every layer."""
    mc = loaded.model_config
    kv_heads = loaded.shard.plan.local_heads[1]
    return KVPools.uniform(mc.num_hidden_layers, kv_heads, mc.head_dim)


@dataclass
class _Rows:
    """What step_batch reads of a sequence, as a follower knows it."""

    block_table: list[int]
    window_table: list[int] = field(default_factory=list)
    edit: None = None
    run_cache: tuple | None = None


_engine_ids = itertools.count()


class MirroredPools(KVPools):
    """Rank 0's pools: their shape goes to the followers at creation, block copies as made."""

    editable = False  # cache edits are refused under tensor parallelism

    def __init__(self, channel: Channel, model: int, shapes, num_blocks, block_size, dtype, windowed=None,
                 window_blocks=0, bits=None, group_size=64):
        # One id per engine: an engine's pools on the followers (bench runs two engines on one model).
        self.engine = next(_engine_ids)
        channel.send(Pools(model, self.engine, num_blocks, block_size, str(dtype).rsplit(".", 1)[-1], windowed,
                           window_blocks, bits, group_size))
        super().__init__(shapes, num_blocks, block_size, dtype, windowed, window_blocks, bits, group_size)
        self.channel = channel

    def copy_block(self, src: int, dst: int) -> None:
        self.channel.send(Copy(self.engine, src, dst))
        super().copy_block(src, dst)

    def move_rows(self, *args, **kwargs) -> None:
        raise RuntimeError("cache edits are not supported under tensor parallelism")


def step_message(pools: MirroredPools, seqs, starts: list[int], every: bool, **extra) -> Run:
    """A forward's announcement: which engine, where each sequence's tokens go, what it sees
    (the followers build the same StepBatch from it); `extra`: the runner's own fields."""
    return Run(pools.engine, starts, every, [s.block_table for s in seqs],
               [s.window_table for s in seqs] if any(pools.windowed) else None, **extra)


class _Leading:
    """What every rank-0 runner shares: the channel, the engine's mirrored pools, and how the
    engine stops when the other ranks stop answering (`on_lost`, set by the engine: its
    thread is then stuck in a collective; this fails its requests from the watchdog's thread)."""

    pools_resizable = False  # the followers' pools are the size the Pools message gave

    def _lead(self, loaded) -> None:
        self.model_id = loaded.shard.model
        self.channel = Channel.of(loaded.shard.group)
        self.pools: MirroredPools | None = None
        self.released = False  # this engine's pools dropped on the followers (close)
        self.on_lost = None
        self.channel.on_lost.append(lambda reason: self.on_lost and self.on_lost(f"ClusterError: {reason}"))

    @property
    def shard_label(self) -> str:
        """This rank's part of the KV, as a disk-tier store names it: "<rank>/<ranks>"."""
        return f"{self.channel.group.rank()}/{self.channel.group.size()}"

    def tier_mirror(self, root: str, budget: int, fingerprint):
        """The disk tier's mirror: the other ranks keep their parts of each block (tier.py)."""
        from mlxlocal.distributed.tier import TierMirror

        assert self.pools is not None
        return TierMirror(self.channel, self.pools.engine, root, budget, fingerprint)

    def new_pools(self, *args, **kwargs) -> MirroredPools:
        self.pools = MirroredPools(self.channel, self.model_id, *args, **kwargs)
        return self.pools

    def close(self) -> None:
        """The followers drop this engine's pools; safe to call more than once."""
        if not self.released and self.pools is not None:
            self.released, channel = True, self.channel
            if channel.broken is None and not channel.send_bounded(Stop(self.pools.engine)):
                log.warning("tensor parallel: could not release the followers: %s", channel.broken)


class LeaderRunner(_Leading, NativeRunner):
    """NativeRunner on rank 0: every forward is announced to the followers first."""

    def __init__(self, loaded, shapes: list[KVShape] | None = None, windows: list[int | None] | None = None):
        # shapes / windows: what this rank's pools hold (default: its KV heads of every layer).
        NativeRunner.__init__(self, loaded.model, shapes or local_shapes(loaded),
                              windows or layer_windows(loaded.model_config))
        self._lead(loaded)

    def run(self, pools, seqs, starts, inputs, every=False):
        # Collectives must run in the same order on every rank, and a follower runs forwards
        # one after the other: so does rank 0, the message and the whole forward evaluated
        # under the channel's lock (self.channel.turn): two engines, or a forward built before the
        # last one ran, could otherwise interleave their all_sums.
        with self.channel.turn():
            mx.eval(inputs)  # the followers need the token ids themselves
            self.channel.send(step_message(pools, seqs, starts, every, tokens=inputs.tolist()))
            logits = NativeRunner.run(self, pools, seqs, starts, inputs, every)
            self.channel.evaluate(logits, pools.state())
        return logits


class MlxLmLeaderRunner(_Leading, MlxLmRunner):
    """MlxLmRunner on rank 0 for an mlx-lm model split by its own shard(): its cache probe and
    every forward are announced first, as LeaderRunner does for native models. Sequences
    decode one per forward (the batched-decode probe could fail halfway through a forward's
    collectives); recurrent (hybrid) models are refused."""

    def __init__(self, loaded):
        self._lead(loaded)
        layout = CacheLayout(loaded.model)  # NotPageable before any message
        with self.channel.turn():  # the probe forward's all_sums, with the followers'
            self.channel.send(ProbeCache(self.model_id))
            MlxLmRunner.__init__(self, loaded.model, layout)
        if self.recurrent:
            raise ModelLoadError(f"{loaded.info.name}: tensor parallelism does not cover recurrent (hybrid) "
                                 "layers: their states would have to be mirrored on every rank")
        self.batched_decode = False

    def _run(self, pools, seqs, starts, n, inputs=None, every=False, snapshot=True):
        with self.channel.turn():
            inputs = step_inputs(seqs, starts, n) if inputs is None else inputs
            mx.eval(inputs)
            self.channel.send(step_message(pools, seqs, starts, every, tokens=inputs.tolist(), mlx_lm=True))
            logits = MlxLmRunner._run(self, pools, seqs, starts, 0, inputs, every, False)
            self.channel.evaluate(logits, pools.state())
        return logits


__all__ = ["LeaderRunner", "MirroredPools", "MlxLmLeaderRunner", "local_shapes", "step_message"]
