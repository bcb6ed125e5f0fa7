"""A submitted request as its caller holds it: a stream of Chunks (sync or async) and cancel.

A handle made for an event loop (`loop=`) is read on that loop only: the engine thread
appends to its deque, and an Outbox wakes each loop once per engine step for every handle
that got chunks then (not once per token per request); `batches()` yields all of them."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import Any

from mlxlocal.engine.errors import EngineDeadError
from mlxlocal.engine.types import Chunk

# How often a waiting consumer checks that its engine still runs: the engine wakes its
# consumers itself when it stops, so this only bounds a wait if that never happens.
LIVENESS_POLL_S = 0.5


def _done(item: Chunk | BaseException) -> bool:
    """An error from the engine is raised in the consumer; the last chunk ends the stream."""
    if isinstance(item, BaseException):
        raise item
    return item.finish_reason is not None


def _wake(handles: list[RequestHandle]) -> None:
    """On the consumers' loop: every handle that got chunks this step."""
    for handle in handles:
        handle._wake()


def _resolve(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


class Outbox:
    """The wake-ups an engine owes its consumers' event loops, sent once per step: the engine
    thread calls flush() after each step (and when it stops), from any thread it may."""

    def __init__(self):
        self._lock = threading.Lock()
        self._due: dict[asyncio.AbstractEventLoop, list[RequestHandle]] = {}
        self.wakeups = 0  # call_soon_threadsafe calls made: one per loop per step with output

    def post(self, handle: RequestHandle) -> None:
        with self._lock:
            if not handle._posted:
                assert handle._loop is not None  # only a loop handle has an outbox
                handle._posted = True
                self._due.setdefault(handle._loop, []).append(handle)

    def flush(self) -> None:
        with self._lock:
            if not self._due:
                return
            due, self._due = self._due, {}
            for handles in due.values():
                for handle in handles:
                    handle._posted = False
        for loop, handles in due.items():
            self.wakeups += 1
            try:
                loop.call_soon_threadsafe(_wake, handles)
            except RuntimeError:  # the consumers' event loop is closed: nobody reads these
                for handle in handles:
                    handle.cancelled.set()


class RequestHandle:
    def __init__(self, cancelled: threading.Event | None = None,
                 loop: asyncio.AbstractEventLoop | None = None, seq: Any = None,
                 dead: Callable[[], str | None] | None = None,
                 progress: Callable[[], tuple[int, int]] | None = None,
                 outbox: Outbox | None = None):
        self.cancelled = cancelled or threading.Event()
        self.seq = seq  # the engine's view of the request (paged engine), for inspection
        self._dead = dead  # why the engine serving this request stopped, or None while it runs
        self._progress = progress
        self._loop = loop
        self._outbox = outbox if loop is not None else None
        self._posted = False  # in the outbox's list for the next flush (under its lock)
        self._out: queue.Queue | None = queue.Queue() if loop is None else None
        self._items: deque = deque()  # loop handles: appended by the engine, drained on the loop
        self._waiter: asyncio.Future | None = None

    @property
    def id(self) -> int:
        return self.seq.id if self.seq is not None else id(self)

    def put(self, item: Chunk | BaseException) -> None:
        """Called by the engine's thread for every chunk (and for an error)."""
        if self._out is not None:
            self._out.put(item)
            return
        self._items.append(item)
        if self._outbox is not None:
            self._outbox.post(self)
            return
        assert self._loop is not None  # a handle without a loop has its queue (_out)
        try:  # no outbox (a worker thread per request): wake the loop now
            self._loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the consumer's event loop is closed: nobody reads this
            self.cancelled.set()

    def _wake(self) -> None:
        if self._waiter is not None:
            _resolve(self._waiter)

    def backlog(self) -> list[Chunk | BaseException]:
        """Everything the engine has handed this request and nobody read yet, at once."""
        items = []
        while self._items:
            items.append(self._items.popleft())
        return items

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
        if self._out is None:
            raise ValueError("this request was submitted with loop=: its chunks go to that event loop "
                             "(read them there with astream() or batches()), not to a blocking iterator")
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

    async def batches(self, idle: float | None = None) -> AsyncGenerator[list[Chunk] | None, None]:
        """The chunks, as lists: all that arrived by each wake-up (one engine step's, unless
        the loop fell behind). With `idle`, also None each time none came for `idle` seconds
        (a front end's cue for a keep-alive while the prompt prefills)."""
        if self._out is not None:
            raise ValueError("batches() and astream() need the request submitted with loop=<the running event loop>")
        loop = asyncio.get_running_loop()
        clock = loop.time
        quiet_since = clock()
        done = False
        try:
            while not done:
                items = self.backlog()
                if not items:
                    # Made before the await with the deque seen empty: a chunk appended after
                    # that check is followed by a wake-up that runs after this await starts.
                    self._waiter = waiter = loop.create_future()
                    wait = LIVENESS_POLL_S
                    if idle is not None:
                        wait = max(min(wait, quiet_since + idle - clock()), 0)
                    timer = loop.call_later(wait, _resolve, waiter)  # the liveness / idle check
                    try:
                        await waiter
                    finally:
                        timer.cancel()
                        self._waiter = None
                    items = self.backlog()
                    if not items:
                        if (error := self._dead_error()) is not None:
                            raise error
                        if idle is not None and clock() - quiet_since >= idle:
                            quiet_since = clock()
                            yield None
                        continue
                batch: list[Chunk] = []
                for item in items:
                    if isinstance(item, BaseException):
                        if batch:  # what came before the error first
                            yield batch
                        raise item
                    batch.append(item)
                    if item.finish_reason is not None:
                        done = True
                        break
                quiet_since = clock()
                yield batch
        finally:
            if not done:
                self.cancel()

    async def astream(self, idle: float | None = None) -> AsyncGenerator[Chunk | None, None]:
        """batches(), one chunk at a time."""
        batches = self.batches(idle)
        try:
            async for batch in batches:
                if batch is None:
                    yield None
                    continue
                for chunk in batch:
                    yield chunk
        finally:
            await batches.aclose()  # cancels the request if this consumer stopped early
