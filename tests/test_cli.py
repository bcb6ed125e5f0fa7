"""The `mlxlocal` command as a user runs it: synthetic models, show, and clean errors."""

from __future__ import annotations

import json
import os
import re
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


@pytest.mark.parametrize("template", [[], ["--no-chat-template"]])
def test_over_long_prompt_is_clear_error(home, template):
    out = mlxlocal("generate", "--model", "synthetic:tiny", "--prompt", "word " * 5000, *template, home=home)
    assert out.returncode == 1
    # Our error names both numbers; transformers' own warning about the length is silenced.
    found = re.search(r"prompt is (\d+) tokens but the model's context length is 4096 tokens", out.stderr)
    assert found and int(found[1]) > 4096, out.stderr
    assert "Token indices sequence length" not in out.stderr and "Traceback" not in out.stderr


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


def test_bad_thinking_budget_in_chat(home):
    out = mlxlocal("chat", "--model", "synthetic:tiny", "--thinking-budget", "0", home=home)
    assert out.returncode == 2 and "think_budget" in out.stderr, out.stderr


def test_unknown_model_names_the_options(home):
    out = mlxlocal("generate", "--model", "no-such-model", "--prompt", "hi", home=home)
    assert out.returncode == 1
    assert "no-such-model" in out.stderr and "synthetic:" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("command", [[], ["generate"], ["show"], ["serve"], ["bench"], ["pull"], ["launch"]])
def test_help_shows_click_style_types(command):
    from typer.testing import CliRunner

    from mlxlocal.cli import app

    out = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "160"})
    assert out.exit_code == 0, out.output
    assert "<bool>" not in out.output and not re.search(r"<(int|str|float|path|list)", out.output)
    assert re.search(r"--help\s+Show this message and exit\.", out.output)  # a flag: no type
    if command == ["generate"]:
        assert re.search(r"--max-tokens\s+-n\s+INTEGER\s+Maximum tokens to generate", out.output)
        assert re.search(r"--temp\s+FLOAT\s", out.output) and re.search(r"--model\s+-m\s+TEXT\s", out.output)
        assert re.search(r"--ignore-eos\s+Keep generating", out.output)
    if command == ["show"]:
        assert "Usage: mlxlocal show [OPTIONS] MODEL" in out.output
        assert re.search(r"model\s+TEXT\s", out.output)


@pytest.mark.parametrize("engine", ["paged", "mlx-lm path"])
def test_reply_says_whether_context_or_max_tokens_ended_it(home, tiny_model, gemma_model, engine):
    model = str(tiny_model if engine == "paged" else gemma_model)
    args = ["generate", "--model", model, "--prompt", "word " * 240, "--no-chat-template", "--ignore-eos"]
    out = mlxlocal(*args, "--max-tokens", "200", "--json", home=home)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert (result["finish_reason"], result["truncated_by"]) == ("length", "context")
    assert result["completion_tokens"] == 512 - result["prompt_tokens"] < 200
    assert result["synthetic"] is False
    out = mlxlocal(*args, "--max-tokens", "3", "--json", home=home)
    result = json.loads(out.stdout)
    assert (result["finish_reason"], result["truncated_by"], result["completion_tokens"]) == ("length", "max_tokens", 3)
    out = mlxlocal(*args, "--max-tokens", "200", home=home)
    assert out.returncode == 0, out.stderr
    assert "finish: length (context full: 512 tokens)" in out.stderr
    assert re.search(r"prompt \d+ tokens \(0 cached\), [\d.]+ tok/s · reply \d+ tokens, [\d.]+ tok/s · "
                     r"TTFT \d+ ms · peak memory [\d.]+ \w+ · finish: ", out.stderr), out.stderr
    assert "random weights" not in out.stderr


def test_synthetic_model_says_its_text_is_gibberish(home):
    out = mlxlocal("generate", "--model", "synthetic:tiny", "--prompt", "hi", "-n", "4", "--ignore-eos", home=home)
    assert out.returncode == 0, out.stderr
    assert "finish: length (max tokens)" in out.stderr
    assert "random weights: the text is gibberish on purpose" in out.stderr
    out = mlxlocal("generate", "--model", "synthetic:tiny", "--prompt", "hi", "-n", "4", "--json", home=home)
    assert json.loads(out.stdout)["synthetic"] is True and "gibberish" not in out.stderr


def test_first_build_says_why_in_two_plain_lines_when_not_a_terminal(tmp_path):
    out = mlxlocal("pull", "synthetic:tiny-llama", home=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 2 and "\x1b" not in out.stderr and "\r" not in out.stderr, out.stderr
    assert re.fullmatch(r"Building synthetic:tiny-llama:\w+: random weights with the real model's shapes, "
                        r"no download \(once; cached under (.+)\)", lines[0])
    assert lines[0].endswith(f"{tmp_path / 'synthetic'}/tiny-llama_{lines[0].split(':')[2]})")
    assert re.fullmatch(r"Built synthetic:tiny-llama:\w+: [\d.]+ MB of weights in [\d.]+ s", lines[1])
    again = mlxlocal("pull", "synthetic:tiny-llama", home=tmp_path)
    assert again.returncode == 0 and "Build" not in again.stderr
