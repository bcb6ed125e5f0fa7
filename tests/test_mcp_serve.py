"""`mlxlocal mcp serve` and /mcp on `mlxlocal serve`, driven by the official MCP SDK client:
stdio (a spawned `python -m mlxlocal mcp serve`), Streamable HTTP (the same on a free port,
with an API key), and the endpoint mounted on the OpenAI server. Tools, the models resource,
argument and engine errors as tool errors; Origin, Host and API-key checks on every request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from contextlib import contextmanager

import anyio
import httpx
import httpx2
import pytest
from mcp import ClientSession, StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client
from server_util import free_port, running_server

from mlxlocal.server import ServerConfig, create_app
from mlxlocal.server.app import Guard
from mlxlocal.server.mcp_tools import MODELS_URI
from mlxlocal.server.metrics import Metrics

KEY = "test-key-7f3a"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
SPAWN_ENV = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def text_of(result) -> str:
    return "".join(getattr(c, "text", "") for c in result.content)


async def exercise(session: ClientSession, engine) -> None:
    """What every transport must do: the tools and their schemas, each tool called, the
    resource, and bad arguments / impossible requests as tool errors naming the field."""
    await session.initialize()
    tools = {t.name: t for t in (await session.list_tools()).tools}
    assert set(tools) == {"generate", "chat", "count_tokens"}
    for tool in tools.values():
        assert tool.annotations.read_only_hint is True and tool.annotations.open_world_hint is False
    max_tokens = tools["generate"].input_schema["properties"]["max_tokens"]
    assert max_tokens["minimum"] == 1 and max_tokens["maximum"] >= 4096
    assert tools["chat"].input_schema["properties"]["messages"]["minItems"] == 1

    prompt = "The capital of France is"
    r = await session.call_tool("generate", {"prompt": prompt, "max_tokens": 4, "temperature": 0.0})
    assert not r.is_error, text_of(r)
    out = r.structured_content
    assert isinstance(out["text"], str) and out["finish_reason"] in ("stop", "length")
    assert out["usage"]["prompt_tokens"] == len(engine.encode_text(prompt))
    assert 1 <= out["usage"]["completion_tokens"] <= 4

    r = await session.call_tool("chat", {"messages": MESSAGES, "max_tokens": 4, "seed": 1})
    assert not r.is_error, text_of(r)
    out = r.structured_content
    assert set(out) >= {"content", "reasoning", "finish_reason", "usage"}
    assert out["usage"]["prompt_tokens"] == len(engine.encode_chat(MESSAGES))

    r = await session.call_tool("count_tokens", {"text": "hello world, hello MCP"})
    assert r.structured_content == {"count": len(engine.encode_text("hello world, hello MCP")),
                                    "context_length": engine.context_length}
    r = await session.call_tool("count_tokens", {"messages": MESSAGES})
    assert r.structured_content["count"] == len(engine.encode_chat(MESSAGES))
    r = await session.call_tool("count_tokens", {"messages": MESSAGES, "add_generation_prompt": False})
    assert r.structured_content["count"] == len(engine.encode_chat(MESSAGES, add_generation_prompt=False))

    contents = (await session.read_resource(MODELS_URI)).contents
    models = json.loads(contents[0].text)["models"]
    assert models[0]["context_length"] == engine.context_length == 512
    assert models[0]["engine"] == "paged" and models[0]["loaded"] is True

    # Bad arguments: the SDK's schema validation, as a tool error naming the field.
    for args, field in [({"prompt": "x", "max_tokens": 0}, "max_tokens"),
                        ({"prompt": "x", "temperature": 9}, "temperature"),
                        ({"prompt": "x", "top_p": 0}, "top_p"),
                        ({"max_tokens": 3}, "prompt")]:
        r = await session.call_tool("generate", args)
        assert r.is_error and field in text_of(r), (args, text_of(r))
    r = await session.call_tool("chat", {"messages": [{"role": "wizard", "content": "hi"}]})
    assert r.is_error and "messages.0.role" in text_of(r)
    r = await session.call_tool("count_tokens", {"text": "a", "messages": MESSAGES})
    assert r.is_error and "exactly one" in text_of(r)
    # Engine limits: a prompt longer than the context, an unknown model; the server lives on.
    r = await session.call_tool("generate", {"prompt": "word " * 2000, "max_tokens": 4})
    assert r.is_error and "context" in text_of(r) and "prompt" in text_of(r)
    r = await session.call_tool("chat", {"messages": MESSAGES, "model": "no-such-model"})
    assert r.is_error and "model" in text_of(r) and "not served" in text_of(r)
    r = await session.call_tool("count_tokens", {"text": "still alive"})
    assert not r.is_error


async def over_http(url: str, engine, key: str | None = None) -> None:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with httpx2.AsyncClient(headers=headers, timeout=120) as http:
        async with streamable_http_client(url, http_client=http) as (read, write):
            async with ClientSession(read, write) as session:
                await exercise(session, engine)


def post(url: str, **headers) -> httpx.Response:
    """An MCP initialize POST with the given headers (Host / Origin / Authorization)."""
    body = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                       "clientInfo": {"name": "test", "version": "0"}}}
    return httpx.post(url, json=body, timeout=30,
                      headers={"Accept": "application/json, text/event-stream", **headers})


def assert_guarded(url: str, key: str | None) -> None:
    auth = {"Authorization": f"Bearer {key}"} if key else {}
    r = post(url, Origin="http://evil.example", **auth)
    assert r.status_code == 403 and "origin" in r.json()["error"]["message"]
    r = post(url, Host="attacker.example", **auth)  # DNS rebinding: a foreign name on our address
    assert r.status_code in (403, 421)
    assert post(url, Origin="http://localhost:3000", **auth).status_code == 200
    if key:
        assert post(url).status_code == 401
        r = post(url, Authorization="Bearer wrong")
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        assert post(url, Authorization=f"Bearer {key}").status_code == 200


@pytest.fixture(scope="module")
def engine(server):
    """The served tiny model's engine: token counts over MCP must match its encode_*."""
    return server[1].state.registry.models[0].engine


@contextmanager
def spawned_http(model, *args: str):
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlxlocal", "mcp", "serve", "--model", str(model),
                             "--transport", "http", "--port", str(port), *args],
                            env=SPAWN_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}/mcp"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"mcp serve exited: {proc.stderr.read()}")
            try:
                httpx.get(url, timeout=5)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()


# --- the standalone server ----------------------------------------------------------------

@pytest.mark.slow
def test_stdio(tiny_model, engine):
    params = StdioServerParameters(command=sys.executable, env=SPAWN_ENV,
                                   args=["-m", "mlxlocal", "mcp", "serve", "--model", str(tiny_model)])

    async def main():
        async with stdio_client(params) as (read, write):
            async with ClientSession(read, write) as session:
                await exercise(session, engine)

    anyio.run(main)


@pytest.mark.slow
def test_http_with_key(tiny_model, engine):
    with spawned_http(tiny_model, "--api-key", KEY) as url:
        assert_guarded(url, KEY)
        anyio.run(over_http, url, engine, KEY)


@pytest.mark.slow
def test_public_bind_needs_a_key_and_load_errors_are_clean(tmp_path):
    def mcp_serve(*args):
        return subprocess.run([sys.executable, "-m", "mlxlocal", "mcp", "serve", *args], env=SPAWN_ENV,
                              capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)

    out = mcp_serve("--model", str(tmp_path), "--transport", "http", "--host", "0.0.0.0")
    assert out.returncode == 2 and "refusing" in out.stderr and "--api-key" in out.stderr
    out = mcp_serve("--model", str(tmp_path / "missing"))  # stdio: fails before serving
    assert out.returncode == 1 and "cannot load model" in out.stderr and "Traceback" not in out.stderr
    assert out.stdout == ""  # nothing but JSON-RPC may ever reach stdout


def test_host_rule_on_public_binds():
    """The SDK checks neither Host nor Origin when bound to 0.0.0.0 without settings (it turns
    protection on only for loopback hosts); our Guard checks the MCP path on every bind."""
    from mcp.server.transport_security import TransportSecurityMiddleware

    assert TransportSecurityMiddleware(None).settings.enable_dns_rebinding_protection is False
    guard = Guard(None, ServerConfig(models=[], host="0.0.0.0", allowed_hosts=[]), Metrics(),
                  strict_paths=("/mcp",))
    assert guard.strict("/mcp") and guard.strict("/mcp/") and not guard.strict("/mcpx")
    assert not guard.host_allowed("attacker.example:8080", strict=True)
    assert guard.host_allowed("192.168.1.20:8080", strict=True)  # an IP cannot be re-pointed
    assert guard.host_allowed("localhost:8080", strict=True)
    assert guard.host_allowed("attacker.example", strict=False)  # /v1 on a public bind: as before
    named = Guard(None, ServerConfig(models=[], host="10.0.0.5", allowed_hosts=["box.lan"]), Metrics(),
                  strict_paths=("/",))
    assert named.host_allowed("box.lan:8765", True) and named.host_allowed("10.0.0.5:8765", True)
    assert not named.host_allowed("10.0.0.6:8765", True) and not named.host_allowed("evil.lan", True)


# --- /mcp on `mlxlocal serve` --------------------------------------------------------------

def test_serve_mounts_mcp(server, engine):
    url = server[0] + "/mcp"
    assert_guarded(url, None)
    anyio.run(over_http, url, engine)


def test_serve_mcp_behind_the_api_key(tiny_model, engine):
    with running_server(ServerConfig(models=[str(tiny_model)], api_key=KEY)) as (url, _):
        assert_guarded(url + "/mcp", KEY)


def test_serve_without_mcp_endpoint(tiny_model):
    app = create_app(ServerConfig(models=[str(tiny_model)], mcp_endpoint=False))
    assert "/mcp" not in {getattr(r, "path", None) for r in app.routes}
    assert "/mcp" in {getattr(r, "path", None) for r in create_app(ServerConfig(models=[str(tiny_model)])).routes}


# --- bounded sessions ------------------------------------------------------------------------

PROTOCOL = {"mcp-protocol-version": "2025-06-18"}


def open_session(url: str) -> tuple[int, str | None]:
    """initialize + initialized, never closed: (status, session id)."""
    r = post(url)
    sid = r.headers.get("mcp-session-id")
    if r.status_code == 200:
        note = {"jsonrpc": "2.0", "method": "notifications/initialized"}
        httpx.post(url, json=note, timeout=30, headers={"Accept": "application/json, text/event-stream",
                                                         "mcp-session-id": sid, **PROTOCOL})
    return r.status_code, sid


def ping(url: str, sid: str) -> int:
    r = httpx.post(url, json={"jsonrpc": "2.0", "id": 2, "method": "ping"}, timeout=30,
                   headers={"Accept": "application/json, text/event-stream", "mcp-session-id": sid, **PROTOCOL})
    return r.status_code


@contextmanager
def get_stream(url: str, sid: str):
    """The session's standalone GET stream, held open: a request in flight."""
    with httpx.stream("GET", url, timeout=30, headers={"Accept": "text/event-stream", "mcp-session-id": sid,
                                                        **PROTOCOL}) as r:
        assert r.status_code == 200
        yield r


def test_a_full_session_table_evicts_the_least_recently_used_idle_session(tiny_model):
    """Before: the SDK's table (10,000 by default) refused every new client with 503 once
    full, for its 30-minute idle timeout. Now a full table closes its LRU idle session."""
    config = ServerConfig(models=[str(tiny_model)], mcp_max_sessions=3)
    with running_server(config) as (base, app):
        url = base + "/mcp"
        sessions = app.state.mcp_sessions
        s1, s2, s3 = (open_session(url)[1] for _ in range(3))
        assert ping(url, s1) == 200  # s1 used again: s2 is now the least recently used
        status, s4 = open_session(url)
        assert status == 200 and sessions.open_sessions == 3 and sessions.evicted == 1
        assert ping(url, s2) == 404  # closed: the client initializes anew (MCP spec)
        assert [ping(url, s) for s in (s1, s3, s4)] == [200, 200, 200]

        # A session with a request in flight (its GET stream) is never evicted, however old.
        with get_stream(url, s1), get_stream(url, s3):
            status, s5 = open_session(url)  # evicts s4, the only idle one
            assert status == 200 and ping(url, s4) == 404
            with get_stream(url, s5):
                assert post(url).status_code == 503  # every session busy: refused, nothing evicted
            assert [ping(url, s) for s in (s1, s3)] == [200, 200]
        assert sessions.open_sessions == 3


def test_idle_mcp_sessions_expire(tiny_model):
    config = ServerConfig(models=[str(tiny_model)], mcp_session_idle=0.5)
    with running_server(config) as (base, app):
        url = base + "/mcp"
        _, sid = open_session(url)
        assert ping(url, sid) == 200
        deadline = time.monotonic() + 10
        while app.state.mcp_sessions.open_sessions and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ping(url, sid) == 404 and app.state.mcp_sessions.open_sessions == 0
