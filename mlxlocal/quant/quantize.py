"""Quantize a model into an MLX checkpoint (the layout mlx-lm loads), and measure perplexity.

Modes are MLX's (`mx.quantize`): affine (bits 2/3/4/5/6/8, group 32/64/128), mxfp4
(4-bit, group 32), nvfp4 (4-bit, group 16), mxfp8 (8-bit, group 32). Recipe `mixed-4-6`
is mlx-lm's `mixed_4_6` predicate (llama.cpp Q4_K_M spirit: v_proj and down_proj of the
first/last eighth of the layers and every third layer between, plus lm_head, at 6 bits),
with the embeddings at 6 bits too when they double as the output head. Method `awq` runs
mlx-lm's `awq_quantize` (activation-aware scale search + clipping, folding the scales into
the previous norm / linear) on calibration text.
"""

from __future__ import annotations

import contextlib
import copy
import io
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxlocal.errors import ConfigError, ModelLoadError

MODES: dict[str, tuple[int, int]] = {  # mode -> (default group size, default bits)
    "affine": (64, 4),
    "mxfp4": (32, 4),
    "nvfp4": (16, 4),
    "mxfp8": (32, 8),
}
FIXED = {"mxfp4": ((32,), (4,)), "nvfp4": ((16,), (4,)), "mxfp8": ((32,), (8,))}
AFFINE_BITS = (2, 3, 4, 5, 6, 8)
AFFINE_GROUPS = (32, 64, 128)
RECIPES = ("mixed-4-6",)
METHODS = ("rtn", "awq")
_SKIP_COPY = {"config.json", "model.safetensors.index.json", "README.md"}


@dataclass
class QuantizeResult:
    out: Path
    mode: str
    bits: int
    group_size: int
    recipe: str | None
    method: str
    size_bytes: int
    bits_per_weight: float
    overrides: int
    notes: list[str] = field(default_factory=list)


def resolve_settings(mode: str, bits: int | None, group_size: int | None) -> tuple[int, int]:
    if mode not in MODES:
        raise ConfigError(f"unknown quantization mode {mode!r}; expected one of {', '.join(MODES)}")
    g0, b0 = MODES[mode]
    group_size, bits = group_size or g0, bits or b0
    if mode in FIXED:
        groups, bitss = FIXED[mode]
        if group_size not in groups or bits not in bitss:
            raise ConfigError(f"mode {mode} is fixed at {bitss[0]} bits, group size {groups[0]}")
    else:
        if bits not in AFFINE_BITS:
            raise ConfigError(f"affine bits must be one of {AFFINE_BITS}, got {bits}")
        if group_size not in AFFINE_GROUPS:
            raise ConfigError(f"affine group size must be one of {AFFINE_GROUPS}, got {group_size}")
    return bits, group_size


def dequantize_in_place(model: nn.Module) -> bool:
    """Turn quantized layers back into float ones (a quantized source); True if any were."""
    from mlx_lm.utils import dequantize_model

    had = any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for _, m in model.named_modules())
    if had:
        dequantize_model(model)
    return had


def mixed_4_6_predicate(model: nn.Module, config: dict[str, Any], group_size: int) -> Callable:
    from mlx_lm.convert import mixed_quant_predicate_builder

    base = mixed_quant_predicate_builder("mixed_4_6", model, group_size)
    tied = "lm_head" not in model

    def predicate(path: str, module: nn.Module):
        if tied and path.endswith("embed_tokens"):
            return {"group_size": group_size, "bits": 6, "mode": "affine"}
        return base(path, module)

    return predicate


def calibration_tokens(tokenizer, text: str, seq_len: int, n_samples: int) -> mx.array:
    ids = tokenizer.encode(text)
    if len(ids) < 2:
        raise ConfigError("calibration text is too short")
    if len(ids) < seq_len:
        return mx.array([ids])
    n = min(len(ids) // seq_len, n_samples)
    return mx.array(ids[: n * seq_len]).reshape(n, seq_len)


def _mlx_lm_model(loaded, params: dict[str, mx.array]) -> nn.Module:
    """The same weights in mlx-lm's model class (mlx-lm's AWQ walks its module layout)."""
    if not getattr(loaded.model, "native", False):
        return loaded.model
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(loaded.config)
    model = model_cls(args_cls.from_dict(loaded.config))
    model.load_weights(list(params.items()), strict=True)
    return model


def _awq(loaded, model: nn.Module, bits: int, group_size: int, calib: mx.array, n_grid: int) -> nn.Module:
    from mlx_lm.quant.awq import AWQ_MODEL_CONFIGS, awq_quantize

    mt = loaded.config.get("model_type")
    if mt not in AWQ_MODEL_CONFIGS:
        raise ConfigError(f"--method awq: no AWQ layer map for model_type '{mt}' (have {sorted(AWQ_MODEL_CONFIGS)})")
    lm = _mlx_lm_model(loaded, dict(tree_flatten(model.parameters())))
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        awq_quantize(lm, calib, AWQ_MODEL_CONFIGS[mt], group_size=group_size, bits=bits,
                     embed_group_size=group_size, embed_bits=bits, n_grid=n_grid)
    return lm


def copy_side_files(src: Path, dst: Path) -> None:
    """Tokenizer and generation files: everything but weights, config and hidden files."""
    for f in sorted(src.iterdir()):
        if f.is_file() and not f.name.startswith(".") and f.suffix != ".safetensors" and f.name not in _SKIP_COPY:
            shutil.copy2(f, dst / f.name)


def quantize(src: str, out: Path, *, mode: str = "affine", bits: int | None = None,
             group_size: int | None = None, recipe: str | None = None, method: str = "rtn",
             calib_text: str | None = None, calib_seq_len: int = 256, calib_samples: int = 32,
             n_grid: int = 20, progress: Any = None) -> QuantizeResult:
    from mlx_lm.utils import quantize_model, save_config, save_model

    from mlxlocal.quant.text import BUILTIN_TEXT
    from mlxlocal.source.loader import load

    bits, group_size = resolve_settings(mode, bits, group_size)
    if recipe is not None and recipe not in RECIPES:
        raise ConfigError(f"unknown recipe {recipe!r}; expected one of {', '.join(RECIPES)}")
    if method not in METHODS:
        raise ConfigError(f"unknown method {method!r}; expected one of {', '.join(METHODS)}")
    if (recipe or method == "awq") and mode != "affine":
        raise ConfigError("--recipe and --method awq work with --mode affine only")
    if recipe and method == "awq":
        raise ConfigError("--recipe mixed-4-6 cannot be combined with --method awq")
    if recipe and bits != 4:
        raise ConfigError("--recipe mixed-4-6 fixes the bits (4 and 6); drop --bits")
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} exists and is not empty")

    step = progress or (lambda _msg: None)
    step("load")
    loaded = load(src, tp=1)  # runs the model directly: whole, on this rank
    notes: list[str] = []
    model = loaded.model
    if dequantize_in_place(model):
        notes.append(f"source was quantized ({loaded.info.quantization}); dequantized first, errors compound")
    config = copy.deepcopy(loaded.config)
    config.pop("quantization", None)
    config.pop("quantization_config", None)

    step("quantize")
    if method == "awq":
        calib = calibration_tokens(loaded.tokenizer, calib_text or BUILTIN_TEXT, calib_seq_len, calib_samples)
        model = _awq(loaded, model, bits, group_size, calib, n_grid)
        config["quantization"] = {"group_size": group_size, "bits": bits, "mode": "affine"}
    else:
        pred = mixed_4_6_predicate(model, config, group_size) if recipe else None
        with contextlib.redirect_stdout(io.StringIO()):
            model, config = quantize_model(model, config, group_size, bits, mode=mode, quant_predicate=pred)
        if recipe:  # overrides equal to the defaults are noise in config.json
            q = config["quantization"]
            for k in [k for k, v in q.items() if isinstance(v, dict) and v == {"group_size": group_size, "bits": bits, "mode": mode}]:
                del q[k]
    mx.eval(model.parameters())

    step("save")
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model, donate_model=False)
    config.pop("quantization_config", None)
    save_config(config, config_path=out / "config.json")
    if loaded.info.path.is_dir():
        copy_side_files(loaded.info.path, out)
    else:  # a single-file source (GGUF): write the tokenizer it carried
        loaded.tokenizer.save_pretrained(str(out))

    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    n_params = loaded.info.n_params
    q = config["quantization"]
    return QuantizeResult(
        out=out, mode=mode, bits=bits, group_size=group_size, recipe=recipe, method=method,
        size_bytes=size, bits_per_weight=size * 8 / max(n_params, 1),
        overrides=sum(1 for v in q.values() if isinstance(v, dict)), notes=notes,
    )


@dataclass
class PerplexityResult:
    ppl: float
    nll: float
    tokens: int
    windows: int
    seq_len: int


def perplexity_windows(ids: list[int], seq_len: int) -> mx.array:
    """mlx-lm's chunking: non-overlapping windows of seq_len tokens, the tail dropped.

    Each window predicts its tokens 1..seq_len-1 from the ones before (no context carried
    across windows). A text shorter than one window becomes a single shorter window.
    """
    if seq_len < 2:
        raise ConfigError("--seq-len must be at least 2")
    if len(ids) < 2:
        raise ConfigError("the text has fewer than 2 tokens")
    if len(ids) < seq_len:
        return mx.array([ids])
    n = len(ids) // seq_len
    return mx.array(ids[: n * seq_len]).reshape(n, seq_len)


def perplexity(loaded, text: str, seq_len: int = 512, batch_size: int = 8,
               on_batch: Callable[[int, int], None] | None = None, kv_bits: int | None = None,
               kv_group_size: int = 64) -> PerplexityResult:
    """With kv_bits, the windows run through the paged engine's pools quantized as the engine
    stores them (engine/scoring.py); else through the model's own dense cache."""
    ids = loaded.tokenizer.encode(text)
    data = perplexity_windows(ids, seq_len)
    forward = lambda batch: loaded.model(batch, loaded.make_cache())  # noqa: E731
    if kv_bits is not None:
        from mlxlocal.engine import NotPageable, PagedScorer

        try:
            forward = PagedScorer(loaded, min(batch_size, data.shape[0]), data.shape[1] - 1, kv_bits,
                                  kv_group_size).logits
        except NotPageable as e:  # (a precision the model cannot take: KVPrecisionError, named as such)
            raise ConfigError(f"--kv-bits needs the paged engine's K/V pools, which this model cannot use ({e})") from e
    total, count = 0.0, 0
    n_batches = (data.shape[0] + batch_size - 1) // batch_size
    for i, s in enumerate(range(0, data.shape[0], batch_size)):
        batch = data[s : s + batch_size]
        logits = forward(batch[:, :-1]).astype(mx.float32)
        losses = nn.losses.cross_entropy(logits, batch[:, 1:], reduction="none")
        total += losses.astype(mx.float32).sum().item()
        count += losses.size
        if on_batch:
            on_batch(i + 1, n_batches)
    if count == 0:
        raise ModelLoadError("no tokens to score")
    nll = total / count
    return PerplexityResult(ppl=math.exp(nll), nll=nll, tokens=count, windows=int(data.shape[0]), seq_len=seq_len)
