"""Safe by default: loopback bind, Origin checks, API keys, body limits, errors in each dialect."""

from __future__ import annotations

import httpx
import pytest
from server_util import running_server

from mlxlocal.server import ServerConfig

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def server(tiny_model):
    config = ServerConfig(models=[str(tiny_model)], api_key=KEY, max_body_bytes=4096,
                          allowed_origins=["https://chat.example.org"],
                          engine_options={"max_waiting": 2})
    with running_server(config) as (url, app):
        yield url, app


def auth(extra: dict | None = None) -> dict:
    return {"Authorization": f"Bearer {KEY}", **(extra or {})}


def test_default_config_binds_loopback():
    assert ServerConfig(models=["x"]).host == "127.0.0.1"


def test_health_needs_no_key_everything_else_does(server):
    url, _ = server
    assert httpx.get(f"{url}/health").status_code == 200
    for path in ("/v1/models", "/api/tags", "/metrics"):
        r = httpx.get(url + path)
        assert r.status_code == 401, path
    assert httpx.get(f"{url}/v1/models", headers=auth()).status_code == 200
    assert httpx.get(f"{url}/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_options_needs_the_key_but_preflights_from_allowed_origins_pass(server):
    """Before: every OPTIONS skipped the key and reached the routes (/mcp's session manager
    among them). Now only a CORS preflight from an allowed origin goes without it, answered
    by the CORS layer alone (headers, no route called); any other OPTIONS is a 401."""
    url, _ = server
    for path in ("/v1/chat/completions", "/v1/messages", "/api/chat", "/v1/models", "/mcp", "/no/such/path"):
        r = httpx.options(url + path)
        assert r.status_code == 401, (path, r.status_code, r.text)
        r = httpx.options(url + path, headers={"Origin": "http://localhost:3000"})  # no request method
        assert r.status_code == 401, path
        assert httpx.options(url + path, headers=auth()).status_code != 401, path
        for origin in ("http://localhost:3000", "https://chat.example.org"):
            r = httpx.options(url + path, headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                                                    "Access-Control-Request-Headers": "authorization"})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin, (path, r.text)
            assert r.text == "OK" and "authorization" in r.headers["access-control-allow-headers"].lower()
    evil = {"Origin": "https://evil.example.com", "Access-Control-Request-Method": "POST"}
    assert httpx.options(url + "/v1/chat/completions", headers=evil).status_code == 403


def test_errors_come_in_the_callers_dialect(server):
    url, _ = server
    openai = httpx.post(f"{url}/v1/chat/completions", headers=auth(), content=b"{not json")
    assert openai.status_code == 400 and "message" in openai.json()["error"]
    anthropic = httpx.post(f"{url}/v1/messages", headers=auth(), content=b"{not json")
    assert anthropic.status_code == 400 and anthropic.json()["type"] == "error"
    assert anthropic.json()["error"]["type"] == "invalid_request_error"
    ollama = httpx.post(f"{url}/api/chat", headers=auth(), content=b"{not json")
    assert ollama.status_code == 400 and isinstance(ollama.json()["error"], str)
    unauthorized = httpx.post(f"{url}/v1/messages", content=b"{}")
    assert unauthorized.status_code == 401 and unauthorized.json()["error"]["type"] == "authentication_error"


def test_foreign_browser_origin_is_refused(server):
    url, _ = server
    evil = httpx.get(f"{url}/v1/models", headers=auth({"Origin": "https://evil.example.com"}))
    assert evil.status_code == 403 and "origin" in evil.json()["error"]["message"]
    for ok in ("http://localhost:3000", "http://127.0.0.1:8081", "https://chat.example.org"):
        r = httpx.get(f"{url}/v1/models", headers=auth({"Origin": ok}))
        assert r.status_code == 200, ok
        assert r.headers.get("access-control-allow-origin") == ok
    assert httpx.get(f"{url}/health", headers={"Origin": "https://evil.example.com"}).status_code == 403


def test_body_size_limit(server):
    url, _ = server
    big = b'{"model": "x", "messages": [{"role": "user", "content": "' + b"a" * 8000 + b'"}]}'
    r = httpx.post(f"{url}/v1/chat/completions", headers=auth({"Content-Type": "application/json"}), content=big)
    assert r.status_code == 413

    def chunks():  # no Content-Length: the limit still holds
        yield big[:3000]
        yield big[3000:]

    r = httpx.post(f"{url}/v1/chat/completions", headers=auth({"Content-Type": "application/json"}), content=chunks())
    assert r.status_code == 413


def test_unknown_model_and_over_long_prompt(server, tiny_model):
    url, _ = server
    r = httpx.post(f"{url}/v1/chat/completions", headers=auth(),
                   json={"model": "nope", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    r = httpx.post(f"{url}/v1/completions", headers=auth(),
                   json={"model": str(tiny_model), "prompt": "word " * 700, "max_tokens": 4})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert "512" in message and "context" in message


def test_metrics_exposes_engine_and_latency_series(server, tiny_model):
    url, _ = server
    r = httpx.post(f"{url}/v1/completions", headers=auth(),
                   json={"model": str(tiny_model), "prompt": "hello there", "max_tokens": 4})
    assert r.status_code == 200, r.text
    text = httpx.get(f"{url}/metrics", headers=auth()).text
    for series in ("mlxlocal_requests_running", "mlxlocal_requests_waiting", "mlxlocal_kv_blocks_used",
                   "mlxlocal_kv_blocks_total", "mlxlocal_prefix_cache_hit_tokens",
                   "mlxlocal_prompt_tokens_total", "mlxlocal_generated_tokens_total",
                   "mlxlocal_time_to_first_token_seconds_bucket", "mlxlocal_inter_token_latency_seconds_bucket"):
        assert series in text, series
    generated = next(line for line in text.splitlines() if line.startswith("mlxlocal_generated_tokens_total"))
    assert float(generated.split()[-1]) >= 4
    # The pools now and the budget they may grow to (the server starts light).
    value = {line.split()[0]: float(line.split()[1]) for line in text.splitlines() if line.startswith("mlxlocal_kv_")}
    assert 0 < value["mlxlocal_kv_blocks_total"] <= value["mlxlocal_kv_blocks_max"]


def test_too_many_waiting_requests_get_429(server, tiny_model):
    """max_waiting=2: a burst beyond what the queue holds is refused, not queued forever."""
    import concurrent.futures

    url, _ = server
    body = {"model": str(tiny_model), "prompt": "count with me", "max_tokens": 200, "ignore_eos": True}

    def post(_):
        return httpx.post(f"{url}/v1/completions", headers=auth(), json=body, timeout=120)

    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        responses = list(pool.map(post, range(24)))
    codes = [r.status_code for r in responses]
    assert 429 in codes and 200 in codes
    assert set(codes) <= {200, 429}
    assert all(r.headers.get("retry-after") == "1" for r in responses if r.status_code == 429)


def test_client_gone_mid_stream_frees_its_blocks(server, tiny_model):
    import time

    url, app = server
    engine = app.state.registry.models[0].engine
    before = engine.stats()["tokens_out"]
    body = {"model": str(tiny_model), "stream": True, "max_tokens": 400, "ignore_eos": True,
            "messages": [{"role": "user", "content": "go on and on"}]}
    with httpx.stream("POST", f"{url}/v1/chat/completions", headers=auth(), json=body, timeout=60) as r:
        assert r.status_code == 200
        for i, _ in enumerate(r.iter_lines()):
            if i == 5:
                break  # hang up mid-stream
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats["running"] == 0 and stats["blocks_used"] == 0:
            break
        time.sleep(0.1)
    assert stats["running"] == 0 and stats["blocks_used"] == 0, stats
    assert stats["tokens_out"] - before < 200  # it stopped well before its 400 tokens
