"""Radix prefix cache: a tree over block-sized token chunks whose nodes hold KV block ids.

Only full blocks enter the tree, so a partially filled block is never shared. The tree
owns its blocks; sequences that use them hold references in the BlockManager. A block
whose last reference is gone stays cached in the tree until LRU eviction reclaims it.
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
        node, blocks, now = self.root, [], next(self._clock)
        for chunk in self._chunks(tokens):
            node = node.children.get(chunk)
            if node is None:
                break
            node.last_used = now
            blocks.append(node.block)
        return blocks

    def insert(self, tokens: list[int], blocks: list[int]) -> list[int]:
        """Record that `blocks` hold the KV of `tokens` (full blocks only).

        Returns, per chunk, the block the tree now holds for it: the caller's own block,
        or an older block with the same content, which the caller should switch to.
        """
        node, held, now = self.root, [], next(self._clock)
        for chunk, block in zip(self._chunks(tokens), blocks):
            child = node.children.get(chunk)
            if child is None:
                child = Node(chunk, block, node)
                node.children[chunk] = child
                self.by_block[block] = child
            child.last_used = now
            held.append(child.block)
            node = child
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
