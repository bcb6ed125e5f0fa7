"""A synthetic model's random weights: build them with mlx-lm's model class, write them
(with config and tokenizer) as a Hugging Face directory, and show a first run's progress.

The weights are lazy MLX arrays (random init, dtype cast, optional quantization). They are
computed one module at a time, just before they are written, while a writer thread puts the
previous module on disk: the build takes about max(compute, disk) instead of the sum, holds
only a few tensors in memory, and can report bytes written against the total.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import queue
import struct
import threading
import time
from pathlib import Path
from typing import Any, Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_map

from mlxlocal.errors import ConfigError, UnsupportedModelError
from mlxlocal.source.synthetic.tokenizer import write_tokenizer

GROUP_SIZE = 64  # as mlx-community checkpoints
# The dtype modifiers of a synthetic spec -> MLX dtype names.
DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

SAFETENSORS_DTYPES = {
    mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.uint32: "U32",
    mx.int32: "I32", mx.uint8: "U8", mx.int8: "I8", mx.uint16: "U16", mx.bool_: "BOOL",
}


class Progress(Protocol):
    def start(self, total_bytes: int) -> None: ...
    def advance(self, nbytes: int) -> None: ...


def _dtype_name(dtype: str) -> str:
    name = DTYPES.get(dtype, dtype)
    if name not in DTYPES.values():
        raise ConfigError(f"unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    return name


def build_model(config: dict[str, Any], *, seed: int = 0):
    """mlx-lm's own Model class for config['model_type'], with weights drawn from `seed`.

    Arrays are lazy: nothing is computed until evaluated or saved. Note that this
    reseeds MLX's global random generator.
    """
    from mlx_lm.utils import _get_classes

    try:
        model_cls, args_cls = _get_classes(config)
    except ValueError as e:
        raise UnsupportedModelError(f"model_type {config.get('model_type')!r}: {e}") from e
    mx.random.seed(seed)
    return model_cls(args_cls.from_dict(config))


def write_model_dir(path: Path, config: dict[str, Any], *, seed: int = 0,
                    dtype: str = "float32", quantize_bits: int | None = None,
                    chat_template: str = "chatml", progress: Progress | None = None) -> Path:
    """Write a random-weight model for `config` (HF config.json fields) into `path`;
    `progress` hears the weights' total bytes, then each write."""
    from mlx_lm.utils import quantize_model, save_config

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(config)
    for key in ("model_type", "vocab_size"):
        if key not in config:
            raise ConfigError(f"synthetic config is missing {key!r}")
    dtype = _dtype_name(dtype)
    if quantize_bits not in (None, 4, 8):
        raise ConfigError(f"quantize_bits must be 4, 8 or None, got {quantize_bits!r}")

    ids = write_tokenizer(path, int(config["vocab_size"]), chat_template,
                          config.get("max_position_embeddings"))
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    if "architectures" not in config and config["model_type"] in _ARCHITECTURES:
        config["architectures"] = [_ARCHITECTURES[config["model_type"]]]
    config["bos_token_id"] = ids["bos_token_id"]
    config["eos_token_id"] = ids["eos_token_id"]
    if config["bos_token_id"] is None:  # chatml has no BOS token
        del config["bos_token_id"]
    config["torch_dtype"] = dtype

    model = build_model(config, seed=seed)
    model.set_dtype(getattr(mx, dtype))
    if quantize_bits:
        # quantize_model prints a bits-per-weight line; keep CLI output clean.
        with contextlib.redirect_stdout(io.StringIO()):
            model, config = quantize_model(model, config, GROUP_SIZE, quantize_bits,
                                           mode="affine")
    for old in path.glob("model*.safetensors"):  # stale shards would be loaded too
        old.unlink()
    # Random init, cast and quantization are lazy: they run module by module as written.
    save_weights(path, model, progress)
    save_config(config, config_path=path / "config.json")
    generation = {"bos_token_id": ids["bos_token_id"], "eos_token_id": ids["stop_token_ids"],
                  "pad_token_id": ids["pad_token_id"]}
    generation = {k: v for k, v in generation.items() if v is not None}
    (path / "generation_config.json").write_text(json.dumps(generation, indent=2))
    return path


def save_weights(path: Path, model: nn.Module, progress: Progress | None = None) -> None:
    """mlx-lm's save_model layout (model.safetensors, or 5 GB shards, plus the index), written
    module by module. The model's parameters are dropped: the files hold the only copy."""
    from mlx_lm.utils import get_total_parameters, make_shards

    weights = dict(tree_flatten(model.parameters()))
    total_params = get_total_parameters(model)
    model.update(tree_map(lambda _: mx.array([]), model.parameters()))
    shards = make_shards(weights)  # sizes come from shapes: nothing is computed yet
    total = sum(v.nbytes for v in weights.values())
    weights.clear()
    if progress is not None:
        progress.start(total)
    pattern = "model-{:05d}-of-{:05d}.safetensors" if len(shards) > 1 else "model.safetensors"
    weight_map: dict[str, str] = {}
    for i in range(len(shards)):
        shard, shards[i] = shards[i], None  # popped as written: memory is freed as we go
        name = pattern.format(i + 1, len(shards))
        weight_map.update(dict.fromkeys(shard, name))
        write_safetensors(path / name, shard, progress)
    index = {"metadata": {"total_size": total, "total_parameters": total_params},
             "weight_map": dict(sorted(weight_map.items()))}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))


def write_safetensors(file: Path, tensors: dict[str, mx.array], progress: Progress | None = None,
                      metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` (emptied as it goes) as one safetensors file, computing each module's
    tensors together (a quantized weight, its scales and biases share one random source)."""
    names = sorted(tensors)
    header: dict[str, Any] = {"__metadata__": metadata or {"format": "mlx"}}
    offset = 0
    for name in names:
        a = tensors[name]
        header[name] = {"dtype": SAFETENSORS_DTYPES[a.dtype], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # the data section starts 8-byte aligned

    pending: queue.Queue = queue.Queue(maxsize=4)
    failed: list[BaseException] = []

    def writer(f) -> None:
        while (buf := pending.get()) is not None:
            if failed:
                continue  # keep draining so the producer never blocks
            try:
                f.write(buf)
                if progress is not None:
                    progress.advance(buf.nbytes)
            except BaseException as e:  # disk full, ...: raised on the main thread
                failed.append(e)

    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        thread = threading.Thread(target=writer, args=(f,), name="mlxlocal-write", daemon=True)
        thread.start()
        try:
            for group in _module_groups(names):
                arrays = [tensors.pop(n) for n in group]
                # numpy has no bfloat16: write its bits as uint16.
                arrays = [a.view(mx.uint16) if a.dtype == mx.bfloat16 else a for a in arrays]
                mx.eval(arrays)
                for a in arrays:
                    pending.put(memoryview(np.ascontiguousarray(np.asarray(a))).cast("B"))
                if failed:
                    break
        finally:
            pending.put(None)
            thread.join()
    if failed:
        raise failed[0]


def _module_groups(names: list[str]) -> list[list[str]]:
    groups: list[list[str]] = []
    for name in names:
        if groups and groups[-1][0].rsplit(".", 1)[0] == name.rsplit(".", 1)[0]:
            groups[-1].append(name)
        else:
            groups.append([name])
    return groups


def _human(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


class BuildProgress:
    """A first build explains itself on stderr: one line saying what and why, then a bar
    with size and ETA on a terminal, or a single closing line when stderr is not one."""

    def __init__(self, spec: str, cache_dir: Path, console: Any = None):
        from rich.console import Console

        self.spec, self.cache_dir = spec, cache_dir
        self.console = console or Console(stderr=True, soft_wrap=True, highlight=False)
        self._bar: Any = None
        self._task: Any = None
        self._t0 = 0.0
        self.total = self.written = 0

    def __enter__(self) -> BuildProgress:
        self._t0 = time.perf_counter()
        self.console.print(
            f"Building {self.spec}: random weights with the real model's shapes, no download "
            f"(once; cached under {self.cache_dir})", markup=False, highlight=False)
        return self

    def start(self, total_bytes: int) -> None:
        self.total = total_bytes
        if not self.console.is_terminal:
            return
        from rich import progress as rp

        self._bar = rp.Progress(rp.TextColumn("  weights"), rp.BarColumn(), rp.DownloadColumn(),
                                rp.TransferSpeedColumn(), rp.TimeRemainingColumn(),
                                console=self.console, transient=True)
        self._task = self._bar.add_task("weights", total=total_bytes)
        self._bar.start()

    def advance(self, nbytes: int) -> None:
        self.written += nbytes
        if self._bar is not None:
            self._bar.advance(self._task, nbytes)

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._bar is not None:
            self._bar.stop()
        if exc_type is None:
            self.console.print(f"Built {self.spec}: {_human(self.total)} of weights in "
                               f"{time.perf_counter() - self._t0:.1f} s", markup=False, highlight=False)
