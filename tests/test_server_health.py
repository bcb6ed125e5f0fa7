"""The server when an engine stops: /health says so (503), nothing hangs, the next request
restarts the engine; and SIGTERM ends `mlxlocal serve` in bounded time, streams running."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import mlx.core as mx
import pytest
from server_util import running_server

from mlxlocal.engine import sampling
from mlxlocal.engine.sampling import Sampler
from mlxlocal.server import ServerConfig


@pytest.fixture(scope="module")
def served(tiny_model):
    with running_server(ServerConfig(models=[str(tiny_model)])) as (url, app):
        yield url, app


@pytest.fixture
def no_eos(served, monkeypatch):
    """The tiny random model may sample EOS early; a stream that must run long never does."""
    eos = sorted(served[1].state.registry.models[0].engine.tokenizer.eos_token_ids)
    original = Sampler.__call__

    def call(self, logits, history, pending=None):
        token, logprobs = original(self, logits, history, pending)
        for e in eos:  # lazy: the step's token may not be computed yet
            token = mx.where(token == e, 7, token)
        return token, logprobs

    monkeypatch.setattr(Sampler, "__call__", call)
    batch = sampling.sample_batch  # the engine's usual path: one call for a step's sequences

    def sample_batch(*args, **kwargs):
        tokens, logprobs = batch(*args, **kwargs)
        for e in eos:
            tokens = mx.where(tokens == e, 7, tokens)
        return tokens, logprobs

    monkeypatch.setattr(sampling, "sample_batch", sample_batch)


def chat(url: str, **kw) -> httpx.Response:
    body = {"model": kw.pop("model"), "messages": [{"role": "user", "content": "hello"}], "max_tokens": 5, **kw}
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=30)


def test_dead_engine_is_reported_and_restarted(served, doomed_scheduler):
    url, app = served
    model = app.state.registry.models[0]
    assert httpx.get(url + "/health", timeout=10).status_code == 200
    old = model.engine
    doomed_scheduler.append(old.scheduler)

    t0 = time.monotonic()
    r = chat(url, model=model.name)
    assert time.monotonic() - t0 < 10  # an error, never a hang
    assert r.status_code == 503 and "injected loop fault" in r.text, r.text
    assert r.headers["retry-after"]

    health = httpx.get(url + "/health", timeout=10)
    assert health.status_code == 503
    body = health.json()
    assert body["status"] == "error"
    assert model.name in body["reason"] and "injected loop fault" in body["reason"]
    assert httpx.get(url + "/metrics", timeout=10).status_code == 200  # a dead engine still answers stats

    r = chat(url, model=model.name)  # drops the dead engine and loads a fresh one
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("stop", "length")
    assert model.engine is not old and model.engine.dead_reason is None
    health = httpx.get(url + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_stream_ends_when_the_engine_dies_mid_stream(served, doomed_scheduler, no_eos):
    url, app = served
    model = app.state.registry.models[0]
    httpx.get(url + "/v1/models", timeout=10)  # a dead engine from an earlier test restarts on use
    chat(url, model=model.name)
    body = {"model": model.name, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 400,
            "stream": True}
    lines: list[str] = []
    t0 = time.monotonic()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            lines.append(line)
            if len(lines) == 3:  # streaming now: kill the engine under it
                doomed_scheduler.append(model.engine.scheduler)
    assert time.monotonic() - t0 < 15
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert any("error" in e and "injected loop fault" in json.dumps(e) for e in events), lines[-3:]
    assert lines[-1] == "data: [DONE]" or lines[-1] == ""
    assert httpx.get(url + "/health", timeout=10).status_code == 503
    assert chat(url, model=model.name).status_code == 200  # and back
    assert httpx.get(url + "/health", timeout=10).status_code == 200


def test_stopping_ends_streams_with_an_error_event_and_refuses_new_requests(served, no_eos, monkeypatch):
    """What SIGTERM does first (registry.begin_shutdown, banner.BannerServer.shutdown): a
    running stream ends at once with an error event in its dialect, a new request is a 503."""
    from mlxlocal.engine import paged

    forward = paged.PagedEngine._forward
    monkeypatch.setattr(paged.PagedEngine, "_forward", lambda *a: time.sleep(0.02) or forward(*a))  # 400: 8 s
    url, app = served
    registry, model = app.state.registry, app.state.registry.models[0]
    chat(url, model=model.name)  # loaded (an earlier test may have killed the engine)
    body = {"model": model.name, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 400,
            "stream": True}
    lines: list[str] = []
    try:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=30) as r:
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 3:
                    registry.stopping = True
        r = chat(url, model=model.name)
        assert r.status_code == 503 and "shutting down" in r.text and r.headers["retry-after"]
    finally:
        registry.stopping = False
    events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    assert "shutting down" in events[-1].get("error", {}).get("message", ""), (len(events), lines[-4:])
    assert lines[-2:] == ["data: [DONE]", ""], lines[-3:]
    assert len(events) < 100  # ended there, not after its 400 tokens
    assert model.engine.stats()["running"] == 0


# --- SIGTERM with a stream running ----------------------------------------------------------

# Loaded by the `mlxlocal serve` subprocess (sitecustomize): makes its streams long, so one
# is still running when SIGTERM arrives — each step sleeps, and EOS never ends a reply.
SLOW_ENGINE = textwrap.dedent("""
    import dataclasses, time
    from mlxlocal.engine import paged

    _submit, _forward = paged.PagedEngine.submit, paged.PagedEngine._forward

    def submit(self, prompt, params=None, *args, **kwargs):
        params = dataclasses.replace(params or paged.SamplingParams(), ignore_eos=True)
        return _submit(self, prompt, params, *args, **kwargs)

    def forward(self, seqs, n):
        time.sleep(0.1)
        return _forward(self, seqs, n)

    paged.PagedEngine.submit, paged.PagedEngine._forward = submit, forward
""")


def _lines(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line)
    into.put(None)


MCP_INIT = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
            "params": {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}}}
MCP_HEADERS = {"Accept": "application/json, text/event-stream", "mcp-protocol-version": "2025-06-18"}


@pytest.mark.slow
def test_sigterm_with_a_stream_running_exits_in_bounded_time(tiny_model, tmp_path):
    """SIGTERM with a chat stream running, MCP sessions open (one with its GET stream): the
    process exits within 5 s, and each stream ends with a final event, not a cut connection.
    Before: ~5.2 s (uvicorn's whole graceful timeout) and the streams were cut."""
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(SLOW_ENGINE)
    env = dict(os.environ, MLXLOCAL_HOME=str(tmp_path), HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(inject), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlxlocal", "serve", "-m", str(tiny_model), "--port", "0", "--kv-blocks", "64"],
        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stderr, lines), daemon=True).start()
    seen: list[str] = []
    received: queue.Queue = queue.Queue()
    ends: dict[str, str] = {}
    try:
        deadline = time.monotonic() + 180
        while not (url := re.search(r"serving on (http://127\.0\.0\.1:\d+)", "".join(seen))):
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
            assert line is not None, "serve exited early:\n" + "".join(seen)
            seen.append(line)
        base = url[1]

        def stream():
            body = {"model": str(tiny_model), "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 400, "stream": True}
            try:
                with httpx.stream("POST", base + "/v1/chat/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        if line and not line.startswith(":"):  # not the keep-alive before the first token
                            received.put(line)
                ends["chat"] = "ended"
            except httpx.HTTPError as e:
                ends["chat"] = f"cut: {e!r}"
            received.put(None)

        sids = [httpx.post(base + "/mcp", json=MCP_INIT, headers=MCP_HEADERS, timeout=30).headers["mcp-session-id"]
                for _ in range(20)]

        def mcp_get():
            try:
                with httpx.stream("GET", base + "/mcp", headers={**MCP_HEADERS, "mcp-session-id": sids[0]},
                                  timeout=60) as r:
                    assert r.status_code == 200
                    for _ in r.iter_lines():
                        pass
                ends["mcp"] = "ended"
            except httpx.HTTPError as e:
                ends["mcp"] = f"cut: {e!r}"

        clients = [threading.Thread(target=f, daemon=True) for f in (stream, mcp_get)]
        for c in clients:
            c.start()
        first = received.get(timeout=60)
        assert first and first.startswith("data: "), first
        time.sleep(0.5)
        assert all(c.is_alive() for c in clients)  # ~40 s of stream left (400 tokens at 0.1 s a step)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("mlxlocal serve still running 30 s after SIGTERM (does banner.py give uvicorn "
                        "a timeout_graceful_shutdown? without one it waits for every stream to end)")
        elapsed = time.monotonic() - t0
        for c in clients:
            c.join(10)
            assert not c.is_alive()  # the clients' streams ended too
        while (line := lines.get(timeout=10)) is not None:
            seen.append(line)
        log = "".join(seen)
        assert elapsed < 5, f"{elapsed:.1f} s to stop after SIGTERM:\n{log}"
        assert ends == {"chat": "ended", "mcp": "ended"}, ends
        chat = []
        while (line := received.get(timeout=1)) is not None:
            chat.append(line)
        events = [json.loads(x[6:]) for x in chat if x.startswith("data: {")]
        assert "shutting down" in json.dumps(events[-1]["error"]) and chat[-1] == "data: [DONE]", chat[-4:]
        # uvicorn re-raises the signal it handled once it has shut down: "killed" by SIGTERM.
        assert proc.returncode in (0, -signal.SIGTERM) and "Finished server process" in log, log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
