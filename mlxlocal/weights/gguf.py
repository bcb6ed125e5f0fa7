"""GGUF (llama.cpp) checkpoints of the llama family -> HF-style config, MLX weights, tokenizer.

Supported architectures: llama (also what llama.cpp writes for Mistral), mistral, qwen2, qwen3.

Tensor types and what they become (MLX affine quantization, `w = scale * q + bias`):

| GGUF  | MLX                | how                                                        |
|-------|--------------------|------------------------------------------------------------|
| F32, F16, BF16 | float arrays | as stored                                           |
| Q8_0  | 8-bit, group 32    | exact: q+128, scale d, bias -128 d                         |
| Q4_0  | 4-bit, group 32    | exact: scale d, bias -8 d                                  |
| Q4_1  | 4-bit, group 32    | exact: scale d, bias m                                     |
| Q5_0  | 5-bit, group 32    | exact: scale d, bias -16 d                                 |
| Q5_1  | 5-bit, group 32    | exact: scale d, bias m                                     |
| Q4_K  | 4-bit, group 32    | exact: per 32-sub-block scale d*sc, bias -dmin*m           |
| Q5_K  | 5-bit, group 32    | exact: as Q4_K                                             |
| Q6_K  | 8-bit, group 64    | dequantized, requantized (16-element sub-blocks do not fit) |
| Q3_K  | 4-bit, group 32    | dequantized, requantized                                   |
| Q2_K  | 3-bit, group 64    | dequantized, requantized                                   |

"Exact" means the MLX layer dequantizes to the same numbers as ggml when scales are
kept in float32; with float16 scales (the default for F16 GGUFs) `d*sc` / `dmin*m` of the
k-quants round to float16. Anything else (IQ*, TQ*, MXFP4 ...) is a ModelLoadError.

llama.cpp permutes the rows of Q and K for llama/mistral (its rope pairs adjacent
elements; HF's pairs halves); we undo that here. Rows are independent in every block
format, so the permutation is applied to packed weights, scales and biases alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from mlxlocal.errors import ModelLoadError

ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3"}
PERMUTED_QK = {"llama", "mistral"}

FLOAT_TYPES = {"F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16}
# Block formats we convert exactly: name -> MLX bits (all group 32).
EXACT = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5}
# k-quants with 16-element sub-blocks: dequantized and requantized to (bits, group size).
# Chosen so requantizing adds at most about half the format's own rounding error
# (measured on dequantized blocks): Q6_K 6.56 bpw -> 8.5, Q3_K 3.44 -> 5.0, Q2_K 2.63 -> 3.5.
REQUANT = {"Q6_K": (8, 64), "Q3_K": (4, 32), "Q2_K": (3, 64)}

_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Tensors llama.cpp writes that carry no weights of ours (rope_freqs is read into the config).
_SKIP = {"rope_freqs.weight"}


@dataclass
class GGUFCheckpoint:
    path: Path
    arch: str
    config: dict[str, Any]
    weights: dict[str, mx.array]
    tensor_types: dict[str, int] = field(default_factory=dict)  # GGUF type name -> tensor count
    formats: dict[str, int] = field(default_factory=dict)  # MLX format -> tensor count
    file_bytes: int = 0

    @property
    def load_path(self) -> str:
        src = "+".join(sorted(self.tensor_types))
        dst = ", ".join(f"{k}" for k in sorted(self.formats))
        return f"GGUF {src} → MLX {dst}"

    @property
    def weight_bytes(self) -> int:
        return sum(v.nbytes for v in self.weights.values())


def _reader(path: Path):
    try:
        import gguf
    except ImportError:  # pragma: no cover
        raise ModelLoadError("reading GGUF files needs the 'gguf' package: pip install gguf") from None
    try:
        return gguf.GGUFReader(str(path))
    except (ValueError, OSError, KeyError, IndexError) as e:
        raise ModelLoadError(f"{path}: not a readable GGUF file ({e})") from None


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


# ---------------------------------------------------------------- config


def _llama3_rope(factors: np.ndarray, theta: float, head_dim: int, context: int, path: Path) -> dict | None:
    """llama.cpp stores llama3 rope scaling as per-frequency factors; recover the parameters."""
    factors = factors.astype(np.float64)
    if np.allclose(factors, 1.0):
        return None
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * math.pi / freqs
    factor = float(factors.max())
    # Several parameter sets can give the same factors; prefer an original context below
    # the model's (transformers warns otherwise).
    olds = (8192, 4096, 2048, 16384, 32768, 65536, 131072, 1024, 512, 256, 128)
    for old in sorted(olds, key=lambda o: o >= context):
        for low in (1.0, 2.0, 0.5, 4.0):
            for high in (4.0, 8.0, 2.0, 1.0, 16.0, 32.0):
                if high <= low:
                    continue
                smooth = (old / wavelen - low) / (high - low)
                expect = np.where(
                    wavelen < old / high, 1.0,
                    np.where(wavelen > old / low, factor, 1 / ((1 - smooth) / factor + smooth)),
                )
                if np.allclose(expect, factors, rtol=1e-4, atol=1e-5):
                    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                            "high_freq_factor": high, "original_max_position_embeddings": old}
    raise ModelLoadError(f"{path}: rope_freqs.weight does not match llama3 rope scaling; "
                         "custom rope frequency factors are not supported")


def build_config(reader, path: Path) -> tuple[str, dict[str, Any]]:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(sorted(ARCHITECTURES))})"
        )

    def get(key: str, default: Any = None) -> Any:
        return _field(reader, f"{arch}.{key}", default)

    def need(key: str) -> Any:
        value = get(key)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata has no '{arch}.{key}'")
        return value

    hidden = int(need("embedding_length"))
    n_heads = int(need("attention.head_count"))
    n_kv = get("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):  # per-layer list in some files; the family uses one value
        if len(set(n_kv)) != 1:
            raise ModelLoadError(f"{path}: per-layer KV head counts {n_kv} are not supported")
        n_kv = n_kv[0]
    tensors = {t.name: t for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = len(tokens) if tokens else int(tensors["token_embd.weight"].shape[-1])
    head_dim = int(get("attention.key_length", hidden // n_heads))
    theta = float(get("rope.freq_base", 10000.0))
    model_type = ARCHITECTURES[arch]
    if arch == "llama" and "mistral" in str(_field(reader, "general.name", "")).lower():
        model_type = "mistral"

    scaling = None
    stype = get("rope.scaling.type")
    if stype in ("linear", "yarn"):
        scaling = {"rope_type": stype, "factor": float(need("rope.scaling.factor"))}
        orig = get("rope.scaling.original_context_length")
        if orig:
            scaling["original_max_position_embeddings"] = int(orig)
        if stype == "yarn":
            for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
                if get(f"rope.scaling.{key}") is not None:
                    scaling[name] = float(get(f"rope.scaling.{key}"))
    elif stype not in (None, "none"):
        raise ModelLoadError(f"{path}: rope scaling type {stype!r} is not supported")
    if "rope_freqs.weight" in tensors:
        if scaling is not None:
            raise ModelLoadError(f"{path}: both rope_freqs and rope scaling '{stype}' are set")
        factors = _tensor_float(tensors["rope_freqs.weight"], path).reshape(-1)
        scaling = _llama3_rope(factors, theta, head_dim, int(get("context_length", 4096)), path)
    rot = get("rope.dimension_count")
    if rot is not None and int(rot) != head_dim:
        raise ModelLoadError(f"{path}: partial rotary ({rot} of {head_dim} dims) is not supported")

    config: dict[str, Any] = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": int(need("block_count")),
        "intermediate_size": int(need("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(n_kv),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": theta,
        "max_position_embeddings": int(get("context_length", 4096)),
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
    }
    if scaling:
        config["rope_scaling"] = scaling
    if model_type == "qwen2":
        config["attention_bias"] = True
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    if bos is not None:
        config["bos_token_id"] = int(bos)
    eos = end_of_generation_ids(reader)
    if eos:
        config["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return arch, config


# Control tokens llama.cpp treats as end of generation even when the file does not name
# them (llama-vocab.cpp's EOG heuristic).
_EOG_TEXTS = {"<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
              "<|eom_id|>", "<EOT>", "<|end_of_text|>", "</s>"}


def end_of_generation_ids(reader) -> list[int]:
    ids = []
    for key in ("eos", "eot", "eom"):
        value = _field(reader, f"tokenizer.ggml.{key}_token_id")
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    types = _field(reader, "tokenizer.ggml.token_type") or []
    for idx, (text, kind) in enumerate(zip(tokens, types)):
        if kind == 3 and text in _EOG_TEXTS and idx not in ids:
            ids.append(idx)
    return ids


# ---------------------------------------------------------------- tensors


def _type_name(tensor) -> str:
    return tensor.tensor_type.name


def _tensor_float(tensor, path: Path) -> np.ndarray:
    """F32/F16/BF16 tensor -> numpy float array in row-major (numpy) shape."""
    import gguf

    name = _type_name(tensor)
    shape = tuple(int(d) for d in reversed(tensor.shape))
    if name == "BF16":
        raw = np.asarray(tensor.data).view(np.uint16).astype(np.uint32) << 16
        return raw.view(np.float32).reshape(shape)
    if name in ("F32", "F16"):
        return np.asarray(tensor.data).reshape(shape)
    if name in EXACT or name in REQUANT:
        return gguf.quants.dequantize(np.asarray(tensor.data), tensor.tensor_type).reshape(shape)
    raise ModelLoadError(f"{path}: tensor '{tensor.name}' has GGUF type {name}, which is not supported "
                         f"(supported: {', '.join(sorted([*FLOAT_TYPES, *EXACT, *REQUANT]))})")


def _block_affine(name: str, blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-32-element (scale, bias) such that value = scale * q_unsigned + bias."""
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    if name == "Q8_0":
        return d, -128.0 * d
    if name == "Q4_0":
        return d, -8.0 * d
    if name == "Q5_0":
        return d, -16.0 * d
    if name in ("Q4_1", "Q5_1"):
        return d, blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    # Q4_K / Q5_K: d, dmin, 12 bytes of 6-bit scales and mins for 8 sub-blocks of 32.
    from gguf.quants import Q4_K

    dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16].copy())
    return d * sc.astype(np.float32), -(dmin * m.astype(np.float32))


def pack_bits(q: np.ndarray, bits: int) -> np.ndarray:
    """Unsigned ints (rows, K) -> MLX's packed uint32 (rows, K*bits/32): a little-endian
    bit stream, element i at bit offset i*bits."""
    rows, k = q.shape
    shifts = np.arange(bits, dtype=np.uint8)
    bitplanes = ((q[..., None].astype(np.uint8) >> shifts) & 1).astype(np.uint8)  # (rows, K, bits)
    packed = np.packbits(bitplanes.reshape(rows, k * bits), axis=-1, bitorder="little")
    return packed.view(np.uint32).reshape(rows, k * bits // 32)


def _quantized(tensor, path: Path, dtype: mx.Dtype) -> tuple[dict[str, mx.array], int, int]:
    """A block-quantized 2D tensor -> {weight, scales, biases} (MLX affine), bits, group."""
    import gguf

    name = _type_name(tensor)
    k = int(tensor.shape[0])
    rows = int(np.prod([int(d) for d in tensor.shape[1:]]))
    data = np.asarray(tensor.data).reshape(rows, -1)
    if name in EXACT:
        bits = EXACT[name]
        block_elems, block_bytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        blocks = data.reshape(-1, block_bytes)
        values = gguf.quants.dequantize(blocks, tensor.tensor_type).reshape(-1, 32)
        scale, bias = _block_affine(name, blocks)
        scale, bias = scale.reshape(-1, 1), bias.reshape(-1, 1)
        safe = np.where(scale == 0, 1.0, scale)
        q = np.rint((values - bias) / safe)
        q = np.where(scale == 0, 0, q).clip(0, 2**bits - 1).astype(np.uint8)
        packed = pack_bits(q.reshape(rows, k), bits)
        return {
            "weight": mx.array(packed),
            "scales": mx.array(scale.reshape(rows, k // 32)).astype(dtype),
            "biases": mx.array(bias.reshape(rows, k // 32)).astype(dtype),
        }, bits, 32
    if name in REQUANT:
        bits, group = REQUANT[name]
        values = gguf.quants.dequantize(data, tensor.tensor_type).reshape(rows, k)
        w, s, b = mx.quantize(mx.array(values).astype(dtype), group_size=group, bits=bits)
        return {"weight": w, "scales": s, "biases": b}, bits, group
    _tensor_float(tensor, path)  # raises the unsupported-type error
    raise AssertionError(name)


def _our_name(gguf_name: str) -> str | None:
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    return None


def _unpermute(w: mx.array, n_head: int) -> mx.array:
    """Undo llama.cpp's `permute` on the output rows of Q or K (weight, scales or biases)."""
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _compute_dtype(reader) -> mx.Dtype:
    """Float dtype for the model: what the 2D float weights are stored in (float16 when none are)."""
    kinds = {_type_name(t) for t in reader.tensors if len(t.shape) >= 2 and _type_name(t) in FLOAT_TYPES}
    if "F32" in kinds:
        return mx.float32
    if "BF16" in kinds:
        return mx.bfloat16
    return mx.float16


def load_gguf(path: str | Path, dtype: mx.Dtype | None = None) -> GGUFCheckpoint:
    """Read a GGUF file: config (HF-style dict, with `quantization` when any tensor is
    quantized) and weights under mlxlocal / mlx-lm names."""
    path = Path(path)
    reader = _reader(path)
    arch, config = build_config(reader, path)
    dtype = dtype or _compute_dtype(reader)
    n_heads, n_kv = config["num_attention_heads"], config["num_key_value_heads"]
    weights: dict[str, mx.array] = {}
    per_layer: dict[str, dict[str, int]] = {}
    types: dict[str, int] = {}
    formats: dict[str, int] = {}
    for tensor in reader.tensors:
        if tensor.name in _SKIP:
            continue
        ours = _our_name(tensor.name)
        if ours is None:
            raise ModelLoadError(f"{path}: unexpected tensor '{tensor.name}' for architecture {arch}")
        tname = _type_name(tensor)
        types[tname] = types.get(tname, 0) + 1
        module = ours.rsplit(".", 1)[0]
        if tname in FLOAT_TYPES or len(tensor.shape) < 2:
            arrays = {"weight": mx.array(_tensor_float(tensor, path)).astype(dtype)}
            fmt = str(dtype).removeprefix("mlx.core.")
            if not ours.endswith(".weight"):
                arrays = {ours.rsplit(".", 1)[1]: arrays["weight"]}
        else:
            if not ours.endswith(".weight"):
                raise ModelLoadError(f"{path}: quantized bias '{tensor.name}' is not supported")
            arrays, bits, group = _quantized(tensor, path, dtype)
            per_layer[module] = {"group_size": group, "bits": bits}
            fmt = f"affine {bits}-bit g{group}"
        formats[fmt] = formats.get(fmt, 0) + 1
        if arch in PERMUTED_QK and module.endswith(("self_attn.q_proj", "self_attn.k_proj")):
            heads = n_heads if module.endswith("q_proj") else n_kv
            arrays = {k: _unpermute(v, heads) for k, v in arrays.items()}
        for suffix, value in arrays.items():
            weights[f"{module}.{suffix}"] = value
    if per_layer:
        counts: dict[tuple[int, int], int] = {}
        for q in per_layer.values():
            key = (q["group_size"], q["bits"])
            counts[key] = counts.get(key, 0) + 1
        group, bits = max(counts, key=lambda key: counts[key])
        config["quantization"] = {"group_size": group, "bits": bits, "mode": "affine", **per_layer}
        config["quantization_config"] = config["quantization"]
    config["torch_dtype"] = str(dtype).removeprefix("mlx.core.")
    return GGUFCheckpoint(path, arch, config, weights, types, formats, path.stat().st_size)


# ---------------------------------------------------------------- tokenizer


def build_hf_tokenizer(path: str | Path):
    """The embedded vocabulary as a transformers fast tokenizer (transformers' GGUF
    converters), with the chat template and special tokens the file names."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf import convert_gguf_tokenizer

    path = Path(path)
    reader = _reader(path)
    arch = _field(reader, "general.architecture")
    meta = {key: f.contents() for key, f in reader.fields.items() if key.startswith("tokenizer.")}
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"{path}: GGUF file has no embedded tokenizer (tokenizer.ggml.tokens)")
    keys = {"model": "tokenizer_type", "pre": "pre_tokenizer_type", "tokens": "tokens",
            "scores": "scores", "token_type": "token_type", "merges": "merges"}
    tokenizer_dict = {name: meta[f"tokenizer.ggml.{k}"] for k, name in keys.items()
                      if f"tokenizer.ggml.{k}" in meta}
    try:
        backend, _ = convert_gguf_tokenizer(arch, tokenizer_dict)
    except (ValueError, KeyError, TypeError) as e:
        raise ModelLoadError(f"{path}: cannot build the tokenizer from the GGUF vocabulary ({e})") from None

    def token(key: str) -> str | None:
        idx = meta.get(f"tokenizer.ggml.{key}")
        return tokens[int(idx)] if idx is not None and 0 <= int(idx) < len(tokens) else None

    bos, eos = token("bos_token_id"), token("eos_token_id")
    tok_type = tokenizer_dict.get("tokenizer_type")
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    if add_bos is None:
        add_bos = tok_type == "llama"
    _set_bos(backend, bos if add_bos else None)
    kwargs = dict(tokenizer_object=backend, bos_token=bos, eos_token=eos,
                  unk_token=token("unknown_token_id"), pad_token=token("padding_token_id"),
                  clean_up_tokenization_spaces=False, model_max_length=131072)
    template = meta.get("tokenizer.chat_template")
    if template:
        kwargs["chat_template"] = template
    return PreTrainedTokenizerFast(**{k: v for k, v in kwargs.items() if v is not None})


def _set_bos(backend, bos: str | None) -> None:
    """Prepend BOS when encoding iff the file says so (tokenizer.ggml.add_bos_token)."""
    from tokenizers import processors

    steps: list = [processors.ByteLevel(trim_offsets=False)] if _is_byte_level(backend) else []
    if bos is not None:
        steps.append(processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
            special_tokens=[(bos, backend.token_to_id(bos))]))
    backend.post_processor = processors.Sequence(steps) if steps else None


def _is_byte_level(backend) -> bool:
    import json

    return '"ByteLevel"' in json.dumps(json.loads(backend.to_str()).get("decoder"))


def write_tokenizer(path: str | Path, out_dir: str | Path) -> None:
    """tokenizer.json, tokenizer_config.json (with the chat template) into out_dir."""
    tok = build_hf_tokenizer(path)
    tok.save_pretrained(str(out_dir))


def load_tokenizer(path: str | Path, eos_token_ids: Any = None):
    """mlx-lm TokenizerWrapper for the GGUF's vocabulary, built the way mlx-lm loads one
    from a directory (so the streaming detokenizer is picked from tokenizer.json)."""
    import tempfile

    from mlx_lm.tokenizer_utils import load as mlx_load_tokenizer

    with tempfile.TemporaryDirectory(prefix="mlxlocal-gguf-tok-") as tmp:
        write_tokenizer(path, tmp)
        try:
            return mlx_load_tokenizer(Path(tmp), eos_token_ids=eos_token_ids)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"{path}: cannot load the tokenizer ({e})") from None


# ---------------------------------------------------------------- convert


def convert(src: str | Path, out_dir: str | Path) -> dict[str, Any]:
    """Write an MLX checkpoint (config.json with quantization, model.safetensors,
    tokenizer files with the chat template) that mlx-lm and mlxlocal load."""
    import json

    src, out = Path(src), Path(out_dir)
    ckpt = load_gguf(src)
    tokenizer = build_hf_tokenizer(src)  # before writing anything: fail early
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("model*.safetensors"):
        old.unlink()
    mx.save_safetensors(str(out / "model.safetensors"), ckpt.weights, metadata={"format": "mlx"})
    config = dict(ckpt.config)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save_pretrained(str(out))
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    return {
        "source": str(src),
        "out": str(out),
        "model_type": config["model_type"],
        "gguf_types": dict(sorted(ckpt.tensor_types.items())),
        "mlx_formats": dict(sorted(ckpt.formats.items())),
        "load_path": ckpt.load_path,
        "gguf_bytes": ckpt.file_bytes,
        "mlx_bytes": (out / "model.safetensors").stat().st_size,
    }
