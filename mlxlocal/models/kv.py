"""The KV cache interface the native models call, and a dense implementation.

A model layer never touches cache storage. It asks its LayerKV for the rope
positions of the new tokens (`offset`) and hands over roped q/k/v to `attend`,
which stores k/v and returns the attention output. A paged cache implements the
same two members (with an `offset` of shape [B] for sequences of different
lengths), so swapping the dense cache for the paged one is local to mlxlocal.cache.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import mlx.core as mx

from mlxlocal.metal import sdpa


@runtime_checkable
class LayerKV(Protocol):
    """One layer's view of the KV cache for one forward step."""

    @property
    def offset(self) -> int | mx.array:
        """Position of the first new token: an int, or an array [B] per sequence."""
        ...

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        """Store k/v [B, Hkv, L, D] and return attention of q [B, Hq, L, D] over all keys."""
        ...


def window_mask(n_queries: int, n_keys: int, window: int | None) -> mx.array | str | None:
    """Causal mask for queries at the end of the keys, limited to `window` keys if given."""
    if window is None or n_keys <= window:
        return "causal" if n_queries > 1 else None
    q_pos = mx.arange(n_keys - n_queries, n_keys)[:, None]
    k_pos = mx.arange(n_keys)[None]
    return (q_pos >= k_pos) & (q_pos < k_pos + window)


class DenseKV:
    """Contiguous K/V for one sequence (batch of 1) in one layer, grown in steps.

    Keys are kept in full even for sliding-window layers; the mask limits what is seen.
    """

    step = 256

    def __init__(self, window: int | None = None):
        self.window = window
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self._offset = 0

    @property
    def offset(self) -> int:
        return self._offset

    def _append(self, k: mx.array, v: mx.array) -> tuple[mx.array, mx.array]:
        prev = self._offset
        n = k.shape[2]
        if self.keys is None or prev + n > self.keys.shape[2]:
            B, H, _, D = k.shape
            grow = ((n + self.step - 1) // self.step) * self.step
            new_k = mx.zeros((B, H, grow, D), k.dtype)
            new_v = mx.zeros((B, H, grow, v.shape[3]), v.dtype)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                self.keys = mx.concatenate([self.keys[..., :prev, :], new_k], axis=2)
                self.values = mx.concatenate([self.values[..., :prev, :], new_v], axis=2)
        self._offset = prev + n
        self.keys[..., prev : self._offset, :] = k
        self.values[..., prev : self._offset, :] = v
        return self.keys[..., : self._offset, :], self.values[..., : self._offset, :]

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        keys, values = self._append(k, v)
        mask = window_mask(q.shape[2], keys.shape[2], self.window)
        return sdpa(q, keys, values, scale, mask)

    def trim(self, n: int) -> int:
        """Forget the last n tokens (a new chat turn that diverges from the cached one)."""
        n = min(self._offset, n)
        self._offset -= n
        return n

    @property
    def nbytes(self) -> int:
        if self.keys is None:
            return 0
        return self.keys.nbytes + self.values.nbytes

    @property
    def state(self) -> list[mx.array]:
        return [] if self.keys is None else [self.keys, self.values]
