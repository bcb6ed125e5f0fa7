"""Tensor parallelism for the native llama family over mx.distributed (Megatron layout).

q/k/v and gate/up are column-parallel: rank r holds the output rows of its query heads, its
KV heads and its slice of the intermediate columns. o and down are row-parallel: rank r holds
the matching input columns, and the partial products meet in one all_sum per projection (the
bias, where there is one, is added once, after the sum). Embeddings, norms and the vocab
projection are replicated, so every rank ends with the same logits.

KV heads are split when the ranks divide them, and replicated in groups when there are fewer
KV heads than ranks (each rank keeps the one KV head its query heads read). A rank's paged
pools hold its own KV heads only.

Each rank loads its shard straight from the mapped file (`TensorPlan.slicer`): a slice of the
mapped bytes is copied, never the whole tensor, so weights per rank are about 1/N of the model
plus the replicated embeddings and head.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import threading
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxlocal import metal
from mlxlocal.errors import ModelLoadError
from mlxlocal.models.config import ModelConfig
from mlxlocal.models.layers import Linear, QuantizedLinear

# Parameter name -> (which split, axis): rows of column-parallel, columns of row-parallel.
_SPLITS = (
    (re.compile(r"\.self_attn\.q_proj\.(weight|bias|scales|biases)$"), "q", 0),
    (re.compile(r"\.self_attn\.[kv]_proj\.(weight|bias|scales|biases)$"), "kv", 0),
    (re.compile(r"\.self_attn\.o_proj\.(weight|scales|biases)$"), "q", -1),
    (re.compile(r"\.mlp\.(gate|up)_proj\.(weight|bias|scales|biases)$"), "mlp", 0),
    (re.compile(r"\.mlp\.down_proj\.(weight|scales|biases)$"), "mlp", -1),
)


@dataclass(frozen=True)
class TensorPlan:
    """What rank `rank` of `size` holds: [start, stop) of the query heads, KV heads and
    intermediate columns (each a fraction of its total)."""

    rank: int
    size: int
    q: tuple[int, int, int]  # (start, stop, total) query heads
    kv: tuple[int, int, int]  # (start, stop, total) KV heads
    mlp: tuple[int, int, int]  # (start, stop, total) intermediate columns

    @staticmethod
    def of(cfg: ModelConfig, rank: int, size: int) -> TensorPlan:
        """The plan for `rank`; a model the ranks cannot split evenly is refused, naming why."""
        hq, hkv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank {rank} of {size}")
        problems = []
        if hq % size:
            problems.append(f"{hq} attention heads")
        if hkv % size and size % hkv:
            problems.append(f"{hkv} KV heads (neither divides the other)")
        if inter % size:
            problems.append(f"intermediate_size {inter}")
        if problems:
            raise ModelLoadError(f"tensor parallel over {size} ranks needs each of these divisible "
                                 f"by {size}: {', '.join(problems)}")
        per_q = hq // size
        if hkv % size == 0:
            kv = (rank * hkv // size, (rank + 1) * hkv // size, hkv)
        else:  # fewer KV heads than ranks: each group of size/hkv ranks shares one KV head
            kv = (rank // (size // hkv), rank // (size // hkv) + 1, hkv)
        per_i = inter // size
        return TensorPlan(rank, size, (rank * per_q, (rank + 1) * per_q, hq), kv,
                          (rank * per_i, (rank + 1) * per_i, inter))

    @property
    def local_heads(self) -> tuple[int, int]:
        """(query heads, KV heads) this rank computes."""
        return self.q[1] - self.q[0], self.kv[1] - self.kv[0]

    def slicer(self, name: str, shape: tuple[int, ...]) -> tuple[slice, ...] | None:
        """The part of tensor `name` this rank loads (None: all of it, a replicated tensor)."""
        for pattern, which, axis in _SPLITS:
            if pattern.search(name):
                start, stop, total = getattr(self, which)
                n = shape[axis]
                if (start * n) % total or (stop * n) % total:
                    raise ModelLoadError(
                        f"tensor '{name}' {tuple(shape)}: rank {self.rank}'s part ({which} {start}..{stop} "
                        f"of {total}) does not fall on whole elements of axis {axis} ({n}); a "
                        f"quantization group would straddle two ranks: use fewer ranks or a smaller group")
                part = slice(start * n // total, stop * n // total)
                return (part,) if axis == 0 else (slice(None),) * (len(shape) - 1) + (part,)
        return None


class RowParallelLinear(Linear):
    """A row-parallel projection: this rank's input columns, the partial products all_sum'ed,
    then the (unsplit) bias once. Parameter names stay nn.Linear's, as in the checkpoint."""

    def __init__(self, in_dims: int, out_dims: int, bias: bool, group: mx.distributed.Group):
        super().__init__(in_dims, out_dims, bias=bias)
        self.group = group

    def __call__(self, x: mx.array) -> mx.array:
        y = mx.distributed.all_sum(metal.linear(x, self.weight), group=self.group)
        return y + self.bias if "bias" in self else y

    def to_quantized(self, group_size=None, bits=None, mode="affine", quantize_input=False):
        if mode != "affine" or quantize_input:
            raise ModelLoadError(f"tensor parallelism supports affine quantization only, not {mode!r}")
        q = QuantizedRowParallel.from_linear(self, group_size, bits, mode)
        q.group = self.group
        return q


class QuantizedRowParallel(QuantizedLinear):
    """RowParallelLinear over a quantized weight (group set by `to_quantized`)."""

    def __call__(self, x: mx.array) -> mx.array:
        y = metal.quantized_linear(x, self.weight, self.scales, self.get("biases"),
                                   self.group_size, self.bits, self.mode)
        y = mx.distributed.all_sum(y, group=self.group)
        return y + self.bias if "bias" in self else y


def shard_model(model: nn.Module, plan: TensorPlan, group: mx.distributed.Group) -> None:
    """Resize a freshly built native model (weights not loaded, not yet quantized: its
    parameters are lazy and never materialise at full size) to `plan`'s shard, in place."""
    cfg: ModelConfig = model.config
    d, hidden = cfg.head_dim, cfg.hidden_size
    hq, hkv = plan.local_heads
    inter = plan.mlp[1] - plan.mlp[0]
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.n_heads, attn.n_kv_heads = hq, hkv
        qkv_bias = "bias" in attn.q_proj
        attn.q_proj = Linear(hidden, hq * d, bias=qkv_bias)
        attn.k_proj = Linear(hidden, hkv * d, bias=qkv_bias)
        attn.v_proj = Linear(hidden, hkv * d, bias=qkv_bias)
        attn.o_proj = RowParallelLinear(hq * d, hidden, "bias" in attn.o_proj, group)
        mlp_bias = "bias" in mlp.gate_proj
        mlp.gate_proj = Linear(hidden, inter, bias=mlp_bias)
        mlp.up_proj = Linear(hidden, inter, bias=mlp_bias)
        mlp.down_proj = RowParallelLinear(inter, hidden, "bias" in mlp.down_proj, group)


class Channel:
    """Rank 0 -> every other rank: JSON messages, in order. A broadcast is an all_sum to which
    the other ranks add zeros: the ring backend sends only to direct neighbours."""

    # Collectives must come in the same order on every rank: rank 0's engines (and their
    # threads) take turns, a whole message or forward at a time.
    lock = threading.RLock()

    def __init__(self, group: mx.distributed.Group):
        self.group = group

    def _all_sum(self, x: mx.array) -> mx.array:
        out = mx.distributed.all_sum(x, group=self.group)
        mx.eval(out)
        return out

    def send(self, msg: dict) -> None:
        payload = np.frombuffer(json.dumps(msg).encode(), dtype=np.uint8)
        with self.lock:
            self._all_sum(mx.array([payload.size], mx.int32))
            self._all_sum(mx.array(payload))

    def recv(self) -> dict:
        size = int(self._all_sum(mx.zeros((1,), mx.int32)).item())
        return json.loads(np.array(self._all_sum(mx.zeros((size,), mx.uint8))).tobytes())


_announced: list[str] = []  # model specs rank 0 told the followers to load, in order


def announce_load(group: mx.distributed.Group, spec: str, **how) -> int:
    """Rank 0: tell the followers to load their shards of `spec` (`how`: e.g. pp=N, pipeline
    stages); returns the model's id in the messages that follow. The first call also
    arranges that they exit with this process."""
    if not _announced:
        atexit.register(release, group)
    _announced.append(spec)
    Channel(group).send({"op": "load", "model": len(_announced) - 1, "spec": spec, **how})
    return len(_announced) - 1


def release(group: mx.distributed.Group | None = None) -> None:
    """Rank 0: let the followers exit (once; before MLX's streams are cleared at exit)."""
    if _announced and _announced[-1] is not None:
        _announced.append(None)  # released: nothing more to announce
        try:
            Channel(group or world()).send({"op": "exit"})
        except RuntimeError:  # a follower already gone: nothing to release
            pass


def launched() -> bool:
    """Started as one rank of several (mlx.launch or launch-cluster set MLX_RANK)."""
    return "MLX_RANK" in os.environ


def world(size: int | None = None) -> mx.distributed.Group:
    """The distributed group this process belongs to (mlx.launch sets it up); `size`, when
    given, must match it."""
    group = mx.distributed.init()
    if size is not None and group.size() != size:
        raise ModelLoadError(f"--tp {size} asks for {size} ranks, but this process runs in a group of "
                             f"{group.size()} (start it with `mlx.launch -n {size} ...`)")
    return group


__all__ = ["Channel", "announce_load", "QuantizedRowParallel", "RowParallelLinear", "TensorPlan", "launched", "release", "shard_model", "world"]
