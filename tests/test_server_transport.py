"""Transport-level safety of `mlxlocal serve`: disconnects cancel work, Host checks, 429
Retry-After, preflights, chunked and slow bodies, slow headers, log flooding."""

from __future__ import annotations

import concurrent.futures
import json
import logging
import re
import socket
import time

import httpx
import pytest
from conftest import BASE, build_tiny
from server_util import running_server

from mlxlocal.server import ServerConfig
from mlxlocal.server.banner import RepeatFilter


@pytest.fixture(scope="module")
def server(tiny_model):
    config = ServerConfig(models=[str(tiny_model)], max_body_bytes=4096, body_timeout=1.0, header_timeout=1.0,
                          allowed_hosts=["api.example.test"], engine_options={"max_waiting": 1})
    with running_server(config, like_serve=True) as (url, app):
        yield url, app


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def metric(url: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", httpx.get(f"{url}/metrics", timeout=30).text, re.M)
    return float(m[1]) if m else 0.0


# --- client gone before the response starts --------------------------------------------------

SLOW = dict(BASE, model_type="qwen3", tie_word_embeddings=True, hidden_size=256, intermediate_size=512,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
            max_position_embeddings=2048, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
PROMPT = " ".join(f"w{i % 50}" for i in range(700))  # ~1,800 tokens: prefill takes several steps


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory):
    path = build_tiny(tmp_path_factory.mktemp("slow") / "m", SLOW)
    with running_server(ServerConfig(models=[str(path)]), like_serve=True) as (url, app):
        yield url, app, str(path)


def hang_up_after(url: str, route: str, body: dict, delay: float) -> None:
    raw = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port_of(url)), timeout=5) as s:
        s.sendall(f"POST {route} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
        time.sleep(delay)


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages", "/api/chat", "/v1/responses"])
def test_client_gone_before_the_response_cancels_the_request(slow_server, route):
    url, app, model = slow_server
    engine = app.state.registry.models[0].engine
    messages = [{"role": "user", "content": PROMPT}]
    body = ({"model": model, "stream": False, "options": {"num_predict": 200}, "messages": messages}
            if route.startswith("/api/") else {"model": model, "max_output_tokens": 200, "input": messages}
            if route == "/v1/responses" else {"model": model, "max_tokens": 200, "messages": messages})
    cancelled = metric(url, "mlxlocal_requests_cancelled_total")
    hang_up_after(url, route, body, 0.1)  # non-streaming, still in prefill
    gone = time.monotonic()
    while time.monotonic() - gone < 10:
        stats = engine.stats()
        if stats["running"] == 0 and stats["waiting"] == 0 and stats["blocks_used"] == 0:
            break
        time.sleep(0.02)
    latency = time.monotonic() - gone
    assert stats["running"] == stats["waiting"] == stats["blocks_used"] == 0, stats
    assert latency < 3.0, latency  # before pure-ASGI middleware: the whole request (tens of s)
    assert metric(url, "mlxlocal_requests_cancelled_total") == cancelled + 1
    assert metric(url, "mlxlocal_cancelled_max_tokens_unspent_total") > 0


# --- DNS rebinding: the Host header ---------------------------------------------------------------

def test_foreign_host_is_refused_in_the_callers_dialect(server):
    url, _ = server
    evil = {"Host": "evil.example"}
    for path in ("/v1/models", "/api/tags", "/api/ps", "/metrics", "/docs"):
        assert httpx.get(url + path, headers=evil).status_code == 421, path
    assert "error" in httpx.get(f"{url}/v1/models", headers=evil).json()
    assert isinstance(httpx.get(f"{url}/api/tags", headers=evil).json()["error"], str)
    anthropic = httpx.post(f"{url}/v1/messages", headers=evil, json={})
    assert anthropic.status_code == 421 and anthropic.json()["type"] == "error"
    assert httpx.get(f"{url}/health", headers=evil).status_code == 200  # liveness stays open


def test_loopback_and_allowed_hosts_pass(server):
    url, _ = server
    port = port_of(url)
    for host in (f"localhost:{port}", f"127.0.0.1:{port}", "127.0.0.2", f"[::1]:{port}", "[::1]",
                 "LOCALHOST", "api.example.test", f"api.example.test:{port}"):
        assert httpx.get(f"{url}/v1/models", headers={"Host": host}).status_code == 200, host
    assert httpx.get(f"{url}/v1/models", headers={"Host": "api.example.test.evil.example"}).status_code == 421


MALFORMED_HOSTS = ["localhost:x@evil.example", "localhost:80@evil.example", "127.0.0.1:1:evil.example",
                   "localhost:", "localhost:0", "localhost:65536", "localhost:８０", "[::1]evil.example",
                   "[::1", "::1", "localhost/evil", "local host", "[127.0.0.1]:80"]


def test_malformed_host_is_refused(server):
    """Before: whatever followed the last ':' was ignored, so `localhost:x@evil.example`
    passed as localhost. Now a Host that is not host[:port] (port 1-65535) is a 400."""
    url, _ = server
    for host in (h for h in MALFORMED_HOSTS if h.isascii()):  # httpx sends ASCII headers only
        for path in ("/v1/models", "/mcp", "/health"):
            r = httpx.get(url + path, headers={"Host": host})
            assert r.status_code == 400 and "Host" in r.text, (host, path, r.status_code)
    with socket.create_connection(("127.0.0.1", port_of(url)), timeout=10) as s:  # httpx sends one Host
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\nHost: evil.example\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 400")


def test_malformed_host_is_refused_on_public_binds_too():
    from mlxlocal.server.app import Guard

    guard = Guard(None, ServerConfig(models=["x"], host="0.0.0.0"), None)
    scope = {"type": "http", "path": "/v1/models", "method": "GET"}
    for host in MALFORMED_HOSTS:
        assert guard.refusal({**scope, "headers": [(b"host", host.encode())]})[0] == 400, host
        assert not guard.host_allowed(host)
    assert guard.refusal({**scope, "headers": [(b"host", b"my-box.lan:8080")]}) is None


def test_non_loopback_bind_accepts_any_host_unless_told():
    from mlxlocal.server.app import Guard

    def allows(header, **kw):
        return Guard(None, ServerConfig(models=["x"], **kw), None).host_allowed(header)

    assert allows("my-box.lan", host="0.0.0.0")
    assert not allows("my-box.lan", host="0.0.0.0", allowed_hosts=["api.example.test"])
    assert allows("localhost:1", host="0.0.0.0", allowed_hosts=["api.example.test"])
    assert not allows("my-box.lan", host="127.0.0.1")


# --- 429 and preflights ---------------------------------------------------------------------------

def test_429_carries_retry_after(server, tiny_model):
    url, _ = server
    body = {"model": str(tiny_model), "prompt": "count with me", "max_tokens": 120, "ignore_eos": True}

    def post(_):
        return httpx.post(f"{url}/v1/completions", json=body, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        responses = list(pool.map(post, range(12)))
    refused = [r for r in responses if r.status_code == 429]
    assert refused, [r.status_code for r in responses]
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"


def test_foreign_preflight_gets_dialect_json_403(server):
    url, _ = server
    preflight = {"Origin": "https://evil.example.com", "Access-Control-Request-Method": "POST"}
    r = httpx.options(f"{url}/v1/chat/completions", headers=preflight)
    assert r.status_code == 403 and "origin" in r.json()["error"]["message"]
    r = httpx.options(f"{url}/v1/messages", headers=preflight)
    assert r.status_code == 403 and r.json()["type"] == "error"
    r = httpx.options(f"{url}/api/chat", headers=preflight)
    assert r.status_code == 403 and isinstance(r.json()["error"], str)
    ok = httpx.options(f"{url}/v1/chat/completions", headers={**preflight, "Origin": "http://localhost:3000"})
    assert ok.status_code == 200 and ok.headers["access-control-allow-origin"] == "http://localhost:3000"


# --- bounded bodies -------------------------------------------------------------------------------

@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages", "/api/chat", "/api/generate"])
def test_chunked_body_over_the_limit_is_413(server, route):
    url, _ = server
    big = b'{"model": "x", "messages": [{"role": "user", "content": "' + b"a" * 8000 + b'"}]}'

    def chunks():  # no Content-Length: chunked transfer encoding
        for i in range(0, len(big), 1000):
            yield big[i:i + 1000]

    r = httpx.post(url + route, content=chunks(), headers={"Content-Type": "application/json"}, timeout=10)
    assert r.status_code == 413, (r.status_code, r.text)
    assert "limit" in json.dumps(r.json())


def test_slow_body_gets_408(server):
    url, _ = server
    with socket.create_connection(("127.0.0.1", port_of(url)), timeout=5) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{")
        t0 = time.monotonic()
        reply = b""
        while b"\r\n\r\n" not in reply and time.monotonic() - t0 < 5:
            s.sendall(b" ")  # a byte every 0.2 s: never done within the 1 s budget
            s.settimeout(0.2)
            try:
                reply += s.recv(4096)
            except TimeoutError:
                pass
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert time.monotonic() - t0 < 2.5


def test_slow_headers_are_cut_off(server):
    url, _ = server
    with socket.create_connection(("127.0.0.1", port_of(url)), timeout=5) as s:
        t0 = time.monotonic()
        closed = False
        for byte in b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 100:
            try:
                s.sendall(bytes([byte]))
                s.settimeout(0.2)
                if s.recv(1) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:  # reset by the server
                closed = True
                break
        assert closed and time.monotonic() - t0 < 2.5  # header_timeout=1.0
    assert httpx.get(f"{url}/health").status_code == 200  # the server itself is fine


# --- log flooding ---------------------------------------------------------------------------------

def test_repeat_filter_collapses_identical_lines():
    records = []
    logger = logging.getLogger("mlxlocal.test_repeat")
    logger.propagate = False
    handler = logging.Handler()
    handler.emit = records.append
    logger.addHandler(handler)
    flt = RepeatFilter(burst=3, interval=0.3)
    logger.addFilter(flt)
    try:
        for _ in range(50):
            logger.error("socket.accept() out of system resource")
        logger.error("a different message")
        assert len(records) == 4  # three copies, then silence; other messages pass
        time.sleep(0.35)
        logger.error("socket.accept() out of system resource")
        assert "suppressed 47 similar messages" in records[-1].getMessage()
    finally:
        logger.removeFilter(flt)
        logger.removeHandler(handler)
