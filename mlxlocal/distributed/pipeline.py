"""Pipeline-parallel serving: each rank runs its layers, hidden states pass along the ring.

Rank 0 leads as under tensor parallelism (leader.py): it owns the scheduler, the
prefix cache and sampling, and announces each forward on the Channel before running it; its
pools and block copies are mirrored the same way (MirroredPools). A pipeline `run` message
carries the step plan only (starts, block tables, the micro-batch split, the input length and
the hidden states' dtype): the tokens stay on rank 0, which embeds them.

One forward, for each micro-batch j (a slice of the batch's sequences), in order:
rank 0 embeds and runs its layers, sends h_j to rank 1; rank r receives h_j from r-1, runs its
layers, sends to r+1; the last rank sends to rank 0 (its ring neighbour), which then applies
the final norm and the vocab projection. Each rank evaluates a micro-batch's send before it
builds the next, so while rank 1 works on micro-batch 1, rank 0 already works on micro-batch
2 (the ranks are separate processes; what overlaps is their compute, not one graph's ops).
"""

from __future__ import annotations

import time

import mlx.core as mx

from mlxlocal.cache import KVPools, KVShape, PagedLayerView
from mlxlocal.distributed.channel import Channel
from mlxlocal.distributed.leader import LeaderRunner, _Rows, step_message
from mlxlocal.distributed.messages import Run
from mlxlocal.distributed.stages import PipelinePlan, embed, head, run_layers
from mlxlocal.engine import layer_windows, step_batch


def stage_layout(loaded) -> tuple[list[KVShape], list[int | None]]:
    """This rank's K/V shapes and sliding windows: one per layer it holds."""
    mc, plan = loaded.model_config, loaded.shard.plan
    windows = layer_windows(mc)
    shapes = KVPools.uniform(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim)
    return shapes[plan.start:plan.stop], windows[plan.start:plan.stop]


def split(rows: int, parts: int) -> list[tuple[int, int]]:
    """[lo, hi) of each of min(parts, rows) micro-batches, sizes differing by at most one."""
    parts = max(1, min(parts, rows))
    return [(j * rows // parts, (j + 1) * rows // parts) for j in range(parts)]


class _Stage:
    """What a rank needs to run its layers over one micro-batch."""

    model: object
    plan: PipelinePlan
    windows: list[int | None]

    def layers(self, pools: KVPools, seqs, starts: list[int], h: mx.array, last_only: bool) -> mx.array:
        batch = step_batch(seqs, starts, h.shape[1], pools.block_size, any(pools.windowed))
        views = [PagedLayerView(pools, i, batch, w) for i, w in enumerate(self.windows)]
        return run_layers(self.model, self.plan, h, views, last_only)


class PipelineLeaderRunner(_Stage, LeaderRunner):
    """Rank 0 of a pipeline: embeds, runs the first layers, samples from what comes back.

    `micro_batches`: how many slices a batch is cut into (default: one per rank, so that
    every rank has one to work on); a prefill (one sequence) is never cut."""

    def __init__(self, loaded, micro_batches: int | None = None):
        LeaderRunner.__init__(self, loaded, *stage_layout(loaded))
        self.plan, self.group = loaded.shard.plan, loaded.shard.group
        self.micro_batches = micro_batches or self.plan.size
        self.hidden = loaded.model_config.hidden_size
        self.forwards = self.sent = 0  # forwards run, micro-batches sent down the pipeline
        # Seconds in rank 0's own stage (embed, layers, sends) and waiting for the pipeline's
        # output (receives, head): the second is the other ranks' time plus the links'.
        self.stage_seconds = self.wait_seconds = 0.0

    def run(self, pools, seqs, starts, inputs, every=False):
        parts = split(len(seqs), self.micro_batches)
        n = inputs.shape[1]
        # As under tensor parallelism: the message and the whole forward under the channel's
        # lock, so two engines' sends and receives never interleave; waits watched (a stage
        # that stops answering stops the engine), a lost link a ClusterError.
        with self.channel.turn():
            self.channel.send(step_message(pools, seqs, starts, every, pp=True, n=n, parts=parts,
                                           dtype=str(self.dtype).rsplit(".", 1)[-1]))
            size, group = self.plan.size, self.group
            t0 = time.perf_counter()
            for lo, hi in parts:
                h = self.layers(pools, seqs[lo:hi], starts[lo:hi], embed(self.model, inputs[lo:hi]), not every)
                self.channel.evaluate(mx.distributed.send(h.astype(self.dtype), 1, group=group))
                self.sent += 1
            t1 = time.perf_counter()
            out = []
            for lo, hi in parts:
                h = mx.distributed.recv((hi - lo, n if every else 1, self.hidden), self.dtype, size - 1, group=group)
                out.append(head(self.model, h))
                # One receive per evaluation: nothing orders two recvs within one graph (MLX
                # ran three of one graph in reverse order, every time), and the micro-batches'
                # states arrive in order on the one link. Sends likewise, one per evaluation.
                self.channel.evaluate(out[-1])
            logits = out[0] if len(out) == 1 else mx.concatenate(out)
            self.channel.evaluate(logits, pools.state())
            self.forwards += 1
            self.stage_seconds += t1 - t0
            self.wait_seconds += time.perf_counter() - t1
        return logits if every else logits[:, -1, :]


class StageRunner(_Stage):
    """A follower's stage: its layers, fed by rank r-1, feeding rank r+1 (rank 0 for the last)."""

    recurrent = False

    def __init__(self, loaded):
        self.model, self.plan, self.group = loaded.model, loaded.shard.plan, loaded.shard.group
        self.shapes, self.windows = stage_layout(loaded)
        self.hidden = loaded.model_config.hidden_size
        self.channel = Channel.of(self.group)

    def follow(self, pools: KVPools, msg: Run) -> None:
        rank, size, group = self.plan.rank, self.plan.size, self.group
        dtype, n, starts = getattr(mx, msg.dtype), msg.n, msg.starts
        windows = msg.windows or [[] for _ in msg.tables]
        seqs = [_Rows(t, w) for t, w in zip(msg.tables, windows)]
        for lo, hi in msg.parts:
            h = mx.distributed.recv((hi - lo, n, self.hidden), dtype, rank - 1, group=group)
            h = self.layers(pools, seqs[lo:hi], starts[lo:hi], h, not msg.every)
            send = mx.distributed.send(h.astype(dtype), (rank + 1) % size, group=group)
            self.channel.evaluate(send, watch=False)
        self.channel.evaluate(pools.state(), watch=False)


__all__ = ["PipelineLeaderRunner", "StageRunner", "split", "stage_layout"]
