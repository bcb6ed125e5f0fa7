"""Find a model directory's safetensors files, validate them together, load them.

A sharded checkpoint names its shards in `model.safetensors.index.json`; we trust
that index over a glob because some repos also ship a `consolidated.safetensors`
holding the same tensors. Without an index every `*.safetensors` file is loaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from mlxlocal.errors import ModelLoadError, WeightFileError
from mlxlocal.units import human_bytes
from mlxlocal.weights.safetensors import (
    SafetensorsHeader,
    Selector,
    load_tensors,
    metal_available,
    read_header,
)

INDEX_NAME = "model.safetensors.index.json"

ZERO_COPY_METAL = "zero-copy (Metal)"
COPY_CPU = "copy (CPU backend: MLX cannot adopt host memory)"
COPY_METAL = "copy (Metal could not adopt the mapped bytes)"
COPY_DISABLED = "copy (zero-copy adoption disabled)"
HEADERS_ONLY = "not loaded (headers only)"


@dataclass
class WeightsReport:
    files: list[tuple[str, int]]  # (file name, size in bytes)
    total_bytes: int
    n_tensors: int
    load_path: str
    dtypes: set[str]
    params_by_dtype: dict[str, int] = field(default_factory=dict)  # elements as stored

    @property
    def n_params(self) -> int:
        return sum(self.params_by_dtype.values())

    def describe(self) -> str:
        dts = ", ".join(sorted(self.dtypes)) or "no dtypes"
        return (f"{_plural(self.n_tensors, 'tensor')}, {_human_count(self.n_params)} params "
                f"({dts}) in {_plural(len(self.files), 'file')}, "
                f"{human_bytes(self.total_bytes)}; {self.load_path}")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _human_count(n: int) -> str:
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{suffix}"
    return str(n)


def _read_index(model_dir: Path, index: Path) -> dict[str, str]:
    """Parse the index file; return its weight_map (tensor name -> shard file name)."""
    try:
        obj = json.loads(index.read_text(encoding="utf-8"))
    except OSError as e:
        raise WeightFileError(f"{index}: cannot read file: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise WeightFileError(f"{index}: is not valid UTF-8") from None
    except json.JSONDecodeError as e:
        raise WeightFileError(f"{index}: is not valid JSON: {e.msg} at line {e.lineno} "
                              f"column {e.colno}") from None
    except RecursionError:
        raise WeightFileError(f"{index}: JSON is nested too deeply") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("weight_map"), dict):
        raise WeightFileError(f"{index}: has no 'weight_map' object mapping tensor names "
                              "to shard files")
    weight_map: dict[str, str] = obj["weight_map"]
    if not weight_map:
        raise WeightFileError(f"{index}: 'weight_map' is empty")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise WeightFileError(f"{index}: weight_map entry for tensor {name!r} is "
                                  f"{json.dumps(shard)}, expected a shard file name")
        # A shard must be named inside the model dir: no absolute paths or "../" escapes. By
        # name only: the HF cache's snapshot files (and synthetic variants') are links out.
        norm = os.path.normpath(shard)
        if os.path.isabs(norm) or norm == ".." or norm.startswith(".." + os.sep):
            raise WeightFileError(f"{index}: shard {shard!r} for tensor {name!r} is "
                                  "outside the model directory")
    return weight_map


def _locate(model_dir: Path) -> tuple[list[Path], dict[str, str] | None, Path | None]:
    """Return (shard paths, weight_map or None, index path or None)."""
    if not model_dir.is_dir():
        raise ModelLoadError(f"{model_dir}: model directory does not exist or is not a "
                             "directory")
    index = model_dir / INDEX_NAME
    if index.is_file():
        weight_map = _read_index(model_dir, index)
        names = sorted(set(weight_map.values()))
        for shard in names:
            if not (model_dir / shard).is_file():
                raise WeightFileError(f"{index}: names shard {shard!r} but "
                                      f"{model_dir / shard} does not exist")
        return [model_dir / n for n in names], weight_map, index
    shards = sorted(p for p in model_dir.glob("*.safetensors") if p.is_file())
    if not shards:
        raise ModelLoadError(f"{model_dir}: no *.safetensors weight files found")
    return shards, None, None


def _check_together(model_dir: Path, headers: list[SafetensorsHeader],
                    weight_map: dict[str, str] | None, index: Path | None) -> None:
    """Cross-file checks: no tensor in two shards; the index agrees with the shards."""
    owner: dict[str, Path] = {}
    for h in headers:
        for name in h.tensors:
            if name in owner:
                raise WeightFileError(f"tensor {name!r} appears in both {owner[name]} and "
                                      f"{h.path}")
            owner[name] = h.path
    if weight_map is None:
        return
    by_path = {h.path: h for h in headers}
    for name, shard in weight_map.items():
        h = by_path[model_dir / shard]
        if name not in h.tensors:
            raise WeightFileError(f"{index}: weight_map puts tensor {name!r} in {h.path}, "
                                  "but that file has no such tensor")


def _read_all(model_dir: Path) -> list[SafetensorsHeader]:
    shards, weight_map, index = _locate(model_dir)
    headers = [read_header(p) for p in shards]
    _check_together(model_dir, headers, weight_map, index)
    return headers


def _report(headers: list[SafetensorsHeader], load_path: str) -> WeightsReport:
    params: dict[str, int] = {}
    for h in headers:
        for t in h.tensors.values():
            params[t.dtype] = params.get(t.dtype, 0) + t.numel
    files = [(h.path.name, h.file_size) for h in headers]
    return WeightsReport(
        files=files,
        total_bytes=sum(size for _, size in files),
        n_tensors=sum(len(h.tensors) for h in headers),
        load_path=load_path,
        dtypes=set(params),
        params_by_dtype=params,
    )


def _describe_path(n_zero: int, n_copy: int, tried: bool, metal: bool) -> str:
    if n_zero and not n_copy:
        return ZERO_COPY_METAL
    if not n_zero:
        if not metal:
            return COPY_CPU
        return COPY_METAL if tried else COPY_DISABLED
    return (f"mixed: {n_zero} tensors zero-copy (Metal), {n_copy} copied "
            "(misaligned or not adoptable)")


def load_model_weights(model_dir: Path, adopt: bool | None = None, select: Selector | None = None
                       ) -> tuple[dict[str, mx.array], WeightsReport]:
    """Load every weight of a model directory (or the parts `select` picks: see load_tensors);
    report files, sizes and the load path."""
    headers = _read_all(Path(model_dir))  # validate everything before loading anything
    weights: dict[str, mx.array] = {}
    n_zero = n_copy = 0
    tried = adopt if adopt is not None else metal_available()
    for h in headers:
        res = load_tensors(h.path, adopt, select)
        weights.update(res.arrays)
        n_zero += res.n_zero_copy
        n_copy += res.n_copied
    load_path = _describe_path(n_zero, n_copy, tried, metal_available())
    return weights, _report(headers, load_path)


def weights_summary(model_dir: Path) -> WeightsReport:
    """Headers only (no tensor data): sizes, tensor count and params per dtype."""
    return _report(_read_all(Path(model_dir)), HEADERS_ONLY)
