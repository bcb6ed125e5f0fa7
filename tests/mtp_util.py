"""Tiny checkpoints with MTP modules, written in their families' exact tensor names.

mlx-lm builds the model (random weights, mlx-lm's layout); the tensors are then written
back in the checkpoint's own layout (HF names: experts one by one, DeepSeek's kv_b_proj whole,
Qwen's zero-centred norms and conv weights as HF keeps them), with the MTP module's tensors
where the released checkpoints keep them.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlxlocal.source.synthetic.trained import checkpoint_layout

VOCAB = 384

DEEPSEEK = dict(
    model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], vocab_size=VOCAB,
    hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=4,
    routed_scaling_factor=1.0, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
    v_head_dim=16, qk_nope_head_dim=16, topk_method="noaux_tc", scoring_func="sigmoid",
    norm_topk_prob=True, n_group=1, topk_group=1, num_experts_per_tok=2, moe_layer_freq=1,
    first_k_dense_replace=1, max_position_embeddings=1024, rms_norm_eps=1e-6, rope_theta=10000.0,
    tie_word_embeddings=False, num_nextn_predict_layers=1, torch_dtype="float32",
)

QWEN35 = dict(
    model_type="qwen3_5", architectures=["Qwen3_5ForCausalLM"], vocab_size=VOCAB, hidden_size=64,
    intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, full_attention_interval=2,
    max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 100000.0, "partial_rotary_factor": 0.5},
    mtp_num_hidden_layers=1, torch_dtype="float32",
)


def _mlx_lm(config: dict):
    from mlx_lm.utils import _get_classes

    model_cls, args_cls = _get_classes(config)
    return model_cls(args_cls.from_dict(config))


def _spread(params: dict, scale: float = 0.3) -> dict:
    """Default inits make a tiny model repeat itself; noise makes greedy tokens vary."""
    return {k: v + scale * mx.random.normal(v.shape, dtype=v.dtype) for k, v in params.items()}


def write_deepseek(path: Path, seed: int = 0, mtp: bool = True) -> Path:
    """A DeepSeek-V3-layout directory: the MTP module as `model.layers.{N}` (N = layers) with
    enorm, hnorm, eh_proj, shared_head.{norm,head}, embed_tokens and a MoE decoder layer;
    `mtp=False`: a conversion that dropped it (the config still declares it)."""
    from mlx_lm.models.deepseek_v3 import DeepseekV3DecoderLayer

    from mlxlocal.source.synthetic.tokenizer import write_tokenizer

    cfg = dict(DEEPSEEK)
    path.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    model = _mlx_lm(cfg)
    main = _spread(dict(tree_flatten(model.parameters())))
    weights = checkpoint_layout(main, cfg)
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    if mtp:
        pre = f"model.layers.{n}."
        layer = _spread(dict(tree_flatten(DeepseekV3DecoderLayer(model.args, n).parameters())))
        weights.update({pre + k: v for k, v in checkpoint_layout(layer, cfg).items()})
        for name in ("enorm", "hnorm", "shared_head.norm"):
            weights[f"{pre}{name}.weight"] = 1 + 0.1 * mx.random.normal((h,))
        weights[pre + "eh_proj.weight"] = 0.1 * mx.random.normal((h, 2 * h))
        weights[pre + "shared_head.head.weight"] = main["lm_head.weight"]
        weights[pre + "embed_tokens.weight"] = main["model.embed_tokens.weight"]
    ids = write_tokenizer(path, cfg["vocab_size"], "chatml", 1024)
    cfg["eos_token_id"] = ids["eos_token_id"]
    (path / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    return path


def write_qwen35(path: Path, seed: int = 0, mtp: bool = True) -> Path:
    """A Qwen3.5-layout directory (HF names: `model.language_model.*`, zero-centred norms,
    conv weights [C, 1, K]) with `mtp.{fc,pre_fc_norm_embedding,pre_fc_norm_hidden,norm}` and
    `mtp.layers.0.*` (a full-attention layer)."""
    from mlx_lm.models.qwen3_5 import DecoderLayer

    from mlxlocal.source.synthetic.tokenizer import write_tokenizer

    cfg = dict(QWEN35)
    path.mkdir(parents=True, exist_ok=True)
    mx.random.seed(seed)
    model = _mlx_lm(cfg)
    main = _spread(dict(tree_flatten(model.parameters())))
    norm_sfx = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                ".q_norm.weight", ".k_norm.weight")

    def hf(k: str, v: mx.array) -> tuple[str, mx.array]:
        if "conv1d.weight" in k:
            v = v.moveaxis(1, 2)  # mlx-lm [C, K, 1] -> HF [C, 1, K]
        elif k.endswith(norm_sfx) and v.ndim == 1:
            v = v - 1.0  # HF keeps them zero-centred
        return k.replace("language_model.model.", "model.language_model."), v

    weights = dict(hf(k, v) for k, v in main.items())
    if mtp:
        layer = DecoderLayer(model.language_model.args, cfg["full_attention_interval"] - 1)
        for k, v in _spread(dict(tree_flatten(layer.parameters()))).items():
            weights[f"mtp.layers.0.{k}"] = v - 1.0 if k.endswith(norm_sfx) and v.ndim == 1 else v
        h = cfg["hidden_size"]
        weights["mtp.fc.weight"] = 0.1 * mx.random.normal((h, 2 * h))
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            weights[f"mtp.{name}.weight"] = 0.1 * mx.random.normal((h,))
    ids = write_tokenizer(path, cfg["vocab_size"], "chatml", 1024)
    cfg["eos_token_id"] = ids["eos_token_id"]
    (path / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    return path


def mlx_lm_reference(path: Path):
    """mlx-lm's own model on the checkpoint's model tensors, the MTP ones left out (mlx-lm's
    DeepSeek sanitize drops only the layer index 61 of the released checkpoints, and refuses
    a tiny checkpoint's `model.layers.2`)."""
    config = json.loads((path / "config.json").read_text())
    n = config["num_hidden_layers"]
    weights = {k: v for k, v in mx.load(str(path / "model.safetensors")).items()
               if not k.startswith((f"model.layers.{n}.", "mtp."))}
    model = _mlx_lm(config)
    model.load_weights(list(model.sanitize(weights).items()), strict=True)
    model.eval()
    return model


def write_deepseek_quantized(path: Path, bits: int = 4, group_size: int = 32) -> Path:
    """A DeepSeek-V3-layout conversion that kept its MTP module, quantized like the rest:
    mlx-lm's layout (experts stacked, MLA split), `quantization` in config.json, the module's
    projections quantized as `model.layers.{N}.*` with their scales and biases."""
    import mlx.nn as nn
    from mlx_lm.models.deepseek_v3 import DeepseekV3DecoderLayer

    from mlxlocal.models.mtp import MTPModule
    from mlxlocal.source.synthetic.tokenizer import write_tokenizer

    cfg = dict(DEEPSEEK, quantization={"group_size": group_size, "bits": bits})
    path.mkdir(parents=True, exist_ok=True)
    mx.random.seed(3)
    model = _mlx_lm(cfg)
    n, h = cfg["num_hidden_layers"], cfg["hidden_size"]
    mtp = MTPModule(DeepseekV3DecoderLayer(model.args, n), h, 1e-6, False, False, cfg["vocab_size"])
    def quantizable(_, mod) -> bool:
        return isinstance(mod, (nn.Linear, nn.Embedding)) and mod.weight.shape[-1] % group_size == 0

    for m in (model, mtp):
        m.update(tree_unflatten(list(_spread(dict(tree_flatten(m.parameters())), 0.1).items())))
        nn.quantize(m, group_size=group_size, bits=bits, class_predicate=quantizable)
    weights = dict(tree_flatten(model.parameters()))
    pre = f"model.layers.{n}."
    for k, v in tree_flatten(mtp.parameters()):
        if k.startswith("layer."):
            k = k.removeprefix("layer.")
        elif k.startswith("norm."):
            k = "shared_head." + k
        weights[pre + k] = v
    ids = write_tokenizer(path, cfg["vocab_size"], "chatml", 1024)
    cfg["eos_token_id"] = ids["eos_token_id"]
    (path / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    return path


def write_mimo(path: Path) -> Path:
    """A MiMo-layout directory: the model, and an MTP module's tensors as model.mtp_layers.0.*."""
    from mlxlocal.source.synthetic.tokenizer import write_tokenizer

    cfg = dict(model_type="mimo", architectures=["MiMoForCausalLM"], vocab_size=VOCAB, hidden_size=64,
               num_hidden_layers=2, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               rms_norm_eps=1e-6, max_position_embeddings=1024, num_nextn_predict_layers=1,
               tie_word_embeddings=False)
    path.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(_mlx_lm(cfg).parameters()))
    h = cfg["hidden_size"]
    for name, shape in (("input_proj.weight", (h, 2 * h)), ("token_layernorm.weight", (h,)),
                        ("hidden_layernorm.weight", (h,)), ("final_layernorm.weight", (h,))):
        weights[f"model.mtp_layers.0.{name}"] = mx.ones(shape)
    ids = write_tokenizer(path, VOCAB, "chatml", 1024)
    cfg["eos_token_id"] = ids["eos_token_id"]
    (path / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    return path
