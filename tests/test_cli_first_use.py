"""The CLI answers at once: `--help` of every command loads none of the heavy libraries
(MLX, mlx-lm, transformers, numpy, huggingface_hub, the server stack); a command loads
them when it runs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer

HEAVY = ("mlx", "mlx_lm", "numpy", "transformers", "huggingface_hub", "tokenizers", "jinja2",
         "fastapi", "uvicorn", "starlette", "httpx", "safetensors", "mlxlocal.engine", "mlxlocal.server",
         "markdown_it", "pygments")

PROBE = """
import json, sys
import typer
from typer.testing import CliRunner
from mlxlocal.cli import app
runner = CliRunner()

def paths(cmd, prefix):
    yield prefix
    for name, sub in sorted(getattr(cmd, "commands", {}).items()):
        yield from paths(sub, prefix + [name])

out = {}
for args in paths(typer.main.get_command(app), []):
    res = runner.invoke(app, args + ["--help"])
    out[" ".join(args)] = [res.exit_code, res.output[:200]]
heavy = sorted({m.split(".")[0] if not m.startswith("mlxlocal.") else ".".join(m.split(".")[:2])
                for m in sys.modules} & set(sys.argv[1].split(",")))
print(json.dumps({"runs": out, "heavy": heavy}))
"""


def test_help_of_every_command_loads_no_heavy_library():
    proc = subprocess.run([sys.executable, "-c", PROBE, ",".join(HEAVY)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    runs = got["runs"]
    assert len(runs) > 15  # every command and group was asked
    for args, (code, text) in runs.items():
        assert code == 0 and "Usage" in text, (args, code, text)
    assert got["heavy"] == [], f"--help imported {got['heavy']}"


def test_a_command_still_loads_what_it_needs():
    # `version` reports MLX's: the lazily imported library is there when a command runs.
    proc = subprocess.run([sys.executable, "-m", "mlxlocal", "version"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "mlx " in proc.stdout and "mlx-lm " in proc.stdout


def mlxlocal(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxlocal", *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def test_errors_print_user_text_verbatim(capsys):
    from mlxlocal.cli.common import fail

    with pytest.raises(typer.Exit):
        fail("--plot needs matplotlib: pip install 'mlxlocal[bench]'")
    assert "pip install 'mlxlocal[bench]'" in capsys.readouterr().err
    proc = mlxlocal("generate", "--model", "./models[v2]", "-p", "hi")
    assert proc.returncode != 0
    assert "'./models[v2]'" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr  # one line


def test_unknown_models_get_a_did_you_mean(tmp_path):
    (tmp_path / "my-model").mkdir()
    (tmp_path / "my-model" / "config.json").write_text("{}")
    proc = mlxlocal("generate", "--model", "llama3.2", "-p", "hi", cwd=tmp_path)
    assert "Did you mean llama3.2-" in proc.stderr, proc.stderr
    assert "mlxlocal list --catalog" in proc.stderr
    proc = mlxlocal("generate", "--model", "my-modle", "-p", "hi", cwd=tmp_path)  # a local directory
    assert "Did you mean ./my-model?" in proc.stderr, proc.stderr
    proc = mlxlocal("generate", "--model", "synthetic:tyny", "-p", "hi")
    assert "did you mean synthetic:tiny?" in proc.stderr, proc.stderr


def test_launch_names_the_model_it_would_fetch(monkeypatch):
    from typer.testing import CliRunner

    from mlxlocal.cli import app

    monkeypatch.delenv("MLXLOCAL_LAUNCH_MODEL", raising=False)
    res = CliRunner().invoke(app, ["launch", "codex", "--print"])
    assert res.exit_code == 0, res.output
    assert "no --model given: using qwen3-8b (mlx-community/" in res.output
    assert "--model picks another" in res.output


# `mlxlocal <command> ... --model X` in an example, and every synthetic:NAME.
EXAMPLE = re.compile(r"mlxlocal [a-z-]+(?: [^\n`]*?)? (?:--model|-m) ([\w./:@=-]+)")
SYNTHETIC = re.compile(r"synthetic:([a-z][\w.-]*)")


def _unknown_models(text: str) -> set[str]:
    from mlxlocal.embeddings import MINILM_ALIASES
    from mlxlocal.source.catalog import load_catalog

    cat = load_catalog()
    bad = {m for m in SYNTHETIC.findall(text) if m.rstrip(".") not in cat.synthetic and m != "NAME"}
    for m in EXAMPLE.findall(text):
        name = m.split(":")[0]
        if m.startswith(("synthetic:", ".", "/", "~", "$")) or "/" in m or name.isupper() or m.endswith(".gguf"):
            continue  # a preset (checked above), a path, a repo id, a placeholder
        if cat.find_alias(name) is None and name.lower() not in MINILM_ALIASES:  # embed's model
            bad.add(m)
    return bad


def test_help_texts_and_readme_name_only_models_that_exist():
    import typer as typer_mod
    from typer.testing import CliRunner

    from mlxlocal.cli import app

    def helps(cmd, prefix):
        yield prefix
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from helps(sub, prefix + [name])

    runner = CliRunner()
    texts = [runner.invoke(app, args + ["--help"], terminal_width=300).output
             for args in helps(typer_mod.main.get_command(app), [])]
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    assert _unknown_models("\n".join(texts)) == set()
    assert _unknown_models(readme) == set()
    assert _unknown_models("mlxlocal serve --model qwen9-99b") == {"qwen9-99b"}  # it can fail


def _options():
    import typer as typer_mod

    from mlxlocal.cli import app

    def walk(cmd, prefix):
        for p in getattr(cmd, "params", []):
            if getattr(p, "param_type_name", "") == "option" and p.name != "help":
                yield " ".join(prefix), p
        for name, sub in getattr(cmd, "commands", {}).items():
            yield from walk(sub, prefix + [name])

    return list(walk(typer_mod.main.get_command(app), []))


def test_every_option_is_described_and_shared_ones_are_declared_once():
    options = _options()
    assert len(options) > 200
    assert [(cmd, p.opts) for cmd, p in options if not p.help] == []
    # One declaration (cli/options.py) of each engine, sampling and cache option, in its panel
    # wherever it is used.
    cli = Path(__file__).parent.parent / "mlxlocal" / "cli"
    for flag in ("--kv-cache-memory", "--block-size", "--temp", "--top-p", "--seed", "--kv-disk", "--kernels"):
        decl = re.compile(r'Option\(\s*(?:[^,()]+,\s*)?"' + re.escape(flag) + '"')
        declared = [f.name for f in sorted(cli.glob("*.py")) if decl.search(f.read_text())]
        assert declared == ["options.py"], (flag, declared)
    panels = {(cmd, p.opts[0]): p.rich_help_panel for cmd, p in options}
    for cmd in ("generate", "chat", "serve"):
        assert panels[(cmd, "--kv-cache-memory")] == "KV cache"
        assert panels[(cmd, "--kernels")] == "Engine"
    for cmd in ("generate", "chat", "run"):
        assert panels[(cmd, "--temp")] == "Sampling"
    assert panels[("serve", "--port")] == "Server"


def test_each_benchmark_is_a_subcommand_with_its_own_options():
    from typer.testing import CliRunner

    from mlxlocal.cli import app

    runner = CliRunner()
    top = runner.invoke(app, ["bench", "--help"], terminal_width=200).output
    for name in ("speed", "agent", "akv", "concurrent", "sessions", "restart", "endpoint", "replay", "embed",
                 "kernels", "spec", "structured", "profile", "contexts"):
        assert f" {name} " in top, name
    helps = {name: runner.invoke(app, ["bench", name, "--help"], terminal_width=200).output
             for name in ("kernels", "agent", "endpoint", "spec")}
    assert "--rows" in helps["kernels"] and "--prompt-tokens" not in helps["kernels"]
    assert "Our Metal kernels" in helps["kernels"]  # its own help, not the bench overview
    assert "--turns" in helps["agent"] and "--url" not in helps["agent"] and "--akv-keep" not in helps["agent"]
    assert "--compare-url" in helps["endpoint"] and "--kv-bits" not in helps["endpoint"]
    assert "--draft-model" in helps["spec"] and "--compare" not in helps["spec"]
    # Options of the speed bench given before another benchmark's name are an error, not ignored.
    res = runner.invoke(app, ["bench", "-p", "64", "agent"])
    assert res.exit_code == 2 and "go after the benchmark's name" in res.output


def test_the_deferred_rich_modules_work_when_used():
    code = """
import sys
import mlxlocal.cli
assert 'markdown_it' not in sys.modules and 'pygments' not in sys.modules
from io import StringIO
from rich.console import Console
from rich.markdown import Markdown
import rich.markdown, rich.traceback
m = Markdown('# Title\\n\\n*hello*')
assert isinstance(m, Markdown) and isinstance(m, rich.markdown.Markdown)
out = StringIO()
Console(file=out, width=40).print(m)
assert 'Title' in out.getvalue() and 'hello' in out.getvalue()
assert callable(rich.traceback.install) and 'pygments' in sys.modules
try:
    1 / 0
except ZeroDivisionError:
    tb = rich.traceback.Traceback()
Console(file=out, width=80).print(tb)
assert 'ZeroDivisionError' in out.getvalue()
print('ok')
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
