"""What a cluster costs: each rank's memory and weights, and the time a step spends talking."""

from __future__ import annotations

import time

import mlx.core as mx

from mlxlocal.distributed.channel import Channel
from mlxlocal.distributed.messages import Noop, Probe, Report
from mlxlocal.distributed.tensor import weight_bytes


def all_sum_probe(group, shape: list[int], dtype: str, count: int, ring: bool = False) -> float:
    """`count` all_sums of one shape, one after the other (every rank runs the same), or with
    `ring` `count` trips of one array around the ring (a pipeline's hidden state): seconds."""
    x = mx.zeros(shape, getattr(mx, dtype))
    mx.eval(x)
    rank, n, watch = group.rank(), group.size(), group.rank() == 0
    channel = Channel.of(group)
    t0 = time.perf_counter()
    for _ in range(count):
        if not ring:
            channel.evaluate(mx.distributed.all_sum(x, group=group), watch=watch)
            continue
        if rank != 0:  # each hop evaluated alone: two receives in one graph are not ordered
            x = mx.distributed.recv_like(x, rank - 1, group=group)
            channel.evaluate(x, watch=False)
        channel.evaluate(mx.distributed.send(x, (rank + 1) % n, group=group), watch=watch)
        if rank == 0:
            channel.evaluate(mx.distributed.recv_like(x, n - 1, group=group))
    return time.perf_counter() - t0


def gather_rank_numbers(group, numbers: list[int]) -> list[list[int]]:
    """Each rank's list of numbers (same length everywhere), gathered on every rank."""
    n, k = group.size(), len(numbers)
    mine = mx.zeros((n, k), mx.int64)
    mine[group.rank()] = mx.array(numbers, mx.int64)
    out = mx.distributed.all_sum(mine, group=group)
    Channel.of(group).evaluate(out, watch=group.rank() == 0)
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
    channel = Channel.of(group)
    with channel.turn():
        channel.send(Report())
        ranks = gather_rank_numbers(group, [mx.get_peak_memory(), weight_bytes(loaded.model)])
        times, sends = [], []
        for _ in range(repeats):
            channel.send(Probe(shape, dtype, count, pipeline))
            times.append(all_sum_probe(group, shape, dtype, count, pipeline))
            # The step's own message (block tables and tokens of `batch` sequences, ~100 B each).
            t0 = time.perf_counter()
            channel.send(Noop("x" * 100 * batch))
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


__all__ = ["all_sum_probe", "cluster_report", "gather_rank_numbers"]
