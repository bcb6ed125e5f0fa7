"""A submitted request as its caller holds it: a stream of Chunks (sync or async) and cancel."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from mlxlocal.engine.types import Chunk


def _done(item: Chunk | BaseException) -> bool:
    """An error from the engine is raised in the consumer; the last chunk ends the stream."""
    if isinstance(item, BaseException):
        raise item
    return item.finish_reason is not None


class RequestHandle:
    def __init__(self, cancelled: threading.Event | None = None,
                 loop: asyncio.AbstractEventLoop | None = None, seq: Any = None):
        self.cancelled = cancelled or threading.Event()
        self.seq = seq  # the engine's view of the request (paged engine), for inspection
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

    def __iter__(self) -> Iterator[Chunk]:
        done = False
        try:
            while not done:
                item = self._out.get()
                done = _done(item)
                yield item
        finally:
            if not done:  # the consumer walked away: free the request's resources
                self.cancel()

    async def astream(self) -> AsyncIterator[Chunk]:
        if self._aqueue is None:
            raise ValueError("astream() needs the request submitted with loop=<the running event loop>")
        done = False
        try:
            while not done:
                item = await self._aqueue.get()
                done = _done(item)
                yield item
        finally:
            if not done:
                self.cancel()
