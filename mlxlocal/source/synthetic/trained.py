"""Trained synthetic models: where random weights make a measurement meaningless.

A draft of random weights is never accepted, so MTP acceptance and its speed-up mean nothing
on the random presets. A preset with `train = "words"` is instead trained here, with MLX, on
text from a small stochastic grammar: a word-level Markov chain (each word has one likely
successor and a few less likely ones), written out and tokenized with the model's own
tokenizer. The model (GLM-4.5 or DeepSeek-V3 type) and its MTP module (their checkpoints'
layout: `model.layers.{N}`) learn it
together, as DeepSeek trains them (loss = next token + 0.5 x the token after), in a minute
or two on a CPU; the directory is then kept like any synthetic model. `bench_prompts.json`
holds held-out text of the same kind (other draws of the chain) as token ids: what a bench
of the fixture's drafts should run on.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

from mlxlocal.source.synthetic.tokenizer import write_tokenizer

WORDS = ("the", "sea", "light", "keeper", "found", "a", "bottle", "on", "rocks", "at", "night",
         "and", "wind", "came", "over", "old", "tower", "with", "letter", "inside", "said",
         "come", "home", "soon", "boat", "waits", "by", "shore", "under", "stars", "he", "read",
         "it", "twice", "then", "lit", "lamp", "again", "storm", "passed")
SEQ = 64  # training window, tokens
BATCH = 16
STEPS = 300
MTP_WEIGHT = 0.5


def chain(seed: int) -> np.ndarray:
    """Transition matrix over WORDS: one likely successor (0.7), two others (0.12 each),
    the rest share 0.06."""
    rng = np.random.default_rng(seed)
    n = len(WORDS)
    p = np.full((n, n), 0.06 / (n - 3))
    for i in range(n):
        a, b, c = rng.choice(n, 3, replace=False)
        p[i, a], p[i, b], p[i, c] = 0.7, 0.12, 0.12
    return p / p.sum(axis=1, keepdims=True)


def text(p: np.ndarray, words: int, rng: np.random.Generator) -> str:
    w = int(rng.integers(len(WORDS)))
    out = []
    for _ in range(words):
        out.append(WORDS[w])
        w = int(rng.choice(len(WORDS), p=p[w]))
    return " ".join(out)


def _tokens(tok, p: np.ndarray, n_tokens: int, rng: np.random.Generator) -> list[int]:
    ids: list[int] = []
    while len(ids) < n_tokens:
        ids += tok.encode(" " + text(p, 64, rng)).ids
    return ids[:n_tokens]


class _Trainee(nn.Module):
    """The mlx-lm model and its MTP module, trained together."""

    def __init__(self, model: nn.Module, mtp: nn.Module):
        super().__init__()
        self.model, self.mtp = model, mtp

    def loss(self, x: mx.array) -> mx.array:
        main, ahead = self.losses(x)
        return main + MTP_WEIGHT * ahead

    def losses(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """Cross-entropy of the next token (the model) and of the one after (MTP)."""
        from mlx_lm.models.base import create_attention_mask

        from mlxlocal.models.mtp import TargetParts

        inner = self.model.model
        h = inner.embed_tokens(x)
        mask = create_attention_mask(h, None, return_array=True)
        for layer in inner.layers:
            h = layer(h, mask, None)
        logits = self.model.lm_head(inner.norm(h))
        main = nn.losses.cross_entropy(logits[:, :-1], x[:, 1:]).mean()
        # Position i: (h_i, token i+1) -> token i+2.
        mtp_logits, _ = self.mtp(x[:, 1:-1], h[:, :-2], None, TargetParts(self.model))
        ahead = nn.losses.cross_entropy(mtp_logits, x[:, 2:]).mean()
        return main, ahead


def write_trained_dir(path: Path, config: dict[str, Any], *, seed: int = 0,
                      chat_template: str = "chatml", steps: int = STEPS) -> dict[str, float]:
    """Train the preset's model (a family whose MTP module is `model.layers.{N}`: GLM-4.5,
    DeepSeek-V3) with one MTP module and write it in the checkpoint layout; returns the
    held-out losses."""
    from mlx_lm.utils import _get_classes
    from tokenizers import Tokenizer

    from mlxlocal.models.mtp import MTPModule

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(config)
    ids = write_tokenizer(path, int(config["vocab_size"]), chat_template,
                          config.get("max_position_embeddings"))
    config.update(eos_token_id=ids["eos_token_id"], torch_dtype="float32",
                  num_nextn_predict_layers=1)
    config.setdefault("rope_scaling", None)  # as GLM's and DeepSeek's configs have it
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    mx.random.seed(seed)
    rng = np.random.default_rng(seed)
    p = chain(seed)
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    n = model.args.num_hidden_layers
    hidden = model.args.hidden_size
    layer = type(model.model.layers[0])(model.args, n)  # the family's own layer, as at index N
    mtp = MTPModule(layer, hidden, model.args.rms_norm_eps, False, False, model.args.vocab_size)
    trainee = _Trainee(model, mtp)
    data = np.array(_tokens(tok, p, BATCH * SEQ * 128, rng), dtype=np.int32).reshape(-1, SEQ)
    opt = optim.AdamW(learning_rate=optim.cosine_decay(3e-3, steps, 3e-4), weight_decay=0.01)
    step = nn.value_and_grad(trainee, lambda m, x: m.loss(x))
    losses = []
    for _ in range(steps):
        batch = mx.array(data[rng.integers(0, len(data), BATCH)])
        loss, grads = step(trainee, batch)
        opt.update(trainee, grads)
        mx.eval(trainee.parameters(), opt.state, loss)
        losses.append(loss.item())
    main = dict(tree_flatten(model.parameters()))
    weights = checkpoint_layout(main, config)
    pre = f"model.layers.{n}."
    own = dict(tree_flatten(mtp.parameters()))
    layer = checkpoint_layout(
        {k.removeprefix("layer."): v for k, v in own.items() if k.startswith("layer.")}, config)
    weights.update({pre + k: v for k, v in layer.items()})
    for name in ("enorm", "hnorm", "eh_proj"):
        weights[f"{pre}{name}.weight"] = own[f"{name}.weight"]
    weights[pre + "shared_head.norm.weight"] = own["norm.weight"]
    weights[pre + "shared_head.head.weight"] = main["lm_head.weight"]
    weights[pre + "embed_tokens.weight"] = main["model.embed_tokens.weight"]
    (path / "config.json").write_text(json.dumps(config, indent=2))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    held_out = np.random.default_rng(seed + 10_000)  # other draws of the same chain
    prompts = {f"held-out-{i}": _tokens(tok, p, 64, held_out) for i in range(2)}
    (path / "bench_prompts.json").write_text(json.dumps(prompts))
    test = mx.array(np.array(_tokens(tok, p, 8 * SEQ, held_out), dtype=np.int32).reshape(8, SEQ))
    main_loss, ahead_loss = trainee.losses(test)
    return {"train_loss": sum(losses[-20:]) / 20, "held_out_next": main_loss.item(),
            "held_out_ahead": ahead_loss.item()}


def checkpoint_layout(params: dict[str, mx.array], config: dict[str, Any]) -> dict[str, mx.array]:
    """mlx-lm's GLM-4.5 / DeepSeek-V3 tensors in the checkpoint's layout (what its sanitize
    undoes): experts one by one, and a DeepSeek attention's kv_b_proj whole again."""
    out: dict[str, mx.array] = {}
    for k, v in params.items():
        if ".switch_mlp." in k:
            pre, rest = k.split(".switch_mlp.")
            for e in range(v.shape[0]):
                out[f"{pre}.experts.{e}.{rest}"] = v[e]
        elif k.endswith("self_attn.embed_q.weight"):
            wv = params[k.replace("embed_q", "unembed_out")]  # [H, v, kv_lora]
            kv_b = mx.concatenate([v.swapaxes(-1, -2), wv], axis=1)  # embed_q: [H, kv_lora, nope]
            out[k.replace("embed_q.weight", "kv_b_proj.weight")] = kv_b.reshape(-1, kv_b.shape[-1])
        elif "unembed_out" not in k:
            out[k] = v
    return out
