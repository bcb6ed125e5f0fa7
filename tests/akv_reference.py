"""An independent reference for cache edits: the model run through a dense cache of our own
(plain MLX attention, no pools, no block tables), where a drop is a mask over the dropped
keys for every query from its edit on, and a reposition re-rotates keys in float64 numpy."""

from __future__ import annotations

import mlx.core as mx
import numpy as np


class MaskedKV:
    """One layer: every key ever computed, at its rope position; `hidden` keys are masked
    for queries computed after they were dropped."""

    def __init__(self):
        self.k = self.v = None
        self.next_pos = 0
        self.hidden: set[int] = set()
        self.key_pos: list[int] = []

    @property
    def offset(self) -> int:
        return self.next_pos

    def attend(self, q, k, v, scale):
        L = k.shape[2]
        self.k = k if self.k is None else mx.concatenate([self.k, k], axis=2)
        self.v = v if self.v is None else mx.concatenate([self.v, v], axis=2)
        n = self.k.shape[2]
        self.key_pos += list(range(self.next_pos, self.next_pos + L))
        self.next_pos += L
        Hq, Hk = q.shape[1], self.k.shape[1]
        keys = mx.repeat(self.k, Hq // Hk, axis=1).astype(mx.float32)
        values = mx.repeat(self.v, Hq // Hk, axis=1).astype(mx.float32)
        scores = (q.astype(mx.float32) * scale) @ keys.transpose(0, 1, 3, 2)
        Lq = q.shape[2]
        allowed = np.zeros((Lq, n), bool)
        for i in range(Lq):
            row = n - Lq + i
            allowed[i, : row + 1] = True
            allowed[i, sorted(self.hidden)] = False
        scores = mx.where(mx.array(allowed), scores, -np.inf)
        return (mx.softmax(scores, axis=-1) @ values).astype(q.dtype)


def rotate_np(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """Non-traditional rope in float64: x [N, H, D] rotated by pos[N] * inv_freq."""
    half = len(inv_freq)
    ang = pos[:, None, None].astype(np.float64) * inv_freq[None, None, :]
    c, s = np.cos(ang), np.sin(ang)
    a, b = x[..., :half], x[..., half : 2 * half]
    out = x.copy()
    out[..., :half] = a * c - b * s
    out[..., half : 2 * half] = a * s + b * c
    return out


class Reference:
    """The model over MaskedKVs: feed / drop / reposition by hand, read logits."""

    def __init__(self, model):
        self.model = model
        self.kv = [MaskedKV() for _ in model.layers]

    def feed(self, tokens: list[int]) -> mx.array:
        logits = self.model(mx.array([tokens]), self.kv)
        mx.eval(logits)
        return logits[0, -1].astype(mx.float32)

    def drop(self, slots: list[int]) -> None:
        for kv in self.kv:
            kv.hidden |= set(slots)

    def reposition(self, slot_pos: dict[int, int], inv_freq: np.ndarray, next_pos: int | None = None) -> None:
        """Keys of the given slots re-rotated to new positions (numpy float64: un-rotate at
        the old position, rotate at the new)."""
        slots = sorted(slot_pos)
        for kv in self.kv:
            k = np.array(kv.k[0].transpose(1, 0, 2).astype(mx.float32))  # [N, H, D]
            old = np.array([kv.key_pos[s] for s in slots])
            new = np.array([slot_pos[s] for s in slots])
            raw = rotate_np(k[slots], -old, inv_freq)
            k[slots] = rotate_np(raw, new, inv_freq)
            kv.k = mx.array(k.transpose(1, 0, 2)[None]).astype(kv.k.dtype)
            for s in slots:
                kv.key_pos[s] = slot_pos[s]
            if next_pos is not None:
                kv.next_pos = next_pos
