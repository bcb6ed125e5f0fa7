"""The engine package is the only door: ruff's banned-api (TID251) refuses an import of any
module inside mlxlocal/engine/ from outside it, and every module there is on the list."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ImportError:  # Python 3.10
    tomllib = pytest.importorskip("tomli")

ROOT = Path(__file__).resolve().parents[1]


def banned() -> set[str]:
    ruff = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["ruff"]["lint"]
    return set(ruff["flake8-tidy-imports"]["banned-api"])


def engine_modules() -> set[str]:
    """Every module under mlxlocal/engine/, sub-packages and their modules included."""
    engine = ROOT / "mlxlocal" / "engine"
    names = set()
    for path in engine.rglob("*.py"):
        parts = path.relative_to(engine).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:  # the package itself is the door
            names.add(".".join(("mlxlocal", "engine", *parts)))
    return names


def test_every_engine_module_is_banned_outside_the_engine():
    modules = engine_modules()
    assert modules - banned() == set(), "a new engine module: add it to the banned-api list"
    assert banned() - modules == set(), "a banned module that no longer exists"


def lint(source: str, as_file: str) -> str:
    out = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "TID251", "--output-format",
                          "concise", "--stdin-filename", as_file, "-"],
                         input=source, capture_output=True, text=True, cwd=ROOT, timeout=60)
    return out.stdout


@pytest.mark.parametrize("source", [
    "from mlxlocal.engine.paged import PagedEngine\n",
    "from mlxlocal.engine import runner\n",
    "import mlxlocal.engine.types\n",
    "from mlxlocal.engine.speculative import Speculator\n",  # a sub-package
    "from mlxlocal.engine.speculative.options import SpeculationChoice\n",  # and its module
    "from mlxlocal.engine import dense\n",
])
def test_a_front_end_importing_an_engine_module_fails_lint(source):
    assert "TID251" in lint(source, "mlxlocal/server/example.py")
    # The engine's own modules, tests and dev scripts may reach inside.
    for inside in ("mlxlocal/engine/example.py", "tests/example.py", "scripts/example.py"):
        assert "TID251" not in lint(source, inside)


def test_the_package_itself_passes():
    assert "TID251" not in lint("from mlxlocal.engine import open_engine, SamplingParams\n",
                                "mlxlocal/server/example.py")


def test_every_name_the_engine_door_lists_is_there():
    """`__all__` is the contract's index: a name moved out of the engine must leave it too."""
    import mlxlocal.engine as door

    assert [n for n in door.__all__ if not hasattr(door, n)] == []
