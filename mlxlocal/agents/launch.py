"""`mlxlocal launch CLIENT`: run a coding agent (Claude Code, Codex, opencode) against a local
`mlxlocal serve`, in the spirit of `ollama launch`.

What a client gets is a `Plan`: environment variables, config files written to a directory of
ours (`$MLXLOCAL_HOME/launch/<client>`, default ~/.cache/mlxlocal/launch), and extra
arguments. The user's own config files are never read or written: every client is pointed at
our files through an environment variable.

Where each knob was verified (package versions pinned in scripts/install_agent_clients.sh):

- Claude Code (@anthropic-ai/claude-code 2.1.332): the variable names below all occur in the
  shipped binary (bin/claude.exe): ANTHROPIC_BASE_URL (the client appends /v1/messages),
  ANTHROPIC_AUTH_TOKEN (sent as `Authorization: Bearer`; unlike ANTHROPIC_API_KEY it does not
  make Claude Code ask whether to trust the key), ANTHROPIC_MODEL,
  ANTHROPIC_DEFAULT_{OPUS,SONNET,HAIKU}_MODEL, ANTHROPIC_SMALL_FAST_MODEL (older name of the
  haiku one), CLAUDE_CODE_SUBAGENT_MODEL, CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC,
  API_TIMEOUT_MS, CLAUDE_CODE_AUTO_COMPACT_WINDOW (the binary: "honoring ...
  CLAUDE_CODE_AUTO_COMPACT_WINDOW", clamped to the model window, which is 1M for an id it does
  not know). Documented at code.claude.com/docs/en/settings (environment variables). Checked
  against the real 2.1.332 binary: it POSTs /v1/messages?beta=true with `Bearer <token>` and
  the model named by ANTHROPIC_MODEL.
- Codex (@openai/codex 0.171.0, native binary codex-linux-x64/.../bin/codex): CODEX_HOME is the
  directory its config.toml is read from; the provider table is `[model_providers.<id>]` with
  name, base_url, env_key, wire_api. The binary says `wire_api = "chat"` "is no longer
  supported" (use "responses"), and that `[profiles]` tables are legacy ("use `--profile
  <name>` with `<name>.config.toml`"), so our config.toml sets model / model_provider at the
  top level and needs no --profile. `model_context_window` and the provider's
  `stream_idle_timeout_ms` occur in the binary too. Checked against the real 0.171.0 binary
  (`codex exec`): it POSTs {base_url}/responses with `Bearer $MLXLOCAL_LAUNCH_API_KEY` and our
  model name.
- opencode (opencode-ai 1.18.33, bun binary opencode-linux-x64/bin/opencode): the config
  loader reads `process.env.OPENCODE_CONFIG` as a custom config file merged over the global
  one; a provider is `provider.<id>` = {npm: "@ai-sdk/openai-compatible", name,
  options: {baseURL, apiKey}, models: {<id>: {name}}} and `model` = "<provider>/<model>"
  (opencode.ai/docs/providers, "Custom provider"; a model's `limit: {context, output}` from
  opencode.ai/docs/models). Checked against the real 1.18.33 binary (`opencode run`): it
  POSTs {baseURL}/chat/completions with `Bearer <apiKey>` and our model name.

The context length each client is told comes from the running server (/api/show) at launch
time; `--print` cannot know it without a server and leaves it out.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

from mlxlocal.errors import MlxLocalError

PROVIDER_ID = "mlxlocal"
DUMMY_KEY = "mlxlocal"  # our server takes any key unless started with --api-key
KEY_ENV = "MLXLOCAL_LAUNCH_API_KEY"  # Codex reads the provider's key from this (env_key)


class LaunchError(MlxLocalError):
    pass


@dataclass
class Plan:
    client: str
    binary: str
    env: dict[str, str]
    files: dict[Path, str] = field(default_factory=dict)  # path -> content, written before the run
    args: list[str] = field(default_factory=list)


@dataclass
class Client:
    name: str
    binary: str
    npm: str  # the npm package that installs `binary`
    title: str
    # (base_url, model, api_key, config dir, context length if known) -> Plan
    plan: Callable[[str, str, str, Path, int | None], Plan]


def launch_home() -> Path:
    home = os.environ.get("MLXLOCAL_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".cache" / "mlxlocal") / "launch"


def npm_bin_dir() -> Path:
    """Where scripts/install_agent_clients.sh puts the clients' binaries."""
    prefix = os.environ.get("MLXLOCAL_NPM_PREFIX")
    if prefix:
        return Path(prefix).expanduser() / "bin"
    home = os.environ.get("MLXLOCAL_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".cache" / "mlxlocal") / "npm" / "bin"


def _claude(base: str, model: str, key: str, _dir: Path, context: int | None) -> Plan:
    env = {
        "ANTHROPIC_BASE_URL": base,  # no /v1: Claude Code appends /v1/messages
        "ANTHROPIC_AUTH_TOKEN": key,
        "ANTHROPIC_MODEL": model,
        "ANTHROPIC_DEFAULT_OPUS_MODEL": model,
        "ANTHROPIC_DEFAULT_SONNET_MODEL": model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": model,
        "ANTHROPIC_SMALL_FAST_MODEL": model,
        "CLAUDE_CODE_SUBAGENT_MODEL": model,
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "API_TIMEOUT_MS": "3000000",  # a long prefill on a local model is not a dead server
    }
    if context:  # an unknown model id is assumed to have a 1M window: compact before ours is full
        env["CLAUDE_CODE_AUTO_COMPACT_WINDOW"] = str(context)
        # The binary's own advice for an unknown model ("set CLAUDE_CODE_MAX_CONTEXT_TOKENS to
        # its real window"): the window it enforces, not only where it compacts.
        env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] = str(context)
    return Plan("claude", "claude", env)


def toml_str(s: str) -> str:
    return json.dumps(s)  # a JSON string is a valid TOML basic string


def _codex(base: str, model: str, key: str, cdir: Path, context: int | None) -> Plan:
    config = "\n".join([
        "# Written by `mlxlocal launch codex`; used through CODEX_HOME, never your ~/.codex.",
        f"model = {toml_str(model)}",
        f"model_provider = {toml_str(PROVIDER_ID)}",
        *([f"model_context_window = {context}"] if context else []),
        "",
        f"[model_providers.{PROVIDER_ID}]",
        'name = "mlxlocal"',
        f"base_url = {toml_str(base + '/v1')}",
        'wire_api = "responses"',
        f"env_key = {toml_str(KEY_ENV)}",
        "stream_idle_timeout_ms = 3000000",
        "",
    ])
    return Plan("codex", "codex", {"CODEX_HOME": str(cdir), KEY_ENV: key}, {cdir / "config.toml": config})


def _opencode(base: str, model: str, key: str, cdir: Path, context: int | None) -> Plan:
    entry: dict = {"name": model}
    if context:
        entry["limit"] = {"context": context, "output": min(context // 4, 32768)}
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {PROVIDER_ID: {
            "npm": "@ai-sdk/openai-compatible",
            "name": "mlxlocal (local)",
            "options": {"baseURL": base + "/v1", "apiKey": key},
            "models": {model: entry},
        }},
        "model": f"{PROVIDER_ID}/{model}",
        "small_model": f"{PROVIDER_ID}/{model}",
    }
    path = cdir / "opencode.json"
    return Plan("opencode", "opencode", {"OPENCODE_CONFIG": str(path)}, {path: json.dumps(config, indent=2) + "\n"})


CLIENTS: dict[str, Client] = {
    "claude": Client("claude", "claude", "@anthropic-ai/claude-code", "Claude Code", _claude),
    "codex": Client("codex", "codex", "@openai/codex", "Codex CLI", _codex),
    "opencode": Client("opencode", "opencode", "opencode-ai", "opencode", _opencode),
}


def get_client(name: str) -> Client:
    client = CLIENTS.get(name.lower())
    if client is None:
        raise LaunchError(f"unknown client {name!r}; known clients: {', '.join(CLIENTS)}")
    return client


def served_alias(spec: str) -> str:
    """The name the client asks for: never a filesystem path or an owner/repo id.

    A catalog alias or synthetic spec stays as it is; a directory or `owner/name[@rev]` becomes
    its last component."""
    s = spec.rstrip("/")
    if s.startswith("synthetic:") or ("/" not in s and not Path(s).expanduser().is_dir()):
        return s
    return Path(s.split("@", 1)[0]).name or s


def base_url(port: int, host: str = "127.0.0.1") -> str:
    return f"http://{host}:{port}"


def make_plan(client: Client, port: int, model: str, api_key: str | None = None,
              home: Path | None = None, context: int | None = None) -> Plan:
    home = home or launch_home()
    return client.plan(base_url(port), model, api_key or DUMMY_KEY, home / client.name, context)


def accepts(port: int, model: str, api_key: str | None = None) -> bool:
    """Whether the server answers to `model` (a loaded model also answers to its directory's name)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.post(base_url(port) + "/api/show", json={"model": model}, headers=headers, timeout=600,
                       trust_env=False)
    except httpx.HTTPError:
        return False
    return r.status_code == 200


def context_length(port: int, model: str, api_key: str | None = None) -> int | None:
    """The served model's context length (Ollama's /api/show on our server), or None."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.post(base_url(port) + "/api/show", json={"model": model}, headers=headers, timeout=30,
                       trust_env=False)
        info = r.json().get("model_info") or {}
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    values = [v for k, v in info.items() if k.endswith(".context_length") and isinstance(v, int) and v > 0]
    return values[0] if values else None


def serve_command(spec: str, alias: str, port: int, extra: list[str] | None = None) -> list[str]:
    cmd = ["mlxlocal", "serve", "--model", spec, "--port", str(port)]
    if alias != spec:
        cmd += ["--served-model-name", alias]
    return cmd + list(extra or [])


def render_plan(plan: Plan, serve_cmd: list[str], client_args: list[str]) -> str:
    """A copy-pasteable shell script: start the server, write the configs, export, run."""
    lines = ["# 1. the server (skip if one already serves the model on this port)",
             shlex.join(serve_cmd) + " &", ""]
    if plan.files:
        lines.append("# 2. config of ours (your own config files are not touched)")
        for path, content in plan.files.items():
            lines += [f"mkdir -p {shlex.quote(str(path.parent))}",
                      f"cat > {shlex.quote(str(path))} <<'EOF'", content.rstrip("\n"), "EOF"]
        lines.append("")
    lines.append(f"# {3 if plan.files else 2}. environment and the client")
    lines += [f"export {k}={shlex.quote(v)}" for k, v in plan.env.items()]
    lines.append(shlex.join([plan.binary, *plan.args, *client_args]))
    return "\n".join(lines)


def find_binary(client: Client) -> str:
    found = shutil.which(client.binary)
    if found:
        return found
    ours = npm_bin_dir() / client.binary
    if ours.is_file() and os.access(ours, os.X_OK):
        return str(ours)
    raise LaunchError(
        f"{client.title} ('{client.binary}') not found on PATH or in {npm_bin_dir()}. Install it with "
        f"`npm install -g {client.npm}`, or `scripts/install_agent_clients.sh {client.name}` from the "
        "mlxlocal repository (a pinned version into ~/.cache/mlxlocal/npm)")


# --- the server -----------------------------------------------------------------------------
def probe(port: int, timeout: float = 2.0) -> list[str] | None:
    """The models a server on the port lists in /health, or None if nothing answers like mlxlocal."""
    try:
        r = httpx.get(base_url(port) + "/health", timeout=timeout, trust_env=False)
    except httpx.HTTPError:
        return None
    try:
        body = r.json()
    except ValueError:
        return []
    models = body.get("models") if isinstance(body, dict) else None
    return [str(m) for m in models] if isinstance(models, list) else []


def log_tail(path: Path, lines: int = 25) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.rstrip().splitlines()[-lines:]) or "(empty log)"


class ServerProcess:
    """A `mlxlocal serve` child in its own session (Ctrl+C in the client does not reach it)."""

    def __init__(self, spec: str, alias: str, port: int, log_path: Path, extra: list[str] | None = None,
                 api_key: str | None = None):
        self.port, self.alias, self.log_path = port, alias, log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "mlxlocal", *serve_command(spec, alias, port, extra)[1:]]
        self.log = open(log_path, "wb")
        env = dict(os.environ)
        env.pop("MLXLOCAL_API_KEY", None)
        if api_key:
            env["MLXLOCAL_API_KEY"] = api_key  # serve's --api-key, kept out of the process list
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True, env=env)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            code = self.proc.poll()
            if code is not None:
                raise LaunchError(f"the server exited with code {code} before it was ready; "
                                  f"last lines of {self.log_path}:\n{log_tail(self.log_path)}")
            models = probe(self.port, timeout=1.0)
            if models is not None and self.alias in models:
                return
            if time.monotonic() > deadline:
                self.stop()
                raise LaunchError(f"the server was not ready after {timeout:g}s; last lines of "
                                  f"{self.log_path}:\n{log_tail(self.log_path)}")
            time.sleep(0.25)

    def stop(self, grace: float = 20.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def run_client(argv: list[str], env: dict[str, str]) -> int:
    """Run the client in the foreground; Ctrl+C belongs to it while it runs."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        proc = subprocess.Popen(argv, env=env, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        return proc.wait()
    finally:
        signal.signal(signal.SIGINT, previous)


def launch(client_name: str, spec: str, port: int, alias: str | None = None, client_args: list[str] | None = None,
           keep_server: bool = False, api_key: str | None = None, timeout: float = 900.0,
           serve_args: list[str] | None = None, say: Callable[[str], None] = print) -> int:
    """Start (or reuse) the server, run the client against it, stop the server we started."""
    client = get_client(client_name)
    binary = find_binary(client)  # before starting anything: a missing client is the cheap error
    alias = alias or served_alias(spec)
    server: ServerProcess | None = None
    models = probe(port)
    if models is not None:
        if alias not in models and not accepts(port, alias, api_key):
            if spec not in models:
                raise LaunchError(f"a server already answers on port {port} but does not serve {alias!r} "
                                  f"(it serves: {', '.join(models) or 'unknown'}); stop it or pick another --port")
            alias = spec  # served under its spec only (e.g. `serve --model ./dir`, not loaded yet)
        say(f"reusing the server on {base_url(port)} (model {alias})")
    else:
        log_path = launch_home() / f"server-{port}.log"
        say(f"starting mlxlocal serve --model {spec} as {alias!r} on {base_url(port)} (log: {log_path})")
        server = ServerProcess(spec, alias, port, log_path, serve_args, api_key)
        t0 = time.monotonic()
        try:
            server.wait_ready(timeout)
        except BaseException:
            server.stop()
            raise
        say(f"server ready in {time.monotonic() - t0:.1f}s (pid {server.pid})")
    try:
        plan = make_plan(client, port, alias, api_key, context=context_length(port, alias, api_key))
        for path, content in plan.files.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(content)
            say(f"wrote {path}")
        for k, v in plan.env.items():
            say(f"export {k}={shlex.quote(v)}")
        argv = [binary, *plan.args, *(client_args or [])]
        say(f"running {shlex.join(argv)}")
        env = {**os.environ, **plan.env}
        return run_client(argv, env)
    finally:
        if server is not None:
            if keep_server:
                say(f"server left running on {base_url(port)} (pid {server.pid}; log {server.log_path})")
                server.log.close()
            else:
                say("stopping the server")
                server.stop()
