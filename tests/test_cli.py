"""The `mlxlocal` command as a user runs it: synthetic models, show, and clean errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.generate import generate_step


def mlxlocal(*args: str, home: Path, stdin: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, MLXLOCAL_HOME=str(home), HF_HUB_OFFLINE="1", HF_HOME=str(home / "hf"))
    return subprocess.run([sys.executable, "-m", "mlxlocal", *args], capture_output=True, text=True,
                          timeout=180, env=env, input=stdin)


@pytest.fixture(scope="module")
def home(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("home")


def test_quantized_synthetic_preset_generates_like_mlx_lm(home):
    out = mlxlocal("generate", "--model", "synthetic:tiny:q4", "--prompt", "hello", "--max-tokens", "12",
                   "--json", "--ignore-eos", home=home)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["completion_tokens"] == 12
    (path,) = (home / "synthetic").glob("tiny_q4*")
    model, tokenizer = mlx_lm.load(str(path))
    assert json.loads((path / "config.json").read_text())["quantization"]["bits"] == 4
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True)
    assert result["prompt_tokens"] == len(ids)
    expected = [int(t) for t, _ in generate_step(mx.array(ids), model, max_tokens=12,
                                                 sampler=lambda x: mx.argmax(x, -1))]
    assert result["tokens"] == expected


def test_show_reports_architecture_quantization_and_load_path(home):
    out = mlxlocal("show", "synthetic:tiny:q4", home=home)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    for expected in ("qwen3 (native mlxlocal)", "affine 4-bit, group size 64", "context length 4,096",
                     "model.safetensors", "loaded by copy (CPU backend"):
        assert expected in text, expected


def test_prompt_from_stdin_and_stop_string(home):
    out = mlxlocal("generate", "--model", "synthetic:tiny", "--max-tokens", "8", "--json",
                   "--no-chat-template", home=home, stdin="piped prompt text")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["prompt_tokens"] > 2


def test_over_long_prompt_is_clear_error(home):
    out = mlxlocal("generate", "--model", "synthetic:tiny", "--prompt", "word " * 5000,
                   "--no-chat-template", home=home)
    assert out.returncode == 1
    assert "context length is 4096" in out.stderr and "Traceback" not in out.stderr


def test_corrupt_weights_is_clear_error(home, tiny_model, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    data = (broken / "model.safetensors").read_bytes()
    (broken / "model.safetensors").write_bytes(data[: len(data) // 2])
    out = mlxlocal("generate", "--model", str(broken), "--prompt", "hi", home=home)
    assert out.returncode == 1
    assert "model.safetensors" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("args, words", [
    (["--temp", "-1"], ["temperature"]),
    (["--top-p", "0"], ["top_p"]),
])
def test_bad_sampling_options(home, args, words):
    out = mlxlocal("generate", "--model", "synthetic:tiny", "--prompt", "hi", *args, home=home)
    assert out.returncode == 2
    assert all(w in out.stderr for w in words)


def test_unknown_model_names_the_options(home):
    out = mlxlocal("generate", "--model", "no-such-model", "--prompt", "hi", home=home)
    assert out.returncode == 1
    assert "no-such-model" in out.stderr and "synthetic:" in out.stderr and "Traceback" not in out.stderr
