"""The CLI answers at once: `--help` of every command loads none of the heavy libraries
(MLX, mlx-lm, transformers, numpy, huggingface_hub, the server stack); a command loads
them when it runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import typer

HEAVY = ("mlx", "mlx_lm", "numpy", "transformers", "huggingface_hub", "tokenizers", "jinja2",
         "fastapi", "uvicorn", "starlette", "httpx", "safetensors", "mlxlocal.engine", "mlxlocal.server")

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
