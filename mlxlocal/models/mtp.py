"""Multi-token-prediction (MTP) modules shipped inside checkpoints, loaded beside the model.

An MTP module predicts the token after next from the model's last hidden state h_i (before
the final norm) and the embedding of token i+1:
    x = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)]),  x = layer(x),  logits = head(norm(x))
with a decoder layer of the family's own kind (its own attention, so its own K/V), and the
model's embedding and output head (or the module's copies). Chained, each step feeds the
module's own x back as h: k drafts per forward of the model (engine/speculative/mtp.py).

Layouts read here, in the checkpoint's own tensor names:
- DeepSeek-V3 / R1, GLM-4.5+: `model.layers.{N+i}.{enorm,hnorm,eh_proj,shared_head.norm,
  shared_head.head,embed_tokens}` plus the layer's own tensors, N = num_hidden_layers,
  `num_nextn_predict_layers` of them;
- Qwen3.5 / 3.6 / Qwen3-Next: `mtp.{fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm}` and
  `mtp.layers.{i}.*` (`mtp_num_hidden_layers`).
The family's mlx-lm sanitize() converts the layer's tensors (experts stacked, MLA split,
zero-centred norms) as it does the model's: they are handed to it under a main layer's name.
"""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlxlocal.errors import ModelLoadError

_DEEPSEEK_RENAMES = (("shared_head.norm.", "norm."), ("shared_head.head.", "head."),
                     ("embed_tokens.", "embed."))
_DEEPSEEK_PARTS = ("enorm.", "hnorm.", "eh_proj.", "norm.", "head.", "embed.")  # after renames
_QWEN_PARTS = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
               "norm": "norm"}
_LAYER = re.compile(r"^(.*?layers\.)(\d+)\.(.*)$")
_PROBE = "probe.input_layernorm.weight"  # no layer has it: ends with a norm key sanitize shifts


@dataclass
class MTPWeights:
    """The MTP tensors split off a checkpoint: per module, its own parts (enorm, hnorm,
    eh_proj, norm, optional head/embed) and its decoder layer's tensors (checkpoint names)."""

    family: str  # "deepseek" | "qwen" | "mimo" (seen, not loaded) | "none" (declared, absent)
    modules: list[dict[str, dict[str, mx.array]]] = field(default_factory=list)
    declared: int = 0  # what the config says the checkpoint was trained with
    raw_conv: bool = False  # the checkpoint's conv weights are unconverted (HF's, not mlx-lm's)


def declared_heads(config: dict[str, Any]) -> int:
    text = config.get("text_config") or config
    return int(text.get("num_nextn_predict_layers") or text.get("mtp_num_hidden_layers") or 0)


def split_mtp(config: dict[str, Any], weights: dict[str, mx.array]) -> MTPWeights | None:
    """Take the MTP tensors out of `weights` (in place); None when there are none and the
    config declares none."""
    declared = declared_heads(config)
    text = config.get("text_config") or config
    n_layers = int(text.get("num_hidden_layers", 0))
    qwen = [k for k in weights if k.startswith("mtp.") or ".mtp." in k]
    if qwen:
        raw = any("conv1d.weight" in k and v.shape[-1] != 1 for k, v in weights.items())
        out = MTPWeights("qwen", declared=declared, raw_conv=raw)
        for k in qwen:
            rest = k[k.index("mtp.") + 4:]
            v = weights.pop(k)
            m = re.match(r"layers\.(\d+)\.(.*)$", rest)
            if m:
                _module(out, int(m.group(1)))["layer"][m.group(2)] = v
            else:
                name, _, leaf = rest.partition(".")
                if name not in _QWEN_PARTS:
                    raise ModelLoadError(f"MTP tensor {k!r}: not a part of a Qwen MTP module")
                _module(out, 0)["own"][f"{_QWEN_PARTS[name]}.{leaf}"] = v
        return out
    past = {k: m for k in weights if (m := _LAYER.match(k)) and int(m.group(2)) >= n_layers}
    if any(k.endswith(".eh_proj.weight") for k in past):
        out = MTPWeights("deepseek", declared=declared)
        for k, m in past.items():
            rest, v = m.group(3), weights.pop(k)
            for old, new in _DEEPSEEK_RENAMES:
                if rest.startswith(old):
                    rest = new + rest.removeprefix(old)
            own = rest.startswith(_DEEPSEEK_PARTS)
            _module(out, int(m.group(2)) - n_layers)["own" if own else "layer"][rest] = v
        return out
    if any(".mtp_layers." in k for k in weights):  # MiMo's: left to its sanitize, which drops them
        return MTPWeights("mimo", declared=declared)
    return MTPWeights("none", declared=declared) if declared else None


def _module(out: MTPWeights, i: int) -> dict[str, dict[str, mx.array]]:
    while len(out.modules) <= i:
        out.modules.append({"own": {}, "layer": {}})
    return out.modules[i]


class MTPModule(nn.Module):
    """One MTP module; `embed`/`head` are the model's (kept outside this module's parameters)
    unless the checkpoint gives the module copies of its own that differ."""

    def __init__(self, layer: nn.Module, hidden: int, eps: float, own_embed: bool, own_head: bool,
                 vocab: int):
        super().__init__()
        self.enorm = nn.RMSNorm(hidden, eps=eps)
        self.hnorm = nn.RMSNorm(hidden, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = layer
        self.norm = nn.RMSNorm(hidden, eps=eps)
        if own_embed:
            self.embed = nn.Embedding(vocab, hidden)
        if own_head:
            self.head = nn.Linear(hidden, vocab, bias=False)

    def __call__(self, tokens: mx.array, hidden: mx.array, cache,
                 target: TargetParts) -> tuple[mx.array, mx.array]:
        """tokens [B, n], hidden [B, n, D] (the model's, or this module's own output when
        chained) -> (logits [B, n, V], this module's output [B, n, D])."""
        from mlx_lm.models.base import create_attention_mask

        embed = self.embed if "embed" in self else target.embed
        x = self.eh_proj(mx.concatenate([self.enorm(embed(tokens)), self.hnorm(hidden)], axis=-1))
        mask = create_attention_mask(x, cache, return_array=True)
        x = self.layer(x, mask, cache)
        h = self.norm(x)
        return (self.head(h) if "head" in self else target.head(h)), x


class TargetParts:
    """The model's inner model (layers, embedding), output head and args, found once."""

    def __init__(self, model: nn.Module):
        inner = model.model
        self.inner = inner
        self.embed = inner.embed_tokens
        lm = getattr(model, "language_model", model)
        tied = not hasattr(lm, "lm_head")
        self.head = inner.embed_tokens.as_linear if tied else lm.lm_head
        self.args = getattr(lm, "args", None) or model.args


class HiddenTap:
    """The model's last hidden state, taken where its final norm is applied: the norm's
    class is swapped for a subclass that records its input (the parameters stay where they
    are, so weights, quantization and fingerprints see the same model). Only threads that
    asked (clear()) record: other engines on the same model, on their own threads, do not."""

    @classmethod
    def of(cls, model: nn.Module) -> HiddenTap:
        """The model's tap (one per model, whichever engine asks first)."""
        return getattr(type(model.model.norm), "mlxlocal_tap", None) or cls(model)

    def __init__(self, model: nn.Module):
        norm = model.model.norm
        base = type(norm)
        tap = self
        self.local = threading.local()

        class Tapped(base):  # type: ignore[valid-type, misc]
            mlxlocal_tap = tap

            def __call__(self, x, *a, **kw):
                taken = getattr(tap.local, "taken", None)
                if taken is not None:
                    taken.append(x)
                return base.__call__(self, x, *a, **kw)

        norm.__class__ = Tapped

    def clear(self) -> None:
        """Start recording on this thread, from nothing."""
        self.local.taken = []

    def take(self, batch: int, n: int) -> mx.array:
        """The hidden states [batch, n, D] of the last forward since clear(): one call of the
        model, a chunk run in two (positions), or a batch run one sequence at a time (rows).
        Earlier calls (a probe of the model's cache kinds) are passed over."""
        parts = getattr(self.local, "taken", None) or []
        self.local.taken = []
        if parts and parts[-1].shape[:2] == (batch, n):
            return parts[-1]
        if batch > 1 and len(parts) >= batch and all(p.shape[:2] == (1, n) for p in parts[-batch:]):
            return mx.concatenate(parts[-batch:], axis=0)
        got = 0
        for i in range(len(parts) - 1, -1, -1):  # a chunk in pieces: positions, in order
            if parts[i].shape[0] != batch:
                break
            got += parts[i].shape[1]
            if got == n:
                return mx.concatenate(parts[i:], axis=1)
        raise RuntimeError(f"the model's forward recorded no hidden state of {batch} x {n} tokens")


def _layer_index(family: str, target: TargetParts) -> int:
    """The main layer whose kind the MTP layer is (its attention is full attention)."""
    layers = target.inner.layers
    if family == "deepseek":
        return len(layers)  # past the last: MoE or dense by the family's own rule
    for i, layer in enumerate(layers):
        if not getattr(layer, "is_linear", False):
            return i
    return 0


def _sanitize_layer(model: nn.Module, main_names: list[str], tensors: dict[str, mx.array],
                    split: MTPWeights) -> tuple[dict[str, mx.array], bool]:
    """The layer's tensors through the family's sanitize(), under main layer 0's name (its
    loops cover it); for Qwen, whether the family shifts norms (zero-centred norms in the
    checkpoint: +1), found by handing it a norm of zeros, and, where the checkpoint's conv
    weights were unconverted, a stand-in of that kind (what its sanitize decides by)."""
    prefix = next((m.group(1) for k in main_names
                   if (m := _LAYER.match(k)) and "mtp" not in m.group(1)), "model.layers.")
    named = {f"{prefix}0.{k}": v for k, v in tensors.items()}
    probe = f"{prefix}0.{_PROBE}"
    if split.family == "qwen":
        named[probe] = mx.zeros((1,))
        if split.raw_conv:
            named[f"{prefix}0.probe.conv1d.weight"] = mx.zeros((1, 1, 4))
    out = model.sanitize(named) if hasattr(model, "sanitize") else named
    layer, shift = {}, False
    for k, v in out.items():
        m = _LAYER.match(k)
        if m is None or m.group(2) != "0":
            continue
        if m.group(3) == _PROBE:
            shift = bool(v.item() != 0)
        if not m.group(3).startswith("probe."):
            layer[m.group(3)] = v
    return layer, shift


def build_mtp(model: nn.Module, split: MTPWeights, main_names: list[str],
              quantization: dict | None = None) -> list[MTPModule]:
    """The MTP modules of `split`, loaded strictly (every tensor used, none missing); a
    quantized checkpoint's (`quantization`: its config's) quantized where its tensors are."""
    from mlxlocal.models import quantize_for_checkpoint

    if not split.modules:
        return []
    target = TargetParts(model)
    args = target.args
    idx = _layer_index(split.family, target)
    layer_cls = type(target.inner.layers[min(idx, len(target.inner.layers) - 1)])
    hidden = args.hidden_size
    eps = getattr(args, "rms_norm_eps", 1e-6)
    vocab = args.vocab_size
    modules = []
    for i, parts in enumerate(split.modules):
        own = dict(parts["own"])
        for name, main in (("embed.weight", target.embed.weight),
                           ("head.weight", getattr(target.head, "weight", None))):
            mine = own.get(name)
            if mine is not None and main is not None and mine.shape == main.shape \
                    and mx.array_equal(mine, main):
                del own[name]  # the same tensor as the model's: shared, not held twice
        layer_w, shift = _sanitize_layer(model, main_names, parts["layer"], split)
        if shift:  # zero-centred norms, as the family's sanitize treats the model's
            own = {k: (v + 1.0 if k.endswith("norm.weight") else v) for k, v in own.items()}
        layer = layer_cls(args, idx + (i if split.family == "deepseek" else 0))
        module = MTPModule(layer, hidden, eps, "embed.weight" in own, "head.weight" in own, vocab)
        weights = {**own, **{f"layer.{k}": v for k, v in layer_w.items()}}
        if quantization:  # its defaults; bits and group size per layer are read off the tensors
            defaults = {k: quantization[k] for k in ("bits", "group_size", "mode") if k in quantization}
            quantize_for_checkpoint(module, {"quantization": defaults}, weights)
        expected = dict(tree_flatten(module.parameters()))
        missing, extra = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
        if missing or extra:
            raise ModelLoadError(f"MTP module {i}: its tensors do not match a {split.family} MTP "
                                 f"module (missing {missing[:3]}, unexpected {extra[:3]})")
        module.load_weights(list(weights.items()), strict=True)
        module.eval()
        mx.eval(module.parameters())
        modules.append(module)
    return modules


def describe(split: MTPWeights | None, loaded: int, sharded: bool = False) -> str | None:
    """What `show` says about MTP heads (None: the model has none)."""
    if split is None:
        return None
    if sharded and split.modules:
        return "MTP: the checkpoint's modules are not loaded on a cluster's ranks (no drafting there)"
    if split.family == "mimo":
        return "MTP: the checkpoint's MiMo modules (model.mtp_layers) are not loaded: that layout is not read yet"
    if loaded:
        layout = {"deepseek": "model.layers.N, as DeepSeek-V3 and GLM-4.5",
                  "qwen": "mtp.*, as Qwen3.5"}
        return f"MTP: {loaded} module(s) loaded ({layout[split.family]}); --mtp drafts with them"
    return (f"MTP: the config declares {split.declared} module(s) but the checkpoint has none "
            "(its conversion dropped them); --mtp cannot draft")


__all__ = ["HiddenTap", "MTPModule", "MTPWeights", "TargetParts", "build_mtp", "declared_heads",
           "describe", "split_mtp"]
