"""Run one request on an engine from async code: errors as API errors, metrics, disconnects."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import Request

from mlxlocal.engine import CapacityError, Chunk, Engine, EngineDeadError, SamplingParams
from mlxlocal.engine.paged import QueueFullError
from mlxlocal.errors import ContextLengthError
from mlxlocal.server.errors import RETRY_AFTER, APIError
from mlxlocal.server.metrics import Metrics


def start(engine: Engine, prompt: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop):
    """Submit; return (async chunk stream, cancel function). Raises APIError on a bad request."""
    try:
        handle = engine.submit(prompt, params, loop=loop)
    except ContextLengthError as e:
        raise APIError(400, str(e), param="messages", code="context_length_exceeded") from None
    except QueueFullError as e:
        raise APIError(429, f"server busy: {e}; retry later", headers={"Retry-After": RETRY_AFTER}) from None
    except CapacityError as e:
        raise APIError(400, str(e)) from None
    except ValueError as e:
        raise APIError(400, str(e)) from None
    except EngineDeadError as e:  # the registry restarts it on the next request
        raise APIError(503, str(e), headers={"Retry-After": RETRY_AFTER}) from None
    return handle.astream(), handle.cancel


async def _watch(request: Request, cancel) -> None:
    """Cancel the request once its client is gone: before the response starts (prefill, a
    non-streaming request) nothing else would notice. is_disconnected() is a non-blocking
    check, so poll it; 0.1 s is small next to a step and costs nothing measurable."""
    while True:
        await asyncio.sleep(0.1)
        if await request.is_disconnected():
            cancel()
            return


async def _dead_is_503(stream: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
    """An engine that dies after accepting the request: a 503 before the response starts,
    an error event after (the routers already turn errors into one mid-stream)."""
    try:
        async for chunk in stream:
            yield chunk
    except EngineDeadError as e:
        raise APIError(503, str(e), headers={"Retry-After": RETRY_AFTER}) from None


async def run(request: Request, engine: Engine, prompt: list[int], params: SamplingParams,
              metrics: Metrics) -> AsyncIterator[Chunk]:
    """Stream a request's chunks; a client that goes away cancels it (blocks freed next step)."""
    loop = asyncio.get_running_loop()
    if params.grammar is None:
        stream, cancel = start(engine, prompt, params, loop)
    else:  # submit compiles the grammar (the first one also indexes the vocabulary): off the loop
        stream, cancel = await asyncio.to_thread(start, engine, prompt, params, loop)
    watcher = asyncio.create_task(_watch(request, cancel))
    t0, last, generated, finished = time.perf_counter(), None, 0, False
    try:
        async for chunk in _dead_is_503(stream):
            if chunk.token is not None:
                generated += 1
                now = time.perf_counter()
                if last is None:
                    metrics.ttft.observe(now - t0)
                else:
                    metrics.itl.observe(now - last)
                last = now
            if chunk.stats is not None:
                metrics.prompt_tokens.inc(chunk.stats.prompt_tokens)
                metrics.generated_tokens.inc(chunk.stats.completion_tokens)
            finished = finished or chunk.finish_reason not in (None, "cancelled")
            yield chunk
    finally:
        watcher.cancel()
        cancel()  # no-op once finished; frees the request if the consumer stopped early
        if not finished:  # the client went away (or the response stopped reading): cut short
            metrics.cancelled.inc()
            budget = min(params.max_tokens, engine.context_length - len(prompt))
            metrics.cancelled_unspent.inc(max(0, budget - generated))
