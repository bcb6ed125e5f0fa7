"""Synthetic models: random weights with a real model's shapes, in Hugging Face layout.

`synthetic:NAME[:MOD]...` names a preset from models.toml plus modifiers:

    q4 | q8              MLX affine quantization, group size 64 (as mlx-community)
    fp16 | bf16 | fp32   weight dtype (default fp16 on Metal, fp32 on the CPU backend)
    seed=N               random seed (default 0); same seed -> identical weights
    layers=N             override num_hidden_layers (quick runs of big shapes)

The directory holds config.json, safetensors, generation_config.json and a byte-level
BPE tokenizer whose vocabulary size equals the model's vocab_size, so mlxlocal,
mlx-lm and transformers all load it like a downloaded checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlxlocal.errors import ConfigError, ModelNotFoundError, UnsupportedModelError
from mlxlocal.source.catalog import load_catalog
from mlxlocal.source.synthetic.weights import BuildProgress, Progress, save_weights

PREFIX = "synthetic:"
MARKER = ".mlxlocal-synthetic.json"
GROUP_SIZE = 64
DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}
QUANT_BITS = {"q4": 4, "q8": 8}
MODIFIERS = ("q4", "q8", "fp16", "bf16", "fp32", "seed=N", "layers=N")
TEMPLATES_DIR = Path(__file__).parent / "templates"
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@dataclass(frozen=True)
class TokenizerStyle:
    """Special tokens of a chat format; they take the highest ids, in this order."""

    special: tuple[str, ...]
    extra: tuple[str, ...]  # added but not special: kept when decoding
    bos: str | None
    eos: str
    pad: str | None
    stop: tuple[str, ...]  # generation_config eos_token_id


STYLES: dict[str, TokenizerStyle] = {
    "chatml": TokenizerStyle(
        special=("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
        extra=("<tool_call>", "</tool_call>", "<think>", "</think>"),
        bos=None,
        eos="<|im_end|>",
        pad="<|endoftext|>",
        stop=("<|im_end|>", "<|endoftext|>"),
    ),
    "llama3": TokenizerStyle(
        special=(
            "<|begin_of_text|>",
            "<|end_of_text|>",
            "<|start_header_id|>",
            "<|end_header_id|>",
            "<|eot_id|>",
            "<|python_tag|>",
        ),
        extra=(),
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
        pad="<|end_of_text|>",
        stop=("<|end_of_text|>", "<|eot_id|>"),
    ),
    "mistral": TokenizerStyle(
        special=(
            "<s>",
            "</s>",
            "[INST]",
            "[/INST]",
            "[TOOL_CALLS]",
            "[AVAILABLE_TOOLS]",
            "[/AVAILABLE_TOOLS]",
            "[TOOL_RESULTS]",
            "[/TOOL_RESULTS]",
        ),
        extra=(),
        bos="<s>",
        eos="</s>",
        pad="</s>",
        stop=("</s>",),
    ),
}

# Training text for the BPE merges: enough variety for word-like tokens. The rest of
# the vocabulary is filled deterministically (see _extend_vocab).
_CORPUS = """\
The small model answered the question quickly, and the user asked another one.
Local inference means the weights stay on your own machine: no network, no account,
and no waiting in a queue. Memory bandwidth decides how fast each token arrives.
A chat turn starts with a system message, then the user speaks and the assistant
replies. Tools let the assistant call functions, read files, and search the web.
When the cache already holds the prompt, only the new tokens need to be computed.
Quantization stores each weight in four or eight bits with a scale and a bias for
every group of sixty-four values, which cuts memory use by a factor of three or four.
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)
for (int i = 0; i < count; ++i) { total += values[i]; }
{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}
Please summarize the following text in three sentences, then list the key points.
What is the capital of France? The capital of France is Paris.
"""
_WORDS = (
    "the a model token user assistant system tool cache memory prompt answer question "
    "time year people way day man thing woman life child world school state family "
    "student group country problem hand part place case week company number point "
    "work government night water room mother area money story fact month lot right "
    "study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute "
    "idea kid body information back parent face others level office door health person "
    "art war history party result change morning reason research girl guy moment air "
    "teacher force education is was are be have do say get make go know take see come "
    "think look want give use find tell ask work seem feel try leave call good new first "
    "last long great little own other old right big high different small large next early "
    "young important few public bad same able"
).split()


def _corpus() -> list[str]:
    lines = _CORPUS.splitlines()
    # Generated sentences and numbers widen the merges beyond the paragraphs above.
    n = len(_WORDS)
    for i in range(3000):
        words = [_WORDS[(i * k * 7 + k * 13 + i) % n] for k in range(1, 9)]
        lines.append(" ".join(words).capitalize() + (".", "?", "!", ",")[i % 4])
    lines += [f"{i} + {i * 3} = {i * 4}; x_{i} = f({i}, {i % 7})" for i in range(2000)]
    return lines


def chat_template_text(name: str) -> str:
    path = TEMPLATES_DIR / f"{name}.jinja"
    if name not in STYLES or not path.is_file():
        raise ConfigError(f"unknown chat template {name!r}; expected one of {sorted(STYLES)}")
    return path.read_text(encoding="utf-8")


def _extend_vocab(vocab: dict[str, int], merges: list[list[str]], target: int) -> None:
    """Add merges (concatenations of existing tokens) until len(vocab) == target.

    Pairs are taken along anti-diagonals of (learned tokens first, then bytes), so short
    common pieces combine first; deterministic because the trained vocab is.
    """
    while len(vocab) < target:
        order = sorted(vocab.items(), key=lambda kv: kv[1])
        base = [t for t, i in order if i >= 256] + [t for t, i in order if i < 256]
        n = len(base)
        for s in range(2 * n - 1):
            for i in range(max(0, s - n + 1), min(s, n - 1) + 1):
                a, b = base[i], base[s - i]
                if a + b not in vocab:
                    vocab[a + b] = len(vocab)
                    merges.append([a, b])
                    if len(vocab) >= target:
                        return


def build_tokenizer(vocab_size: int, chat_template: str = "chatml"):
    """A byte-level BPE `tokenizers.Tokenizer` with exactly `vocab_size` ids."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from tokenizers.trainers import BpeTrainer

    style = STYLES[chat_template]
    added = [*style.special, *style.extra]
    n_base = vocab_size - len(added)
    if n_base < 257:
        raise ConfigError(
            f"vocab_size {vocab_size} is too small for a byte-level tokenizer "
            f"(needs at least {257 + len(added)})"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    trainer = BpeTrainer(
        vocab_size=n_base,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)

    # Pad the model part to n_base through its JSON form (the Rust side has no API).
    data = json.loads(tok.to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    merges: list[list[str]] = [m.split(" ", 1) if isinstance(m, str) else m
                               for m in data["model"]["merges"]]
    _extend_vocab(vocab, merges, n_base)
    data["model"]["merges"] = merges
    tok = Tokenizer.from_str(json.dumps(data))

    special = [AddedToken(t, special=True, normalized=False) for t in style.special]
    extra = [AddedToken(t, special=False, normalized=False) for t in style.extra]
    tok.add_special_tokens(special)
    tok.add_tokens(extra)
    tok.decoder = decoders.ByteLevel()
    post: list[Any] = [processors.ByteLevel(trim_offsets=False)]
    if style.bos is not None:
        # Llama and Mistral tokenizers prepend BOS when encoding plain text.
        bos = (style.bos, tok.token_to_id(style.bos))
        post.append(processors.TemplateProcessing(
            single=f"{style.bos} $A", pair=f"{style.bos} $A {style.bos} $B", special_tokens=[bos]
        ))
    tok.post_processor = processors.Sequence(post)
    if tok.get_vocab_size(with_added_tokens=True) != vocab_size:
        raise ConfigError(f"tokenizer has {tok.get_vocab_size()} ids, expected {vocab_size}")
    return tok


def write_tokenizer(path: Path, vocab_size: int, chat_template: str = "chatml",
                    model_max_length: int | None = None) -> dict[str, Any]:
    """Write tokenizer.json + tokenizer_config.json; return bos/eos/pad token ids."""
    style = STYLES.get(chat_template)
    if style is None:
        raise ConfigError(f"unknown chat template {chat_template!r}; expected {sorted(STYLES)}")
    template = chat_template_text(chat_template)
    tok = build_tokenizer(vocab_size, chat_template)
    tok.save(str(path / "tokenizer.json"))
    ids = {t: tok.token_to_id(t) for t in (*style.special, *style.extra)}
    decoder = {
        str(ids[t]): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": t in style.special}
        for t in ids
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": style.bos,
        "eos_token": style.eos,
        "pad_token": style.pad,
        "unk_token": None,
        "added_tokens_decoder": decoder,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length or 131072,
        "chat_template": template,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    special_map = {k: v for k, v in (("bos_token", style.bos), ("eos_token", style.eos),
                                     ("pad_token", style.pad)) if v is not None}
    (path / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2))
    return {
        "bos_token_id": ids[style.bos] if style.bos else None,
        "eos_token_id": ids[style.eos],
        "pad_token_id": ids[style.pad] if style.pad else None,
        "stop_token_ids": [ids[t] for t in style.stop],
    }


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


@dataclass(frozen=True)
class SyntheticSpec:
    preset: str
    dtype: str  # float16 | bfloat16 | float32
    bits: int | None = None
    seed: int = 0
    layers: int | None = None

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
        raise ModelNotFoundError(
            f"unknown synthetic preset {name!r}; available: {', '.join(sorted(catalog.synthetic))}"
        )
    bits: int | None = None
    dtype: str | None = None
    seed, layers = 0, None
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
        else:
            what = "repeated" if mod in QUANT_BITS or mod in DTYPES else "unknown"
            raise ModelNotFoundError(
                f"{spec!r}: {what} modifier {raw!r}; valid modifiers: {', '.join(MODIFIERS)} "
                "(one quantization and one dtype at most)"
            )
    return SyntheticSpec(preset.name, dtype or default_dtype(), bits, seed, layers)


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
    if (target / MARKER).is_file():
        return target
    preset = load_catalog().synthetic[parsed.preset]
    config = copy.deepcopy(preset.config)
    if parsed.layers is not None:
        config["num_hidden_layers"] = parsed.layers
        for key in ("max_window_layers", "layer_types"):
            config.pop(key, None)

    root.mkdir(parents=True, exist_ok=True)
    if target.exists():  # a leftover without marker was never completed
        shutil.rmtree(target, ignore_errors=True)
    # Build next to the target, then rename: readers never see a partial directory.
    tmp = Path(tempfile.mkdtemp(prefix=f".{parsed.dirname}.", dir=root))
    try:
        with contextlib.nullcontext() if quiet else BuildProgress(parsed.canonical, target) as progress:
            write_model_dir(tmp, config, seed=parsed.seed, dtype=parsed.dtype, quantize_bits=parsed.bits,
                            chat_template=preset.chat_template, progress=progress)
        marker = {"spec": parsed.canonical, "preset": parsed.preset, "seed": parsed.seed,
                  "dtype": parsed.dtype, "bits": parsed.bits, "layers": parsed.layers}
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


@dataclass(frozen=True)
class MaterializedModel:
    spec: str
    path: Path
    size_bytes: int
    last_modified: float


def _dir_size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


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
