"""A prepared request on its engine, from async code: submitted (its refusals as API errors,
its session and cache edits), watched (a client gone or the server stopping cancels it),
counted (metrics), and its chunks parsed into events once for every dialect: the routers
only translate.

`open_events` starts a request and awaits its first chunk, so a refused request (context,
queue, pool, dead engine) raises as a real HTTP error before any response byte. With
`keepalive` (streaming responses) it returns once the request is submitted: what fails
after that (the engine dying mid-prefill) comes in the stream, as the routers' error event.
The stream it returns yields, in order:
  Token(chunk)                  each generated token, before the text events it produced
  Event("reasoning"|"content")  text (parse.Event), whitespace that only pads a think block
                                already dropped
  Event("tool_call")            a parsed call (name, arguments as JSON text, id)
  Finish(...)                   last: the engine's finish reason, stats, generated ids
and, with `keepalive`, Waiting(done, total) first and whenever no chunk came for that many
seconds: the router sends its dialect's keep-alive (prefill progress where it has room).
The chunks ready at one wake-up (an engine step's) are parsed together: their text is one
feed, so one text event, not one per token. With `flushes`, a Flush closes each wake-up's
events: a streaming router frames all it wrote since the last one as one write (`coalesced`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Literal

from fastapi import Request

from mlxlocal.engine import (
    Chunk,
    Engine,
    EngineDeadError,
    GenerationStats,
    OutOfCapacity,
    QueueFull,
    SamplingParams,
    SessionBusy,
)
from mlxlocal.errors import ContextLengthError, NonFiniteLogitsError
from mlxlocal.grammar.parse import Event, OutputParser, starts_in_reasoning
from mlxlocal.server import lanes
from mlxlocal.server.errors import RETRY_AFTER, APIError
from mlxlocal.server.metrics import Metrics
from mlxlocal.server.prompt import SESSION_HEADER, CacheUse, reset_quietly

log = logging.getLogger("mlxlocal.server")


def _busy(session_id: str | None) -> APIError:
    return APIError(409, f"session {session_id!r} is already generating a reply; a session runs one request at "
                         f"a time (wait for it, or use another {SESSION_HEADER})", param=SESSION_HEADER,
                    code="session_busy")


@dataclass(frozen=True)
class Waiting:
    """No output yet (or for a while): time for a keep-alive. `done` of the `total` prompt
    tokens are in the cache (the prefill's progress)."""

    done: int
    total: int
    kind: Literal["waiting"] = "waiting"


def submit(engine: Engine, prompt: list[int], params: SamplingParams, loop: asyncio.AbstractEventLoop,
           session=None, cache: CacheUse | None = None):
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
                   cache: CacheUse | None):
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
    await reset_quietly(evicted)
    return session


async def stream(request: Request, engine: Engine, prompt: list[int], params: SamplingParams,
                 metrics: Metrics, cache: CacheUse | None = None,
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


@dataclass
class Token:
    chunk: Chunk  # for logprobs
    kind: Literal["token"] = "token"


@dataclass
class Finish:
    reason: str | None  # the engine's: "stop" | "length" | "cancelled"
    stats: GenerationStats | None
    tokens: list[int] = field(default_factory=list)  # generated ids
    tool_calls: bool = False  # the parser found at least one call
    kind: Literal["finish"] = "finish"


@dataclass(frozen=True)
class Flush:
    """The end of one wake-up's events: what a stream framed for them goes out as one write."""

    kind: Literal["flush"] = "flush"


FLUSH = Flush()
StreamEvent = Token | Event | Finish | Waiting | Flush
Item = list[Chunk] | Waiting  # what a request's chunk stream yields: the chunks of one wake-up


async def coalesced(body: AsyncGenerator[str | Flush, None]) -> AsyncIterator[str]:
    """A streaming body's pieces joined up to each Flush: one write (one ASGI message, one
    socket send) per wake-up, not one per event."""
    parts: list[str] = []
    try:
        async for piece in body:
            if not isinstance(piece, Flush):
                parts.append(piece)
            elif parts:
                yield "".join(parts)
                parts.clear()
        if parts:
            yield "".join(parts)
    finally:
        await body.aclose()


def stream_keepalive(request: Request) -> float | None:
    """Seconds between keep-alives on this server's streams (--stream-keepalive), None: off."""
    return request.app.state.config.stream_keepalive or None


def keepalive_comment(w: Waiting) -> str:
    """An SSE keep-alive: a comment (every SSE parser skips it) with the prefill's progress,
    as mlx_lm.server writes it."""
    return f": keepalive {w.done}/{w.total}\n\n"


async def open_chunks(request: Request, engine, ids: list[int], params: SamplingParams,
                      metrics: Metrics, cache: CacheUse | None = None,
                      keepalive: float | None = None) -> AsyncGenerator[Item, None]:
    """Start the request and await its first chunks (errors raise here, as HTTP errors; with
    `keepalive`, a Waiting once it is submitted); return all of its chunk lists, that first
    one included. `cache`: its session and edits."""
    chunks = stream(request, engine, ids, params, metrics, cache, keepalive)
    try:
        first = await chunks.__anext__()
    except StopAsyncIteration:  # the engine always ends with a final chunk
        raise APIError(500, "the engine returned no output") from None
    except BaseException:
        await chunks.aclose()
        raise
    return _rest(first, chunks)


async def _rest(first: Item, chunks: AsyncGenerator[Item, None]) -> AsyncGenerator[Item, None]:
    try:
        yield first
        if isinstance(first, Waiting) or first[-1].finish_reason is None:
            async for chunk in chunks:
                yield chunk
    finally:
        await chunks.aclose()  # cancels the request if the consumer stopped early


async def open_events(request: Request, engine, ids: list[int], params: SamplingParams,
                      tools: list[dict] | None, metrics: Metrics, cache: CacheUse | None = None,
                      keepalive: float | None = None, flushes: bool = False,
                      ) -> AsyncGenerator[StreamEvent, None]:
    """`open_chunks`, parsed into events (see the module docstring; `flushes`: a Flush after
    each wake-up's). A thinking budget (params.think_budget) is the engine's: the think-end
    marker it writes comes as text without a token, so the answer after it is content."""
    parser = OutputParser(engine.chat_format, tools, starts_in_reasoning(engine, ids))
    chunks = await open_chunks(request, engine, ids, params, metrics, cache, keepalive)
    return parse_chunks(chunks, parser, flushes)


def local_events(engine, ids: list[int], params: SamplingParams, tools: list[dict] | None,
                 ) -> AsyncGenerator[StreamEvent, None]:
    """Submit now (refusals raise here, as APIErrors) and return the parsed events, without an
    HTTP request (the MCP tools): no session, no disconnect watch, no metrics. Leaving early
    cancels the request, so its KV blocks are freed next step."""
    handle = submit(engine, ids, params, asyncio.get_running_loop())
    parser = OutputParser(engine.chat_format, tools, starts_in_reasoning(engine, ids))
    return _cancelling(handle, parse_chunks(handle.batches(), parser))


async def _cancelling(handle, events: AsyncGenerator[StreamEvent, None]) -> AsyncGenerator[StreamEvent, None]:
    try:
        async for e in events:
            yield e
    finally:
        await events.aclose()
        handle.cancel()


class _Trim:
    """Drop whitespace that only pads a think block: at the start of the reasoning, and at
    the start of the answer after it (templates and models put newlines around the tags)."""

    def __init__(self):
        self.pending = {"reasoning": True, "content": False}

    def __call__(self, events: Iterable[Event]) -> Iterable[Event]:
        for e in events:
            if e.kind == "tool_call":
                yield e
                continue
            if e.kind == "reasoning":
                self.pending["content"] = True
            if self.pending[e.kind]:
                text = e.text.lstrip()
                if not text:
                    continue
                self.pending[e.kind] = False
                e = Event(e.kind, text)
            yield e


async def parse_chunks(chunks: AsyncGenerator[Item, None], parser: OutputParser,
                       flushes: bool = False) -> AsyncGenerator[StreamEvent, None]:
    trim, tokens, last = _Trim(), [], None
    try:
        async for batch in chunks:
            if isinstance(batch, Waiting):
                yield batch
                if flushes:
                    yield FLUSH
                continue
            last = batch[-1]
            for chunk in batch:
                if chunk.token is not None:
                    tokens.append(chunk.token)
                    yield Token(chunk)
            text = batch[0].text if len(batch) == 1 else "".join(chunk.text for chunk in batch)
            for e in trim(parser.feed(text)):
                yield e
            if flushes and last.finish_reason is None:  # the last one's events end with Finish
                yield FLUSH
        for e in trim(parser.finish()):
            yield e
    finally:
        await chunks.aclose()
    yield Finish(last.finish_reason if last else None, last.stats if last else None, tokens,
                 parser.made_tool_calls)


def usage_fields(stats) -> dict[str, int]:
    """The cache edits' usage fields (AKV's names), beside each dialect's cached-token count."""
    return {"drop_skipped_tokens": stats.dropped_tokens if stats else 0,
            "repos_tokens": stats.repositioned_tokens if stats else 0}
