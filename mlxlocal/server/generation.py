"""Run one request on an engine from async code: errors as API errors, metrics, disconnects."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from fastapi import Request

from mlxlocal.engine import CapacityError, Chunk, SamplingParams
from mlxlocal.engine.paged import QueueFullError
from mlxlocal.errors import ContextLengthError
from mlxlocal.server.errors import APIError
from mlxlocal.server.metrics import Metrics


def start(engine, prompt: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop):
    """Submit; return (async chunk stream, cancel function). Raises APIError on a bad request."""
    try:
        handle = engine.submit(prompt, params, loop=loop)
    except ContextLengthError as e:
        raise APIError(400, str(e), param="messages", code="context_length_exceeded") from None
    except QueueFullError as e:
        raise APIError(429, f"server busy: {e}; retry later") from None
    except CapacityError as e:
        raise APIError(400, str(e)) from None
    except ValueError as e:
        raise APIError(400, str(e)) from None
    return handle.astream(), handle.cancel


async def _watch(request: Request, cancel) -> None:
    while True:
        await asyncio.sleep(0.25)
        if await request.is_disconnected():
            cancel()
            return


async def run(request: Request, engine, prompt: list[int], params: SamplingParams,
              metrics: Metrics) -> AsyncIterator[Chunk]:
    """Stream a request's chunks; a client that goes away cancels it (blocks freed next step)."""
    stream, cancel = start(engine, prompt, params, asyncio.get_running_loop())
    watcher = asyncio.create_task(_watch(request, cancel))
    t0, last = time.perf_counter(), None
    try:
        async for chunk in stream:
            if chunk.token is not None:
                now = time.perf_counter()
                if last is None:
                    metrics.ttft.observe(now - t0)
                else:
                    metrics.itl.observe(now - last)
                last = now
            if chunk.stats is not None:
                metrics.prompt_tokens.inc(chunk.stats.prompt_tokens)
                metrics.generated_tokens.inc(chunk.stats.completion_tokens)
            yield chunk
    finally:
        watcher.cancel()
        cancel()  # no-op once finished; frees the request if the consumer stopped early
