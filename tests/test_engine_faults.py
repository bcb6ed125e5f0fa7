"""An engine that cannot die silently: faults fail one request, a dead engine wakes everyone,
shutdown is bounded, and a cancel during prefill is honoured between chunks.

Faults are injected by patching what the engine thread calls. Every wait is bounded:
a hang fails the test instead of blocking the run.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from conftest import wait_for
from engine_util import drain, tokens

from mlxlocal.engine import EngineDeadError, PagedEngine, SamplingParams, SimpleEngine, open_engine
from mlxlocal.engine.handle import RequestHandle
from mlxlocal.engine.sampling import Sampler, sample_batch
from mlxlocal.source.loader import load_from_dir

POISON = 4242  # the seed that marks the request a fault is injected into


def prompt_of(n: int, shift: int = 0) -> list[int]:
    return [(i * 37 + 11 + shift * 101) % 300 for i in range(n)]


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def idle_blocks(eng: PagedEngine) -> dict:
    assert wait_for(lambda: (s := eng.stats())["running"] + s["waiting"] == 0), eng.stats()
    st = eng.stats()
    assert st["blocks_used"] == 0, st
    return st


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return load_from_dir(tiny_model)


@pytest.fixture
def engine(loaded):
    eng = open_engine(loaded, block_size=16, kv_blocks=64)
    assert isinstance(eng, PagedEngine)
    yield eng
    eng.shutdown(timeout=5)


# --- 1. a fault in one request fails that request only ------------------------------------

@pytest.fixture
def poisoned_admission(monkeypatch):
    """Sampler creation (on the engine thread, at admission) raises for the POISON seed: the
    review's seed -1 did just this in mx.random.key and killed the engine for good."""
    original = Sampler.__init__

    def init(self, params, *args, **kwargs):
        if params.seed == POISON:
            raise RuntimeError("injected admission fault")
        original(self, params, *args, **kwargs)

    monkeypatch.setattr(Sampler, "__init__", init)


def test_admission_fault_fails_only_its_request(engine, poisoned_admission):
    expected = tokens(drain(engine.submit(prompt_of(20), greedy(8)))[0])
    good = engine.submit(prompt_of(20), greedy(8))
    bad = engine.submit(prompt_of(20, shift=1), greedy(8, seed=POISON))
    other = engine.submit(prompt_of(20), greedy(8))
    chunks, error = drain(bad)
    assert chunks == [] and isinstance(error, RuntimeError) and "injected admission fault" in str(error)
    assert tokens(drain(good)[0]) == expected and tokens(drain(other)[0]) == expected
    assert engine.dead_reason is None
    assert tokens(drain(engine.submit(prompt_of(20), greedy(8)))[0]) == expected
    idle_blocks(engine)


def test_admission_fault_releases_the_session(engine, poisoned_admission):
    session = engine.new_session()
    first = drain(engine.submit(prompt_of(40), greedy(4), session=session))[0]
    assert first[-1].finish_reason == "length" and session.block_table
    _, error = drain(engine.submit(prompt_of(40) + [5, 6], greedy(4, seed=POISON), session=session))
    assert isinstance(error, RuntimeError) and "injected admission fault" in str(error)
    # The session's blocks went back to the pool, and it takes the next turn.
    assert not session.busy and session.block_table == []
    idle_blocks(engine)
    again = drain(engine.submit(prompt_of(40), greedy(4), session=session))[0]
    assert tokens(again) == tokens(first)


def test_sampling_fault_mid_stream_fails_only_that_request(engine, monkeypatch):
    solo = {s: tokens(drain(engine.submit(prompt_of(30, s), greedy(12)))[0]) for s in (0, 2)}
    original, original_batch = Sampler.__call__, sample_batch
    calls = {"n": 0}

    def batch(samplers, *args):
        if any(s.params.seed == POISON for s in samplers):
            calls["n"] += 1
            if calls["n"] >= 4:  # a few tokens out: the request is decoding alongside the others
                raise RuntimeError("injected sampling fault")
        return original_batch(samplers, *args)

    def call(self, logits, history, pending=None, allowed=None):
        # The engine's fallback samples one by one, so the fault lands on this request alone.
        if self.params.seed == POISON:
            raise RuntimeError("injected sampling fault")
        return original(self, logits, history, pending, allowed)

    monkeypatch.setattr("mlxlocal.engine.sampling.sample_batch", batch)
    monkeypatch.setattr(Sampler, "__call__", call)
    handles = [engine.submit(prompt_of(30, 0), greedy(12)),
               engine.submit(prompt_of(30, 1), greedy(12, seed=POISON)),
               engine.submit(prompt_of(30, 2), greedy(12))]
    results = [drain(h) for h in handles]
    chunks, error = results[1]
    assert "injected sampling fault" in str(error) and 1 <= len(tokens(chunks)) <= 4
    assert tokens(results[0][0]) == solo[0] and tokens(results[2][0]) == solo[2]
    assert results[0][1] is None and results[2][1] is None
    idle_blocks(engine)


# --- 2. a dead engine: everyone is told, nothing hangs -----------------------------------

def test_dead_engine_fails_every_waiter_at_once(engine, doomed_scheduler):
    """The loop raises outside request handling: a sync and an asyncio consumer both wake."""
    sync_stream = iter(engine.submit(prompt_of(20), greedy(400)))
    assert next(sync_stream).token is not None  # kept: a dropped iterator cancels its request
    result: dict = {}

    async def consume():
        handle = engine.submit(prompt_of(20, 1), greedy(400), loop=asyncio.get_running_loop())
        await asyncio.sleep(0.05)
        doomed_scheduler.append(engine.scheduler)
        t0 = time.monotonic()
        try:
            async for _ in handle.astream():
                pass
        except EngineDeadError as e:
            result["async"] = (e, time.monotonic() - t0)

    asyncio.run(asyncio.wait_for(consume(), 20))
    error, waited = result["async"]
    assert "injected loop fault" in str(error) and waited < 2.0
    _, sync_error = drain(sync_stream, timeout=5)
    assert isinstance(sync_error, EngineDeadError)
    assert "RuntimeError: injected loop fault" in engine.dead_reason
    with pytest.raises(EngineDeadError, match="injected loop fault"):
        engine.submit(prompt_of(5), greedy(2))
    t0 = time.monotonic()
    with pytest.raises(EngineDeadError):
        engine.call(lambda: 1)
    stats = engine.stats()  # answered here, not by the dead thread
    assert stats["running"] == stats["waiting"] == 0 and stats["dead_reason"] == engine.dead_reason
    engine.shutdown(timeout=5)
    assert time.monotonic() - t0 < 1.0


def test_a_consumer_wakes_even_if_its_engine_never_says_so():
    """The handle's own backstop: a stopped engine that sent nothing still ends the wait."""
    reason: list[str] = []
    handle = RequestHandle(dead=lambda: reason[0] if reason else None)
    threading.Timer(0.2, reason.append, ["engine thread vanished"]).start()
    _, error = drain(handle, timeout=5)
    assert isinstance(error, EngineDeadError) and "vanished" in str(error)

    async def consume():
        h = RequestHandle(loop=asyncio.get_running_loop(), dead=lambda: "engine thread vanished")
        with pytest.raises(EngineDeadError):
            async for _ in h.astream():
                pass
        assert h.cancelled.is_set()

    asyncio.run(asyncio.wait_for(consume(), 5))


# --- 3. shutdown is bounded -------------------------------------------------------------

def test_shutdown_cancels_running_and_fails_waiting(loaded):
    eng = open_engine(loaded, block_size=16, kv_blocks=64, max_num_seqs=1)
    running = iter(eng.submit(prompt_of(20), greedy(400)))
    assert next(running).token is not None
    waiting = eng.submit(prompt_of(20, 1), greedy(400))
    t0 = time.monotonic()
    eng.shutdown(timeout=5)
    assert time.monotonic() - t0 < 5
    chunks, error = drain(running, timeout=5)
    assert error is None and chunks[-1].finish_reason == "cancelled"
    _, error = drain(waiting, timeout=5)
    assert isinstance(error, EngineDeadError) and "shut down" in str(error)
    with pytest.raises(EngineDeadError):
        eng.submit(prompt_of(5), greedy(2))


def test_shutdown_returns_while_a_step_is_stuck(loaded):
    eng = open_engine(loaded, block_size=16, kv_blocks=64)
    forward, stuck, release = eng._forward, threading.Event(), threading.Event()

    def slow(seqs, n):
        if n == 1:  # the first decode step hangs until released
            stuck.set()
            release.wait(30)
        return forward(seqs, n)

    eng._forward = slow
    handle = eng.submit(prompt_of(20), greedy(50))
    assert stuck.wait(20)
    t0 = time.monotonic()
    eng.shutdown(timeout=0.3)
    assert time.monotonic() - t0 < 2
    _, error = drain(handle, timeout=5)  # woken while the thread is still stuck
    assert isinstance(error, EngineDeadError)
    release.set()
    eng._thread.join(10)  # once unstuck, the thread sees it is dead and ends
    assert not eng._thread.is_alive()


# --- 4. a cancel during prefill is honoured between chunks ---------------------------------

def slowed(forward, calls: list, delay: float = 0.03):
    def run(*args):
        calls.append(time.monotonic())
        time.sleep(delay)
        return forward(*args)
    return run


def test_paged_cancel_during_prefill_drops_at_next_chunk(loaded):
    eng = open_engine(loaded, block_size=16, kv_blocks=64, max_step_tokens=16)
    try:
        calls: list = []
        eng._forward = slowed(eng._forward, calls)
        prompt = prompt_of(400)  # 25 prefill chunks of 16 tokens
        handle = eng.submit(prompt, greedy(5))
        assert wait_for(lambda: len(calls) >= 2)
        handle.cancel()
        t0 = time.monotonic()
        chunks, error = drain(handle, timeout=10)
        assert error is None and tokens(chunks) == []
        assert chunks[-1].finish_reason == "cancelled"
        assert time.monotonic() - t0 < 1.0 and len(calls) < 10  # not the remaining ~20 chunks
        assert handle.seq.num_computed < len(prompt)
        idle_blocks(eng)
    finally:
        eng.shutdown(timeout=5)


@pytest.fixture(scope="module")
def simple_engine(gemma_model):
    eng = SimpleEngine(load_from_dir(gemma_model), max_step_tokens=16)
    yield eng
    eng.shutdown(timeout=5)


def test_simple_cancel_during_prefill_drops_at_next_chunk(simple_engine, monkeypatch):
    calls: list = []
    monkeypatch.setattr(simple_engine, "_forward", slowed(simple_engine._forward, calls))
    handle = simple_engine.submit(prompt_of(400), greedy(5))
    assert wait_for(lambda: len(calls) >= 2)
    handle.cancel()
    t0 = time.monotonic()
    chunks, error = drain(handle, timeout=10)
    assert error is None and tokens(chunks) == [] and chunks[-1].finish_reason == "cancelled"
    assert time.monotonic() - t0 < 1.0 and len(calls) < 10


def test_simple_engine_fault_fails_one_request_and_resets_its_session(simple_engine, monkeypatch):
    session = simple_engine.new_session()
    expected = tokens(drain(simple_engine.submit(prompt_of(20), greedy(6), session=session))[0])
    forward = simple_engine._forward
    monkeypatch.setattr(simple_engine, "_forward", lambda *a: (_ for _ in ()).throw(RuntimeError("injected")))
    _, error = drain(simple_engine.submit(prompt_of(20) + [9], greedy(6), session=session))
    assert isinstance(error, RuntimeError) and "injected" in str(error)
    assert session.tokens == [] and session.cached_len == 0  # a fresh cache for the next turn
    monkeypatch.setattr(simple_engine, "_forward", forward)
    assert tokens(drain(simple_engine.submit(prompt_of(20), greedy(6), session=session))[0]) == expected


def test_simple_engine_shutdown_is_bounded(tmp_path):
    from conftest import BASE, build_tiny

    path = build_tiny(tmp_path / "gemma", dict(BASE, model_type="gemma", rope_theta=10000.0))
    eng = SimpleEngine(load_from_dir(path))
    calls: list = []
    eng._forward = slowed(eng._forward, calls, delay=0.05)
    running = eng.submit(prompt_of(10), greedy(400))
    queued = eng.submit(prompt_of(10), greedy(400))  # waits for the first: one at a time
    assert wait_for(lambda: len(calls) >= 3)
    t0 = time.monotonic()
    eng.shutdown(timeout=5)
    assert time.monotonic() - t0 < 2
    chunks, error = drain(running, timeout=5)
    assert error is None and chunks[-1].finish_reason == "cancelled"
    _, error = drain(queued, timeout=5)
    assert isinstance(error, EngineDeadError)
    with pytest.raises(EngineDeadError):
        eng.submit(prompt_of(5), greedy(2))
