"""Pipeline parallelism for the native llama family: contiguous layer ranges per rank.

Rank r of N holds layers [start, stop) (balanced by count). Rank 0 also holds both ends of
the model, the embeddings and the final norm + vocab projection: it is the rank that has the
tokens and samples, the last rank's output comes back to it over the ring's closing link
(rank N-1 -> 0 is a neighbour) as a hidden state (hidden_size per token, not vocab_size),
and a model with tied embeddings keeps its one embedding matrix in one place.

Each rank loads only its tensors: `PipelinePlan.slicer` answers SKIP for the others, and the
safetensors reader never touches their bytes. `prune` drops the other layers' modules from a
freshly built model (parameters still lazy) so the checkpoint's names load unchanged.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mlxlocal.errors import ModelLoadError
from mlxlocal.models.config import ModelConfig
from mlxlocal.models.layers import embedding_as_linear
from mlxlocal.weights.safetensors import SKIP

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_ENDS = re.compile(r"^(model\.embed_tokens|model\.norm|lm_head)\.")


@dataclass(frozen=True)
class PipelinePlan:
    """What rank `rank` of `size` holds: layers [start, stop) of `total`, and the ends on rank 0."""

    kind = "pipeline"
    rank: int
    size: int
    start: int
    stop: int
    total: int

    def leader(self, loaded):
        """Rank 0's runner: the first stage, which also embeds and samples."""
        from mlxlocal.distributed.pipeline import PipelineLeaderRunner

        return PipelineLeaderRunner(loaded)

    @staticmethod
    def of(cfg: ModelConfig, rank: int, size: int) -> PipelinePlan:
        n = cfg.num_hidden_layers
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank {rank} of {size}")
        if size > n:
            raise ModelLoadError(f"pipeline parallel over {size} ranks (--pp {size}) needs at least {size} "
                                 f"layers, one per rank; this model has {n}")
        return PipelinePlan(rank, size, rank * n // size, (rank + 1) * n // size, n)

    @property
    def layers(self) -> range:
        return range(self.start, self.stop)

    @property
    def ends(self) -> bool:
        """Embeddings, final norm and vocab projection are here."""
        return self.rank == 0

    @property
    def last(self) -> bool:
        """This rank runs the model's last layer (prefill asks it for the last position only)."""
        return self.stop == self.total

    def slicer(self, name: str, shape: tuple[int, ...]):
        """SKIP for tensors of other ranks, None (all of it) for this rank's."""
        if (m := _LAYER.search(name)) is not None:
            return None if self.start <= int(m.group(1)) < self.stop else SKIP
        if _ENDS.search(name) and not self.ends:
            return SKIP
        return None

    def prune(self, model: nn.Module) -> None:
        """Keep this rank's layers (others become empty modules: the list keeps the
        checkpoint's indices) and, off rank 0, drop the ends. Before weights are loaded."""
        layers = model.model.layers
        for i in range(len(layers)):
            if i not in self.layers:
                layers[i] = nn.Module()
        if not self.ends:
            del model.model.embed_tokens
            del model.model.norm
            if "lm_head" in model:
                del model.lm_head


def stage_report(model: nn.Module, cfg: ModelConfig, size: int) -> list[dict]:
    """What each of `size` stages would hold of this (whole, loaded) model: its layers and its
    weight bytes, by the same slicer the ranks load with."""
    from mlx.utils import tree_flatten

    params = tree_flatten(model.parameters())
    rows = []
    for rank in range(size):
        plan = PipelinePlan.of(cfg, rank, size)
        held = sum(v.nbytes for name, v in params if plan.slicer(name, tuple(v.shape)) is not SKIP)
        rows.append({"rank": rank, "layers": (plan.start, plan.stop), "ends": plan.ends, "weight_bytes": held,
                     "total_bytes": sum(v.nbytes for _, v in params)})
    return rows


def embed(model: nn.Module, tokens: mx.array) -> mx.array:
    return model.model.embed_tokens(tokens)


def run_layers(model: nn.Module, plan: PipelinePlan, h: mx.array, views: list, last_only: bool) -> mx.array:
    """This rank's layers over h; views[i] is local layer i's K/V (global layer start + i)."""
    for i, layer in enumerate(model.model.layers[plan.start:plan.stop]):
        # Past the model's last layer's K/V only the last position is needed (prefill).
        h = layer(h, views[i], last_only and plan.start + i == plan.total - 1)
    return h


def head(model: nn.Module, h: mx.array) -> mx.array:
    h = model.model.norm(h)
    if "lm_head" in model:
        return model.lm_head(h)
    return embedding_as_linear(model.model.embed_tokens, h)


__all__ = ["PipelinePlan", "embed", "head", "run_layers", "stage_report"]
