"""Kernel warm-up: the dispatch points a paged engine's decode steps call, decided (and on
Metal compiled, and under auto measured) when the engine is built, not on the first request.

Each projection (N, K, dtype, quantization) at decode rows 1..the most the engine forwards
(max_num_seqs, times 1 + draft tokens when speculating), paged attention for each
attention layer's (Hq, Hkv, D, block size, dtype, kv bits), and a native model's norms and
ropes (compiled or mx.fast, metal/fused.py) at those rows in powers of two, and without Metal
its decode attention's composition (metal/fused.py) at each size class.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx

from mlxlocal.cache import quantized
from mlxlocal.engine.config import EngineConfig
from mlxlocal.engine.runner import NativeRunner
from mlxlocal.metal import dispatch, fused, layout
from mlxlocal.models.kernel_sites import (
    attention_heads,
    fused_sites,
    projection_sites,
    projection_weights,
)

kernel_status = dispatch.status  # mode, Metal or not, the cache file and the chip, for reports
describe_plan = dispatch.describe  # the plan as table rows (op, shape, dtype, path)


def decode_rows(cfg: EngineConfig) -> int:
    """Rows of the largest decode forward: every running sequence, with its draft when verifying."""
    spec = cfg.speculative
    return cfg.max_num_seqs * (1 + (spec.num_draft_tokens if spec is not None else 0))


def decode_sites(runner, cfg: EngineConfig) -> list[tuple[str, tuple]]:
    """(op, gate arguments) of every dispatch call a decode step of `runner` makes."""
    sites = projection_sites(runner.model, range(1, decode_rows(cfg) + 1), runner.dtype)
    if isinstance(runner, NativeRunner):  # mlx-lm models attend through their own code
        tables = mx.zeros((1, 1), mx.int32)
        for (hq, d), shape, window in zip(attention_heads(runner.model), runner.shapes, runner.windows):
            q = mx.zeros((1, hq, 1, d), runner.dtype)
            k, v = (quantized.empty(1, cfg.block_size, h, dim, runner.dtype, cfg.kv_bits, cfg.kv_group_size)
                    for h, dim in ((shape.k_heads, shape.k_dim), (shape.v_heads, shape.v_dim)))
            if cfg.kv_bits is None:
                sites.append(("paged_attention", (q, k, v, tables, window)))
            else:
                sites.append(("paged_attention_quantized", (q, k, v, tables, cfg.kv_group_size,
                                                            cfg.kv_bits, window)))
    return sites


def warm_up(runner, cfg: EngineConfig, draft_runner=None) -> list[dict]:
    """The plan (one dict per op and shape: path, how it was decided, timings) after deciding,
    compiling and measuring what is needed; on a machine without Metal nothing compiles and
    every path is the MLX reference. A draft model (it follows every forward of the target, on
    pools that are never quantized) is warmed up too."""
    sites = decode_sites(runner, cfg)
    if draft_runner is not None:
        sites += decode_sites(draft_runner, replace(cfg, kv_bits=None))
    plan = [c.as_dict() for c in dispatch.warm_up(sites)]
    rows = sorted({1 << (r - 1).bit_length() for r in range(1, decode_rows(cfg) + 1)})
    for r in [runner] + ([draft_runner] if draft_runner is not None else []):
        plan += fused.warm_up(*fused_sites(r.model), rows, r.dtype)
        plan += layout.layouts.plan(m[name] for m, name in projection_weights(r.model))
        if isinstance(r, NativeRunner) and (cfg.kv_bits is None or r is draft_runner):
            heads = {(hq, shape.k_heads, d)
                     for (hq, d), shape in zip(attention_heads(r.model), r.shapes)}
            plan += fused.warm_up_decode_attention(sorted(heads), r.dtype)
    return plan


def kernel_plan(loaded, cfg: EngineConfig | None = None) -> list[dict]:
    """warm_up for a loaded model at `cfg` (default settings), without building an engine
    (`show`); [] for models the paged engine cannot run (none of our dispatch points)."""
    from mlxlocal.engine.runner import NotPageable, make_runner

    try:
        runner = make_runner(loaded)
    except NotPageable:
        return []
    return warm_up(runner, cfg or EngineConfig())
