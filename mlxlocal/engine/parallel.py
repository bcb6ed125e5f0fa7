"""Tensor-parallel serving: rank 0 leads, the other ranks follow its step plan.

Rank 0 runs the whole engine (scheduler, prefix cache, sampling, front ends) on its shard of
the model. Whatever changes the KV pools is first sent to the followers as a small message,
then done locally: a forward (which writes the step's K/V) and a copy-on-write block copy.
Each follower repeats it on its own shard (its KV heads, its weights); the all_sums inside
the forward keep the ranks in step, so a follower that dies surfaces on rank 0 as an error
from the next forward (the engine then stops with that reason) rather than as a hang.

Messages are broadcast (an all_sum) on the group the model was loaded with: a length, then
that many bytes of JSON. Cache edits (KV compaction) are refused under
tensor parallelism: their re-rotation would have to be mirrored too.
"""

from __future__ import annotations

import itertools
import logging
import sys
import time
from dataclasses import dataclass, field

import mlx.core as mx

from mlxlocal.cache import KVPools, KVShape
from mlxlocal.cache.mlx_lm_views import CacheLayout
from mlxlocal.engine.runner import MlxLmRunner, NativeRunner, layer_windows, step_inputs
from mlxlocal.errors import ClusterError, ModelLoadError
from mlxlocal.models.parallel import Channel, weight_bytes, world

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
        channel.send({"op": "pools", "model": model, "engine": self.engine, "num_blocks": num_blocks,
                      "block_size": block_size, "dtype": str(dtype).rsplit(".", 1)[-1], "windowed": windowed,
                      "window_blocks": window_blocks, "bits": bits, "group_size": group_size})
        super().__init__(shapes, num_blocks, block_size, dtype, windowed, window_blocks, bits, group_size)
        self.channel = channel

    def copy_block(self, src: int, dst: int) -> None:
        self.channel.send({"op": "copy", "engine": self.engine, "src": src, "dst": dst})
        super().copy_block(src, dst)

    def move_rows(self, *args, **kwargs) -> None:
        raise RuntimeError("cache edits are not supported under tensor parallelism")


def step_message(pools: MirroredPools, seqs, starts: list[int], every: bool, **extra) -> dict:
    """A forward's announcement: which engine, where each sequence's tokens go, what it sees
    (the followers build the same StepBatch from it); `extra`: the runner's own fields."""
    return {"op": "run", "engine": pools.engine, "starts": starts, "every": every,
            "tables": [s.block_table for s in seqs],
            "windows": [s.window_table for s in seqs] if any(pools.windowed) else None, **extra}


class _Leading:
    """What every rank-0 runner shares: the channel, the engine's mirrored pools, and how the
    engine stops when the other ranks stop answering (`on_lost`, set by the engine: its
    thread is then stuck in a collective; this fails its requests from the watchdog's thread)."""

    def _lead(self, loaded) -> None:
        self.model_id = loaded.shard.model
        self.channel: Channel | None = Channel(loaded.shard.group)
        self.pools: MirroredPools | None = None
        self.on_lost = None
        Channel.on_lost.append(lambda reason: self.on_lost and self.on_lost(f"ClusterError: {reason}"))

    def new_pools(self, *args, **kwargs) -> MirroredPools:
        self.pools = MirroredPools(self.channel, self.model_id, *args, **kwargs)
        return self.pools

    def close(self) -> None:
        """The followers drop this engine's pools; safe to call more than once."""
        if self.channel is not None and self.pools is not None:
            channel, self.channel = self.channel, None
            if Channel.broken is None and not channel.send_bounded({"op": "stop", "engine": self.pools.engine}):
                log.warning("tensor parallel: could not release the followers: %s", Channel.broken)


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
        # under the channel's lock (Channel.turn): two engines, or a forward built before the
        # last one ran, could otherwise interleave their all_sums.
        with Channel.turn():
            mx.eval(inputs)  # the followers need the token ids themselves
            self.channel.send(step_message(pools, seqs, starts, every, tokens=inputs.tolist()))
            logits = NativeRunner.run(self, pools, seqs, starts, inputs, every)
            Channel.evaluate(logits, pools.state())
        return logits


class MlxLmLeaderRunner(_Leading, MlxLmRunner):
    """MlxLmRunner on rank 0 for an mlx-lm model split by its own shard(): its cache probe and
    every forward are announced first, as LeaderRunner does for native models. Sequences
    decode one per forward (the batched-decode probe could fail halfway through a forward's
    collectives); recurrent (hybrid) models are refused."""

    def __init__(self, loaded):
        self._lead(loaded)
        layout = CacheLayout(loaded.model)  # NotPageable before any message
        with Channel.turn():  # the probe forward's all_sums, with the followers'
            self.channel.send({"op": "probe_cache", "model": self.model_id})
            MlxLmRunner.__init__(self, loaded.model, layout)
        if self.recurrent:
            raise ModelLoadError(f"{loaded.info.name}: tensor parallelism does not cover recurrent (hybrid) "
                                 "layers: their states would have to be mirrored on every rank")
        self.batched_decode = False

    def _run(self, pools, seqs, starts, n, inputs=None, every=False, snapshot=True):
        with Channel.turn():
            inputs = step_inputs(seqs, starts, n) if inputs is None else inputs
            mx.eval(inputs)
            self.channel.send(step_message(pools, seqs, starts, every, tokens=inputs.tolist(), mlx_lm=True))
            logits = MlxLmRunner._run(self, pools, seqs, starts, 0, inputs, every, False)
            Channel.evaluate(logits, pools.state())
        return logits


class Follower:
    """A follower rank: the models rank 0 loaded (this rank's shards), the pools of each engine
    rank 0 opened on them, and the step it is told to repeat."""

    def __init__(self, group: mx.distributed.Group):
        self.group, self.channel = group, Channel(group)
        self.runners: dict[int, NativeRunner] = {}  # by model id
        self.loaded: dict = {}  # mlx-lm models loaded, waiting for their cache probe
        self.pools: dict[int, tuple[NativeRunner, KVPools]] = {}  # by engine id
        self.forwards = 0

    def serve(self) -> int:
        """Repeat rank 0's messages until it exits; returns the number of forwards run."""
        while (msg := self.channel.recv())["op"] != "exit":
            getattr(self, "_" + msg["op"])(msg)
        return self.forwards

    def _load(self, msg: dict) -> None:
        from mlxlocal.source.loader import load

        if msg.get("pp"):  # a pipeline stage: engine/pipeline.py
            from mlxlocal.engine.pipeline import StageRunner

            self.runners[msg["model"]] = StageRunner(load(msg["spec"], pp=msg["pp"]))
            return
        loaded = load(msg["spec"], tp=self.group.size(), pp=1)  # as rank 0 decided
        if not loaded.info.native:  # its runner comes with rank 0's cache probe (_probe_cache)
            self.loaded[msg["model"]] = loaded
            return
        self.runners[msg["model"]] = NativeRunner(loaded.model, local_shapes(loaded), layer_windows(loaded.model_config))

    def _pools(self, msg: dict) -> None:
        runner = self.runners[msg["model"]]
        pools = KVPools(runner.shapes, msg["num_blocks"], msg["block_size"], getattr(mx, msg["dtype"]),
                        msg["windowed"], msg["window_blocks"], msg["bits"], msg["group_size"])
        self.pools[msg["engine"]] = (runner, pools)

    def _copy(self, msg: dict) -> None:
        self.pools[msg["engine"]][1].copy_block(msg["src"], msg["dst"])

    def _stop(self, msg: dict) -> None:
        self.pools.pop(msg["engine"], None)

    def _probe_cache(self, msg: dict) -> None:
        """An mlx-lm model's runner: its cache probe runs a forward, with rank 0's."""
        loaded = self.loaded[msg["model"]]  # each engine rank 0 opens probes again
        self.runners[msg["model"]] = MlxLmRunner(loaded.model, CacheLayout(loaded.model))

    def _noop(self, msg: dict) -> None:
        pass

    def _probe(self, msg: dict) -> None:
        all_sum_probe(self.group, msg["shape"], msg["dtype"], msg["count"], msg.get("ring", False))

    def _report(self, msg: dict) -> None:
        gather_rank_numbers(self.group, self._numbers())

    def _numbers(self) -> list[int]:
        weights = sum(weight_bytes(r.model) for r in self.runners.values())
        return [mx.get_peak_memory(), weights]

    def _run(self, msg: dict) -> None:
        runner, pools = self.pools[msg["engine"]]
        if msg.get("pp"):  # a pipeline stage: its layers, hidden states from/to its neighbours
            runner.follow(pools, msg)
            self.forwards += 1
            return
        windows = msg["windows"] or [[] for _ in msg["tables"]]
        seqs = [_Rows(t, w) for t, w in zip(msg["tables"], windows)]
        tokens = mx.array(msg["tokens"], mx.uint32)
        if msg.get("mlx_lm"):
            logits = runner._run(pools, seqs, msg["starts"], 0, tokens, msg["every"], False)
        else:
            logits = runner.run(pools, seqs, msg["starts"], tokens, msg["every"])
        # Everything up to the logits: rank 0 waits in each of this forward's all_sums.
        Channel.evaluate(logits, pools.state(), watch=False)
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


def all_sum_probe(group, shape: list[int], dtype: str, count: int, ring: bool = False) -> float:
    """`count` all_sums of one shape, one after the other (every rank runs the same), or with
    `ring` `count` trips of one array around the ring (a pipeline's hidden state): seconds."""
    x = mx.zeros(shape, getattr(mx, dtype))
    mx.eval(x)
    rank, n, watch = group.rank(), group.size(), group.rank() == 0
    t0 = time.perf_counter()
    for _ in range(count):
        if not ring:
            Channel.evaluate(mx.distributed.all_sum(x, group=group), watch=watch)
            continue
        if rank != 0:  # each hop evaluated alone: two receives in one graph are not ordered
            x = mx.distributed.recv_like(x, rank - 1, group=group)
            Channel.evaluate(x, watch=False)
        Channel.evaluate(mx.distributed.send(x, (rank + 1) % n, group=group), watch=watch)
        if rank == 0:
            Channel.evaluate(mx.distributed.recv_like(x, n - 1, group=group))
    return time.perf_counter() - t0


def gather_rank_numbers(group, numbers: list[int]) -> list[list[int]]:
    """Each rank's list of numbers (same length everywhere), gathered on every rank."""
    n, k = group.size(), len(numbers)
    mine = mx.zeros((n, k), mx.int64)
    mine[group.rank()] = mx.array(numbers, mx.int64)
    out = mx.distributed.all_sum(mine, group=group)
    Channel.evaluate(out, watch=group.rank() == 0)
    return out.tolist()


def cluster_report(loaded, batch: int, repeats: int = 5) -> dict:
    """Rank 0 (`bench` under a launch): each rank's peak memory and weight bytes, and the time one
    decode step spends in communication, timed alone (every rank taking part), medians of
    `repeats`: tensor parallel, its 2 all_sums per layer of [batch, hidden]; pipeline, one trip
    of [batch, hidden] around the ring; both, the step's message to the followers."""
    import statistics

    group, mc = loaded.shard.group, loaded.model_config
    pipeline = loaded.shard.plan.kind == "pipeline"
    dtype = str(loaded.model.model.embed_tokens.weight.dtype).rsplit(".", 1)[-1]
    shape, count = [batch, 1, mc.hidden_size], 1 if pipeline else 2 * mc.num_hidden_layers
    channel = Channel(group)
    with Channel.turn():
        channel.send({"op": "report"})
        ranks = gather_rank_numbers(group, [mx.get_peak_memory(), weight_bytes(loaded.model)])
        times, sends = [], []
        for _ in range(repeats):
            channel.send({"op": "probe", "shape": shape, "dtype": dtype, "count": count, "ring": pipeline})
            times.append(all_sum_probe(group, shape, dtype, count, pipeline))
            # The step's own message (block tables and tokens of `batch` sequences, ~100 B each).
            t0 = time.perf_counter()
            channel.send({"op": "noop", "pad": "x" * 100 * batch})
            sends.append(time.perf_counter() - t0)
    itemsize = mx.zeros((1,), getattr(mx, dtype)).itemsize
    n, payload = group.size(), batch * mc.hidden_size * itemsize
    return {
        "ranks": n, "mode": "pipeline" if pipeline else "tensor", "peak_memory_bytes": [r[0] for r in ranks],
        "weight_bytes": [r[1] for r in ranks],
        "comm_s_per_step": statistics.median(times) + statistics.median(sends),
        "collectives_per_step": count, "message_s_per_step": statistics.median(sends),
        # A ring all-reduce moves 2 (n - 1) / n of the buffer through each rank's link; a
        # pipeline sends its hidden state once over each link.
        "link_bytes_per_step": int(payload if pipeline else count * payload * 2 * (n - 1) / n),
    }


def cluster_problem() -> str | None:
    """Why this process's cluster cannot run any more (None while it can, or when not launched)."""
    return Channel.broken


__all__ = ["Follower", "MlxLmLeaderRunner", "cluster_problem", "cluster_report", "LeaderRunner", "MirroredPools", "follower_main", "local_shapes", "step_message"]
