"""Block keys of the disk KV tier: block i's key covers its tokens, its tag (a cache edit's
history) and every block before it, so equal keys mean equal prefixes.

A key is blake2b over the prefix's token bytes, not a chain of per-block hashes: a restore
of 16k tokens hashes them in one call and digests only the blocks it looks at (a file's
first and last), 0.1 ms, where a chain took 1,024 calls (1 ms). Cryptographic, unlike the
files' checksums: a prompt made to collide with another's key would be served its KV.
"""

from __future__ import annotations

import hashlib

import numpy as np

_PLAIN, _TAGGED = b"mlxlocal-kv", b"mlxlocal-kv-tag"  # separate domains


def _hasher(person: bytes):
    return hashlib.blake2b(digest_size=16, person=person)


class PrefixKeys:
    """The keys of a token list's full blocks, worked out as they are asked for (in order:
    one hash call over what lies between; out of order: all of them, once)."""

    def __init__(self, tokens: list[int] | np.ndarray, block_size: int, tags: list | None = None):
        self.n, size = len(tokens) // block_size, len(tokens) // block_size * block_size
        self._step = block_size * 8
        ids = tokens[:size].astype(np.int64, copy=False) if isinstance(tokens, np.ndarray) \
            else np.fromiter(tokens, np.int64, size)
        self._data = ids.tobytes()
        self._keys: dict[int, bytes] = {}
        self._h, self._fed = _hasher(_PLAIN), 0  # the running hash: blocks fed so far
        self._tags = tags if tags is not None and any(t is not None for t in tags[:self.n]) else None
        if self._tags is not None:  # an edit history: every block's key at once (rare)
            self._keys = dict(enumerate(self._all_tagged()))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> bytes:
        if not 0 <= i < self.n:
            raise IndexError(i)
        key = self._keys.get(i)
        if key is not None:
            return key
        if i < self._fed:  # behind the running hash: every key, once
            self._keys.update(enumerate(self.all()))
            return self._keys[i]
        self._h.update(self._data[self._fed * self._step:(i + 1) * self._step])
        self._fed = i + 1
        key = self._keys[i] = self._h.copy().digest()
        return key

    def all(self) -> list[bytes]:
        if self._tags is not None or len(self._keys) == self.n:
            return [self._keys[i] for i in range(self.n)]
        h, step, data, out = _hasher(_PLAIN), self._step, memoryview(self._data), []
        for i in range(self.n):
            h.update(data[i * step:(i + 1) * step])
            out.append(h.copy().digest())
        return out

    def _all_tagged(self) -> list[bytes]:
        """Blocks before the first tag keep the plain keys (shared with untagged prompts);
        from it on, a stream of each block's tokens and its tag, length-prefixed."""
        tags, step, data = self._tags, self._step, memoryview(self._data)
        plain, tagged, out = _hasher(_PLAIN), _hasher(_TAGGED), []
        seen_tag = False
        for i in range(self.n):
            tag = tags[i] if i < len(tags) else None
            block = data[i * step:(i + 1) * step]
            raw = b"" if tag is None else repr(tag).encode()
            tagged.update(block)
            tagged.update(len(raw).to_bytes(8, "little") + raw)
            seen_tag = seen_tag or tag is not None
            if not seen_tag:
                plain.update(block)
            out.append((tagged if seen_tag else plain).copy().digest())
        return out


def chain_hashes(tokens: list[int], block_size: int, tags: list | None = None) -> list[bytes]:
    """Every full block's key (PrefixKeys)."""
    return PrefixKeys(tokens, block_size, tags).all()
