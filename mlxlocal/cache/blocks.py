"""Block allocation: free list, reference counts, and the prefix cache on top.

A block is in exactly one state: free (in the free list), referenced (ref > 0, by one
or more sequences), or cached (ref == 0 but held by the radix tree, reclaimable).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from mlxlocal.cache.radix import RadixCache


def id_runs(ids: list[int]) -> list[tuple[int, int, int]]:
    """(index in ids, first id, length) of each run of consecutive block ids; where they break
    found by numpy (a 16k-token table or restore: 1,024 ids, most often a run or two)."""
    if not ids:
        return []
    cuts = (np.flatnonzero(np.diff(np.asarray(ids, np.int64)) != 1) + 1).tolist()
    bounds = [0, *cuts, len(ids)]
    return [(a, ids[a], b - a) for a, b in zip(bounds, bounds[1:])]


class OutOfBlocks(Exception):
    """Not enough free or reclaimable blocks: the scheduler preempts and retries."""


class FreeBlocks:
    """The free block ids as a map (one byte per block), handed out in runs of consecutive
    ids where it can: a sequence on a run is read by attention as one slice, not a gather."""

    def __init__(self, num_blocks: int):
        self.map = bytearray(b"\x01") * num_blocks
        self.count = num_blocks

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[int]:
        i = self.map.find(1)
        while i >= 0:
            yield i
            i = self.map.find(1, i + 1)

    def __contains__(self, block: int) -> bool:
        return bool(self.map[block])

    def resize(self, total: int) -> None:
        """Ids past the end come free (the pools grew) or go (they shrank: all free)."""
        if total >= len(self.map):
            self.count += total - len(self.map)
            self.map += b"\x01" * (total - len(self.map))
        else:
            assert self.map.count(1, total) == len(self.map) - total, "shrinking over taken blocks"
            self.count -= len(self.map) - total
            del self.map[total:]

    def extend(self, blocks: list[int]) -> None:
        for b in blocks:
            assert not self.map[b], f"block {b} freed twice"
            self.map[b] = 1
        self.count += len(blocks)

    def take(self, n: int, after: int | None = None, room: int = 0) -> list[int]:
        """n free ids (n <= len(self)): those right after block `after` first (the sequence
        grows in place), then a run with `room` to grow on (_place), then the longest runs."""
        out: list[int] = []
        if after is not None:
            i = after + 1
            while len(out) < n and i < len(self.map) and self.map[i]:
                out.append(i)
                i += 1
            self._mark(out)
        need = n - len(out)
        if need:
            start = self._place(need, room)
            more = list(range(start, start + need)) if start >= 0 else self._longest_runs(need)
            self._mark(more)
            out += more
        return out

    def _place(self, n: int, room: int) -> int:
        """Start of a free run for n blocks, -1 if none fits. With `room`: `room` blocks past
        the run's start when an allocated block precedes it (its holder may grow into them),
        and room for this one to grow after; with less space, the first run that fits n."""
        if room:
            start = self.map.find(b"\x01" * (n + 2 * room))
            if start >= 0:
                return start + room if start > 0 else start
            start = self.map.find(b"\x01" * (n + room))
            if start >= 0:
                return start
        return self.map.find(b"\x01" * n)

    def _mark(self, taken: list[int]) -> None:
        for b in taken:
            self.map[b] = 0
        self.count -= len(taken)

    def _longest_runs(self, n: int) -> list[int]:
        runs, start = [], None
        for i, free in enumerate(self.map + b"\x00"):
            if free:
                start = i if start is None else start
            elif start is not None:
                runs.append((start, i))
                start = None
        out: list[int] = []
        for a, b in sorted(runs, key=lambda r: r[0] - r[1]):
            out += range(a, min(b, a + n - len(out)))
            if len(out) == n:
                break
        return out


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_cache: bool = True,
                 max_blocks: int | None = None, on_resize: Callable[[int], None] | None = None):
        self.num_blocks = num_blocks
        # Pools that grow on demand (on_resize makes them `total` blocks) up to max_blocks.
        self.max_blocks = max(num_blocks, max_blocks or num_blocks) if on_resize else num_blocks
        self.on_resize = on_resize
        self.block_size = block_size
        self.free = FreeBlocks(num_blocks)
        self.refs = [0] * num_blocks
        self.radix = RadixCache(block_size) if prefix_cache else None
        # Told of every block that becomes free, so what was keyed by its content goes, and
        # of a block replaced by an equal one already cached (old, new), so it can move over.
        self.on_free: Callable[[int], None] | None = None
        self.on_move: Callable[[int, int], None] | None = None

    # --- counts ------------------------------------------------------------------
    @property
    def num_referenced(self) -> int:
        return sum(1 for r in self.refs if r > 0)

    @property
    def num_cached(self) -> int:
        """Blocks only the prefix cache holds (reclaimable)."""
        if self.radix is None:
            return 0
        return sum(1 for b in self.radix.by_block if self.refs[b] == 0)

    def can_allocate(self, n: int) -> bool:
        return len(self.free) + self.num_cached + self.max_blocks - self.num_blocks >= n

    # --- allocation ----------------------------------------------------------------
    def allocate(self, n: int, after: int | None = None, room: int = 0) -> list[int]:
        """n blocks, consecutive where the free map allows: following block `after` (the
        caller's last), else where `room` more could follow (the caller's expected growth)."""
        if len(self.free) < n and self.num_blocks < self.max_blocks:
            # Grow before evicting what the prefix cache holds: doubling, so the copies a
            # growth costs add up to about the final size.
            short = n - len(self.free)
            self._resize(min(self.max_blocks, max(2 * self.num_blocks, self.num_blocks + short)))
        if len(self.free) < n and self.radix is not None:
            self._to_free(self.radix.evict(n - len(self.free), self._unreferenced))
        if len(self.free) < n:
            raise OutOfBlocks(n)
        blocks = self.free.take(n, after, room)
        for b in blocks:
            self.refs[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        for b in blocks:
            self.refs[b] += 1

    def release(self, blocks: list[int]) -> None:
        refs, cached = self.refs, self.radix.by_block if self.radix is not None else {}
        freed = []
        for b in blocks:  # a loop of plain operations: a 16k-token prompt releases 1,024
            refs[b] -= 1
            assert refs[b] >= 0, f"block {b} released twice"
            if refs[b] == 0 and b not in cached:
                freed.append(b)
        if freed:
            self._to_free(freed)

    def shrink(self, total: int) -> int:
        """Give back the free blocks from `total` on, up to the last one a sequence holds or
        the prefix cache keeps (a cached prefix is worth more than its memory back: an agent's
        next turn reuses it). Returns the new size."""
        if self.on_resize is None:
            return self.num_blocks
        kept = self.radix.by_block if self.radix is not None else {}
        last = max((b for b in range(total, self.num_blocks) if self.refs[b] or b in kept),
                   default=total - 1)
        if last + 1 >= self.num_blocks:
            return self.num_blocks
        self._resize(last + 1)
        return last + 1

    def _resize(self, total: int) -> None:
        assert self.on_resize is not None
        self.on_resize(total)  # the pools first: an error leaves the ids as they were
        self.free.resize(total)
        self.refs = self.refs[:total] + [0] * (total - len(self.refs))
        self.num_blocks = total

    def _unreferenced(self, block: int) -> bool:
        return self.refs[block] == 0

    # --- prefix cache -------------------------------------------------------------
    def match_prefix(self, tokens: list[int]) -> list[int]:
        """Shared blocks for the longest cached prefix; the caller now references them."""
        return self.match_tokens(tokens)[0]

    def match_tokens(self, tokens: list[int], copy: Callable[[int, int], None] | None = None,
                     tags: list | None = None, held: list[int] | None = None
                     ) -> tuple[list[int], int]:
        """Block table and token count of the longest cached prefix, to the token.

        Full blocks are shared. With `copy`, a further k tokens matching the start of a
        cached block (full or partial) are reused copy-on-write: a new block, filled by
        copy(src, dst), ends the table (or the block itself, see _take_over). `tags`: the edit history of each full chunk (radix.py).
        `held`: blocks that may already be the match's first ones (radix.match_partial).
        The caller now references every block returned.
        """
        if self.radix is None:
            return [], 0
        blocks, partial = self.radix.match_partial(tokens, partial=copy is not None, tags=tags,
                                                   held=held)
        self.share(blocks)
        n = len(blocks) * self.block_size
        if partial is not None and self._take_over(*partial):
            blocks.append(partial[0])
            n += partial[1]
        elif partial is not None:
            src, k = partial
            self.share([src])  # not evicted by the allocation below
            try:
                dst = self.allocate(1)[0]
            except OutOfBlocks:
                dst = None
            if dst is not None:
                copy(src, dst)
                blocks.append(dst)
                n += k
            self.release([src])
        return blocks, n

    def _take_over(self, block: int, k: int) -> bool:
        """A partial leaf no one holds, whose every token the request shares (the next turn
        of the conversation that left it), is taken as it is, without a copy: the
        sequence's table stays one run, and it writes on after those k tokens."""
        if self.refs[block] or k != self.radix.partial_length(block):
            return False
        self.radix.detach([block])
        self.refs[block] = 1
        return True

    def cache_prefix(self, tokens: list[int], blocks: list[int], partial: bool = False,
                     tags: list | None = None) -> list[int]:
        """Put the full blocks of a sequence into the prefix cache, and with `partial`
        its partially filled last block as a partial leaf (copied, never shared, on reuse).

        Where the tree already holds a block with the same content, the sequence switches
        to that block (its own copy is released), so equal prefixes share one copy.
        Returns the sequence's updated block table.
        """
        if self.radix is None:
            return blocks
        n_full = len(tokens) // self.block_size
        if partial:
            held = self.radix.insert(tokens, blocks[: n_full + 1], partial=True, tags=tags)
        else:
            held = self.radix.insert(tokens[: n_full * self.block_size], blocks[:n_full], tags=tags)
        table = list(blocks)
        if held == blocks[:len(held)]:  # most often: the tree holds the sequence's own blocks
            return table
        for i, (mine, kept) in enumerate(zip(blocks, held)):
            if mine != kept:
                if self.on_move is not None:
                    self.on_move(mine, kept)
                self.share([kept])
                self.release([mine])
                table[i] = kept
        return table

    def detach(self, blocks: list[int]) -> None:
        """Blocks about to be rewritten in place by their only holder: out of the prefix
        cache, with what was cached below them (freed unless someone holds it)."""
        if self.radix is None:
            return
        self._to_free([b for b in self.radix.detach(blocks) if self.refs[b] == 0])

    def clear_prefix_cache(self) -> int:
        if self.radix is None:
            return 0
        freed = self.radix.clear(self._unreferenced)
        self._to_free(freed)
        return len(freed)

    def _to_free(self, blocks: list[int]) -> None:
        self.free.extend(blocks)
        if self.on_free is not None:
            for b in blocks:
                self.on_free(b)
