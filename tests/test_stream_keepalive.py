"""Keep-alives while a long prompt prefills: every dialect's stream starts once the request is
accepted and sends a keep-alive every --stream-keepalive seconds until output comes, so a
client (or proxy) whose idle timeout is shorter than the prefill keeps waiting.

The prefill is made slow deterministically: the tiny model prefills in 32-token chunks and
each chunk's forward sleeps first (`slow_prefill`), so a ~400-token prompt takes >= 3 s
whatever the machine; the clients' read timeout is 1.5 s, keep-alives every 0.25 s.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from contextlib import contextmanager

import anthropic
import httpx
import ollama
import openai
import pytest
from server_util import running_server

from mlxlocal.engine import PagedEngine, SamplingParams, SimpleEngine, open_engine
from mlxlocal.server import ServerConfig
from mlxlocal.source.loader import load_from_dir

CHUNK = 32  # prefill tokens per step
DELAY = 0.25  # seconds each prefill chunk sleeps: ~13 chunks, >= 3 s
TIMEOUT = 1.5  # the clients' read (idle) timeout: shorter than the prefill
KEEPALIVE = 0.25
_tags = itertools.count()


FORWARD = {PagedEngine: PagedEngine._forward, SimpleEngine: SimpleEngine._forward}


@contextmanager
def slow_prefill(cls=PagedEngine, delay: float = DELAY):
    """Every prefill chunk's forward sleeps `delay` first (decode steps are not slowed); an
    inner one replaces an outer one's delay, never adds to it."""
    original, previous = FORWARD[cls], cls._forward

    def forward(self, *args):
        tokens = args[1] if cls is PagedEngine else args[0].size  # (seqs, n) / (token array, cache)
        if tokens > 1:
            time.sleep(delay)
        return original(self, *args)

    cls._forward = forward
    try:
        yield
    finally:
        cls._forward = previous


def long_prompt() -> str:
    """~400 tokens on the tiny tokenizer, new each time (no prefix-cache hit)."""
    return f"request {next(_tags)} at {time.time()}: " + "hello world " * 64


def serve(tiny_model, keepalive: float):
    return running_server(ServerConfig(models=[str(tiny_model)], stream_keepalive=keepalive,
                                       engine_options={"max_step_tokens": CHUNK}))


@pytest.fixture(scope="module")
def slow_server(tiny_model):
    with serve(tiny_model, KEEPALIVE) as (url, app), slow_prefill():
        yield url, app


# --- one streamed request per dialect, with its official client (httpx for raw framing) -------------
def openai_chat(url, model):
    with openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=TIMEOUT, max_retries=0) as c:
        stream = c.chat.completions.create(model=model, stream=True, max_tokens=3, temperature=0,
                                           messages=[{"role": "user", "content": long_prompt()}])
        return [ch.choices[0].finish_reason for ch in stream if ch.choices][-1]


def openai_completions(url, model):
    with openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=TIMEOUT, max_retries=0) as c:
        stream = c.completions.create(model=model, prompt=long_prompt(), stream=True, max_tokens=3,
                                       temperature=0)
        return [ch.choices[0].finish_reason for ch in stream if ch.choices][-1]


def responses(url, model):
    with openai.OpenAI(base_url=url + "/v1", api_key="x", timeout=TIMEOUT, max_retries=0) as c:
        stream = c.responses.create(model=model, input=long_prompt(), stream=True, max_output_tokens=3,
                                     temperature=0)  # greedy: a sampled EOS would end it early
        return [e.type for e in stream][-1]


def anthropic_messages(url, model):
    with anthropic.Anthropic(base_url=url, api_key="x", timeout=TIMEOUT, max_retries=0) as c:
        with c.messages.stream(model=model, max_tokens=3, messages=[{"role": "user", "content": long_prompt()}]) as s:
            return s.get_final_message().stop_reason


def ollama_chat(url, model):
    c = ollama.Client(host=url, timeout=TIMEOUT)
    parts = list(c.chat(model=model, messages=[{"role": "user", "content": long_prompt()}], stream=True,
                        options={"num_predict": 3, "temperature": 0}))
    assert all(not p.done for p in parts[:-1])  # the keep-alives are plain not-done chunks
    return parts[-1].done_reason


def ollama_generate(url, model):
    c = ollama.Client(host=url, timeout=TIMEOUT)
    parts = list(c.generate(model=model, prompt=long_prompt(), stream=True,
                            options={"num_predict": 3, "temperature": 0}))
    return parts[-1].done_reason


DIALECTS = {"openai_chat": (openai_chat, "length"), "completions": (openai_completions, "length"),
            "responses": (responses, "response.incomplete"), "anthropic": (anthropic_messages, "max_tokens"),
            "ollama_chat": (ollama_chat, "length"), "ollama_generate": (ollama_generate, "length")}


@pytest.mark.parametrize("dialect", [
    "openai_chat", *(pytest.param(d, marks=pytest.mark.slow) for d in DIALECTS if d != "openai_chat")])
def test_a_client_with_a_short_idle_timeout_waits_out_a_long_prefill(slow_server, tiny_model, dialect):
    call, finish = DIALECTS[dialect]
    t0 = time.monotonic()
    assert call(slow_server[0], str(tiny_model)) == finish
    assert time.monotonic() - t0 > 2 * TIMEOUT  # the prefill was longer than the client's timeout


@pytest.mark.slow
def test_without_keepalives_that_client_gives_up(tiny_model):
    """The same request with keep-alives off (today's behaviour before them): no byte before
    the first token, so the client's read timeout fires during the prefill."""
    with serve(tiny_model, 0) as (url, _), slow_prefill():
        for dialect in ("openai_chat", "anthropic", "ollama_chat"):
            with pytest.raises((openai.APITimeoutError, anthropic.APITimeoutError, httpx.ReadTimeout)):
                DIALECTS[dialect][0](url, str(tiny_model))


def _raw(url: str, path: str, body: dict) -> tuple[float, list[str]]:
    """(seconds to the first body byte, the body's lines) of a streamed request."""
    t0 = time.monotonic()
    with httpx.stream("POST", url + path, json=body, timeout=TIMEOUT) as r:
        assert r.status_code == 200, r.read()
        lines = r.iter_lines()
        first = next(lines)
        ttfb = time.monotonic() - t0
        return ttfb, [first, *lines]


def test_sse_keepalives_carry_the_prefill_progress(slow_server, tiny_model):
    ttfb, lines = _raw(slow_server[0], "/v1/chat/completions",
                       {"model": str(tiny_model), "stream": True, "max_tokens": 2,
                        "messages": [{"role": "user", "content": long_prompt()}]})
    assert ttfb < TIMEOUT / 2  # the response starts once the request is accepted
    comments = [re.fullmatch(r": keepalive (\d+)/(\d+)", line) for line in lines if line.startswith(":")]
    progress = [(int(m[1]), int(m[2])) for m in comments]  # each one matched
    done, total = [d for d, _ in progress], progress[0][1]
    assert len(progress) >= 8 and progress[0] == (0, total) and total > 300  # one every 0.25 s of >= 3 s
    assert done == sorted(done) and 0 < done[len(done) // 2] < total  # it moved, chunk by chunk
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    # The role chunk comes with the first token, as without keep-alives (clients time it).
    assert data[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert lines.index(next(line for line in lines if line.startswith("data: "))) > len(progress)


@pytest.mark.slow
def test_anthropic_pings_until_the_first_token(slow_server, tiny_model):
    _, lines = _raw(slow_server[0], "/v1/messages", {
        "model": str(tiny_model), "stream": True, "max_tokens": 2,
        "messages": [{"role": "user", "content": long_prompt()}]})
    events = [line[7:] for line in lines if line.startswith("event: ")]
    assert events[0] == "message_start" and events.count("ping") >= 8
    # Pings until the first token; two sampled tokens may show no text (a held-back UTF-8
    # fragment), so what follows the pings is the first block or, without one, the final delta.
    after = next(i for i, event in enumerate(events[1:], 1) if event != "ping")
    assert events[after] in ("content_block_start", "message_delta")
    assert "ping" not in events[after:]
    # Each ping after the first (sent with message_start, as before) has the progress beside it.
    assert sum(line.startswith(": keepalive ") for line in lines) == events.count("ping") - 1


PATHS = (("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
         ("/v1/completions", {"prompt": "hi"}),
         ("/v1/responses", {"input": "hi"}),
         ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}),
         ("/api/chat", {"messages": [{"role": "user", "content": "hi"}]}),
         ("/api/generate", {"prompt": "hi"}))


def test_refusals_at_submit_stay_http_statuses(slow_server, tiny_model, monkeypatch):
    """Headers go out only once the engine took the request: a full queue is still a 429."""
    url, app = slow_server
    httpx.post(url + "/v1/completions", json={"model": str(tiny_model), "prompt": "hi", "max_tokens": 1}, timeout=30)
    engine = app.state.registry.models[0].engine
    monkeypatch.setattr(engine.config, "max_waiting", 0)
    for path, body in PATHS:
        r = httpx.post(url + path, json={"model": str(tiny_model), "stream": True, **body}, timeout=30)
        assert r.status_code == 429 and "already waiting" in r.text, (path, r.text)


def test_an_engine_that_dies_mid_prefill_ends_the_stream_with_an_error(tiny_model, doomed_scheduler):
    with serve(tiny_model, KEEPALIVE) as (url, app), slow_prefill():
        httpx.post(url + "/v1/completions", json={"model": str(tiny_model), "prompt": "hi", "max_tokens": 1})
        engine = app.state.registry.models[0].engine
        body = {"model": str(tiny_model), "stream": True, "max_tokens": 2,
                "messages": [{"role": "user", "content": long_prompt()}]}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=10) as r:
            assert r.status_code == 200
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                if line.startswith(": keepalive") and len(lines) > 4:  # prefilling: kill the engine
                    doomed_scheduler.append(engine.scheduler)
    errors = [json.loads(line[6:])["error"] for line in lines if line.startswith('data: {"error"')]
    assert errors and errors[0]["type"] == "server_error" and "injected loop fault" in errors[0]["message"]
    assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]"


# --- the engine's side: progress through the contract, idle ticks ------------------------------------
@pytest.mark.parametrize("kind", ["paged", "simple"])
def test_a_handle_reports_its_prefill_progress(kind, tiny_model, gemma_model):
    if kind == "paged":
        engine, cls = open_engine(load_from_dir(tiny_model), max_step_tokens=16, kv_blocks=64), PagedEngine
    else:
        engine, cls = SimpleEngine(load_from_dir(gemma_model), max_step_tokens=16), SimpleEngine
    prompt = engine.encode_text(long_prompt())[:300]

    async def go():
        handle = engine.submit(prompt, SamplingParams(max_tokens=2), loop=asyncio.get_running_loop())
        seen, ticks = [handle.progress()], 0
        async for chunk in handle.astream(idle=0.05):
            if chunk is None:
                ticks += 1
                seen.append(handle.progress())
            elif chunk.finish_reason is not None:
                return seen, ticks, chunk
        raise AssertionError("no last chunk")

    try:
        with slow_prefill(cls, delay=0.1):
            seen, ticks, last = asyncio.run(go())
    finally:
        engine.shutdown()
    assert seen[0][1] == len(prompt) and all(total == len(prompt) for _, total in seen)
    done = [d for d, _ in seen]
    assert done == sorted(done) and any(0 < d < len(prompt) for d in done), seen
    assert ticks >= 10 and last.stats.completion_tokens == 2  # ~19 chunks of 0.1 s, ticks every 0.05 s
