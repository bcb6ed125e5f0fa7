"""Native models against the oracle: mlx-lm on the same model directory."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlxlocal.engine import SamplingParams, open_engine
from mlxlocal.source.loader import load_from_dir

FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
PROMPT_LENGTHS = [1, 7, 33, 120]


def prompt_of(n: int, vocab: int = 300) -> list[int]:
    return [(i * 37 + 11) % vocab for i in range(n)]


def greedy(logits: mx.array) -> mx.array:
    return mx.argmax(logits, axis=-1)


def mlx_lm_tokens(model, prompt: list[int], n: int) -> list[int]:
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=n, sampler=greedy)]


@pytest.fixture(scope="module")
def pairs(tiny_models):
    """(ours, mlx-lm's) for each family, loaded once."""
    return {f: (load_from_dir(p), mlx_lm.load(str(p))[0]) for f, p in tiny_models.items()}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n", PROMPT_LENGTHS)
def test_logits_match_mlx_lm(pairs, family, n):
    ours, ref = pairs[family]
    assert ours.info.native, "llama-family models must take the native path"
    tokens = mx.array(prompt_of(n))[None]
    expected = ref(tokens, cache=make_prompt_cache(ref))
    got = ours.model(tokens, ours.make_cache())
    assert got.shape == expected.shape
    assert mx.allclose(got, expected, atol=1e-4, rtol=1e-4).item(), mx.abs(got - expected).max().item()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("n", PROMPT_LENGTHS)
def test_greedy_tokens_match_mlx_lm(pairs, family, n):
    ours, ref = pairs[family]
    prompt = prompt_of(n)
    expected = mlx_lm_tokens(ref, prompt, 24)
    chunks = list(open_engine(ours).generate(prompt, SamplingParams(max_tokens=24, ignore_eos=True)))
    got = [c.token for c in chunks if c.token is not None]
    assert got == expected
    assert chunks[-1].stats.completion_tokens == 24
    assert chunks[-1].finish_reason == "length"


def test_decode_logits_match_step_by_step(pairs):
    """Incremental decode through the dense cache equals mlx-lm's cache, step by step."""
    ours, ref = pairs["qwen2"]
    cache_a, cache_b = ours.make_cache(), make_prompt_cache(ref)
    prompt = mx.array(prompt_of(20))[None]
    a, b = ours.model(prompt, cache_a)[:, -1], ref(prompt, cache=cache_b)[:, -1]
    for _ in range(10):
        assert mx.allclose(a, b, atol=1e-4).item()
        tok = mx.argmax(a, axis=-1)[None]
        a, b = ours.model(tok, cache_a)[:, -1], ref(tok, cache=cache_b)[:, -1]


def test_chunked_prefill_gives_same_tokens(pairs):
    ours, _ = pairs["llama"]
    prompt = prompt_of(100)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    whole = [c.token for c in open_engine(ours, max_step_tokens=512).generate(prompt, params) if c.token is not None]
    chunked = [c.token for c in open_engine(ours, max_step_tokens=16).generate(prompt, params) if c.token is not None]
    assert whole == chunked


def test_sliding_window_matches_mlx_lm(tmp_path):
    """Sliding-window layers (llama layer_types) against mlx-lm's rotating cache, past the window."""
    from conftest import FAMILY_CONFIGS, build_tiny

    cfg = dict(FAMILY_CONFIGS["llama"], sliding_window=8,
               layer_types=["sliding_attention", "full_attention"])
    path = build_tiny(tmp_path / "swa", cfg, template="llama3")
    ours, ref = load_from_dir(path), mlx_lm.load(str(path))[0]
    assert ours.model_config.sliding_window == 8
    prompt = prompt_of(30)
    expected = mlx_lm_tokens(ref, prompt, 16)
    got = [c.token for c in open_engine(ours).generate(prompt, SamplingParams(max_tokens=16, ignore_eos=True))
           if c.token is not None]
    assert got == expected


def test_quantized_checkpoint_matches_mlx_lm(tmp_path):
    from conftest import FAMILY_CONFIGS, build_tiny

    cfg = dict(FAMILY_CONFIGS["qwen3"], hidden_size=128, intermediate_size=256)
    path = build_tiny(tmp_path / "q4", cfg, bits=4)
    ours, ref = load_from_dir(path), mlx_lm.load(str(path))[0]
    assert "4-bit" in ours.info.quantization
    tokens = mx.array(prompt_of(16))[None]
    expected = ref(tokens, cache=make_prompt_cache(ref))
    got = ours.model(tokens, ours.make_cache())
    assert mx.allclose(got, expected, atol=1e-4, rtol=1e-4).item()
    prompt = prompt_of(9)
    got_tokens = [c.token for c in open_engine(ours).generate(prompt, SamplingParams(max_tokens=10, ignore_eos=True))
                  if c.token is not None]
    assert got_tokens == mlx_lm_tokens(ref, prompt, 10)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_cli_generate_json_matches_mlx_lm(tiny_models, family):
    path = tiny_models[family]
    prompt = "the quick brown fox"
    out = subprocess.run(
        [sys.executable, "-m", "mlxlocal", "generate", "--model", str(path), "--prompt", prompt,
         "--max-tokens", "16", "--temp", "0", "--json", "--no-chat-template", "--ignore-eos"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    for key in ("text", "tokens", "prompt_tokens", "completion_tokens", "finish_reason", "ttft_s",
                "prefill_tps", "decode_tps", "peak_memory_bytes"):
        assert key in result
    ref, tokenizer = mlx_lm.load(str(path))
    ids = tokenizer.encode(prompt)
    assert result["prompt_tokens"] == len(ids)
    assert result["tokens"] == mlx_lm_tokens(ref, ids, 16)
    assert result["text"] == tokenizer.decode(result["tokens"])
    assert result["completion_tokens"] == 16 and result["finish_reason"] == "length"
    assert result["peak_memory_bytes"] > 0 and result["decode_tps"] > 0


def test_other_model_types_run_through_mlx_lm(tmp_path):
    """A family we have no native code for runs on mlx-lm's model, with the same tokens."""
    from conftest import BASE, build_tiny

    cfg = dict(BASE, model_type="gemma", rope_theta=10000.0, rope_traditional=False)
    path = build_tiny(tmp_path / "gemma", cfg)
    ours, ref = load_from_dir(path), mlx_lm.load(str(path))[0]
    assert not ours.info.native and "mlx-lm" in ours.info.notes[0]
    prompt = prompt_of(12)
    got = [c.token for c in open_engine(ours).generate(prompt, SamplingParams(max_tokens=10, ignore_eos=True))
           if c.token is not None]
    assert got == mlx_lm_tokens(ref, prompt, 10)


def test_mixed_precision_checkpoint_with_per_layer_overrides(tmp_path):
    """mlx-community mixed recipes: some layers 8-bit, some kept in full precision."""
    import shutil

    from conftest import FAMILY_CONFIGS, build_tiny
    from mlx_lm.utils import load_config, quantize_model, save_config, save_model

    cfg = dict(FAMILY_CONFIGS["llama"], hidden_size=128, intermediate_size=256)
    src = build_tiny(tmp_path / "fp", cfg, template="llama3")
    model, _ = mlx_lm.load(str(src))

    def predicate(path, module):
        if "down_proj" in path:
            return {"group_size": 32, "bits": 8}
        return "lm_head" not in path

    model, qconfig = quantize_model(model, load_config(src), group_size=64, bits=4, quant_predicate=predicate)
    dst = tmp_path / "mixed"
    save_model(dst, model)
    save_config(qconfig, dst / "config.json")
    for f in src.glob("tokenizer*"):
        shutil.copy(f, dst / f.name)
    ours, ref = load_from_dir(dst), mlx_lm.load(str(dst))[0]
    layers = ours.model.layers
    assert layers[0].mlp.down_proj.bits == 8 and layers[0].mlp.up_proj.bits == 4
    assert "lm_head" in ours.model and not hasattr(ours.model.lm_head, "bits")
    assert "per-layer overrides" in ours.info.quantization
    tokens = mx.array(prompt_of(10))[None]
    expected = ref(tokens, cache=make_prompt_cache(ref))
    assert mx.allclose(ours.model(tokens, ours.make_cache()), expected, atol=1e-4, rtol=1e-4).item()
