"""Blocks of the sliding-window layers: only each sequence's last window is held.

A model with sliding-window layers keeps those layers' K/V in pools of their own block
ids. A sequence's window table runs parallel to its block table; a block whose every
position has left the window is released and its entry becomes a hole (HOLE, masked,
never read). So a window layer needs about window / block_size blocks per sequence,
however long the context.

Prefix reuse still works: a window block leaving a sequence's window, or its full
blocks entering the prefix cache, is kept, keyed by the full-attention block at the same
position (the radix tree says which tokens that block holds). A later request that matches a
prefix of m tokens resumes there only if the window blocks covering (m - window, m) are
still kept; kept blocks are given back, least recently used first, when space is needed.
"""

from __future__ import annotations

from collections import OrderedDict

from mlxlocal.cache.blocks import BlockManager, OutOfBlocks

HOLE = -1


class WindowBlocks:
    def __init__(self, num_blocks: int, block_size: int, window: int):
        self.blocks = BlockManager(num_blocks, block_size, prefix_cache=False)
        self.block_size = block_size
        self.window = window
        # Full-attention block -> window block at the same position; the cache holds a ref.
        self.kept: OrderedDict[int, int] = OrderedDict()

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    def first_needed(self, position: int) -> int:
        """Index of the first block a query at `position` (or later) still sees."""
        return max(0, position - self.window + 1) // self.block_size

    def allocate(self, n: int) -> list[int]:
        while len(self.blocks.free) < n and self.kept:
            self.blocks.release([self.kept.popitem(last=False)[1]])
        if len(self.blocks.free) < n:
            raise OutOfBlocks(n)
        return self.blocks.allocate(n)

    def release(self, table: list[int]) -> None:
        self.blocks.release([b for b in table if b != HOLE])

    def trim(self, table: list[int], position: int, full_table: list[int] | None = None) -> None:
        """Release the blocks a query at `position` no longer sees; holes in their place.
        With `full_table` (the prefix cache is on) each is kept first, keyed by its full
        block, so a later request sharing the prefix can still resume there. Holes only
        ever grow from the start, so the scan stops at the first one it meets."""
        i = min(self.first_needed(position), len(table)) - 1
        while i >= 0 and table[i] != HOLE:
            if full_table is not None:
                self.keep(full_table[i : i + 1], table[i : i + 1])
            self.blocks.release([table[i]])
            table[i] = HOLE
            i -= 1

    # --- the prefix cache's window blocks -----------------------------------------------
    def keep(self, full_blocks: list[int], table: list[int]) -> None:
        """Keep the window blocks of these (cached) full blocks for later requests."""
        for f, w in zip(full_blocks, table):
            if w == HOLE or f in self.kept:
                continue
            self.blocks.share([w])
            self.kept[f] = w

    def restorable(self, full_blocks: list[int], n_tokens: int) -> bool:
        """Are the window blocks a query at n_tokens sees (over these full blocks) kept?"""
        wanted = full_blocks[self.first_needed(n_tokens) : -(-n_tokens // self.block_size)]
        return all(f in self.kept for f in wanted)

    def restore(self, full_blocks: list[int], n_tokens: int) -> list[int]:
        """The window table for resuming at n_tokens over these full blocks (restorable);
        the caller now references its blocks."""
        lo = self.first_needed(n_tokens)
        wanted = full_blocks[lo : -(-n_tokens // self.block_size)]
        table = [self.kept[f] for f in wanted]
        for f in wanted:
            self.kept.move_to_end(f)
        self.blocks.share(table)
        return [HOLE] * lo + table

    def forget(self, full_block: int) -> None:
        """The full block was freed: what was kept for its position goes too."""
        w = self.kept.pop(full_block, None)
        if w is not None:
            self.blocks.release([w])

    def move(self, old: int, new: int) -> None:
        """Full block `old` is replaced by `new`, which holds the same tokens."""
        if old in self.kept and new not in self.kept:
            self.kept[new] = self.kept.pop(old)

    def clear(self) -> None:
        while self.kept:
            self.blocks.release([self.kept.popitem()[1]])

    @property
    def num_referenced(self) -> int:
        return self.blocks.num_referenced
