"""`mlxlocal launch CLIENT`: the setup each client gets (--print), and real launches with a fake
client binary on PATH that records what it was given and talks to the server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from server_util import free_port, running_server

from mlxlocal.agents import launch as L
from mlxlocal.server import ServerConfig

REPO = Path(__file__).resolve().parents[1]


def toml(text: str) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    return tomllib.loads(text)


FAKE_CLIENT = """#!{python}
import json, os, sys, urllib.request
base = os.environ.get("ANTHROPIC_BASE_URL") or "http://127.0.0.1:" + os.environ["FAKE_PORT"]
health = json.load(urllib.request.urlopen(base + "/health", timeout=30))
models = json.load(urllib.request.urlopen(base + "/v1/models", timeout=30))
config = {{}}
if os.environ.get("CODEX_HOME"):
    config["codex"] = open(os.path.join(os.environ["CODEX_HOME"], "config.toml")).read()
if os.environ.get("OPENCODE_CONFIG"):
    config["opencode"] = open(os.environ["OPENCODE_CONFIG"]).read()
env = {{k: v for k, v in os.environ.items() if k.startswith(("ANTHROPIC_", "CLAUDE_", "CODEX_", "OPENCODE_", "MLXLOCAL_LAUNCH"))}}
with open(os.environ["FAKE_OUT"], "w") as f:
    json.dump({{"argv": sys.argv[1:], "env": env, "health": health, "models": models, "config": config}}, f)
sys.exit(int(os.environ.get("FAKE_EXIT", "0")))
"""


def fake_bin(tmp_path: Path, *names: str) -> Path:
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    for name in names:
        p = d / name
        p.write_text(FAKE_CLIENT.format(python=sys.executable))
        p.chmod(0o755)
    return d


def cli(*args: str, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    full = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", **(env or {}))
    return subprocess.run([sys.executable, "-m", "mlxlocal", *args], capture_output=True, text=True,
                          timeout=timeout, env=full)


# --- --print ------------------------------------------------------------------------------------
@pytest.fixture
def launch_home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("MLXLOCAL_HOME", str(tmp_path / "home"))
    return tmp_path / "home" / "launch"


def print_plan(client: str, *extra: str) -> str:
    from typer.testing import CliRunner

    from mlxlocal.cli import app

    out = CliRunner().invoke(app, ["launch", "--print", client, "--model", "mlx-community/Qwen3-4B-4bit",
                                   "--port", "9123", *extra])
    assert out.exit_code == 0, out.output
    return out.output


def exports(text: str) -> dict[str, str]:
    return dict(line[len("export "):].split("=", 1) for line in text.splitlines() if line.startswith("export "))


def heredoc(text: str, path: Path) -> str:
    start = text.index(f"cat > {path} <<'EOF'\n") + len(f"cat > {path} <<'EOF'\n")
    return text[start:text.index("\nEOF\n", start)]


def test_print_claude(launch_home):
    text = print_plan("claude", "--", "--verbose")
    env = exports(text)
    assert env["ANTHROPIC_BASE_URL"] == "http://127.0.0.1:9123"  # Claude Code appends /v1/messages
    assert env["ANTHROPIC_AUTH_TOKEN"] == "mlxlocal"
    for key in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL", "ANTHROPIC_DEFAULT_HAIKU_MODEL",
                "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_SMALL_FAST_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL"):
        assert env[key] == "Qwen3-4B-4bit", key  # the alias, never the repo id or a path
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    assert ("mlxlocal serve --model mlx-community/Qwen3-4B-4bit --port 9123 --served-model-name Qwen3-4B-4bit &"
            in text)
    assert text.rstrip().endswith("claude --verbose")
    assert not launch_home.exists()  # --print writes nothing


def test_print_codex(launch_home):
    text = print_plan("codex")
    env = exports(text)
    assert env["CODEX_HOME"] == str(launch_home / "codex") and env["MLXLOCAL_LAUNCH_API_KEY"] == "mlxlocal"
    config = toml(heredoc(text, launch_home / "codex" / "config.toml"))
    assert config["model"] == "Qwen3-4B-4bit" and config["model_provider"] == "mlxlocal"
    provider = config["model_providers"]["mlxlocal"]
    assert provider["base_url"] == "http://127.0.0.1:9123/v1"
    assert provider["wire_api"] == "responses" and provider["env_key"] == "MLXLOCAL_LAUNCH_API_KEY"
    assert text.rstrip().endswith("\ncodex")
    assert not launch_home.exists()


def test_print_opencode(launch_home):
    text = print_plan("opencode", "--served-model-name", "coder")
    env = exports(text)
    assert env["OPENCODE_CONFIG"] == str(launch_home / "opencode" / "opencode.json")
    config = json.loads(heredoc(text, launch_home / "opencode" / "opencode.json"))
    provider = config["provider"]["mlxlocal"]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"]["baseURL"] == "http://127.0.0.1:9123/v1"
    assert list(provider["models"]) == ["coder"] and config["model"] == "mlxlocal/coder"
    assert "--served-model-name coder &" in text


@pytest.mark.parametrize("spec, alias", [("qwen3-4b", "qwen3-4b"), ("synthetic:tiny:q4", "synthetic:tiny:q4"),
                                         ("mlx-community/Qwen3-4B-4bit@main", "Qwen3-4B-4bit")])
def test_served_alias(spec, alias, tmp_path):
    assert L.served_alias(spec) == alias
    (tmp_path / "My-Model").mkdir()
    assert L.served_alias(str(tmp_path / "My-Model") + "/") == "My-Model"


def test_unknown_client_lists_known_ones():
    out = cli("launch", "vim")
    assert out.returncode == 2
    assert "unknown client 'vim'" in out.stderr and "claude, codex, opencode" in out.stderr


def test_missing_binary_says_how_to_install(tmp_path):
    out = cli("launch", "codex", "--model", "synthetic:tiny", env={
        "PATH": str(tmp_path), "MLXLOCAL_HOME": str(tmp_path / "home")})
    assert out.returncode == 1
    assert "npm install -g @openai/codex" in out.stderr and "install_agent_clients.sh" in out.stderr
    assert "Traceback" not in out.stderr


# --- real launches ------------------------------------------------------------------------------
def test_launch_reuses_a_running_server_and_leaves_it(tiny_model, tmp_path, monkeypatch, launch_home):
    monkeypatch.setenv("PATH", str(fake_bin(tmp_path, "opencode")) + os.pathsep + os.environ["PATH"])
    monkeypatch.setenv("FAKE_OUT", str(tmp_path / "out.json"))
    port = free_port()
    monkeypatch.setenv("FAKE_PORT", str(port))
    config = ServerConfig(models=[str(tiny_model)], served_model_names=["tiny"], port=port)
    said: list[str] = []
    with running_server(config):
        code = L.launch("opencode", str(tiny_model), port, alias="tiny", client_args=["run", "hi"], say=said.append)
        assert L.probe(port) == ["tiny"]  # not ours to stop
    assert code == 0 and any("reusing" in s for s in said)
    rec = json.loads((tmp_path / "out.json").read_text())
    assert rec["argv"] == ["run", "hi"]
    opencode = json.loads(rec["config"]["opencode"])
    assert opencode["model"] == "mlxlocal/tiny"
    assert opencode["provider"]["mlxlocal"]["options"]["baseURL"] == f"http://127.0.0.1:{port}/v1"
    assert opencode["provider"]["mlxlocal"]["models"]["tiny"]["limit"]["context"] == 512  # from /api/show
    assert (launch_home / "opencode" / "opencode.json").is_file()


def test_port_taken_by_another_model(tiny_model, tmp_path, monkeypatch, launch_home):
    monkeypatch.setenv("PATH", str(fake_bin(tmp_path, "claude")) + os.pathsep + os.environ["PATH"])
    port = free_port()
    with running_server(ServerConfig(models=[str(tiny_model)], served_model_names=["other"], port=port)):
        with pytest.raises(L.LaunchError, match="does not serve 'tiny'.*serves: other"):
            L.launch("claude", "tiny", port, say=lambda m: None)


@pytest.mark.slow
def test_launch_starts_the_server_runs_the_client_and_stops_the_server(tiny_model, tmp_path):
    port = free_port()
    out_file = tmp_path / "out.json"
    env = {"PATH": str(fake_bin(tmp_path, "claude", "codex")) + os.pathsep + os.environ["PATH"],
           "MLXLOCAL_HOME": str(tmp_path / "home"), "FAKE_OUT": str(out_file), "FAKE_PORT": str(port),
           "FAKE_EXIT": "7"}
    out = cli("launch", "codex", "--model", str(tiny_model), "--port", str(port), "--", "exec", "hello", env=env)
    assert out.returncode == 7, out.stderr  # the client's exit code
    rec = json.loads(out_file.read_text())
    assert rec["argv"] == ["exec", "hello"]
    assert rec["health"]["models"] == ["qwen3"]  # the directory's name, not its path
    assert [m["id"] for m in rec["models"]["data"]] == ["qwen3"]
    assert rec["env"]["CODEX_HOME"] == str(tmp_path / "home" / "launch" / "codex")
    codex = toml(rec["config"]["codex"])
    assert codex["model"] == "qwen3" and codex["model_context_window"] == 512
    assert codex["model_providers"]["mlxlocal"]["base_url"] == f"http://127.0.0.1:{port}/v1"
    for line in ("starting mlxlocal serve", "server ready", "export CODEX_HOME=", "stopping the server"):
        assert line in out.stderr, line
    assert L.probe(port) is None  # stopped
    assert (tmp_path / "home" / "launch" / f"server-{port}.log").is_file()


@pytest.mark.slow
def test_server_that_fails_to_start_shows_its_log(tmp_path):
    env = {"PATH": str(fake_bin(tmp_path, "claude")) + os.pathsep + os.environ["PATH"],
           "MLXLOCAL_HOME": str(tmp_path / "home"), "FAKE_OUT": str(tmp_path / "out.json")}
    out = cli("launch", "claude", "--model", str(tmp_path / "no-such-model"), "--port", str(free_port()), env=env)
    assert out.returncode == 1
    assert "exited with code" in out.stderr and "no-such-model" in out.stderr
    assert not (tmp_path / "out.json").exists()  # the client never ran


def test_context_length_reaches_each_client(tmp_path):
    plans = {c: L.make_plan(L.get_client(c), 9000, "m", home=tmp_path, context=4096) for c in L.CLIENTS}
    assert plans["claude"].env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == "4096"
    assert toml(plans["codex"].files[tmp_path / "codex" / "config.toml"])["model_context_window"] == 4096
    opencode = json.loads(plans["opencode"].files[tmp_path / "opencode" / "opencode.json"])
    assert opencode["provider"]["mlxlocal"]["models"]["m"]["limit"]["context"] == 4096
    assert "CLAUDE_CODE_AUTO_COMPACT_WINDOW" not in L.make_plan(L.CLIENTS["claude"], 9000, "m", home=tmp_path).env


def test_reused_server_without_served_names_is_asked_for_the_directory_name(tiny_model, tmp_path, monkeypatch,
                                                                             launch_home):
    monkeypatch.setenv("PATH", str(fake_bin(tmp_path, "opencode")) + os.pathsep + os.environ["PATH"])
    monkeypatch.setenv("FAKE_OUT", str(tmp_path / "out.json"))
    port = free_port()
    monkeypatch.setenv("FAKE_PORT", str(port))
    with running_server(ServerConfig(models=[str(tiny_model)], port=port)):  # `serve --model /path/qwen3`
        assert L.launch("opencode", str(tiny_model), port, say=lambda m: None) == 0
    opencode = json.loads(json.loads((tmp_path / "out.json").read_text())["config"]["opencode"])
    assert opencode["model"] == "mlxlocal/qwen3"  # the directory's name, which the server accepts once loaded


@pytest.mark.slow
def test_keep_server_leaves_it_running(tiny_model, tmp_path):
    import re
    import signal
    import time

    port = free_port()
    env = {"PATH": str(fake_bin(tmp_path, "claude")) + os.pathsep + os.environ["PATH"],
           "MLXLOCAL_HOME": str(tmp_path / "home"), "FAKE_OUT": str(tmp_path / "out.json")}
    out = cli("launch", "claude", "--model", str(tiny_model), "--served-model-name", "tiny", "--port", str(port),
              "--keep-server", env=env)
    assert out.returncode == 0, out.stderr
    pid = int(re.search(r"server left running on \S+ \(pid (\d+)", out.stderr)[1])
    try:
        rec = json.loads((tmp_path / "out.json").read_text())
        assert rec["env"]["ANTHROPIC_BASE_URL"] == f"http://127.0.0.1:{port}"
        assert rec["env"]["ANTHROPIC_MODEL"] == "tiny" and rec["env"]["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] == "512"
        assert L.probe(port) == ["tiny"]
    finally:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while L.probe(port) is not None and time.monotonic() < deadline:
            time.sleep(0.2)
    assert L.probe(port) is None
