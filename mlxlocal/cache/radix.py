"""Radix prefix cache: a path-compressed tree over block-sized token chunks, its nodes runs
of chunks held in KV blocks.

A node holds a run of full chunks (their tokens, one block each) that no other prefix
branches from but at its end: a 16k-token prompt is one node of 1,024 blocks, matched by
comparing token lists, not one node per block. A branch inside a run splits it there.

Full blocks are shared in place. A sequence's partially filled last block may enter too,
as a "partial" leaf (a node of one chunk shorter than block_size, never a parent): it is
never shared for writing, only copied (`match_partial` finds the longest common prefix with
the chunk that follows). The tree owns its blocks; sequences that use them hold references
in the BlockManager. A block whose last reference is gone stays cached in the tree until
LRU eviction reclaims it, from the ends of leaf runs.

A chunk may carry a tag: the cache edits (engine/edits.py) its K/V went through. Tagged and
untagged chunks never match each other, so K/V computed under one edit history is only
ever reused by a request with the same history.
"""

from __future__ import annotations

import itertools

Chunk = tuple[int, ...]


class Node:
    """A run of chunks: `tokens` (len(blocks) full chunks, or a partial leaf's fewer than
    block_size), the `blocks` holding them, each chunk's tag (None: untagged); `key`: its
    key in parent.children (its first chunk, or (tag, chunk))."""

    __slots__ = ("tokens", "blocks", "tags", "parent", "children", "last_used", "key", "partial")

    def __init__(self, tokens: list[int], blocks: list[int], tags: list, parent: Node | None,
                 last_used: int, key: object, partial: bool = False):
        self.tokens, self.blocks, self.tags, self.parent = tokens, blocks, tags, parent
        self.children: dict = {}
        self.last_used, self.key, self.partial = last_used, key, partial


class RadixCache:
    def __init__(self, block_size: int):
        self.block_size = block_size
        self.root = Node([], [], [], None, 0, ())
        self.by_block: dict[int, Node] = {}
        self._clock = itertools.count(1)

    def __len__(self) -> int:
        return len(self.by_block)

    @staticmethod
    def _tag(tags: list | None, i: int):
        return tags[i] if tags is not None and i < len(tags) else None

    def _key(self, tokens: list[int], tags: list | None, i: int) -> object:
        """Chunk i's key among its parent's children."""
        chunk = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
        tag = self._tag(tags, i)
        return chunk if tag is None else (tag, chunk)

    def chunk(self, block: int) -> Chunk:
        """The tokens a cached block holds."""
        node = self.by_block[block]
        j, bs = node.blocks.index(block), self.block_size
        return tuple(node.tokens[j * bs:(j + 1) * bs])

    def partial_length(self, block: int) -> int | None:
        """The tokens of the partial leaf held in `block`, or None: not a partial leaf."""
        node = self.by_block.get(block)
        return len(node.tokens) if node is not None and node.partial else None

    def match(self, tokens: list[int], tags: list | None = None) -> list[int]:
        """Block ids of the longest cached prefix of `tokens`, in full blocks."""
        return self.match_partial(tokens, partial=False, tags=tags)[0]

    def match_partial(self, tokens: list[int], partial: bool = True, tags: list | None = None,
                      held: list[int] | None = None) -> tuple[list[int], tuple[int, int] | None]:
        """Full-block match (chunk i under tags[i], if given), then (block, k): the untagged
        chunk (full or partial) that may follow, sharing the longest common prefix k > 0 with
        the next chunk of `tokens`, to be copied. `held`: blocks the caller holds that may be
        the tree's chain for the first chunks (checked, not walked)."""
        now = next(self._clock)
        known, node, j = self._held_chain(tokens, held, tags) if held else (0, self.root, 0)
        blocks = list(held[:known]) if known else []
        node, i = self._walk(node, j, known, tokens, tags, len(tokens) // self.block_size,
                             now, blocks)
        if not partial:
            return blocks, None
        bs = self.block_size
        rest = tokens[i * bs:(i + 1) * bs]
        best, k = None, 0
        for child in node.children.values():
            if child.tags[0] is not None:  # tagged: another history
                continue
            chunk = child.tokens[:bs]
            n = next((x for x, (a, b) in enumerate(zip(chunk, rest)) if a != b), min(len(chunk), len(rest)))
            if n > k:
                best, k = child, n
        if best is None:
            return blocks, None
        if best.partial:  # a run is not touched for its first block copied
            best.last_used = now
        return blocks, (best.blocks[0], k)

    def _walk(self, node: Node, j: int, i: int, tokens: list[int], tags: list | None,
              end: int, now: int, blocks: list[int]) -> tuple[Node, int]:
        """Match chunks i.. (to `end`) from block j of `node` on, the blocks appended to
        `blocks`; (the node the match ends with, chunks matched). A run it ends inside is
        split there, and the chain to it touched as used (only what was matched counts as
        used, for LRU eviction)."""
        while i < end:
            if j == len(node.blocks):
                child = node.children.get(self._key(tokens, tags, i))
                if child is None or child.partial:
                    break
                node, j = child, 0
            n = min(len(node.blocks) - j, end - i)
            same = self._same(node, j, tokens, tags, i, n)
            blocks += node.blocks[j:j + same]
            i, j = i + same, j + same
            if same < n:
                break
        if j < len(node.blocks):
            self._split(node, j)
        at = node
        while at is not self.root:
            at.last_used = now
            at = at.parent
        return node, i

    def _same(self, node: Node, j: int, tokens: list[int], tags: list | None, i: int, n: int) -> int:
        """How many of node's chunks from j equal tokens' chunks from i (up to n), tags too:
        one comparison of token lists where they all do."""
        bs = self.block_size
        same = n
        mine = node.tokens if j == 0 and n == len(node.blocks) else node.tokens[j * bs:(j + n) * bs]
        if mine != tokens[i * bs:(i + n) * bs]:
            same = next(x for x in range(n) if node.tokens[(j + x) * bs:(j + x + 1) * bs]
                        != tokens[(i + x) * bs:(i + x + 1) * bs])
        if tags is not None or node.tags[j:j + same].count(None) != same:
            same = next((x for x in range(same) if node.tags[j + x] != self._tag(tags, i + x)), same)
        return same

    def insert(self, tokens: list[int], blocks: list[int], partial: bool = False,
               tags: list | None = None) -> list[int]:
        """Record that `blocks` hold the KV of `tokens`: the full blocks, and with `partial`
        the partially filled last block as a partial leaf.

        Returns, per full chunk, the block the tree now holds for it: the caller's own
        block, or an older block with the same content, which the caller should switch to.
        A partial leaf is never switched to (its owner may still write into its block).
        """
        bs, now = self.block_size, next(self._clock)
        # The walk goes on below the blocks the tree already holds as this chain (full chunks
        # only: a partial leaf is never in it), so a sequence caching its prompt again after
        # a match or a restore compares no tokens.
        known, node, j = self._held_chain(tokens, blocks, tags)
        fresh = self.by_block.keys().isdisjoint(blocks[known:])  # none of them in the tree
        if not fresh:
            for block in blocks[known:]:  # grew since it was cached partially: re-placed below
                leaf = self.by_block.get(block)
                if leaf is not None and leaf.partial:
                    del leaf.parent.children[leaf.key]
                    del self.by_block[block]
        n_chunks = len(tokens) // bs
        end = min(n_chunks, len(blocks))
        held = list(blocks[:known])
        node, i = self._walk(node, j, known, tokens, tags, end, now, held)
        tail = tuple(tokens[n_chunks * bs:])
        with_leaf = partial and bool(tail) and end == n_chunks < len(blocks) \
            and blocks[n_chunks] not in self.by_block
        if i < end:  # the rest of the chain is new: one run, or the run it ends grown
            held += blocks[i:end]
            # Up to a block the tree holds elsewhere, if any (never, from the engine): a
            # block is in one place in the tree.
            stop = end if fresh else next(
                (x for x in range(i, end) if blocks[x] in self.by_block), end)
            if stop > i:
                node = self._grow(node, tokens, blocks, tags, i, stop, now)
            with_leaf = with_leaf and stop == end
        if with_leaf and tail not in node.children:
            leaf = Node(list(tail), [blocks[n_chunks]], [None], node, now, tail, partial=True)
            node.children[tail] = leaf
            self.by_block[blocks[n_chunks]] = leaf
        return held

    def _held_chain(self, tokens: list[int], blocks: list[int] | None,
                    tags: list | None) -> tuple[int, Node, int]:
        """How many of the first blocks are already the tree's chain from the root for these
        tokens, and where it ends: (k, node, blocks of the node in it). A
        sequence that matched or cached its prefix holds them. Checked up the parents by
        block ids, no token compared but the last chunk's."""
        bs, none, by_block = self.block_size, (0, self.root, 0), self.by_block
        k = min(len(tokens) // bs, len(blocks or ()))
        if not k or blocks[0] not in by_block:
            return none
        if blocks[k - 1] not in by_block:  # its newest blocks are not in yet: the last that is,
            lo, hi = 1, k - 1  # by bisection (they lead; the chain is checked below anyway)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if blocks[mid - 1] in by_block else (lo, mid - 1)
            k = lo
        last = node = self.by_block[blocks[k - 1]]
        if node.partial:
            return none
        j = node.blocks.index(blocks[k - 1]) + 1
        if node.tokens[(j - 1) * bs:j * bs] != tokens[(k - 1) * bs:k * bs] \
                or node.tags[j - 1] != self._tag(tags, k - 1):
            return none
        at, n = k, j
        while node is not self.root:  # a shorter chain meets the root first
            if at < n or node.blocks[:n] != blocks[at - n:at]:
                return none
            at, node = at - n, node.parent
            n = len(node.blocks)
        return (k, last, j) if at == 0 else none

    def _split(self, node: Node, j: int) -> Node:
        """Cut node's run after its first j blocks: the rest becomes its only child (with
        node's children below it); returns that child."""
        bs = self.block_size
        rest = Node(node.tokens[j * bs:], node.blocks[j:], node.tags[j:], node, node.last_used,
                    None)
        rest.key = self._key(rest.tokens, rest.tags, 0)
        rest.children = node.children
        for child in rest.children.values():
            child.parent = rest
        self.by_block.update(dict.fromkeys(rest.blocks, rest))
        node.tokens, node.blocks, node.tags = node.tokens[:j * bs], node.blocks[:j], node.tags[:j]
        node.children = {rest.key: rest}
        return rest

    def _grow(self, node: Node, tokens: list[int], blocks: list[int], tags: list | None,
              start: int, end: int, now: int) -> Node:
        """Chunks start..end (with their blocks) below `node`, at the end of its run: one new
        node, or node's run grown where nothing branches from it yet; the node they are in."""
        bs = self.block_size
        new_tags = [self._tag(tags, i) for i in range(start, end)] if tags is not None else [None] * (end - start)
        if node is not self.root and not node.children:
            node.tokens += tokens[start * bs:end * bs]
            node.blocks += blocks[start:end]
            node.tags += new_tags
        else:
            child = Node(tokens[start * bs:end * bs], blocks[start:end], new_tags, node, now,
                         self._key(tokens, tags, start))
            node.children[child.key] = child
            node = child
        node.last_used = now
        self.by_block.update(dict.fromkeys(blocks[start:end], node))
        return node

    def detach(self, blocks: list[int]) -> list[int]:
        """Take these blocks out of the tree (their content is about to be rewritten), with
        everything cached below them; returns the blocks of the rest taken out."""
        mine, others = set(blocks), []
        for b in blocks:
            node = self.by_block.get(b)
            if node is None:
                continue
            j = node.blocks.index(b)
            if j:
                node = self._split(node, j)
            del node.parent.children[node.key]
            stack = [node]
            while stack:
                n = stack.pop()
                for block in n.blocks:
                    del self.by_block[block]
                    if block not in mine:
                        others.append(block)
                stack.extend(n.children.values())
        return others

    def contains(self, block: int) -> bool:
        return block in self.by_block

    def _leaves(self, is_free: callable) -> list[Node]:
        """Nodes with nothing below whose last block nobody references."""
        nodes = {id(n): n for n in self.by_block.values()}.values()
        return [n for n in nodes if not n.children and is_free(n.blocks[-1])]

    def evict(self, n: int, is_free: callable) -> list[int]:
        """Remove up to n blocks nobody references, from the ends of the least recently used
        leaf runs; return them."""
        bs, freed = self.block_size, []
        while len(freed) < n:
            leaves = self._leaves(is_free)
            if not leaves:
                break
            leaves.sort(key=lambda node: node.last_used)
            for leaf in leaves:
                while leaf.blocks and len(freed) < n and is_free(leaf.blocks[-1]):
                    block = leaf.blocks.pop()
                    leaf.tags.pop()
                    del leaf.tokens[len(leaf.blocks) * bs:]
                    del self.by_block[block]
                    freed.append(block)
                if not leaf.blocks:
                    del leaf.parent.children[leaf.key]
                if len(freed) == n:
                    break
        return freed

    def clear(self, is_free: callable) -> list[int]:
        return self.evict(len(self.by_block), is_free)
