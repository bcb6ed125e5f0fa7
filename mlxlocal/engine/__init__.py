"""The engine: requests in, streamed tokens out. Front ends use only this package.

Native models run on the paged engine (paged KV, prefix cache, continuous batching);
models that run on mlx-lm's code use the simple one-sequence engine. Both implement
the `Engine` protocol (contract.py), the whole of what front ends may use.
"""

from __future__ import annotations

import logging

from mlxlocal.cache import KVPools
from mlxlocal.cache.mlx_lm_views import CacheLayout
from mlxlocal.cache.quantized import KVPrecisionError
from mlxlocal.engine.base import REPLY_MARKER, EngineBase
from mlxlocal.engine.config import EngineConfig
from mlxlocal.engine.contract import STATS_KEYS, Engine, EngineSession
from mlxlocal.engine.dense import SimpleEngine
from mlxlocal.engine.errors import EngineDeadError, OutOfCapacity, QueueFull, SessionBusy
from mlxlocal.engine.handle import RequestHandle
from mlxlocal.engine.kernels import describe_plan, kernel_plan, kernel_status
from mlxlocal.engine.paged import PagedEngine
from mlxlocal.engine.profile import EVAL_PHASES, HOST_PHASES, PHASES, StepProfile

# For runner plug-ins (mlxlocal/distributed: a cluster's leader and follower runners).
from mlxlocal.engine.runner import (
    MlxLmRunner,
    NativeRunner,
    NotPageable,
    Runner,
    layer_windows,
    make_runner,
    step_batch,
    step_inputs,
)
from mlxlocal.engine.scoring import PagedScorer
from mlxlocal.engine.speculative import (
    DEFAULT_DRAFT_TOKENS,
    DEFAULT_MTP_TOKENS,
    SpeculationChoice,
    SpeculationError,
    speculation_of,
)
from mlxlocal.engine.types import (
    MAX_STOP_STRINGS,
    CacheEdit,
    Chunk,
    GenerationStats,
    Grammar,
    SamplingParams,
    SpeculativeConfig,
)
from mlxlocal.errors import EngineOptionError
from mlxlocal.source.chat_format import ChatFormat, chat_format_of
from mlxlocal.source.loader import LoadedModel

__all__ = [
    "CacheEdit", "ChatFormat", "Chunk", "DEFAULT_DRAFT_TOKENS", "DEFAULT_MTP_TOKENS", "EVAL_PHASES",
    "Engine", "EngineConfig", "EngineDeadError", "EngineOptionError", "EngineSession", "GenerationStats",
    "Grammar", "HOST_PHASES", "KVPrecisionError", "MAX_STOP_STRINGS", "MlxLmRunner",
    "NativeRunner", "NotPageable", "OutOfCapacity", "PHASES", "PagedEngine", "PagedScorer",
    "QueueFull", "REPLY_MARKER", "RequestHandle", "Runner", "STATS_KEYS", "SamplingParams",
    "SessionBusy", "SimpleEngine", "SpeculationChoice", "SpeculationError", "SpeculativeConfig",
    "StepProfile", "chat_format_of", "describe_plan", "engine_kind", "kernel_plan",
    "kernel_status", "kv_bytes_per_token", "layer_windows", "open_engine", "prompt_encoder",
    "speculation_of", "step_batch", "step_inputs",
]


log = logging.getLogger("mlxlocal.engine")


def open_engine(loaded: LoadedModel, **config) -> Engine:
    """The engine for a loaded model; keyword arguments are EngineConfig fields.

    A SpeculationChoice under "speculative" (what --draft-model / --prompt-lookup ask for) is
    resolved for this model first; the engine's refusal of it (a model on the dense engine, a
    draft vocabulary it cannot verify) is then a SpeculationError, said as one line.
    """
    choice = config.get("speculative")
    if not isinstance(choice, SpeculationChoice):
        return _open(loaded, config)
    spec = choice.config_for(loaded)
    plain = {k: v for k, v in config.items() if k != "speculative"}
    if spec is None:  # --mtp auto, and the model has no MTP modules
        return _open(loaded, plain)
    try:
        return _open(loaded, {**config, "speculative": spec})
    except (ValueError, EngineOptionError) as e:
        if choice.auto:  # not asked for by name: the model runs without it, and the log says why
            log.info("%s: MTP drafting off (%s)", loaded.info.name, e)
            return _open(loaded, plain)
        raise SpeculationError(f"{loaded.info.name}: speculative decoding ({choice.describe()}): {e}") from None


def _open(loaded: LoadedModel, config: dict) -> Engine:
    """Every model whose cache the paged engine can hold runs on it; the rest (a cache type
    it does not know) on the one-sequence dense engine, with the reason in `paged_reason`."""
    try:
        runner = make_runner(loaded)
    except NotPageable as e:
        if getattr(loaded, "shard", None) is not None:  # the dense engine has no followers
            raise EngineOptionError(f"{loaded.info.name}: tensor parallelism needs the paged engine, and this "
                                    f"model's cache cannot be paged ({e})") from e
        wanted = [name for name, on in (("speculative decoding", config.get("speculative")),
                                        ("--kv-bits", config.get("kv_bits"))) if on]
        if wanted:  # the dense engine has neither: refused, not ignored
            raise EngineOptionError(f"{' and '.join(wanted)} need the paged engine; {loaded.info.name} runs on "
                                    f"the dense one-sequence engine ({e})") from e
        return SimpleEngine(loaded, paged_reason=str(e), **config)
    return PagedEngine(loaded, EngineConfig(**config), runner)


def kv_bytes_per_token(loaded: LoadedModel, group_size: int = 64) -> dict[str, int | str] | None:
    """For `show`: bytes one token's K/V takes in the paged pools at the model dtype and with
    --kv-bits 8 / 4 (or why that precision cannot be used); None for dense-engine models."""
    try:
        runner = make_runner(loaded)
    except NotPageable:
        return None
    out: dict[str, int | str] = {}
    for label, bits in (("model dtype", None), ("8-bit", 8), ("4-bit", 4)):
        try:
            out[label] = KVPools.bytes_per_block(runner.shapes, 1, runner.dtype, bits, group_size)
        except ValueError as e:
            out[label] = str(e)
    return out


def prompt_encoder(loaded: LoadedModel) -> EngineBase:
    """Prompt encoding (encode_chat / encode_text / decode) for a loaded model without an
    engine: to size one for its prompt before its KV pools are allocated."""
    return EngineBase(loaded)


def engine_kind(loaded: LoadedModel) -> str:
    """How this model runs, for `show`: on the paged engine, or dense and why."""
    if loaded.info.native:
        return "paged (native): continuous batching, prefix cache, sessions"
    try:
        layout = CacheLayout(loaded.model)
    except NotPageable as e:
        return f"dense, one sequence at a time: {e}"
    extra = ", recurrent-state snapshots at block boundaries" if layout.recurrent else ""
    return f"paged (mlx-lm model code): continuous batching, prefix cache, sessions{extra}"
