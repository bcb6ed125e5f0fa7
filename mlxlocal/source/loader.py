"""Load a model by spec: resolve where it lives, read weights, build the model and tokenizer."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxlocal.errors import ModelLoadError
from mlxlocal.metal.layout import relayout
from mlxlocal.models import build_model, is_native, quantize_for_checkpoint
from mlxlocal.models.config import ModelConfig, read_config_file
from mlxlocal.models.kernel_sites import projection_weights
from mlxlocal.models.mtp import build_mtp, split_mtp
from mlxlocal.models.mtp import describe as describe_mtp
from mlxlocal.source.chat_format import ChatFormat, chat_format_of
from mlxlocal.weights import WeightsReport, load_model_weights


@dataclass
class ModelInfo:
    """What `show` and the stats footers report about a loaded model."""

    name: str
    path: Path
    source: str
    model_type: str
    native: bool
    n_params: int
    quantization: str
    context_length: int
    dtype: str
    weights: WeightsReport
    load_seconds: float = 0.0
    notes: list[str] = field(default_factory=list)


@dataclass
class Shard:
    """This process's part of a tensor-parallel model: its plan and its group."""

    plan: Any  # distributed/: TensorPlan, MlxLmPlan or PipelinePlan (its leader())
    group: Any  # mx.distributed.Group
    model: int = 0  # the id rank 0's messages name this model by


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any  # mlx_lm TokenizerWrapper
    config: dict[str, Any]
    model_config: ModelConfig | None
    info: ModelInfo
    shard: Shard | None = None  # this rank's part of a tensor-parallel model
    mtp: list = field(default_factory=list)  # the checkpoint's MTP modules (models/mtp.py)
    # What the tokenizer says about the chat format: read once, here, for every front end.
    chat_format: ChatFormat = field(init=False)

    def __post_init__(self) -> None:
        self.chat_format = chat_format_of(self.tokenizer)

    def make_cache(self) -> list:
        if hasattr(self.model, "make_cache"):
            return self.model.make_cache()
        from mlx_lm.models.cache import make_prompt_cache

        return make_prompt_cache(self.model)


def count_parameters(model: nn.Module, config: dict[str, Any]) -> int:
    """Parameters as the checkpoint means them (packed quantized weights unpacked)."""
    total = 0
    for name, p in tree_flatten(model.parameters()):
        if name.endswith((".scales", ".biases")) and "quantization" in config:
            continue
        if p.dtype == mx.uint32 and name.endswith(".weight"):
            bits = _bits_of(model, name.rsplit(".", 1)[0]) or 4
            total += p.size * 32 // bits
        else:
            total += p.size
    return total


def _bits_of(model: nn.Module, path: str) -> int | None:
    module = dict(model.named_modules()).get(path)
    return getattr(module, "bits", None)


def describe_quantization(config: dict[str, Any]) -> str:
    q = config.get("quantization")
    if not q:
        return "none"
    overrides = sum(1 for v in q.values() if isinstance(v, (dict, bool)))
    text = f"{q.get('mode', 'affine')} {q['bits']}-bit, group size {q['group_size']}"
    return text + (f", {overrides} per-layer overrides" if overrides else "")


def load_from_dir(path: Path, name: str | None = None, source: str = "local", tp: int = 1,
                  pp: int = 1) -> LoadedModel:
    t0 = time.perf_counter()
    config = read_config_file(path)
    awq_gptq = config.get("quantization_config", {}).get("quant_method") in ("awq", "gptq")
    shard = (_pipeline_parallel(config, str(path / "config.json"), pp) if pp > 1
             else _tensor_parallel(config, str(path / "config.json"), tp, awq_gptq))
    weights, report = load_model_weights(path, select=shard.plan.slicer if shard else None)
    notes: list[str] = []
    if awq_gptq and "quantization" not in config:
        from mlxlocal.weights.awq_gptq import convert_awq_gptq, convert_config

        try:
            converted = convert_awq_gptq(weights, config)
        except ModelLoadError as e:
            raise ModelLoadError(f"{path}: {e}") from None
        weights, config = converted.weights, convert_config(config, converted.quantization)
        notes += converted.notes

    def tokenizer():
        from mlx_lm.tokenizer_utils import load as load_tokenizer

        try:
            return load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: cannot load the tokenizer ({e})") from None

    return assemble(path, config, weights, tokenizer, report, name or path.name, source, t0, notes,
                    config_path=str(path / "config.json"), shard=shard)


def _tensor_parallel(config: dict[str, Any], config_path: str, tp: int, awq_gptq: bool) -> Shard | None:
    """The shard to load for `tp` ranks (None for 1); refuses models it cannot split."""
    if tp == 1:
        return None
    from mlxlocal.distributed.channel import world
    from mlxlocal.distributed.tensor import MlxLmPlan, TensorPlan
    from mlxlocal.models import mlx_lm_shardable
    from mlxlocal.models.config import parse_config

    if awq_gptq:
        raise ModelLoadError(f"{config_path}: --tp cannot split AWQ/GPTQ packings; convert the model first")
    if not is_native(config.get("model_type")):
        if not mlx_lm_shardable(config):
            raise ModelLoadError(f"{config_path}: --tp needs a native model (llama, mistral, qwen2, qwen3) or an "
                                 f"mlx-lm model with shard(); model_type '{config.get('model_type')}' has none")
        group = world(tp)
        return Shard(MlxLmPlan.of(config, group.rank(), tp, config_path), group)
    group = world(tp)
    return Shard(TensorPlan.of(parse_config(config, config_path), group.rank(), tp), group)


def _pipeline_parallel(config: dict[str, Any], config_path: str, pp: int) -> Shard:
    """This rank's layers of `pp` pipeline stages (distributed/stages.py)."""
    from mlxlocal.distributed.channel import world
    from mlxlocal.distributed.stages import PipelinePlan
    from mlxlocal.models.config import parse_config

    if not is_native(config.get("model_type")):
        raise ModelLoadError(f"{config_path}: --pp needs a native model (llama, mistral, qwen2, qwen3); "
                             f"model_type '{config.get('model_type')}' runs through mlx-lm")
    group = world()
    if group.size() != pp:
        raise ModelLoadError(f"--pp {pp} asks for {pp} ranks, but this process runs in a group of "
                             f"{group.size()} (start it with `mlx.launch -n {pp} ...`)")
    return Shard(PipelinePlan.of(parse_config(config, config_path), group.rank(), pp), group)


def assemble(path: Path, config: dict[str, Any], weights: dict[str, mx.array], make_tokenizer,
             report: WeightsReport, name: str, source: str, t0: float, notes: list[str],
             config_path: str, shard: Shard | None = None) -> LoadedModel:
    """Config + weights (any source format, already MLX) -> a loaded model and its info;
    with `shard`, this rank's part of a tensor-parallel model (weights already sliced)."""
    model, model_config = build_model(config, weights, config_path)
    kind = shard.plan.kind if shard is not None else None
    if kind == "pipeline":  # a stage: its layers only
        shard.plan.prune(model)
    elif kind == "tensor":
        from mlxlocal.distributed.tensor import shard_model

        shard_model(model, shard.plan, shard.group)
    given = weights
    # MTP modules come out before the family's sanitize (which drops or refuses them).
    split = None if is_native(config.get("model_type")) else split_mtp(config, weights)
    main_names = list(weights)
    if hasattr(model, "sanitize"):
        weights = model.sanitize(weights)
    quantize_for_checkpoint(model, config, weights)
    model.eval()
    _load_weights_strict(model, weights, path)
    if kind == "mlx_lm":
        model.shard(shard.group)  # mlx-lm's own tensor-parallel split (distributed.tensor.MlxLmPlan)
    mx.eval(model.parameters())
    # The model holds the weights now: the loaded dicts must not keep a second reference,
    # or each relaid-out weight would be held twice until the load returns.
    given.clear()
    weights.clear()
    # Without Metal the weights are copies anyway: projections take the faster layout.
    relayout(projection_weights(model))
    # Derived arrays (rope frequency tables) too: the engine thread must not inherit lazy
    # graphs built on this thread's stream.
    mx.eval([v for m in model.modules() for v in m.values() if isinstance(v, mx.array)])
    mtp = build_mtp(model, split, main_names, config.get("quantization")) if split and not shard else []
    if (said := describe_mtp(split, len(mtp), sharded=shard is not None)) is not None:
        notes = notes + [said]
    tokenizer = make_tokenizer()
    _no_length_warning(tokenizer)

    native = is_native(config.get("model_type"))
    dtypes = sorted({str(p.dtype).removeprefix("mlx.core.") for _, p in tree_flatten(model.parameters())
                     if mx.issubdtype(p.dtype, mx.floating)})
    if not native:
        notes = notes + [
            f"model_type '{config.get('model_type')}' runs through mlx-lm's model code "
            "(compatibility path: dense mlx-lm caches, no mlxlocal kernels)"
        ]
    info = ModelInfo(
        name=name,
        path=path,
        source=source,
        model_type=str(config.get("model_type")),
        native=native,
        n_params=count_parameters(model, config),
        quantization=describe_quantization(config),
        context_length=int(
            (model_config.context_length if model_config else None)
            or config.get("max_position_embeddings")
            or 4096
        ),
        dtype=",".join(dtypes),
        weights=report,
        load_seconds=time.perf_counter() - t0,
        notes=notes,
    )
    return LoadedModel(model, tokenizer, config, model_config, info, shard, mtp=mtp)


def _no_length_warning(tokenizer: Any) -> None:
    """Over-long prompts are reported by the engine (ContextLengthError names both numbers);
    transformers' "Token indices sequence length is longer..." warning would come first."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)  # mlx-lm's wrapper holds the HF one
    if hasattr(inner, "model_max_length"):
        inner.model_max_length = 1 << 62  # only ever compared against: never truncates


def _load_weights_strict(model: nn.Module, weights: dict[str, mx.array], path: Path) -> None:
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensors (e.g. {', '.join(missing[:3])})")
        if extra:
            parts.append(f"{len(extra)} unexpected tensors (e.g. {', '.join(extra[:3])})")
        raise ModelLoadError(f"{path}: weights do not match the model: " + "; ".join(parts))
    for key, value in weights.items():
        if value.shape != expected[key].shape:
            raise ModelLoadError(
                f"{path}: tensor '{key}' has shape {tuple(value.shape)}, the config implies "
                f"{tuple(expected[key].shape)}"
            )
    model.load_weights(list(weights.items()), strict=True)


def load(spec: str, tp: int | None = None, pp: int | None = None) -> LoadedModel:
    """Load `spec`: a local dir, a catalog alias, a HF repo id or synthetic:NAME.

    `tp`: tensor-parallel ranks; None means every rank of the launch this process is part of
    (1 when not launched). With tp > 1 this is rank 0's shard, and the other ranks are told to
    load theirs (they follow rank 0: distributed/follower.py).
    `pp`: pipeline stages (layer ranges, distributed/pipeline.py); None means MLXLOCAL_PP under a
    launch (launch-cluster --pp N sets it), else 1; not combined with tp > 1."""
    from mlxlocal.distributed.channel import announce_load, launched, world
    from mlxlocal.source import hub  # imported here: huggingface_hub is slow to import

    if pp is None:  # launch-cluster --pp N (or MLXLOCAL_PP under mlx.launch): pipeline stages
        pp = _env_pp() if launched() else 1
    if pp > 1 and tp not in (None, 1):
        raise ModelLoadError(f"--pp {pp} with --tp {tp}: pipeline and tensor parallelism cannot be "
                             "combined yet; use one of them over all the ranks")
    if tp is None:
        tp = 1 if pp > 1 else world().size() if launched() else 1
    resolved = hub.resolve(spec)
    model_id = announce_load(world(tp), spec) if tp > 1 and world(tp).rank() == 0 else None
    if pp > 1 and world().rank() == 0 and world().size() == pp:
        model_id = announce_load(world(), spec, pp=pp)
    if resolved.path.is_file():  # hub.resolve returns a file only for GGUF
        loaded = load_from_gguf(resolved.path, name=resolved.name, source=resolved.source, tp=tp, pp=pp)
    else:
        loaded = load_from_dir(resolved.path, name=resolved.name, source=resolved.source, tp=tp, pp=pp)
    if model_id is not None:
        loaded.shard.model = model_id
    return loaded


def _env_pp() -> int:
    value = os.environ.get("MLXLOCAL_PP", "1")
    if not value.isdigit() or int(value) < 1:
        raise ModelLoadError(f"MLXLOCAL_PP must be a whole number of pipeline stages >= 1, not {value!r}")
    return int(value)


def load_from_gguf(path: Path, name: str | None = None, source: str = "local", tp: int = 1,
                   pp: int = 1) -> LoadedModel:
    """A llama-family GGUF file: config, weights (MLX affine) and tokenizer from the file."""
    from mlxlocal.weights.gguf import load_gguf
    from mlxlocal.weights.gguf import load_tokenizer as load_gguf_tokenizer

    t0 = time.perf_counter()
    ckpt = load_gguf(path)
    config, weights = ckpt.config, ckpt.weights
    shard = _pipeline_parallel(config, str(path), pp) if pp > 1 else _tensor_parallel(config, str(path), tp, False)
    if shard is not None and pp > 1:  # converted whole, then other stages' tensors dropped
        weights = {k: v for k, v in weights.items() if shard.plan.slicer(k, tuple(v.shape)) is None}
    elif shard is not None:  # GGUF blocks are converted whole: the shard is cut after conversion
        weights = {k: mx.contiguous(v[part]) if (part := shard.plan.slicer(k, tuple(v.shape))) else v
                   for k, v in weights.items()}
    params_by_dtype: dict[str, int] = {}
    for value in weights.values():
        key = str(value.dtype).removeprefix("mlx.core.")
        params_by_dtype[key] = params_by_dtype.get(key, 0) + value.size
    report = WeightsReport(
        files=[(path.name, ckpt.file_bytes)],
        total_bytes=ckpt.file_bytes,
        n_tensors=sum(ckpt.tensor_types.values()),
        load_path=ckpt.load_path,
        dtypes=set(ckpt.tensor_types),
        params_by_dtype=params_by_dtype,
    )
    notes = [f"converted from GGUF on load: {ckpt.load_path} "
             f"({ckpt.file_bytes / 2**20:.1f} MiB file, {ckpt.weight_bytes / 2**20:.1f} MiB in MLX)"]
    return assemble(path, config, weights,
                    lambda: load_gguf_tokenizer(path, eos_token_ids=config.get("eos_token_id")),
                    report, name or path.stem, source, t0, notes, config_path=str(path), shard=shard)


def check_draft_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft model proposes token ids the target verifies: both must mean the same text by
    the same id. Raises ModelLoadError naming both models when the vocabularies differ in
    size or in any token's id (checked before an engine starts, not at the first step)."""
    if draft is target:
        return
    tv, dv = _vocab_of(target.tokenizer), _vocab_of(draft.tokenizer)
    d, t = draft.info, target.info
    same = d.name == t.name  # two directories of one name: say which is which
    names = f"draft model {d.name}{f' ({d.path})' if same else ''} and target model {t.name}" + (
        f" ({t.path})" if same else "")
    if len(tv) != len(dv):
        raise ModelLoadError(f"{names} have different tokenizers: {len(dv)} tokens in the draft's vocabulary, "
                             f"{len(tv)} in the target's; a draft model must share the target's tokenizer")
    differ = sorted((tok for tok, i in tv.items() if dv.get(tok) != i), key=tv.__getitem__)
    if differ:
        tok = differ[0]
        where = f"id {dv[tok]} in the draft" if tok in dv else "absent from the draft"
        raise ModelLoadError(f"{names} have different tokenizers: {len(differ)} of {len(tv)} tokens map to other "
                             f"ids (e.g. {tok!r} is id {tv[tok]} in the target, {where}); a draft model must share "
                             "the target's tokenizer")


def _vocab_of(tokenizer: Any) -> dict[str, int]:
    """token -> id, added tokens included (mlx-lm's wrapper passes get_vocab through)."""
    return dict(tokenizer.get_vocab())
