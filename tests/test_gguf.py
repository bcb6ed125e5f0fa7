"""GGUF checkpoints: config, tokenizer and weights read from the file, converted to MLX.

GGUF files are written here from the tiny models the way llama.cpp's converter writes
them (byte-level BPE vocabulary, chat template, Q/K permutation for llama, rope_freqs for
llama3 scaling). k-quant blocks are random but valid: the gguf package cannot quantize to
k-quants, and what matters is that we read whatever blocks a file holds.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from conftest import FAMILY_CONFIGS, TEMPLATES, build_tiny
from gguf_kquant import random_kquant
from gguf_util import gguf_name, write_gguf
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlxlocal.engine import SamplingParams, open_engine
from mlxlocal.errors import ModelLoadError
from mlxlocal.source import hub
from mlxlocal.source.loader import load, load_from_dir
from mlxlocal.weights.gguf import load_gguf, pack_bits

gguf = pytest.importorskip("gguf")

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
PROMPT = [(i * 37 + 11) % 300 for i in range(20)]
# k-quants need K % 256 == 0.
K256 = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64)
KQ_SCALE = {"Q4_K": 2e-4, "Q5_K": 1e-4, "Q6_K": 5e-5, "Q3_K": 2e-4, "Q2_K": 3e-4}


@pytest.fixture(scope="module")
def ggufs(tiny_models, tmp_path_factory):
    """(family, type) -> GGUF path, written on first use."""
    root = tmp_path_factory.mktemp("gguf")
    made: dict[tuple[str, str], Path] = {}

    def get(family: str, qtype: str) -> Path:
        if (family, qtype) not in made:
            made[family, qtype] = write_gguf(tiny_models[family], root / f"{family}-{qtype}.gguf", qtype)
        return made[family, qtype]

    return get


@pytest.fixture(scope="module")
def refs(tiny_models):
    return {f: mlx_lm.load(str(p))[0] for f, p in tiny_models.items()}


def logits(model, tokens: list[int], cache) -> mx.array:
    return model(mx.array(tokens)[None], cache)


def ref_logits(ref, tokens: list[int]) -> mx.array:
    return ref(mx.array(tokens)[None], cache=make_prompt_cache(ref))


def greedy(logits: mx.array) -> mx.array:
    return mx.argmax(logits, axis=-1)


def mlx_lm_tokens(model, prompt: list[int], n: int) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, sampler=greedy)]


def our_tokens(loaded, prompt: list[int], n: int) -> list[int]:
    chunks = open_engine(loaded).generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    return [c.token for c in chunks if c.token is not None]


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """transformers' reverse of llama.cpp's permute (independent of ours)."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def dequantized_weights(path: Path, config: dict) -> dict[str, np.ndarray]:
    """What ggml computes with: every tensor dequantized by the gguf package, under HF names."""
    reader = gguf.GGUFReader(str(path))
    inverse = {}
    out = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        shape = tuple(int(d) for d in reversed(t.shape))
        value = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape).astype(np.float32)
        inverse[t.name] = value
    for hf in _hf_names(config):
        value = inverse.pop(gguf_name(hf))
        if config["model_type"] in ("llama", "mistral") and hf.endswith("q_proj.weight"):
            value = unpermute(value, config["num_attention_heads"])
        elif config["model_type"] in ("llama", "mistral") and hf.endswith("k_proj.weight"):
            value = unpermute(value, config["num_key_value_heads"])
        out[hf] = value
    assert not inverse, inverse.keys()
    return out


def _hf_names(config: dict) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.get("tie_word_embeddings"):
        names.append("lm_head.weight")
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        names += [p + n + ".weight" for n in (
            "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm",
            "post_attention_layernorm")]
        if config["model_type"] == "qwen3":
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
        if config["model_type"] == "qwen2":
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
    return names


def reference_model(model_dir: Path, gguf_path: Path):
    """mlx-lm's model for the source config, loaded with the GGUF's dequantized weights (float32)."""
    model = mlx_lm.load(str(model_dir))[0]
    config = json.loads((model_dir / "config.json").read_text())
    weights = dequantized_weights(gguf_path, config)
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=False)
    return model


# ---------------------------------------------------------------- float types


@pytest.mark.parametrize("family", FAMILIES)
def test_f32_gguf_logits_match_source(ggufs, refs, family):
    loaded = load(str(ggufs(family, "F32")))
    assert loaded.info.native and loaded.info.model_type in (family, "llama")
    assert loaded.info.weights.load_path == "GGUF F32 → MLX float32"
    got, expected = logits(loaded.model, PROMPT, loaded.make_cache()), ref_logits(refs[family], PROMPT)
    assert mx.allclose(got, expected, atol=1e-4, rtol=1e-4).item(), mx.abs(got - expected).max().item()


@pytest.mark.parametrize("family", FAMILIES)
def test_f16_gguf_logits_close_to_source(ggufs, refs, family):
    loaded = load(str(ggufs(family, "F16")))
    assert loaded.info.weights.load_path == "GGUF F16+F32 → MLX float16"
    got, expected = logits(loaded.model, PROMPT, loaded.make_cache()), ref_logits(refs[family], PROMPT)
    scale = mx.abs(expected).max().item()
    assert mx.abs(got.astype(mx.float32) - expected).max().item() < 5e-3 * scale


def test_config_from_metadata(ggufs):
    cfg = load_gguf(ggufs("llama", "F32")).config
    src = FAMILY_CONFIGS["llama"]
    for key in ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rope_theta"):
        assert cfg[key] == src[key], key
    assert cfg["tie_word_embeddings"] is False
    # llama3 scaling comes back from rope_freqs.weight (parameters equivalent on these dims).
    assert cfg["rope_scaling"]["rope_type"] == "llama3" and cfg["rope_scaling"]["factor"] == 8.0
    q3 = load_gguf(ggufs("qwen3", "F32")).config
    assert q3["model_type"] == "qwen3" and q3["tie_word_embeddings"] is True
    assert set(q3["eos_token_id"]) >= {377, 379}  # <|endoftext|>, <|im_end|>: llama.cpp's EOG set


# ---------------------------------------------------------------- block formats


@pytest.mark.parametrize("family", FAMILIES)
def test_q8_0_logits_close_to_source(ggufs, refs, family):
    loaded = load(str(ggufs(family, "Q8_0")))
    assert "→ MLX affine 8-bit g32" in loaded.info.weights.load_path
    assert loaded.info.quantization.startswith("affine 8-bit, group size 32")
    got, expected = logits(loaded.model, PROMPT, loaded.make_cache()), ref_logits(refs[family], PROMPT)
    scale = mx.abs(expected).max().item()
    assert mx.abs(got.astype(mx.float32) - expected).max().item() < 0.03 * scale
    assert (greedy(got[0, -1]) == greedy(expected[0, -1])).item()


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_block_formats_convert_exactly(ggufs, tiny_models, qtype):
    """MLX dequantizes to the numbers ggml computes with (float32 scales)."""
    path = ggufs("llama", qtype)
    config = json.loads((tiny_models["llama"] / "config.json").read_text())
    ours = load_gguf(path, dtype=mx.float32)
    expected = dequantized_weights(path, config)
    bits = {"Q8_0": 8, "Q5_0": 5, "Q5_1": 5}.get(qtype, 4)
    assert ours.config["quantization"]["bits"] == bits
    _assert_dequantizes_to(ours, expected)


def _assert_dequantizes_to(ours, expected: dict[str, np.ndarray], exact: bool = True) -> None:
    quant = ours.config["quantization"]
    n_quantized = 0
    for name, want in expected.items():
        module = name.rsplit(".", 1)[0]
        if f"{module}.scales" in ours.weights and name.endswith(".weight"):
            q = quant[module]
            got = mx.dequantize(ours.weights[name], ours.weights[f"{module}.scales"],
                                ours.weights[f"{module}.biases"], group_size=q["group_size"], bits=q["bits"])
            n_quantized += 1
        else:
            got = ours.weights[name]
        got = np.array(got.astype(mx.float32))
        if exact:
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-6 * max(1.0, np.abs(want).max()), err_msg=name)
    assert n_quantized > 0


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_4bit_logits_match_dequantized_reference(ggufs, tiny_models, refs, family, qtype):
    path = ggufs(family, qtype)
    loaded = load(str(path))
    ref = reference_model(tiny_models[family], path)
    got, expected = logits(loaded.model, PROMPT, loaded.make_cache()), ref_logits(ref, PROMPT)
    scale = mx.abs(expected).max().item()
    assert mx.abs(got.astype(mx.float32) - expected).max().item() < 0.01 * scale
    # Against the unquantized source: only loosely (4-bit rounding of random weights).
    source = ref_logits(refs[family], PROMPT)
    assert mx.abs(got.astype(mx.float32) - source).max().item() < 0.4 * scale


# ---------------------------------------------------------------- k-quants


@pytest.fixture(scope="module")
def kquant_model(tmp_path_factory):
    """A 256-wide one-layer model (k-quant blocks are 256 wide) and its GGUFs."""
    root = tmp_path_factory.mktemp("kquant")
    made = {}

    def get(family: str, kinds: tuple[str, ...]) -> tuple[Path, Path]:
        if (family, kinds) not in made:
            src = root / family
            if not src.exists():
                build_tiny(src, dict(FAMILY_CONFIGS[family], **K256), template=TEMPLATES[family])
            config = json.loads((src / "config.json").read_text())
            rng = np.random.default_rng(1)
            raw = {}
            for i, hf in enumerate(n for n in _hf_names(config) if not n.endswith(("norm.weight", ".bias"))):
                kind = kinds[i % len(kinds)]
                rows = config["vocab_size"] if "embed" in hf or "lm_head" in hf else None
                out_in = {"q_proj": (256, 256), "k_proj": (128, 256), "v_proj": (128, 256), "o_proj": (256, 256),
                          "gate_proj": (512, 256), "up_proj": (512, 256), "down_proj": (256, 512)}
                shape = (rows, 256) if rows else next(v for k, v in out_in.items() if k in hf)
                raw[gguf_name(hf)] = (random_kquant(kind, *shape, rng, KQ_SCALE[kind]), kind)
            path = root / f"{family}-{'-'.join(kinds)}.gguf"
            made[family, kinds] = (src, write_gguf(src, path, "F32", raw=raw))
        return made[family, kinds]

    return get


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K"])
def test_k_quants_with_32_sub_blocks_convert_exactly(kquant_model, kind):
    src, path = kquant_model("llama", (kind,))
    ours = load_gguf(path, dtype=mx.float32)
    bits = {"Q4_K": 4, "Q5_K": 5}[kind]
    assert set(ours.formats) == {f"affine {bits}-bit g32", "float32"}
    _assert_dequantizes_to(ours, dequantized_weights(path, json.loads((src / "config.json").read_text())))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_k_quant_mix_logits_match_dequantized_reference(kquant_model, family):
    """A Q4_K_M-like mix: Q4_K (exact), Q6_K (8-bit requantized), Q3_K and Q2_K."""
    src, path = kquant_model(family, ("Q4_K", "Q6_K", "Q3_K", "Q2_K"))
    loaded = load(str(path))
    lp = loaded.info.weights.load_path
    assert lp.startswith("GGUF F32+Q2_K+Q3_K+Q4_K+Q6_K → MLX "), lp
    for fmt in ("affine 3-bit g64", "affine 4-bit g32", "affine 8-bit g64"):
        assert fmt in lp
    q = loaded.config["quantization"]
    assert q["model.embed_tokens"] == {"group_size": 32, "bits": 4}  # Q4_K, exact
    assert {"group_size": 64, "bits": 8} in q.values()  # Q6_K
    ref = reference_model(src, path)
    got, expected = logits(loaded.model, PROMPT, loaded.make_cache()), ref_logits(ref, PROMPT)
    scale = mx.abs(expected).max().item()
    # Requantizing Q3_K/Q2_K adds rounding: loose, but far tighter than chance.
    assert mx.abs(got.astype(mx.float32) - expected).max().item() < 0.15 * scale


def test_pack_bits_matches_mlx_layout():
    w = mx.random.normal((8, 128))
    for bits in (2, 3, 4, 5, 6, 8):
        packed, scales, biases = mx.quantize(w, group_size=32, bits=bits)
        deq = mx.dequantize(packed, scales, biases, group_size=32, bits=bits)
        q = np.rint((np.array(deq) - np.repeat(np.array(biases), 32, -1)) / np.repeat(np.array(scales), 32, -1))
        assert np.array_equal(pack_bits(q.astype(np.uint8), bits), np.array(packed)), bits


# ---------------------------------------------------------------- generation, tokenizer, convert


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_source(ggufs, refs, family):
    loaded = load(str(ggufs(family, "F32")))
    assert our_tokens(loaded, PROMPT, 16) == mlx_lm_tokens(refs[family], PROMPT, 16)


@pytest.mark.parametrize("family", FAMILIES)
def test_tokenizer_round_trips_like_source(ggufs, tiny_models, family):
    src = load_from_dir(tiny_models[family]).tokenizer
    tok = load(str(ggufs(family, "Q8_0"))).tokenizer
    texts = ["Hello world, this is a test.\n  def f(x): return x**2 ", "émoji 🤖 ñ 数字 123456",
             "<|im_start|>user\nhi<|im_end|>", ""]
    for text in texts:
        ids = src.encode(text)
        assert tok.encode(text) == ids, text
        assert tok.decode(ids) == src.decode(ids)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert (tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            == src.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    assert set(src.eos_token_ids) <= set(tok.eos_token_ids)
    # Streaming detokenizer: the same one mlx-lm picks for the source.
    assert type(tok._detokenizer) is type(src._detokenizer)


@pytest.mark.parametrize("family,qtype", [("llama", "Q4_0"), ("qwen2", "Q8_0"), ("qwen3", "F16")])
def test_convert_output_loads_in_mlx_lm(ggufs, tmp_path, family, qtype):
    import typer
    from typer.testing import CliRunner

    from mlxlocal.cli import convert as cli_convert

    app = typer.Typer()
    cli_convert.register(app)
    app.command("noop")(lambda: None)  # a multi-command app, as in mlxlocal.cli
    out = tmp_path / "mlx"
    src = ggufs(family, qtype)
    result = CliRunner().invoke(app, ["convert", "--model", str(src), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["mlx_bytes"] > 0 and qtype in summary["gguf_types"]
    config = json.loads((out / "config.json").read_text())
    assert ("quantization" in config) == (qtype != "F16")

    ref_model, ref_tok = mlx_lm.load(str(out))
    ours = load(str(src))
    assert mlx_lm_tokens(ref_model, PROMPT, 12) == our_tokens(ours, PROMPT, 12)
    messages = [{"role": "user", "content": "hi"}]
    assert (ref_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == ours.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
    reloaded = load(str(out))
    assert our_tokens(reloaded, PROMPT, 12) == our_tokens(ours, PROMPT, 12)


def test_resolve_accepts_gguf_file_and_dir(ggufs, tmp_path):
    src = ggufs("qwen3", "Q8_0")
    assert hub.resolve(str(src)).path == src.resolve()
    d = tmp_path / "one"
    d.mkdir()
    (d / "model-q8.gguf").write_bytes(src.read_bytes())
    assert hub.resolve(str(d)).path == (d / "model-q8.gguf").resolve()
    assert load(str(d)).info.name == "model-q8"
    (d / "other.gguf").write_bytes(b"GGUF")
    with pytest.raises(ModelLoadError, match="2 .gguf files"):
        hub.resolve(str(d))


# ---------------------------------------------------------------- errors


def test_unsupported_architecture_is_named(tiny_models, tmp_path):
    path = write_gguf(tiny_models["qwen3"], tmp_path / "phi.gguf", "F32", arch="phi3")
    with pytest.raises(ModelLoadError, match="architecture 'phi3' is not supported"):
        load(str(path))


def test_unsupported_tensor_type_is_named(tiny_models, tmp_path):
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, size=(128 * 64 // 32, 18), dtype=np.uint8)
    blocks[:, :2] = np.full(blocks.shape[0], 1e-3, np.float16).view(np.uint8).reshape(-1, 2)
    raw = {"blk.0.ffn_gate.weight": (blocks.reshape(128, -1), "IQ4_NL")}
    path = write_gguf(tiny_models["qwen3"], tmp_path / "iq.gguf", "F32", raw=raw)
    with pytest.raises(ModelLoadError, match=r"blk\.0\.ffn_gate\.weight.*IQ4_NL"):
        load(str(path))


def test_not_a_gguf_file(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 10)
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        load(str(bad))
