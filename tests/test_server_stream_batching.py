"""Per-step delivery from the engine thread to the HTTP streams: one event-loop wake-up per
engine step for all requests (engine.handle.Outbox), one write per wake-up (generation.coalesced)."""

from __future__ import annotations

import asyncio
import re
import threading

import httpx
import openai
import pytest
from conftest import wait_for
from server_util import scripted_output

from mlxlocal.engine import Chunk, EngineDeadError, RequestHandle
from mlxlocal.engine.handle import Outbox
from mlxlocal.server.generation import FLUSH, coalesced


@pytest.fixture(scope="module")
def model(tiny_model) -> str:
    return str(tiny_model)


@pytest.fixture(scope="module")
def engine(server):
    return server[1].state.registry.models[0].engine


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# --- the handle and its outbox ------------------------------------------------------------------
def test_one_wakeup_per_loop_per_flush_and_backlog_drains_all():
    async def main():
        loop, outbox = asyncio.get_running_loop(), Outbox()
        handles = [RequestHandle(loop=loop, outbox=outbox) for _ in range(8)]

        def engine_step(step: int) -> None:  # another thread, as the engine's
            for h in handles:
                for k in range(3):
                    h.put(Chunk(f"{step}.{k} ", token=k, finish_reason="stop" if step == 1 and k == 2 else None))
            outbox.flush()

        got = [[] for _ in handles]

        async def read(i: int) -> None:
            async for batch in handles[i].batches():
                got[i].append([c.text for c in batch])

        readers = [asyncio.create_task(read(i)) for i in range(8)]
        await asyncio.sleep(0)  # every reader waits on its future
        for step in range(2):
            t = threading.Thread(target=engine_step, args=(step,))
            t.start()
            t.join()
            await asyncio.sleep(0.05)
        await asyncio.wait_for(asyncio.gather(*readers), 5)
        return outbox.wakeups, got

    wakeups, got = asyncio.run(main())
    assert wakeups == 2  # 2 steps x 8 requests x 3 chunks: one call_soon_threadsafe a step
    assert all(g == [["0.0 ", "0.1 ", "0.2 "], ["1.0 ", "1.1 ", "1.2 "]] for g in got), got


def test_chunks_before_an_error_come_first_then_it_raises():
    async def main():
        h = RequestHandle(loop=asyncio.get_running_loop(), outbox=Outbox())
        h.put(Chunk("a", token=1))
        h.put(EngineDeadError("gone"))
        seen = []
        with pytest.raises(EngineDeadError):
            async for batch in h.batches():
                seen.append([c.text for c in batch])
        return seen, h.cancelled.is_set()

    seen, cancelled = asyncio.run(main())
    assert seen == [["a"]] and cancelled


def test_a_loop_handle_cannot_be_read_synchronously():
    async def make():
        return RequestHandle(loop=asyncio.get_running_loop())

    h = asyncio.run(make())
    with pytest.raises(ValueError, match="loop="):
        next(iter(h))


def test_coalesced_joins_up_to_each_flush():
    async def body():
        for piece in ["a", "b", FLUSH, FLUSH, "c", FLUSH, "d", "e"]:
            yield piece

    async def main():
        return [w async for w in coalesced(body())]

    assert asyncio.run(main()) == ["ab", "c", "de"]


# --- through the real server ---------------------------------------------------------------------
def _count_flushes(engine, monkeypatch) -> list[int]:
    """The number of event loops each of the engine's flushes owed a wake-up (steps with output)."""
    seen: list[int] = []
    original = engine.outbox.flush

    def flush():
        with engine.outbox._lock:
            loops = len(engine.outbox._due)
        if loops:
            seen.append(loops)
        original()

    monkeypatch.setattr(engine.outbox, "flush", flush)
    return seen


def test_eight_concurrent_streams_match_sequential_with_one_wakeup_a_step(server, model, engine, monkeypatch):
    prompts = [f"stream number {i} " + "y" * i for i in range(8)]

    async def one(c, p):
        stream = await c.chat.completions.create(model=model, messages=ask(p), max_tokens=24, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        text, usage = [], None
        async for chunk in stream:
            if chunk.choices:
                text.append(chunk.choices[0].delta.content or "")
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return "".join(text), usage

    async def main():
        async with openai.AsyncOpenAI(base_url=server[0] + "/v1", api_key="x", max_retries=0, timeout=120) as c:
            sequential = [await one(c, p) for p in prompts]
            before = engine.outbox.wakeups
            flushes = _count_flushes(engine, monkeypatch)
            concurrent = await asyncio.gather(*(one(c, p) for p in prompts))
        return sequential, concurrent, engine.outbox.wakeups - before, flushes

    sequential, concurrent, wakeups, flushes = asyncio.run(main())
    assert concurrent == sequential
    assert all(n == 24 for _, n in concurrent)
    # One server event loop: every step with output woke it exactly once, for all 8 streams
    # (8 x 24 tokens in far fewer wake-ups than tokens).
    assert flushes and all(n == 1 for n in flushes)
    assert wakeups == len(flushes)
    assert wakeups < 8 * 24 / 2, wakeups


def _metric(url: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", httpx.get(f"{url}/metrics", timeout=30).text, re.M)
    return float(m[1]) if m else 0.0


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/messages", "/api/chat"])
def test_client_gone_mid_stream_frees_its_sequence(server, model, engine, route):
    url = server[0]
    before = _metric(url, "mlxlocal_requests_cancelled_total")
    body = {"model": model, "messages": ask("go on"), "max_tokens": 3000, "stream": True}

    async def hang_up_after_output(c):
        async with c.stream("POST", url + route, json=body) as r:
            async for line in r.aiter_lines():
                if '"content"' in line or "text_delta" in line:
                    return  # hang up while it is generating

    async def main():
        async with httpx.AsyncClient(timeout=60) as c:
            await asyncio.gather(*(hang_up_after_output(c) for _ in range(4)))

    with scripted_output(engine.tokenizer, "and on " * 2000):
        asyncio.run(main())
        assert wait_for(lambda: (s := engine.stats())["running"] == 0 and s["waiting"] == 0
                        and s["blocks_used"] == 0, 10), engine.stats()
    assert _metric(url, "mlxlocal_requests_cancelled_total") == before + 4


class _CountWrites:
    """ASGI wrapper: how many non-empty body messages each response sent."""

    def __init__(self, app):
        self.app, self.writes = app, []

    def __getattr__(self, name):  # app.state etc.
        return getattr(self.app, name)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        count = [0]
        self.writes.append(count)

        async def counted(message):
            if message["type"] == "http.response.body" and message.get("body"):
                count[0] += 1
            await send(message)

        await self.app(scope, receive, counted)


@pytest.fixture(scope="module")
def counted_server(tiny_model):
    import time

    import uvicorn
    from server_util import free_port

    from mlxlocal.server import ServerConfig, create_app

    config = ServerConfig(models=[str(tiny_model)], port=free_port())
    app = _CountWrites(create_app(config))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=config.port, log_level="warning",
                                           lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        assert thread.is_alive()
        time.sleep(0.05)
    yield f"http://127.0.0.1:{config.port}", app
    server.should_exit = True
    thread.join(timeout=30)


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/v1/messages", "/api/chat",
                                   "/v1/responses"])
def test_one_write_per_wakeup_in_every_dialect(counted_server, tiny_model, route):
    url, app = counted_server
    engine = app.state.registry.models[0].engine
    model = str(tiny_model)
    body = {"model": model, "stream": True, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    if route == "/v1/completions":
        body["prompt"] = "count to ten"
    elif route == "/v1/responses":
        body = {"model": model, "stream": True, "max_output_tokens": 24, "input": "count to ten"}
    else:
        body["messages"] = ask("count to ten")
    if route == "/api/chat":
        body = {"model": model, "messages": ask("count to ten"), "options": {"num_predict": 24}}
    before = engine.outbox.wakeups
    with httpx.stream("POST", url + route, json=body, timeout=60) as r:
        assert r.status_code == 200
        events = sum(1 for line in r.iter_lines() if line.startswith(("data:", "{")))
    wakeups = engine.outbox.wakeups - before
    writes = app.writes[-1][0]
    # Each wake-up's events go out together, plus the keep-alive the response opens with:
    # not one write per SSE event (message_start, deltas, block stops, usage, [DONE] ...).
    assert writes <= wakeups + 1, (writes, wakeups, events)
    if route in ("/v1/messages", "/v1/responses"):  # several events a token, one write
        assert events > writes, (writes, events)
