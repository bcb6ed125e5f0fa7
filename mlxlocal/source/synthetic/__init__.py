"""Synthetic models: random weights with a real model's shapes, in Hugging Face layout.

`synthetic:NAME[:MOD]...` names a preset from models.toml plus modifiers:

    q4 | q8              MLX affine quantization, group size 64 (as mlx-community)
    fp16 | bf16 | fp32   weight dtype (default fp16 on Metal, fp32 on the CPU backend)
    seed=N               random seed (default 0); same seed -> identical weights
    layers=N             override num_hidden_layers (quick runs of big shapes)
    context=N            override max_position_embeddings (long traces on a tiny shape)

The directory holds config.json, safetensors, generation_config.json and a byte-level
BPE tokenizer whose vocabulary size equals the model's vocab_size, so mlxlocal,
mlx-lm and transformers all load it like a downloaded checkpoint.

This module parses specs and keeps the built directories (materialize / list / remove);
tokenizer.py builds the tokenizer, weights.py builds and writes the random weights.
"""

from __future__ import annotations

import contextlib
import copy
import difflib
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx

from mlxlocal.errors import ModelNotFoundError
from mlxlocal.source.catalog import load_catalog
from mlxlocal.source.synthetic.weights import DTYPES, BuildProgress, write_model_dir

PREFIX = "synthetic:"
MARKER = ".mlxlocal-synthetic.json"
QUANT_BITS = {"q4": 4, "q8": 8}
MODIFIERS = ("q4", "q8", "fp16", "bf16", "fp32", "seed=N", "layers=N", "context=N")


@dataclass(frozen=True)
class SyntheticSpec:
    preset: str
    dtype: str  # float16 | bfloat16 | float32
    bits: int | None = None
    seed: int = 0
    layers: int | None = None
    context: int | None = None

    @property
    def canonical(self) -> str:
        """One spelling per model: `synthetic:tiny:q4:fp32:seed=1`."""
        parts = [self.preset]
        if self.bits:
            parts.append(f"q{self.bits}")
        parts.append({v: k for k, v in DTYPES.items()}[self.dtype])
        if self.seed:
            parts.append(f"seed={self.seed}")
        if self.layers is not None:
            parts.append(f"layers={self.layers}")
        if self.context is not None:
            parts.append(f"context={self.context}")
        return PREFIX + ":".join(parts)

    @property
    def dirname(self) -> str:
        return self.canonical[len(PREFIX):].replace(":", "_").replace("=", "")


def is_synthetic(spec: str) -> bool:
    return spec.strip().lower().startswith(PREFIX)


def default_dtype() -> str:
    # fp16 matmuls are very slow on the CPU backend, so fp32 there.
    return "float16" if mx.metal.is_available() else "float32"


def _int_modifier(spec: str, mod: str, minimum: int) -> int:
    try:
        value = int(mod.split("=", 1)[1])
    except ValueError:
        value = minimum - 1
    if value < minimum:
        raise ModelNotFoundError(f"{spec!r}: {mod!r} needs an integer >= {minimum}")
    return value


def parse_spec(spec: str) -> SyntheticSpec:
    """Parse `synthetic:NAME[:MOD]...`; unknown names or modifiers raise ModelNotFoundError."""
    body = spec.strip()
    if body.lower().startswith(PREFIX):
        body = body[len(PREFIX):]
    name, *mods = body.split(":")
    catalog = load_catalog()
    preset = catalog.find_preset(name) if name else None
    if preset is None:
        close = difflib.get_close_matches(name, list(catalog.synthetic), n=2, cutoff=0.6)
        hint = f"did you mean {' or '.join('synthetic:' + c for c in close)}? " if close else ""
        raise ModelNotFoundError(
            f"unknown synthetic preset {name!r}; {hint}available: {', '.join(sorted(catalog.synthetic))}"
        )
    bits: int | None = None
    dtype: str | None = None
    seed, layers, context = 0, None, None
    for raw in mods:
        mod = raw.strip().lower()
        if mod in QUANT_BITS and bits is None:
            bits = QUANT_BITS[mod]
        elif mod in DTYPES and dtype is None:
            dtype = DTYPES[mod]
        elif mod.startswith("seed="):
            seed = _int_modifier(spec, mod, 0)
        elif mod.startswith("layers="):
            layers = _int_modifier(spec, mod, 1)
        elif mod.startswith("context="):
            context = _int_modifier(spec, mod, 16)
        else:
            what = "repeated" if mod in QUANT_BITS or mod in DTYPES else "unknown"
            raise ModelNotFoundError(
                f"{spec!r}: {what} modifier {raw!r}; valid modifiers: {', '.join(MODIFIERS)} "
                "(one quantization and one dtype at most)"
            )
    if preset.train is not None:
        if bits is not None or dtype not in (None, "float32") or layers is not None:
            raise ModelNotFoundError(f"{spec!r}: synthetic:{preset.name} is trained here, float32 and "
                                     "unquantized; it takes seed= and context= only")
        dtype = "float32"
    return SyntheticSpec(preset.name, dtype or default_dtype(), bits, seed, layers, context)


def default_root() -> Path:
    home = os.environ.get("MLXLOCAL_HOME")
    base = Path(home).expanduser() if home else Path.home() / ".cache" / "mlxlocal"
    return base / "synthetic"


def materialize(spec: str, root: Path | None = None, quiet: bool = False) -> Path:
    """Build (once) the model directory for `spec` and return it. A build says on stderr
    what it is doing and why (progress bar on a terminal) unless `quiet`."""
    parsed = parse_spec(spec)
    root = Path(root) if root is not None else default_root()
    target = root / parsed.dirname
    # Complete (a marker), and the base model a context variant links to still there.
    if (target / MARKER).is_file() and all(p.exists() for p in target.iterdir()):
        return target
    # context=N changes one config number, not a weight: the base model's files are linked.
    base = None if parsed.context is None else materialize(replace(parsed, context=None).canonical, root, quiet)

    root.mkdir(parents=True, exist_ok=True)
    if target.exists():  # a leftover without marker was never completed
        shutil.rmtree(target, ignore_errors=True)
    # Build next to the target, then rename: readers never see a partial directory.
    tmp = Path(tempfile.mkdtemp(prefix=f".{parsed.dirname}.", dir=root))
    try:
        if base is not None:
            _link_variant(base, tmp, max_position_embeddings=parsed.context)
        else:
            preset = load_catalog().synthetic[parsed.preset]
            config = copy.deepcopy(preset.config)
            if parsed.layers is not None:
                config["num_hidden_layers"] = parsed.layers
                for key in ("max_window_layers", "layer_types"):
                    config.pop(key, None)
            if preset.train is not None:
                _train(tmp, config, parsed, preset.chat_template, quiet)
            else:
                with contextlib.nullcontext() if quiet else BuildProgress(parsed.canonical, target) as progress:
                    write_model_dir(tmp, config, seed=parsed.seed, dtype=parsed.dtype,
                                    quantize_bits=parsed.bits, chat_template=preset.chat_template,
                                    progress=progress)
        marker = {"spec": parsed.canonical, "preset": parsed.preset, "seed": parsed.seed,
                  "dtype": parsed.dtype, "bits": parsed.bits, "layers": parsed.layers,
                  "context": parsed.context}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2))
        tmp.chmod(0o755)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / MARKER).is_file():  # not just a concurrent build that won
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _train(out: Path, config: dict, parsed: SyntheticSpec, chat_template: str, quiet: bool) -> None:
    """A trained preset: its model learnt here (synthetic/trained.py), float32, unquantized."""
    from mlxlocal.source.synthetic.trained import write_trained_dir

    if not quiet:
        print(f"training {parsed.canonical} here (synthetic text, about 2 minutes on a CPU) ...",
              file=sys.stderr, flush=True)
    losses = write_trained_dir(out, config, seed=parsed.seed, chat_template=chat_template)
    if not quiet:
        print(f"trained: held-out loss {losses['held_out_next']:.3f} (next token), "
              f"{losses['held_out_ahead']:.3f} (MTP, the token after)", file=sys.stderr, flush=True)


def is_trained(path: Path) -> bool:
    """A materialised synthetic model whose preset is trained here (its text is of the kind it
    learnt, not random)."""
    try:
        preset = json.loads((Path(path) / MARKER).read_text())["preset"]
    except (OSError, ValueError, KeyError, TypeError):
        return False
    found = load_catalog().synthetic.get(preset)
    return found is not None and found.train is not None


def _link_variant(base: Path, out: Path, **config) -> None:
    """`out` as `base` with other config.json values: its other files are links to base's."""
    for f in base.iterdir():
        if f.name not in (MARKER, "config.json"):
            (out / f.name).symlink_to(Path("..") / base.name / f.name)
    merged = {**json.loads((base / "config.json").read_text()), **config}
    (out / "config.json").write_text(json.dumps(merged, indent=2))


@dataclass(frozen=True)
class MaterializedModel:
    spec: str
    path: Path
    size_bytes: int
    last_modified: float


def _dir_size(path: Path) -> int:
    """Bytes the directory itself holds (a context variant's links to its base count as links)."""
    return sum(f.lstat().st_size for f in path.rglob("*") if f.is_symlink() or f.is_file())


def list_materialized(root: Path | None = None) -> list[MaterializedModel]:
    root = Path(root) if root is not None else default_root()
    found = []
    for marker in sorted(root.glob(f"*/{MARKER}")) if root.is_dir() else []:
        try:
            spec = json.loads(marker.read_text())["spec"]
        except (OSError, ValueError, KeyError):
            continue
        found.append(MaterializedModel(spec, marker.parent, _dir_size(marker.parent),
                                       marker.stat().st_mtime))
    return found


def remove_materialized(spec: str, root: Path | None = None) -> int:
    """Delete a materialised synthetic model; return the bytes freed."""
    root = Path(root) if root is not None else default_root()
    target = root / parse_spec(spec).dirname
    if not target.is_dir():
        raise ModelNotFoundError(f"{spec!r} is not materialised under {root}")
    size = _dir_size(target)
    shutil.rmtree(target)
    return size
