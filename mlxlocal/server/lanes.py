"""Bounded worker lanes for the server's heavy CPU work, so one kind cannot starve another.

asyncio.to_thread shares one default pool (cores + 4 threads) among every request's small
jobs. A burst of grammar compiles or multi-MB tokenizations would fill it, and every small
chat would wait behind them. Each heavy kind gets a lane instead: a few threads of its own and
a bounded queue; a full lane is a 429 with Retry-After, before any work is done. A lane's jobs
may hand freed heap back to the OS when they end (mlxlocal.heap).
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from mlxlocal import heap
from mlxlocal.server.errors import RETRY_AFTER, APIError


class Lane:
    def __init__(self, what: str, threads: int, queue: int, trim: bool = False):
        self.what, self.threads, self.queue, self.trim = what, threads, queue, trim
        self._lock = threading.Lock()
        self._pending = 0  # running + waiting
        self._executor: ThreadPoolExecutor | None = None
        self.counters = {"done": 0, "refused": 0}

    @property
    def pending(self) -> int:
        return self._pending

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix=f"mlxlocal-{self.what[:12]}")
        return self._executor

    def _job(self, ctx, fn, args, kwargs):
        try:
            return ctx.run(fn, *args, **kwargs)
        finally:
            if self.trim:
                heap.trim()

    def _done(self, _future) -> None:
        with self._lock:
            self._pending -= 1
            self.counters["done"] += 1

    async def run(self, fn, *args, **kwargs):
        """fn(*args, **kwargs) on the lane; APIError 429 when its queue is full."""
        with self._lock:
            if self._pending >= self.threads + self.queue:
                self.counters["refused"] += 1
                raise APIError(429, f"server busy: {self._pending} {self.what} running or waiting "
                                    f"(at most {self.threads + self.queue}); retry later",
                               headers={"Retry-After": RETRY_AFTER})
            self._pending += 1
            pool = self._pool()
        # Counted down when the job ends, not when its waiter gives up: abandoned work
        # still holds its place, so the bound is on threads' work, not on waiters.
        future = pool.submit(self._job, contextvars.copy_context(), fn, args, kwargs)
        future.add_done_callback(self._done)
        return await asyncio.wrap_future(future)


def weight(value: Any) -> int:
    """UTF-8 bytes of the strings in a JSON-like value (a request part: messages, a schema)."""
    if isinstance(value, str):
        return len(value.encode("utf-8", "surrogatepass"))
    if isinstance(value, dict):
        return sum(weight(k) + weight(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(weight(v) for v in value)
    return 0


# Grammar compiles (JSON schema -> grammar, grammar -> matcher against the vocabulary). Small
# ones two at a time; large ones (a schema of thousands of properties: seconds, much of it
# holding the GIL) one at a time on their own lane, so they never hold up small ones.
GRAMMAR = Lane("grammar compiles", threads=2, queue=16)
LARGE_GRAMMAR = Lane("large grammar compiles", threads=1, queue=8)
LARGE_GRAMMAR_BYTES = 32 << 10


def grammar_lane(size: int) -> Lane:
    return LARGE_GRAMMAR if size > LARGE_GRAMMAR_BYTES else GRAMMAR
# Tokenizations of large prompts (over LARGE_TEXT_BYTES of text): one at a time, so their peak
# memory does not add up, and their freed heap goes back to the OS after each.
LARGE_TEXT = Lane("large tokenizations", threads=1, queue=8, trim=True)
LARGE_TEXT_BYTES = 256 << 10


# Chat requests in flight (generation.stream), so background work can give way to them: the
# embedding engine starts no batch while chat is running or ran in the last CHAT_QUIET_S.
_chat = {"active": 0, "last": 0.0}
_chat_lock = threading.Lock()  # the MCP stdio server runs chats on a loop of its own
CHAT_QUIET_S = 0.5


def chat_started() -> None:
    with _chat_lock:
        _chat["active"] += 1


def chat_ended() -> None:
    with _chat_lock:
        _chat["active"] -= 1
        _chat["last"] = time.monotonic()


def chat_busy() -> bool:
    return _chat["active"] > 0 or time.monotonic() - _chat["last"] < CHAT_QUIET_S
