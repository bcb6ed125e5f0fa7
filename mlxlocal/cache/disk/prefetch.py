"""Prefetch: the block files a waiting request will restore, read ahead on a thread of its own.

The engine thread reads restored blocks straight into the pools (tier.py), which a cold
file would hold up for as long as the disk takes, with every other stream waiting. A
request admitted while others decode is therefore prefetched first: this thread reads its
files once (hashing its prompt on the way) and drops the bytes, the OS keeps them, and the
scheduler admits the request once that is done; the engine thread then copies from memory.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mlxlocal.cache.disk.keys import chain_hashes
from mlxlocal.cache.disk.store import DiskStore

log = logging.getLogger("mlxlocal.engine")
QUEUED = 64  # prompts waiting to be prefetched at most; past it a request is not prefetched
BUFFER = 4 << 20
WAIT_S = 30.0  # longest a request waits for its read-ahead


@dataclass
class Prefetch:
    """One request's read-ahead: done when its files are in memory; `chains` its full blocks'
    chain hashes, which the restore takes instead of hashing the prompt again."""

    done: threading.Event = field(default_factory=threading.Event)
    since: float = field(default_factory=time.monotonic)
    chains: list[bytes] | None = None

    def pending(self) -> bool:
        """Still reading, and not for longer than WAIT_S."""
        return not self.done.is_set() and time.monotonic() - self.since < WAIT_S


class Prefetcher:
    def __init__(self, store: DiskStore, key: Callable[[bytes, int], object], search_back: int):
        self.store, self.key, self.search_back = store, key, search_back
        self.read_bytes = 0  # what the thread read ahead, for stats and tests
        self._jobs: queue.Queue = queue.Queue(QUEUED)
        self._thread: threading.Thread | None = None

    def submit(self, tokens: list[int], block_size: int, start: int) -> Prefetch | None:
        """Read ahead the files holding the full blocks of `tokens` from block `start` (what
        RAM holds ends there). None: the queue is full."""
        job = Prefetch()
        try:
            self._jobs.put_nowait((tokens, block_size, start, job))
        except queue.Full:
            return None
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mlxlocal-kv-prefetch",
                                            daemon=True)
            self._thread.start()
        return job

    def _run(self) -> None:
        buf = bytearray(BUFFER)
        while True:
            tokens, bs, start, job = self._jobs.get()
            try:
                job.chains = chain_hashes(tokens, bs, None)
                self._warm(job.chains, start, buf)
            except Exception:  # a prefetch only saves time: the restore reads what it needs
                log.exception("disk tier: prefetch failed")
            finally:
                job.done.set()

    def _warm(self, chains: list[bytes], start: int, buf: bytearray) -> None:
        keys = [self.key(c, i) for i, c in enumerate(chains)]
        # A file is named by its first block: the one holding block `start` may begin before it.
        first = next((c for c in range(start, max(-1, start - self.search_back), -1)
                      if keys[c] in self.store), None)
        if first is None:
            return
        for k in keys[first:]:
            self.read_bytes += self.store.warm(k, buf)
