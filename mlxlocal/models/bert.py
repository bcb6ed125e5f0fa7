"""BERT-family sentence encoder (all-MiniLM-L6-v2 and friends) in MLX, one file as mlx-lm keeps models.

The encoder is HF's BertModel without its pooler: word + position + token-type embeddings,
LayerNorm, then post-LN layers (attention -> add -> LayerNorm, GELU MLP -> add -> LayerNorm).
On top sit the sentence-transformers modules a model directory declares in modules.json:
Pooling (1_Pooling/config.json: cls, mean, max, mean_sqrt_len) and Normalize; the maximum
length comes from sentence_bert_config.json. A directory without modules.json is treated as
sentence-transformers treats a bare transformer: mean pooling, no normalisation.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxlocal.errors import ConfigError, ModelLoadError

ENCODER_TYPES = ("bert",)
POOLING_MODES = ("cls", "mean", "max", "mean_sqrt_len")
# HF's names -> the attribute names below ("self" cannot be an attribute of a Module).
_RENAMES = (("attention.self.", "attention.attn."),)
# Tensors a BERT checkpoint may carry that the encoder does not use: the registered
# position_ids buffer, the pooler (sentence-transformers never reads it), pre-training heads.
_UNUSED_PREFIXES = ("pooler.", "cls.")


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str) -> BertConfig:
        if raw.get("model_type") not in ENCODER_TYPES:
            raise ConfigError(f"{where}: model_type {raw.get('model_type')!r} is not a BERT encoder "
                              f"(supported: {', '.join(ENCODER_TYPES)})")
        # Options that would change the math and that this encoder does not implement.
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ConfigError(f"{where}: position_embedding_type {raw['position_embedding_type']!r} "
                              "is not supported (only 'absolute')")
        if raw.get("is_decoder") or raw.get("add_cross_attention"):
            raise ConfigError(f"{where}: a BERT decoder / cross-attention model is not a sentence encoder")
        act = raw.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ConfigError(f"{where}: hidden_act {act!r} is not supported ({', '.join(_ACTIVATIONS)})")
        try:
            cfg = cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=int(raw["num_attention_heads"]),
                intermediate_size=int(raw["intermediate_size"]),
                max_position_embeddings=int(raw.get("max_position_embeddings", 512)),
                type_vocab_size=int(raw.get("type_vocab_size", 2)),
                layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
                hidden_act=act,
            )
        except KeyError as e:
            raise ConfigError(f"{where}: missing field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where}: malformed field ({e})") from None
        if cfg.hidden_size % cfg.num_attention_heads:
            raise ConfigError(f"{where}: hidden_size {cfg.hidden_size} is not a multiple of "
                              f"num_attention_heads {cfg.num_attention_heads}")
        return cfg


_ACTIVATIONS = {
    "gelu": nn.gelu,  # HF's "gelu" is the exact (erf) one
    "gelu_new": nn.gelu_approx,
    "gelu_pytorch_tanh": nn.gelu_approx,
    "relu": nn.relu,
}


class Embeddings(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def __call__(self, ids: mx.array, token_types: mx.array) -> mx.array:
        positions = mx.arange(ids.shape[1])[None, :]
        x = self.word_embeddings(ids) + self.position_embeddings(positions) + self.token_type_embeddings(token_types)
        return self.LayerNorm(x)


class SelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        b, n, d = x.shape
        h = self.n_heads

        def heads(t):
            return t.reshape(b, n, h, d // h).transpose(0, 2, 1, 3)

        out = mx.fast.scaled_dot_product_attention(
            heads(self.query(x)), heads(self.key(x)), heads(self.value(x)),
            scale=1.0 / math.sqrt(d // h), mask=mask)
        return out.transpose(0, 2, 1, 3).reshape(b, n, d)


class DenseNorm(nn.Module):
    """BertSelfOutput / BertOutput: dense, then LayerNorm of the residual sum (post-LN)."""

    def __init__(self, d_in: int, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(d_in, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        return self.LayerNorm(self.dense(x) + residual)


class Attention(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.attn = SelfAttention(cfg)
        self.output = DenseNorm(cfg.hidden_size, cfg)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        return self.output(self.attn(x, mask), x)


class Intermediate(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def __call__(self, x: mx.array) -> mx.array:
        return self.act(self.dense(x))


class Layer(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.attention = Attention(cfg)
        self.intermediate = Intermediate(cfg)
        self.output = DenseNorm(cfg.intermediate_size, cfg)

    def __call__(self, x: mx.array, mask: mx.array) -> mx.array:
        x = self.attention(x, mask)
        return self.output(self.intermediate(x), x)


class Encoder(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.layer = [Layer(cfg) for _ in range(cfg.num_hidden_layers)]


class BertModel(nn.Module):
    def __init__(self, cfg: BertConfig):
        super().__init__()
        self.config = cfg
        self.embeddings = Embeddings(cfg)
        self.encoder = Encoder(cfg)

    def __call__(self, ids: mx.array, attention_mask: mx.array,
                 token_types: mx.array | None = None) -> mx.array:
        """Last hidden states [B, L, D] for right-padded ids [B, L] and their mask (1 = token)."""
        if token_types is None:
            token_types = mx.zeros_like(ids)
        x = self.embeddings(ids, token_types)
        # Additive mask over keys: padding gets a large negative (not -inf: a row of only
        # padding would give NaN, and HF uses the dtype's minimum the same way).
        mask = ((1 - attention_mask.astype(x.dtype)) * -1e9)[:, None, None, :].astype(x.dtype)
        for layer in self.encoder.layer:
            x = layer(x, mask)
        return x

    @staticmethod
    def sanitize(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """HF checkpoint names -> ours: drop the 'bert.' prefix (BertForX checkpoints), the
        position_ids buffer, the pooler and pre-training heads."""
        out = {}
        for key, value in weights.items():
            key = key.removeprefix("bert.")
            if key.endswith("position_ids") or key.startswith(_UNUSED_PREFIXES):
                continue
            for old, new in _RENAMES:
                key = key.replace(old, new)
            out[key] = value
        return out


# --- sentence-transformers modules -------------------------------------------------------

@dataclass(frozen=True)
class SentenceConfig:
    """What sits on top of the encoder, read from the sentence-transformers files."""

    pooling: str  # one of POOLING_MODES
    normalize: bool  # a Normalize module follows pooling
    max_length: int  # max_seq_length (or the position table's size)
    layout: str  # "sentence-transformers" or "bare transformer"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"{path}: cannot read it ({e})") from None


def read_sentence_config(path: Path, cfg: BertConfig, tokenizer_max: int | None) -> SentenceConfig:
    limit = cfg.max_position_embeddings
    if tokenizer_max and tokenizer_max < limit:
        limit = tokenizer_max
    modules_file = path / "modules.json"
    if not modules_file.is_file():
        return SentenceConfig("mean", False, limit, "bare transformer")
    modules = _read_json(modules_file)
    if not isinstance(modules, list):
        raise ModelLoadError(f"{modules_file}: expected a list of modules")
    pooling, normalize = None, False
    for m in modules:
        kind = str(m.get("type", "")).rsplit(".", 1)[-1]
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            pooling = _pooling_mode(_read_json(path / m.get("path", "") / "config.json"),
                                    path / m.get("path", "") / "config.json")
        elif kind == "Normalize":
            normalize = True
        else:
            # A Dense projection or other module changes the output: refuse rather than
            # return embeddings that differ from sentence-transformers'.
            raise ModelLoadError(f"{modules_file}: module type {m.get('type')!r} is not supported "
                                 "(Transformer, Pooling, Normalize are)")
    max_length = limit
    st_file = path / "sentence_bert_config.json"
    if st_file.is_file():
        seq = _read_json(st_file).get("max_seq_length")
        if isinstance(seq, int) and seq > 0:
            max_length = min(seq, cfg.max_position_embeddings)
    return SentenceConfig(pooling or "mean", normalize, max_length, "sentence-transformers")


def _pooling_mode(raw: dict[str, Any], where: Path) -> str:
    if raw.get("pooling_mode"):  # newer sentence-transformers write the mode by name
        mode = {"mean_sqrt_len_tokens": "mean_sqrt_len"}.get(raw["pooling_mode"], raw["pooling_mode"])
        if mode in POOLING_MODES:
            return mode
        raise ModelLoadError(f"{where}: pooling_mode {raw['pooling_mode']!r} is not supported")
    on = [m for m in POOLING_MODES if raw.get(f"pooling_mode_{m}_token" if m == "cls" else f"pooling_mode_{m}_tokens")]
    unsupported = [k for k, v in raw.items() if k.startswith("pooling_mode_") and v
                   and k not in {"pooling_mode_cls_token", "pooling_mode_mean_tokens",
                                 "pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens"}]
    if unsupported:
        raise ModelLoadError(f"{where}: {', '.join(unsupported)} is not supported")
    if len(on) != 1:
        # sentence-transformers concatenates several modes; no common model does that.
        raise ModelLoadError(f"{where}: exactly one pooling mode must be on, found {on or 'none'}")
    return on[0]


def pool(hidden: mx.array, mask: mx.array, mode: str) -> mx.array:
    """[B, L, D] hidden states -> [B, D], over the positions where mask is 1."""
    m = mask.astype(hidden.dtype)[:, :, None]
    if mode == "cls":
        return hidden[:, 0]
    if mode == "max":
        return mx.max(mx.where(m > 0, hidden, mx.array(-1e9, hidden.dtype)), axis=1)
    summed = mx.sum(hidden * m, axis=1)
    counts = mx.maximum(mx.sum(m, axis=1), 1e-9)
    return summed / (mx.sqrt(counts) if mode == "mean_sqrt_len" else counts)


def l2_normalize(x: mx.array) -> mx.array:
    # torch.nn.functional.normalize's eps: an all-zero vector stays zero.
    return x / mx.maximum(mx.linalg.norm(x, axis=-1, keepdims=True), 1e-12)


def build(path: Path, weights: dict[str, mx.array]) -> BertModel:
    """config.json + already-validated weights -> the encoder, weights checked by name and shape."""
    from mlx.utils import tree_flatten

    cfg = BertConfig.from_dict(_read_json(path / "config.json"), str(path / "config.json"))
    model = BertModel(cfg)
    weights = model.sanitize(weights)
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    extra = sorted(set(weights) - set(expected))
    if missing or extra:
        parts = [f"missing {len(missing)} tensors (e.g. {', '.join(missing[:3])})"] if missing else []
        parts += [f"{len(extra)} unexpected tensors (e.g. {', '.join(extra[:3])})"] if extra else []
        raise ModelLoadError(f"{path}: weights do not match a BERT encoder: " + "; ".join(parts))
    for key, value in weights.items():
        if value.shape != expected[key].shape:
            raise ModelLoadError(f"{path}: tensor '{key}' has shape {tuple(value.shape)}, the config "
                                 f"implies {tuple(expected[key].shape)}")
    # Compute in float32 at least: a half-precision checkpoint loses parity in the LayerNorms.
    weights = {k: v.astype(mx.float32) if v.dtype in (mx.float16, mx.bfloat16) else v
               for k, v in weights.items()}
    model.load_weights(list(weights.items()), strict=True)
    model.eval()
    mx.eval(model.parameters())
    return model
