"""Radix prefix cache: a tree over block-sized token chunks whose nodes hold KV block ids.

Full blocks are shared in place. A sequence's partially filled last block may enter too,
as a "partial" leaf (a chunk shorter than block_size, never a parent): it is never shared
for writing, only copied (`match_partial` finds the longest common prefix with a child).
The tree owns its blocks; sequences that use them hold references in the BlockManager. A
block whose last reference is gone stays cached in the tree until LRU eviction reclaims it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

Chunk = tuple[int, ...]


@dataclass(eq=False)
class Node:
    chunk: Chunk
    block: int
    parent: Node | None
    children: dict[Chunk, Node] = field(default_factory=dict)
    last_used: int = 0


class RadixCache:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.root = Node((), -1, None)
        self.by_block: dict[int, Node] = {}
        self._clock = itertools.count(1)

    def __len__(self) -> int:
        return len(self.by_block)

    def _chunks(self, tokens: list[int]) -> list[Chunk]:
        bs = self.block_size
        return [tuple(tokens[i : i + bs]) for i in range(0, len(tokens) - bs + 1, bs)]

    def match(self, tokens: list[int]) -> list[int]:
        """Block ids of the longest cached prefix of `tokens`, in full blocks."""
        return self.match_partial(tokens, partial=False)[0]

    def match_partial(self, tokens: list[int], partial: bool = True) -> tuple[list[int], tuple[int, int] | None]:
        """Full-block match, then (block, k): the child (full or partial) sharing the
        longest common prefix k > 0 with the next chunk of `tokens`, to be copied."""
        node, blocks, now = self.root, [], next(self._clock)
        for chunk in self._chunks(tokens):
            child = node.children.get(chunk)
            if child is None:
                break
            node = child
            node.last_used = now
            blocks.append(node.block)
        if not partial:
            return blocks, None
        start = len(blocks) * self.block_size
        rest = tokens[start : start + self.block_size]
        best, k = None, 0
        for child in node.children.values():
            n = next((i for i, (a, b) in enumerate(zip(child.chunk, rest)) if a != b), min(len(child.chunk), len(rest)))
            if n > k:
                best, k = child, n
        if best is None:
            return blocks, None
        best.last_used = now
        return blocks, (best.block, k)

    def insert(self, tokens: list[int], blocks: list[int], partial: bool = False) -> list[int]:
        """Record that `blocks` hold the KV of `tokens`: the full blocks, and with `partial`
        the partially filled last block as a partial leaf.

        Returns, per full chunk, the block the tree now holds for it: the caller's own
        block, or an older block with the same content, which the caller should switch to.
        A partial leaf is never switched to (its owner may still write into its block).
        """
        for block in blocks:  # a block that grew since it was cached partially: re-placed below
            node = self.by_block.get(block)
            if node is not None and len(node.chunk) < self.block_size:
                del node.parent.children[node.chunk]
                del self.by_block[block]
        chunks = self._chunks(tokens)
        node, held, now = self.root, [], next(self._clock)
        for chunk, block in zip(chunks, blocks):
            child = node.children.get(chunk)
            if child is None:
                child = Node(chunk, block, node)
                node.children[chunk] = child
                self.by_block[block] = child
            child.last_used = now
            held.append(child.block)
            node = child
        tail = tuple(tokens[len(chunks) * self.block_size :])
        if partial and tail and len(blocks) > len(chunks) and tail not in node.children:
            leaf = Node(tail, blocks[len(chunks)], node, last_used=now)
            node.children[tail] = leaf
            self.by_block[leaf.block] = leaf
        return held

    def contains(self, block: int) -> bool:
        return block in self.by_block

    def evictable_leaves(self, is_free: callable) -> list[Node]:
        return [n for n in self.by_block.values() if not n.children and is_free(n.block)]

    def evict(self, n: int, is_free: callable) -> list[int]:
        """Remove up to n least recently used leaves nobody references; return their blocks."""
        freed: list[int] = []
        while len(freed) < n:
            leaves = self.evictable_leaves(is_free)
            if not leaves:
                break
            leaves.sort(key=lambda node: node.last_used)
            for leaf in leaves[: n - len(freed)]:
                del leaf.parent.children[leaf.chunk]
                del self.by_block[leaf.block]
                freed.append(leaf.block)
        return freed

    def clear(self, is_free: callable) -> list[int]:
        return self.evict(len(self.by_block), is_free)
