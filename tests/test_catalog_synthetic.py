"""models.toml catalog, synthetic presets, and materialised synthetic model directories."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from mlxlocal.errors import ModelNotFoundError
from mlxlocal.source import synthetic
from mlxlocal.source.catalog import CHAT_TEMPLATES, find_alias, find_preset, load_catalog
from mlxlocal.source.synthetic.tokenizer import STYLES, build_tokenizer, write_tokenizer
from mlxlocal.source.synthetic.weights import build_model, write_model_dir

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]},
    },
}]
TOOL_CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_0123456789", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }]},
    {"role": "tool", "tool_call_id": "call_0123456789", "content": "18C and sunny"},
]

# Parameter counts of the original checkpoints (tied embeddings counted once).
REAL_PARAMS = {
    "qwen3-0.6b": 596_049_920,
    "qwen3-1.7b": 1_720_574_976,
    "qwen3-8b": 8_190_735_360,
    "qwen2.5-0.5b": 494_032_768,
    "qwen2.5-7b": 7_615_616_512,
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
    "mistral-7b-v0.3": 7_248_023_552,
    "smollm2-135m": 134_515_008,
}

TINY_CONFIGS = {
    "llama": {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
              "vocab_size": 512, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "max_position_embeddings": 2048, "tie_word_embeddings": False},
    "mistral": {"model_type": "mistral", "hidden_size": 64, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
                "vocab_size": 512, "rms_norm_eps": 1e-5, "rope_theta": 1e6,
                "max_position_embeddings": 2048, "tie_word_embeddings": False},
    "qwen2": {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 128,
              "vocab_size": 512, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
              "max_position_embeddings": 2048, "tie_word_embeddings": True},
    "qwen3": {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "intermediate_size": 128, "vocab_size": 512, "rms_norm_eps": 1e-6,
              "rope_theta": 1e6, "max_position_embeddings": 2048, "tie_word_embeddings": True},
}
TEMPLATE_FOR = {"llama": "llama3", "mistral": "mistral", "qwen2": "chatml", "qwen3": "chatml"}


def _weights(path: Path) -> dict[str, mx.array]:
    out: dict[str, mx.array] = {}
    for f in sorted(path.glob("*.safetensors")):
        out.update(mx.load(str(f)))
    return out


# ---------------------------------------------------------------- catalog


def test_catalog_aliases_are_well_formed():
    cat = load_catalog()
    assert cat.path.name == "models.toml"
    for name in ("qwen3-0.6b", "qwen3-30b-a3b", "qwen2.5-7b", "qwen2.5-coder-7b",
                 "llama3.2-1b", "llama3.1-8b", "mistral-7b", "mistral-nemo", "gemma3-4b"):
        assert name in cat.aliases, name
    for alias in cat.aliases.values():
        assert alias.repo.startswith("mlx-community/"), alias
        assert alias.quant in ("4bit", "8bit", "bf16")
        assert alias.context >= 4096 and alias.params and alias.family and alias.description
    assert cat.aliases["qwen3-0.6b"].repo == "mlx-community/Qwen3-0.6B-4bit"


def test_alias_lookup_normalizes_names():
    for spelling in ("qwen3-0.6b", "qwen3:0.6b", "Qwen3:0.6B", " qwen3-0.6b "):
        assert find_alias(spelling).repo == "mlx-community/Qwen3-0.6B-4bit"
    assert find_alias("llama3.2:1b").repo == "mlx-community/Llama-3.2-1B-Instruct-4bit"
    assert find_alias("no-such-model") is None


def test_presets_are_well_formed():
    cat = load_catalog()
    assert {"tiny", "tiny-llama", *REAL_PARAMS} <= set(cat.synthetic)
    for preset in cat.synthetic.values():
        assert preset.chat_template in CHAT_TEMPLATES
        assert preset.description
        assert preset.config["model_type"] in ("qwen3", "qwen2", "llama", "mistral") or (
            preset.train == "words" and preset.config["model_type"] == "glm4_moe")
    assert find_preset("llama3.2-1b").name == "llama-3.2-1b"  # loose spelling
    assert find_preset("nope") is None


@pytest.mark.parametrize("name", sorted(REAL_PARAMS))
def test_preset_shapes_match_the_real_models(name):
    # mlx arrays are lazy: instantiating a 8B model costs nothing until evaluated.
    preset = find_preset(name)
    model = build_model(preset.config)
    params = dict(tree_flatten(model.parameters()))
    assert sum(p.size for p in params.values()) == REAL_PARAMS[name]
    c = preset.config
    assert params["model.embed_tokens.weight"].shape == (c["vocab_size"], c["hidden_size"])
    assert ("lm_head.weight" in params) == (not c["tie_word_embeddings"])


def test_key_preset_numbers():
    q = find_preset("qwen2.5-7b").config
    assert (q["hidden_size"], q["num_hidden_layers"], q["num_attention_heads"],
            q["num_key_value_heads"], q["intermediate_size"], q["vocab_size"]) == (
        3584, 28, 28, 4, 18944, 152064)
    params = dict(tree_flatten(build_model(q).parameters()))
    assert "model.layers.0.self_attn.q_proj.bias" in params  # Qwen2 has qkv bias
    llama = find_preset("llama-3.2-1b").config
    assert llama["rope_scaling"] == {"rope_type": "llama3", "factor": 32.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 8192}
    assert find_preset("mistral-7b-v0.3").chat_template == "mistral"


# ---------------------------------------------------------------- specs


def test_parse_spec_and_canonical_names():
    s = synthetic.parse_spec("synthetic:tiny:q4:fp32:seed=7:layers=1")
    assert (s.preset, s.bits, s.dtype, s.seed, s.layers) == ("tiny", 4, "float32", 7, 1)
    assert s.canonical == "synthetic:tiny:q4:fp32:seed=7:layers=1"
    assert synthetic.parse_spec("SYNTHETIC:tiny:seed=7:FP32:q4:layers=1") == s
    assert synthetic.parse_spec("synthetic:tiny").dtype == synthetic.default_dtype()
    assert synthetic.parse_spec("synthetic:tiny:bf16").canonical == "synthetic:tiny:bf16"
    assert "/" not in s.dirname and ":" not in s.dirname


@pytest.mark.parametrize("spec,needle", [
    ("synthetic:nope", "tiny"),           # lists the presets
    ("synthetic:tiny:q3", "q4"),          # lists the modifiers
    ("synthetic:tiny:q4:q8", "repeated"),
    ("synthetic:tiny:seed=x", "seed"),
    ("synthetic:tiny:layers=0", "layers"),
])
def test_bad_specs_raise_model_not_found(spec, needle):
    with pytest.raises(ModelNotFoundError, match=needle):
        synthetic.parse_spec(spec)


# ---------------------------------------------------------------- tokenizer


def test_tokenizer_vocab_size_and_round_trip(tmp_path):
    from transformers import AutoTokenizer

    text = "Hello, world! Local models run on 4-bit weights.\n\tdef f(x): return x * 2  # ok"
    for vocab_size, style in ((512, "chatml"), (1000, "llama3"), (32768, "mistral")):
        tok = build_tokenizer(vocab_size, style)
        assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
        assert tok.decode(tok.encode(text, add_special_tokens=False).ids) == text
        # The special tokens take the top ids, in the documented order.
        top = list(STYLES[style].special)
        assert [tok.token_to_id(t) for t in top][0] == vocab_size - len(
            top) - len(STYLES[style].extra)

    d = tmp_path / "tok"
    d.mkdir()
    ids = write_tokenizer(d, 640, "llama3")
    hf = AutoTokenizer.from_pretrained(d)
    assert len(hf) == 640
    assert hf.eos_token == "<|eot_id|>" and ids["eos_token_id"] == hf.eos_token_id
    enc = hf(text).input_ids
    assert enc[0] == ids["bos_token_id"]  # Llama adds BOS to plain text
    assert hf.decode(enc, skip_special_tokens=True) == text
    assert isinstance(hf.decode(list(range(640))), str)  # any id in range decodes


def test_large_vocab_tokenizer_is_exact():
    tok = build_tokenizer(152064, "chatml")
    assert tok.get_vocab_size(with_added_tokens=True) == 152064
    assert tok.token_to_id("<|im_end|>") == 152064 - 5


@pytest.mark.parametrize("template", CHAT_TEMPLATES)
def test_chat_templates_render_with_and_without_tools(tmp_path, template):
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path, 600, template)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    plain = tok.apply_chat_template(TOOL_CONVERSATION[:2], add_generation_prompt=True,
                                    tokenize=False)
    assert "Weather in Paris?" in plain and "Be brief." in plain
    assert "get_weather" not in plain
    with_tools = tok.apply_chat_template(TOOL_CONVERSATION, tools=TOOLS,
                                         add_generation_prompt=True, tokenize=False)
    assert "Current weather for a city" in with_tools  # the tool schema
    assert '"city": "Paris"' in with_tools  # the assistant's call
    assert "18C and sunny" in with_tools  # the tool result
    marker = {"chatml": "<tool_call>", "llama3": "<|start_header_id|>ipython",
              "mistral": "[TOOL_CALLS]"}[template]
    assert marker in with_tools
    gen_prompt = {"chatml": "<|im_start|>assistant\n",
                  "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
                  "mistral": "[/INST]"}[template]
    assert plain.endswith(gen_prompt)


# ---------------------------------------------------------------- model dirs


@pytest.mark.parametrize("spec", ["synthetic:tiny", "synthetic:tiny:q4"])
def test_materialize_loads_in_mlx_lm_and_generates(tmp_path, spec):
    import mlx_lm

    path = synthetic.materialize(spec, tmp_path)
    assert (path / synthetic.MARKER).is_file()
    config = json.loads((path / "config.json").read_text())
    assert config["vocab_size"] == 2048
    if spec.endswith("q4"):
        expected = {"group_size": 64, "bits": 4, "mode": "affine"}
        assert config["quantization"] == config["quantization_config"] == expected
        assert "model.layers.0.mlp.up_proj.scales" in _weights(path)
    model, tok = mlx_lm.load(str(path))
    assert len(tok._tokenizer) == 2048  # .vocab_size excludes added tokens, as for Qwen
    assert tok.eos_token_ids == {tok.convert_tokens_to_ids("<|im_end|>"),
                                 tok.convert_tokens_to_ids("<|endoftext|>")}
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                     add_generation_prompt=True)
    text = mlx_lm.generate(model, tok, prompt=prompt, max_tokens=4)
    assert isinstance(text, str)
    # A second call reuses the finished directory.
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert synthetic.materialize(spec, tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_layers_modifier_and_listing(tmp_path):
    path = synthetic.materialize("synthetic:tiny-llama:layers=1:seed=2", tmp_path)
    config = json.loads((path / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["model_type"] == "llama"
    assert not any(k.startswith("model.layers.1.") for k in _weights(path))
    [listed] = synthetic.list_materialized(tmp_path)
    assert listed.spec.endswith(":seed=2:layers=1") and listed.size_bytes > 0
    assert synthetic.remove_materialized(listed.spec, tmp_path) == listed.size_bytes
    assert not path.exists()


def test_context_modifier_links_the_base_weights_instead_of_copying_them(tmp_path):
    path = synthetic.materialize("synthetic:tiny:context=2048", tmp_path)
    base = synthetic.materialize("synthetic:tiny", tmp_path)  # built first, on the way
    assert json.loads((path / "config.json").read_text())["max_position_embeddings"] == 2048
    weights = sorted(path.glob("*.safetensors"))
    assert weights and all(f.is_symlink() and f.resolve().parent == base.resolve() for f in weights)
    assert _weights(path).keys() == _weights(base).keys()
    sizes = {m.spec: m.size_bytes for m in synthetic.list_materialized(tmp_path)}
    assert sizes["synthetic:tiny:fp32:context=2048"] < sizes["synthetic:tiny:fp32"] // 10  # links, not bytes
    # Its base removed, the variant is made again rather than left with dangling links.
    synthetic.remove_materialized("synthetic:tiny", tmp_path)
    again = synthetic.materialize("synthetic:tiny:context=2048", tmp_path)
    assert again == path and all(f.exists() for f in again.iterdir())


def test_same_seed_same_weights_other_seed_differs(tmp_path):
    config = TINY_CONFIGS["qwen3"]
    a = _weights(write_model_dir(tmp_path / "a", config, seed=0))
    b = _weights(write_model_dir(tmp_path / "b", config, seed=0))
    c = _weights(write_model_dir(tmp_path / "c", config, seed=1))
    assert a.keys() == b.keys() == c.keys()
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not mx.array_equal(a[key], c[key]).item()


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_write_model_dir_families_load_in_mlx_lm(tmp_path, family):
    import mlx_lm

    path = write_model_dir(tmp_path / family, TINY_CONFIGS[family], seed=3,
                                     dtype="float32", chat_template=TEMPLATE_FOR[family])
    model, tok = mlx_lm.load(str(path))
    ids = tok.encode("The cache holds the prompt.")
    logits = model(mx.array([ids]))
    assert logits.shape == (1, len(ids), 512)
    assert logits.dtype == mx.float32
    assert mx.all(mx.isfinite(logits)).item()
    gen = json.loads((path / "generation_config.json").read_text())
    assert tok.eos_token_id in gen["eos_token_id"]


def test_write_model_dir_reports_every_byte_it_writes(tmp_path):
    """Progress hears the total first, then each tensor as it reaches the file."""
    events: list[tuple[str, int]] = []

    class Recorder:
        def start(self, total: int) -> None:
            events.append(("start", total))

        def advance(self, nbytes: int) -> None:
            events.append(("advance", nbytes))

    path = write_model_dir(tmp_path / "m", TINY_CONFIGS["qwen3"], quantize_bits=4,
                                     progress=Recorder())
    weights = _weights(path)
    total = sum(a.nbytes for a in weights.values())
    assert events[0] == ("start", total)
    assert [k for k, _ in events[1:]] == ["advance"] * len(weights)
    assert sum(n for _, n in events[1:]) == total
    # Header, then exactly the tensor bytes: the data section has no gaps or leftovers.
    header = synthetic_write_header(path / "model.safetensors")
    assert (path / "model.safetensors").stat().st_size == 8 + header + total
    assert (8 + header) % 8 == 0


def synthetic_write_header(file: Path) -> int:
    import struct

    with open(file, "rb") as f:
        return struct.unpack("<Q", f.read(8))[0]


def test_first_build_on_a_terminal_shows_size_and_eta(tmp_path):
    import io
    import re

    from rich.console import Console

    from mlxlocal.source.synthetic.weights import BuildProgress

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120, soft_wrap=True)
    with BuildProgress("synthetic:tiny", tmp_path / "cache", console=console) as progress:
        write_model_dir(tmp_path / "m", TINY_CONFIGS["llama"], progress=progress)
    out = buf.getvalue()
    assert out.startswith("Building synthetic:tiny: random weights with the real model's shapes, "
                          f"no download (once; cached under {tmp_path / 'cache'})")
    total = sum(a.nbytes for a in _weights(tmp_path / "m").values())
    done = f"{total / 1e3:.1f}/{total / 1e3:.1f} kB"  # rich's DownloadColumn, decimal units
    assert done in out, out  # the bar reached the full size
    assert re.search(r"\d:\d\d:\d\d", out)  # the ETA column
    assert re.search(r"Built synthetic:tiny: [\d.]+ kB of weights in [\d.]+ s\n$", out)
