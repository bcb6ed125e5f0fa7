"""A submitted request as its caller holds it: a stream of Chunks (sync or async) and cancel."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from mlxlocal.engine.types import Chunk
from mlxlocal.errors import MlxLocalError

# How often a waiting consumer checks that its engine still runs: the engine wakes its
# consumers itself when it stops, so this only bounds a wait if that never happens.
LIVENESS_POLL_S = 0.5


class EngineDeadError(MlxLocalError):
    """The engine has stopped (a fault, or shutdown): it serves no more requests (HTTP 503)."""


def _done(item: Chunk | BaseException) -> bool:
    """An error from the engine is raised in the consumer; the last chunk ends the stream."""
    if isinstance(item, BaseException):
        raise item
    return item.finish_reason is not None


class RequestHandle:
    def __init__(self, cancelled: threading.Event | None = None,
                 loop: asyncio.AbstractEventLoop | None = None, seq: Any = None,
                 dead: Callable[[], str | None] | None = None,
                 progress: Callable[[], tuple[int, int]] | None = None):
        self.cancelled = cancelled or threading.Event()
        self.seq = seq  # the engine's view of the request (paged engine), for inspection
        self._dead = dead  # why the engine serving this request stopped, or None while it runs
        self._progress = progress
        self._out: queue.Queue = queue.Queue()
        self._loop = loop
        self._aqueue: asyncio.Queue | None = asyncio.Queue() if loop is not None else None

    @property
    def id(self) -> int:
        return self.seq.id if self.seq is not None else id(self)

    def put(self, item: Chunk | BaseException) -> None:
        """Called by the engine's thread for every chunk (and for an error)."""
        self._out.put(item)
        if self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self._aqueue.put_nowait, item)
            except RuntimeError:  # the consumer's event loop is closed: nobody reads this
                self.cancelled.set()

    def cancel(self) -> None:
        self.cancelled.set()

    def progress(self) -> tuple[int, int]:
        """(prompt tokens in the cache, prompt tokens): how far the prefill is, from any thread
        (read, never waited for; a prefix-cache hit counts as done). (0, 0): not known."""
        return self._progress() if self._progress is not None else (0, 0)

    def _dead_error(self) -> EngineDeadError | None:
        reason = self._dead() if self._dead is not None else None
        return EngineDeadError(f"the engine stopped before this request finished: {reason}") if reason else None

    def __iter__(self) -> Iterator[Chunk]:
        done = False
        try:
            while not done:
                try:
                    item = self._out.get(timeout=LIVENESS_POLL_S)
                except queue.Empty:
                    if (error := self._dead_error()) is None:
                        continue
                    try:  # what the engine sent before it stopped comes first
                        item = self._out.get_nowait()
                    except queue.Empty:
                        item = error
                done = _done(item)
                yield item
        finally:
            if not done:  # the consumer walked away: free the request's resources
                self.cancel()

    async def astream(self, idle: float | None = None) -> AsyncIterator[Chunk | None]:
        """The chunks; with `idle`, also None each time no chunk came for `idle` seconds (a
        front end's cue for a keep-alive while the prompt prefills)."""
        if self._aqueue is None:
            raise ValueError("astream() needs the request submitted with loop=<the running event loop>")
        done = False
        getter: asyncio.Future | None = None  # kept across polls, so no chunk is lost to a timeout
        clock = asyncio.get_running_loop().time
        quiet_since = clock()
        try:
            while not done:
                if not self._aqueue.empty():
                    item = self._aqueue.get_nowait()
                else:
                    getter = getter or asyncio.ensure_future(self._aqueue.get())
                    wait = LIVENESS_POLL_S
                    if idle is not None:
                        wait = max(min(wait, quiet_since + idle - clock()), 0)
                    finished, _ = await asyncio.wait({getter}, timeout=wait)
                    if not finished:
                        if (error := self._dead_error()) is None:
                            if idle is not None and clock() - quiet_since >= idle:
                                quiet_since = clock()
                                yield None
                            continue
                        # What the engine posted to this loop just before it stopped comes first.
                        finished, _ = await asyncio.wait({getter}, timeout=0.05)
                    if not finished:
                        raise error
                    item, getter = getter.result(), None
                done = _done(item)
                quiet_since = clock()
                yield item
        finally:
            if getter is not None:
                getter.cancel()
            if not done:
                self.cancel()
