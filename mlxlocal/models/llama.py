"""Native decoder for the llama family: llama, mistral, qwen2, qwen3.

One parametrised file: the families differ only in flags read from the config
(q/k/v bias for qwen2, per-head q/k RMSNorm for qwen3, sliding-window layers for
mistral). Parameter names follow HF / mlx-lm so the same checkpoints load.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.activations import swiglu
from mlx_lm.models.rope_utils import initialize_rope

from mlxlocal import metal
from mlxlocal.models.config import ModelConfig
from mlxlocal.models.kv import DenseKV, LayerKV
from mlxlocal.models.layers import Linear, RMSNorm, embedding_as_linear

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = d = cfg.head_dim
        self.scale = d**-0.5
        bias = cfg.attention_bias
        self.q_proj = Linear(cfg.hidden_size, self.n_heads * d, bias=bias)
        self.k_proj = Linear(cfg.hidden_size, self.n_kv_heads * d, bias=bias)
        self.v_proj = Linear(cfg.hidden_size, self.n_kv_heads * d, bias=bias)
        # qwen2 has biases on q/k/v only, never on o.
        o_bias = bias and cfg.model_type != "qwen2"
        self.o_proj = Linear(self.n_heads * d, cfg.hidden_size, bias=o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, eps=cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, eps=cfg.rms_norm_eps)
        self.rope = initialize_rope(
            d, cfg.rope_theta, False, cfg.rope_scaling, cfg.max_position_embeddings
        )
        # The rope's arguments, for the dispatch (None: a kind only its module applies).
        self.rope_args = metal.RopeArgs.of(self.rope)

    def __call__(self, x: mx.array, kv: LayerKV, last_only: bool = False) -> mx.array:
        B, L, _ = x.shape
        # last_only: every position's K/V is stored, but only the last one asks a query.
        Lq = 1 if last_only else L
        q = self.q_proj(x[:, -Lq:]).reshape(B, Lq, self.n_heads, self.head_dim)
        k = self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
        if "q_norm" in self:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(0, 2, 1, 3) for t in (q, k, v))
        # The step's offset object as is when no position is skipped: the rope's angles are
        # computed once per step for every layer that passes the same offset.
        q = self._rotate(q, kv.offset if L == Lq else kv.offset + (L - Lq))
        k = self._rotate(k, kv.offset)
        out = kv.attend(q, k, v, self.scale)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, Lq, -1))

    def _rotate(self, x: mx.array, offset: int | mx.array) -> mx.array:
        if self.rope_args is None:
            return self.rope(x, offset=offset)
        return metal.rope(self.rope_args, x, offset)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, i, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = Linear(h, i, bias=b)
        self.up_proj = Linear(h, i, bias=b)
        self.down_proj = Linear(i, h, bias=b)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))  # one fused op, as mlx-lm


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def __call__(self, x: mx.array, kv: LayerKV, last_only: bool = False) -> mx.array:
        h = x[:, -1:] if last_only else x
        h = h + self.self_attn(self.input_layernorm(x), kv, last_only)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)]
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class Model(nn.Module):
    """tokens [B, L] + one LayerKV per layer -> logits [B, L, vocab]."""

    native = True

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model_type = cfg.model_type
        self.model = Backbone(cfg)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def __call__(self, tokens: mx.array, cache: list[LayerKV], last_only: bool = False) -> mx.array:
        h = self.model.embed_tokens(tokens)
        last = len(self.model.layers) - 1
        for i, (layer, kv) in enumerate(zip(self.model.layers, cache)):
            # Prefill needs the next-token logits only: past the last layer's K/V, compute
            # just the last position (the rest of that layer and the vocab projection).
            h = layer(h, kv, last_only and i == last)
        h = self.model.norm(h)
        if "lm_head" in self:
            return self.lm_head(h)
        return embedding_as_linear(self.model.embed_tokens, h)

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    def make_cache(self) -> list[DenseKV]:
        cfg = self.config
        return [
            DenseKV(window=cfg.sliding_window if t == "sliding_attention" else None)
            for t in cfg.layer_types
        ]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        # Precomputed rotary tables are derived state; tied models may still ship lm_head.
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights
