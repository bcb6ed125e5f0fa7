"""The real agent clients against our server: Codex CLI (`codex exec`, the Responses API)
and Claude Code (`claude -p`, the Messages API), two turns each.

They are installed from npm at pinned versions by scripts/install_agent_clients.sh into a
cache (once; later runs find them there); without Node and npm these tests skip and say so. The model is a tiny random one with a
64k context (their system prompts and tool schemas are tens of thousands of tokens), and
its sampler is scripted to answer a fixed sentence, so each turn ends with EOS quickly.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from server_util import running_server, scripted_output

from mlxlocal.server import ServerConfig
from mlxlocal.source.loader import load_from_dir

pytestmark = pytest.mark.slow

ANSWER = "Hi there, from a tiny model."
NAME = "tiny-agent"


ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def clients() -> dict[str, str]:
    """{name: binary path} after scripts/install_agent_clients.sh (idempotent)."""
    if shutil.which("node") is None or shutil.which("npm") is None:
        pytest.skip("Node.js and npm are not installed: the real agent clients cannot run")
    out = subprocess.run(["bash", str(ROOT / "scripts" / "install_agent_clients.sh"), "codex", "claude"],
                         capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        pytest.skip(f"installing the agent clients from npm failed: {out.stderr.strip()[-500:]}")
    found = {}
    for line in out.stdout.splitlines():  # "<bin> <version> <path>"
        name, _, path = line.split(" ", 2)
        found[name] = path
    return found


@pytest.fixture(scope="module")
def agent_server(agent_model):
    tokenizer = load_from_dir(agent_model).tokenizer
    config = ServerConfig(models=[str(agent_model)], served_model_names=[NAME])
    with scripted_output(tokenizer, ANSWER), running_server(config) as (url, app):
        yield url, app


def statuses(url: str) -> dict[str, float]:
    import httpx

    text = httpx.get(f"{url}/metrics").text
    out = {}
    for line in text.splitlines():
        if line.startswith("mlxlocal_requests_total{"):
            labels, value = line.rsplit(" ", 1)
            out[labels] = float(value)
    return out


def prefix_hits(app) -> int:
    return sum(m.engine.stats()["prefix_hit_tokens"] for m in app.state.registry.models if m.engine is not None)


def run(cmd: list[str], env: dict, cwd: Path) -> subprocess.CompletedProcess:
    full = {**os.environ, **env}
    return subprocess.run(cmd, env=full, cwd=cwd, capture_output=True, text=True, timeout=600)


def assert_no_errors(url: str) -> None:
    bad = {k: v for k, v in statuses(url).items() if 'status="4' in k or 'status="5' in k}
    assert not bad, bad


def test_codex_exec_two_turns(clients, agent_server, tmp_path):
    codex = clients["codex"]
    url, app = agent_server
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(
        f'model = "{NAME}"\nmodel_provider = "mlxlocal"\n\n[model_providers.mlxlocal]\nname = "mlxlocal"\n'
        f'base_url = "{url}/v1"\nwire_api = "responses"\nenv_key = "MLXLOCAL_API_KEY"\n')
    env = {"CODEX_HOME": str(home), "MLXLOCAL_API_KEY": "local"}
    first = run([codex, "exec", "--skip-git-repo-check", "Say hi"], env, tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert ANSWER in first.stdout + first.stderr
    before = prefix_hits(app)
    second = run([codex, "exec", "--skip-git-repo-check", "resume", "--last", "Say hi again"], env, tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    assert prefix_hits(app) > before  # the second turn resent the first: served from the cache
    assert_no_errors(url)


def test_claude_print_two_turns(clients, agent_server, tmp_path):
    claude = clients["claude"]
    url, app = agent_server
    env = {"HOME": str(tmp_path), "ANTHROPIC_BASE_URL": url, "ANTHROPIC_AUTH_TOKEN": "local",
           "ANTHROPIC_MODEL": NAME, "ANTHROPIC_SMALL_FAST_MODEL": NAME, "CLAUDE_CODE_MAX_CONTEXT_TOKENS": "65536", "CLAUDE_CODE_AUTO_COMPACT_WINDOW": "65536",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "DISABLE_AUTOUPDATER": "1"}
    first = run([claude, "-p", "Say hi"], env, tmp_path)
    assert first.returncode == 0, (first.stdout + first.stderr)[-3000:]
    assert ANSWER in first.stdout
    before = prefix_hits(app)
    second = run([claude, "-p", "--continue", "Say hi again"], env, tmp_path)
    assert second.returncode == 0, (second.stdout + second.stderr)[-3000:]
    assert prefix_hits(app) > before
    assert_no_errors(url)
