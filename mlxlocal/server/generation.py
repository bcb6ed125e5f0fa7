"""Run one request on an engine from async code: errors as API errors, metrics, disconnects,
and its KV cache use (akv.py): the session it continues, the edits of its prompt."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Literal

from fastapi import Request

from mlxlocal.engine import (
    Chunk,
    Engine,
    EngineDeadError,
    OutOfCapacity,
    QueueFull,
    SamplingParams,
    SessionBusy,
)
from mlxlocal.errors import ContextLengthError, NonFiniteLogitsError
from mlxlocal.server import akv, lanes
from mlxlocal.server.errors import RETRY_AFTER, APIError
from mlxlocal.server.metrics import Metrics

log = logging.getLogger("mlxlocal.server")


def _busy(session_id: str | None) -> APIError:
    return APIError(409, f"session {session_id!r} is already generating a reply; a session runs one request at "
                         f"a time (wait for it, or use another {akv.SESSION_HEADER})", param=akv.SESSION_HEADER,
                    code="session_busy")


@dataclass(frozen=True)
class Waiting:
    """No output yet (or for a while): time for a keep-alive. `done` of the `total` prompt
    tokens are in the cache (the prefill's progress)."""

    done: int
    total: int
    kind: Literal["waiting"] = "waiting"


def submit(engine: Engine, prompt: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop,
           session=None, cache: akv.CacheUse | None = None):
    """engine.submit, its refusals as APIErrors; returns the RequestHandle."""
    edits = cache.edits if cache is not None else []
    # Only what the request uses: a plain request is the plain submit call.
    extra = {**({"session": session} if session is not None else {}), **({"edits": edits} if edits else {})}
    try:
        try:
            handle = engine.submit(prompt, params, loop=loop, **extra)
        except ValueError as e:
            if cache is None or not edits or cache.field is not None or isinstance(e, SessionBusy):
                raise
            # The server's --kv-compact policy on a model or engine that cannot edit its cache
            # (the engine says why): the request runs uncompacted rather than failing.
            log.warning("--kv-compact skipped for session %r: %s", cache.session_id, e)
            handle = engine.submit(prompt, params, loop=loop, **({"session": session} if session is not None else {}))
    except ContextLengthError as e:
        raise APIError(400, str(e), param="messages", code="context_length_exceeded") from None
    except QueueFull as e:
        raise APIError(429, f"server busy: {e}; retry later", headers={"Retry-After": RETRY_AFTER}) from None
    except OutOfCapacity as e:
        raise APIError(400, str(e)) from None
    except SessionBusy:  # a second request raced to the same session
        raise _busy(cache.session_id if cache is not None else None) from None
    except ValueError as e:
        field = cache.field if cache is not None and edits else None
        raise APIError(400, f"{field}: {e}" if field else str(e), param=field) from None
    except EngineDeadError as e:  # the registry restarts it on the next request
        raise APIError(503, str(e), headers={"Retry-After": RETRY_AFTER}) from None
    return handle


def _stopping() -> APIError:
    return APIError(503, "the server is shutting down; retry the request", headers={"Retry-After": RETRY_AFTER})


async def _watch(request: Request, cancel, registry) -> None:
    """Cancel the request once its client is gone: before the response starts (prefill, a
    non-streaming request) nothing else would notice. is_disconnected() is a non-blocking
    check, so poll it; 0.1 s is small next to a step and costs nothing measurable. Also
    once the server stops (SIGTERM): `run` then ends the stream with an error event."""
    while True:
        await asyncio.sleep(0.1)
        if registry.stopping or await request.is_disconnected():
            cancel()
            return


async def _dead_is_503(batches: AsyncGenerator[list[Chunk] | None, None],
                       ) -> AsyncGenerator[list[Chunk] | None, None]:
    """An engine that dies after accepting the request: a 503 before the response starts,
    an error event after (the routers already turn errors into one mid-stream). Non-finite
    logits end this request alone: a 500 that says so."""
    try:
        async for batch in batches:
            yield batch
    except EngineDeadError as e:
        raise APIError(503, str(e), headers={"Retry-After": RETRY_AFTER}) from None
    except NonFiniteLogitsError as e:  # this request alone: the engine serves on
        raise APIError(500, str(e), code="non_finite_logits") from None
    finally:
        await batches.aclose()


async def _session(request: Request, engine: Engine, prompt: list[int], params: SamplingParams,
                   cache: akv.CacheUse | None):
    """The engine session a request continues (None without a session id); 409 while it
    generates. Looked up on the event loop, right before submit. Idle sessions that pin
    the room this request needs are freed first (the engine would wait for it for ever)."""
    registry = request.app.state.registry
    session, evicted = None, []
    if cache is not None and cache.session_id is not None:
        session, evicted = registry.session(cache.model, cache.session_id)
        if session.busy:
            raise _busy(cache.session_id)
    need = len(prompt) + min(params.max_tokens, max(engine.context_length - len(prompt), 0))
    evicted += registry.make_room(engine, need, session)
    await akv.reset_quietly(evicted)
    return session


async def run(request: Request, engine: Engine, prompt: list[int], params: SamplingParams,
              metrics: Metrics, cache: akv.CacheUse | None = None,
              keepalive: float | None = None) -> AsyncGenerator[list[Chunk] | Waiting, None]:
    """Stream a request's chunks, a list of all that are ready at each wake-up (the routers
    parse and frame them together: one write per step, not per token); a client that goes
    away cancels it (blocks freed next step). With `keepalive` (seconds), a Waiting right
    after submit (the response can start) and one each time no chunk came for that long."""
    loop = asyncio.get_running_loop()
    registry = request.app.state.registry
    if registry.stopping:
        raise _stopping()
    session = await _session(request, engine, prompt, params, cache)
    if params.grammar is None:
        handle = submit(engine, prompt, params, loop, session, cache)
    else:  # submit compiles the grammar (the first one also indexes the vocabulary): off the loop
        lane = lanes.grammar_lane(len(params.grammar.spec))
        handle = await lane.run(submit, engine, prompt, params, loop, session, cache)
    cancel = handle.cancel
    watcher = asyncio.create_task(_watch(request, cancel, registry))
    t0, last, generated, finished = time.perf_counter(), None, 0, False
    lanes.chat_started()
    try:
        if keepalive is not None:
            yield Waiting(*handle.progress())
        async for batch in _dead_is_503(handle.batches(idle=keepalive)):
            if batch is None:
                yield Waiting(*handle.progress())
                continue
            now = time.perf_counter()
            for chunk in batch:
                if chunk.finish_reason == "cancelled" and registry.stopping:
                    raise _stopping()  # a 503 before the response starts, an error event after
                if chunk.token is not None:
                    generated += 1
                    if last is None:
                        metrics.ttft.observe(now - t0)
                    else:
                        metrics.itl.observe(now - last)
                    last = now
                if chunk.stats is not None:
                    metrics.prompt_tokens.inc(chunk.stats.prompt_tokens)
                    metrics.generated_tokens.inc(chunk.stats.completion_tokens)
                finished = finished or chunk.finish_reason not in (None, "cancelled")
            yield batch
    finally:
        lanes.chat_ended()
        watcher.cancel()
        cancel()  # no-op once finished; frees the request if the consumer stopped early
        if not finished:  # the client went away (or the response stopped reading): cut short
            metrics.cancelled.inc()
            budget = min(params.max_tokens, engine.context_length - len(prompt))
            metrics.cancelled_unspent.inc(max(0, budget - generated))
