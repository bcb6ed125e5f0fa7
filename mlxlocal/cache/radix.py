"""Radix prefix cache: a tree over block-sized token chunks whose nodes hold KV block ids.

Full blocks are shared in place. A sequence's partially filled last block may enter too,
as a "partial" leaf (a chunk shorter than block_size, never a parent): it is never shared
for writing, only copied (`match_partial` finds the longest common prefix with a child).
The tree owns its blocks; sequences that use them hold references in the BlockManager. A
block whose last reference is gone stays cached in the tree until LRU eviction reclaims it.

A chunk may carry a tag: the cache edits (engine/edits.py) its K/V went through. Tagged and
untagged children never match each other, so K/V computed under one edit history is only
ever reused by a request with the same history.
"""

from __future__ import annotations

import itertools

Chunk = tuple[int, ...]


class Node:
    """One chunk of a cached prefix, held in KV block `block`; `key`: its key in
    parent.children (the chunk, or (tag, chunk)). A plain class: a restore of 16k tokens
    makes 1,024 of them."""

    __slots__ = ("chunk", "block", "parent", "children", "last_used", "key")

    def __init__(self, chunk: Chunk, block: int, parent: Node | None, children: dict | None = None,
                 last_used: int = 0, key: object = None):
        self.chunk, self.block, self.parent = chunk, block, parent
        self.children = {} if children is None else children
        self.last_used = last_used
        self.key = chunk if key is None else key


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

    @staticmethod
    def _key(chunk: Chunk, tags: list | None, i: int) -> object:
        tag = tags[i] if tags is not None and i < len(tags) else None
        return chunk if tag is None else (tag, chunk)

    def match(self, tokens: list[int], tags: list | None = None) -> list[int]:
        """Block ids of the longest cached prefix of `tokens`, in full blocks."""
        return self.match_partial(tokens, partial=False, tags=tags)[0]

    def match_partial(self, tokens: list[int], partial: bool = True, tags: list | None = None,
                      held: list[int] | None = None) -> tuple[list[int], tuple[int, int] | None]:
        """Full-block match (chunk i under tags[i], if given), then (block, k): the untagged
        child (full or partial) sharing the longest common prefix k > 0 with the next chunk
        of `tokens`, to be copied. `held`: blocks the caller holds that may be the tree's chain
        for the first chunks (checked, not walked)."""
        node, blocks, now, bs = self.root, [], next(self._clock), self.block_size
        known = self._held_chain(tokens, held, tags, now) if held else 0
        if known:
            node, blocks = self.by_block[held[known - 1]], held[:known]
        for i in range(known, len(tokens) // bs):  # by chunk: a miss stops before the rest is cut
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            child = node.children.get(chunk if tags is None else self._key(chunk, tags, i))
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
            if child.key is not child.chunk:  # tagged: another history
                continue
            n = next((i for i, (a, b) in enumerate(zip(child.chunk, rest)) if a != b), min(len(child.chunk), len(rest)))
            if n > k:
                best, k = child, n
        if best is None:
            return blocks, None
        best.last_used = now
        return blocks, (best.block, k)

    def insert(self, tokens: list[int], blocks: list[int], partial: bool = False,
               tags: list | None = None) -> list[int]:
        """Record that `blocks` hold the KV of `tokens`: the full blocks, and with `partial`
        the partially filled last block as a partial leaf.

        Returns, per full chunk, the block the tree now holds for it: the caller's own
        block, or an older block with the same content, which the caller should switch to.
        A partial leaf is never switched to (its owner may still write into its block).
        """
        for block in blocks:  # a block that grew since it was cached partially: re-placed below
            node = self.by_block.get(block)
            if node is not None and len(node.chunk) < self.block_size:
                del node.parent.children[node.key]
                del self.by_block[block]
        chunks = self._chunks(tokens)
        node, held, now = self.root, [], next(self._clock)
        known = self._held_chain(tokens, blocks, tags, now)
        if known:  # the walk goes on below the blocks the tree already holds as this chain
            node, held = self.by_block[blocks[known - 1]], blocks[:known]
        for i, chunk in enumerate(chunks[known: len(blocks)], known):
            key = self._key(chunk, tags, i)
            child = node.children.get(key)
            if child is None:  # the rest of the chain is new: no more lookups
                node = self._grow(node, chunks, blocks, tags, i, now)
                held += blocks[i:len(chunks)]
                break
            child.last_used = now
            held.append(child.block)
            node = child
        tail = tuple(tokens[len(chunks) * self.block_size :])
        if partial and tail and len(blocks) > len(chunks) and tail not in node.children:
            leaf = Node(tail, blocks[len(chunks)], node, last_used=now)
            node.children[tail] = leaf
            self.by_block[leaf.block] = leaf
        return held

    def _held_chain(self, tokens: list[int], blocks: list[int], tags: list | None,
                    now: int) -> int:
        """How many of the first blocks are already the tree's chain from the root for these
        tokens (touched as used): a sequence that matched or cached its prefix holds them.
        Their nodes are checked up the parents, no token compared but the last chunk's."""
        bs = self.block_size
        k = min(len(tokens) // bs, len(blocks))
        while k and blocks[k - 1] not in self.by_block:  # its newest blocks are not in yet
            k -= 1
        if not k:
            return 0
        node = self.by_block[blocks[k - 1]]
        if node.key != self._key(tuple(tokens[(k - 1) * bs:k * bs]), tags, k - 1):
            return 0
        for j in range(k - 1, -1, -1):  # a shorter chain meets the root (block -1) first
            if node.block != blocks[j]:
                return 0
            node.last_used = now
            node = node.parent
        return k if node is self.root else 0

    def _grow(self, node: Node, chunks: list[Chunk], blocks: list[int], tags: list | None,
              start: int, now: int) -> Node:
        """New nodes for chunks[start:] (with their blocks) in a chain below `node`; the last."""
        by_block = self.by_block
        for i in range(start, min(len(chunks), len(blocks))):
            chunk, block = chunks[i], blocks[i]
            key = chunk if tags is None else self._key(chunk, tags, i)
            child = Node(chunk, block, node, {}, now, key)
            node.children[key] = child
            by_block[block] = child
            node = child
        return node

    def detach(self, blocks: list[int]) -> list[int]:
        """Take these blocks' nodes out of the tree (their content is about to be rewritten),
        with every node below them; returns the blocks of those other nodes."""
        mine, others = set(blocks), []
        for b in blocks:
            node = self.by_block.get(b)
            if node is None:
                continue
            del node.parent.children[node.key]
            stack = [node]
            while stack:
                n = stack.pop()
                del self.by_block[n.block]
                if n.block not in mine:
                    others.append(n.block)
                stack.extend(n.children.values())
        return others

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
                del leaf.parent.children[leaf.key]
                del self.by_block[leaf.block]
                freed.append(leaf.block)
        return freed

    def clear(self, is_free: callable) -> list[int]:
        return self.evict(len(self.by_block), is_free)
