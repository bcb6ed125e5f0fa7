"""Engine chunks -> parsed events, once for every API dialect; the routers only translate.

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

from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from dataclasses import dataclass, field
from typing import Literal

from fastapi import Request

from mlxlocal.engine import Chunk, GenerationStats, SamplingParams
from mlxlocal.grammar.parse import Event, OutputParser, starts_in_reasoning
from mlxlocal.server import generation
from mlxlocal.server.akv import CacheUse
from mlxlocal.server.errors import APIError
from mlxlocal.server.generation import Waiting
from mlxlocal.server.metrics import Metrics


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
    chunks = generation.run(request, engine, ids, params, metrics, cache, keepalive)
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
