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

import re
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

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

    kind = "tensor"  # how a model is split over ranks: tensor, mlx_lm (its own shard()), pipeline
    rank: int
    size: int
    q: tuple[int, int, int]  # (start, stop, total) query heads
    kv: tuple[int, int, int]  # (start, stop, total) KV heads
    mlp: tuple[int, int, int]  # (start, stop, total) intermediate columns

    def leader(self, loaded):
        """Rank 0's runner (engine/runner.py's Runner) for a model split by this plan."""
        from mlxlocal.distributed.leader import LeaderRunner

        return LeaderRunner(loaded)

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


@dataclass(frozen=True)
class MlxLmPlan:
    """An mlx-lm-path model split by its own `shard(group)` (mlx-lm's tensor-parallel layout):
    every rank loads the whole checkpoint, then keeps its slices."""

    kind = "mlx_lm"
    rank: int
    size: int

    def leader(self, loaded):
        from mlxlocal.distributed.leader import MlxLmLeaderRunner

        return MlxLmLeaderRunner(loaded)

    @staticmethod
    def of(config: dict, rank: int, size: int, config_path: str) -> MlxLmPlan:
        # mlx-lm's shard() divides the head counts with //: refuse what would not split evenly.
        heads = config.get("num_attention_heads")
        kv = config.get("num_key_value_heads") or heads
        if not isinstance(heads, int) or heads % size or kv % size:
            raise ModelLoadError(f"{config_path}: tensor parallel over {size} ranks needs the attention heads "
                                 f"({heads}) and KV heads ({kv}) divisible by {size}")
        return MlxLmPlan(rank, size)

    def slicer(self, name: str, shape: tuple[int, ...]) -> None:
        return None  # loaded whole: shard() cuts it


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


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the parameters this process holds of `model` (a rank's shard or stage)."""
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def shard_report(model: nn.Module, cfg: ModelConfig, size: int) -> list[dict]:
    """What each of `size` ranks would hold of this (whole, loaded) model: its heads, its
    intermediate columns and its weight bytes, by the same slicer the ranks load with."""
    from mlx.utils import tree_flatten

    params = tree_flatten(model.parameters())
    rows = []
    for rank in range(size):
        plan = TensorPlan.of(cfg, rank, size)
        nbytes = 0
        for name, value in params:
            part = plan.slicer(name, tuple(value.shape))
            share = 1.0
            for axis, s in enumerate(part or ()):
                n = value.shape[axis]
                share *= len(range(*s.indices(n))) / n
            nbytes += int(value.nbytes * share)
        rows.append({"rank": rank, "q_heads": plan.q[:2], "kv_heads": plan.kv[:2], "mlp": plan.mlp[:2],
                     "weight_bytes": nbytes})
    return rows


__all__ = ["MlxLmPlan", "QuantizedRowParallel", "RowParallelLinear", "TensorPlan", "shard_model", "shard_report",
           "weight_bytes"]
