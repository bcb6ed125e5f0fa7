"""What the engine thread does while it has nothing to run, and when.

Two chores, each once per idle spell, a while after the last request (calls such as stats()
do not end a spell): MLX's buffer cache back to the system (CLEAR_IDLE_S), so one large
request does not keep its peak memory for the life of the server; and grown KV pools'
free tail back (after kv_shrink_idle_s). Not at once: clearing the cache right after a
request held up its last chunk (0.7 ms on a 16k-token one here) and made the next request of
a burst allocate its buffers anew.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import mlx.core as mx

CLEAR_IDLE_S = 0.5


class IdleChores:
    def __init__(self, shrink_after_s: float, shrink: Callable[[], None]):
        self.shrink_after_s, self.shrink = shrink_after_s, shrink
        self.clear_after_s = CLEAR_IDLE_S
        self._clear_at: float | None = None  # when idle (inf: done this spell)
        self._shrink_at: float | None = None

    def due_in(self, idle: bool, quiet: bool, grown: bool, now: float) -> float | None:
        """Run what is due; how long the thread may block before the next chore (None: no
        chore pending). `idle`: nothing queued or running (`quiet`: nor a step in flight);
        `grown`: the pools are larger than at start."""
        self._clear_at = self._due(self._clear_at, quiet, now, self.clear_after_s, mx.clear_cache)
        self._shrink_at = self._due(self._shrink_at, idle and grown, now, self.shrink_after_s,
                                    self.shrink)
        waits = [t - now for t in (self._clear_at, self._shrink_at) if t is not None and t != math.inf]
        return max(0.0, min(waits)) if waits else None

    @staticmethod
    def _due(at: float | None, idle: bool, now: float, after: float,
             chore: Callable[[], None]) -> float | None:
        if not idle:
            return None
        if at is None:
            return now + after
        if at != math.inf and now >= at:
            chore()
            return math.inf  # done: not again until requests come and go
        return at
