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

import json
import logging
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from mlxlocal.cache import KVPools, KVShape
from mlxlocal.engine.runner import NativeRunner

log = logging.getLogger("mlxlocal.engine")


class Channel:
    """Rank 0 -> every other rank: JSON messages, in order. A broadcast is an all_sum to which
    the other ranks add zeros: the ring backend sends only to direct neighbours."""

    def __init__(self, group: mx.distributed.Group):
        self.group = group

    def _all_sum(self, x: mx.array) -> mx.array:
        out = mx.distributed.all_sum(x, group=self.group)
        mx.eval(out)
        return out

    def send(self, msg: dict) -> None:
        payload = np.frombuffer(json.dumps(msg).encode(), dtype=np.uint8)
        self._all_sum(mx.array([payload.size], mx.int32))
        self._all_sum(mx.array(payload))

    def recv(self) -> dict:
        size = int(self._all_sum(mx.zeros((1,), mx.int32)).item())
        return json.loads(np.array(self._all_sum(mx.zeros((size,), mx.uint8))).tobytes())


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


class MirroredPools(KVPools):
    """Rank 0's pools: their shape goes to the followers at creation, block copies as made."""

    editable = False  # cache edits are refused under tensor parallelism

    def __init__(self, channel: Channel, shapes, num_blocks, block_size, dtype, windowed=None,
                 window_blocks=0, bits=None, group_size=64):
        channel.send({"op": "pools", "num_blocks": num_blocks, "block_size": block_size,
                      "dtype": str(dtype).rsplit(".", 1)[-1], "windowed": windowed,
                      "window_blocks": window_blocks, "bits": bits, "group_size": group_size})
        super().__init__(shapes, num_blocks, block_size, dtype, windowed, window_blocks, bits, group_size)
        self.channel = channel

    def copy_block(self, src: int, dst: int) -> None:
        self.channel.send({"op": "copy", "src": src, "dst": dst})
        super().copy_block(src, dst)

    def move_rows(self, *args, **kwargs) -> None:
        raise RuntimeError("cache edits are not supported under tensor parallelism")


class LeaderRunner(NativeRunner):
    """NativeRunner on rank 0: every forward is announced to the followers first."""

    def __init__(self, loaded):
        mc = loaded.model_config
        windows = [mc.sliding_window if t == "sliding_attention" else None for t in mc.layer_types]
        super().__init__(loaded.model, local_shapes(loaded), windows)
        self.channel = Channel(loaded.shard.group)
        self._in_flight: mx.array | None = None  # the last forward's logits

    def new_pools(self, *args, **kwargs) -> MirroredPools:
        return MirroredPools(self.channel, *args, **kwargs)

    def run(self, pools, seqs, starts, inputs, every=False):
        # Collectives must run in the same order on every rank. Two forwards in flight at once
        # (the engine builds the next step before the last is evaluated) could interleave
        # their all_sums here while a follower runs them one forward after the other.
        mx.eval(inputs, self._in_flight)
        self.channel.send({
            "op": "run", "starts": starts, "tokens": inputs.tolist(), "every": every,
            "tables": [s.block_table for s in seqs],
            "windows": [s.window_table for s in seqs] if any(pools.windowed) else None,
        })
        self._in_flight = logits = super().run(pools, seqs, starts, inputs, every)
        return logits

    def close(self) -> None:
        """Release the followers (their loop returns); safe to call more than once."""
        if self.channel is not None:
            channel, self.channel = self.channel, None
            try:
                channel.send({"op": "stop"})
            except RuntimeError as e:  # a follower already gone: nothing to release
                log.warning("tensor parallel: could not stop the followers: %s", e)


def follow(loaded) -> int:
    """A follower rank's whole life: repeat rank 0's steps on this shard until told to stop.
    Returns the number of forwards run."""
    mc = loaded.model_config
    windows = [mc.sliding_window if t == "sliding_attention" else None for t in mc.layer_types]
    runner = NativeRunner(loaded.model, local_shapes(loaded), windows)
    channel = Channel(loaded.shard.group)
    pools: KVPools | None = None
    forwards = 0
    while True:
        msg = channel.recv()
        op = msg["op"]
        if op == "stop":
            return forwards
        if op == "pools":
            pools = KVPools(runner.shapes, msg["num_blocks"], msg["block_size"], getattr(mx, msg["dtype"]),
                            msg["windowed"], msg["window_blocks"], msg["bits"], msg["group_size"])
        elif op == "copy":
            pools.copy_block(msg["src"], msg["dst"])
        elif op == "run":
            windows_of = msg["windows"] or [[] for _ in msg["tables"]]
            seqs = [_Rows(t, w) for t, w in zip(msg["tables"], windows_of)]
            logits = runner.run(pools, seqs, msg["starts"], mx.array(msg["tokens"], mx.uint32), msg["every"])
            mx.eval(logits, pools.state())
            forwards += 1
        else:
            raise RuntimeError(f"tensor parallel: unknown message {op!r} from rank 0")


__all__ = ["Channel", "LeaderRunner", "MirroredPools", "follow", "local_shapes"]
