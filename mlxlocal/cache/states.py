"""Recurrent-state snapshots at block boundaries: the prefix cache of hybrid SSM models.

A recurrent layer's state after token t cannot be rebuilt from the KV blocks: it folds in
everything before t. So the state after a full block is kept, keyed by that block, as
long as the block holds the same tokens (the block manager reports every block it frees). A later request or turn sharing a prefix resumes from the deepest boundary
that has a snapshot instead of recomputing from the start. MLX arrays are immutable, so a
snapshot is a set of references, not a copy; a byte budget evicts the least recently used.
"""

from __future__ import annotations

from collections import OrderedDict


class StateSnapshots:
    def __init__(self, budget_bytes: int, state_bytes: int):
        self.capacity = max(1, budget_bytes // max(state_bytes, 1))
        self._by_block: OrderedDict[int, list] = OrderedDict()
        self.restored = 0  # snapshots a request or turn resumed from (stats, tests)

    def __len__(self) -> int:
        return len(self._by_block)

    def put(self, block: int, state: list) -> None:
        self._by_block[block] = state
        self._by_block.move_to_end(block)
        while len(self._by_block) > self.capacity:
            self._by_block.popitem(last=False)

    def get(self, block: int) -> list | None:
        state = self._by_block.get(block)
        if state is not None:
            self._by_block.move_to_end(block)
        return state

    def peek(self, block: int) -> list | None:
        """The snapshot, without making it the most recently used (the disk tier's copy)."""
        return self._by_block.get(block)

    def drop(self, block: int) -> None:
        """The block was freed (its tokens may change): its snapshot no longer applies."""
        self._by_block.pop(block, None)

    def move(self, old: int, new: int) -> None:
        """Block `old` is being replaced by `new`, which holds the same tokens."""
        state = self._by_block.get(old)
        if state is not None and new not in self._by_block:
            self.put(new, state)
