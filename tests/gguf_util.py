"""Write GGUF files from tiny HF-layout models the way llama.cpp's convert_hf_to_gguf.py does."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def permute(w: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(name: str) -> str:
    module, _, suffix = name.rpartition(".")
    if module in GLOBAL:
        return f"{GLOBAL[module]}.{suffix}"
    _, _, idx, rest = module.split(".", 3)
    return f"blk.{idx}.{LAYER[rest]}.{suffix}"


def llama3_rope_factors(config: dict) -> np.ndarray | None:
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type") != "llama3":
        return None
    base = config.get("rope_theta", 10000.0)
    dim = config["head_dim"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_gguf(model_dir: Path, out: Path, qtype: str = "F32", *, arch: str | None = None,
               name: str = "tiny", type_overrides: dict[str, str] | None = None,
               raw: dict[str, tuple[np.ndarray, str]] | None = None) -> Path:
    """Convert the HF dir to GGUF; 2D weights stored as `qtype` (1D ones F32, as llama.cpp).

    `raw` gives ready-made block data (uint8 rows, GGUF type name) for some GGUF tensor
    names: stored as is (used for k-quants, which the gguf package cannot quantize)."""
    import gguf
    import mlx.core as mx

    config = json.loads((model_dir / "config.json").read_text())
    arch = arch or {"mistral": "llama"}.get(config["model_type"], config["model_type"])
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(name)
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_rope_dimension_count(config["head_dim"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    theta = config.get("rope_theta") or config.get("rope_parameters", {}).get("rope_theta", 10000.0)
    w.add_rope_freq_base(float(theta))
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_key_length(config["head_dim"])
    w.add_value_length(config["head_dim"])

    # Tokenizer: llama.cpp's _set_vocab_gpt2 (byte-level BPE).
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    added = {t["id"]: t for t in tok["added_tokens"]}
    size = max([*vocab.values(), *added]) + 1
    tokens, types = [""] * size, [1] * size
    for text, idx in vocab.items():
        tokens[idx] = text
    for idx, t in added.items():
        tokens[idx] = t["content"]
        types[idx] = 3 if t["special"] else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    # llama.cpp names the pre-tokenizer by what the source tokenizer does; transformers 5
    # loads model_type qwen2 tokenizers with Qwen2's split regex whatever tokenizer.json says.
    w.add_tokenizer_pre("qwen2" if config["model_type"] == "qwen2" else "gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if tok_cfg.get("bos_token"):
        w.add_bos_token_id(tokens.index(tok_cfg["bos_token"]))
        w.add_add_bos_token(True)
    else:
        w.add_add_bos_token(False)
    w.add_eos_token_id(tokens.index(tok_cfg["eos_token"]))
    w.add_chat_template(tok_cfg["chat_template"])

    weights = {k: np.array(v.astype(mx.float32)) for k, v in mx.load(str(model_dir / "model.safetensors")).items()}
    factors = llama3_rope_factors(config)
    if factors is not None:
        w.add_tensor("rope_freqs.weight", factors)
    overrides = type_overrides or {}
    for key in sorted(weights):
        value = weights[key]
        if arch == "llama" and key.endswith("q_proj.weight"):
            value = permute(value, config["num_attention_heads"], config["num_attention_heads"])
        elif arch == "llama" and key.endswith("k_proj.weight"):
            value = permute(value, config["num_attention_heads"], config["num_key_value_heads"])
        name_ = gguf_name(key)
        if name_ in (raw or {}):
            data, kind = raw[name_]
            w.add_tensor(name_, data, raw_dtype=gguf.GGMLQuantizationType[kind])
            continue
        kind = overrides.get(name_, qtype) if value.ndim == 2 else "F32"
        if kind == "F32":
            w.add_tensor(name_, value.astype(np.float32))
        elif kind == "F16":
            w.add_tensor(name_, value.astype(np.float16))
        else:
            t = gguf.GGMLQuantizationType[kind]
            w.add_tensor(name_, gguf.quants.quantize(value, t), raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
