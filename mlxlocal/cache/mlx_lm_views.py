"""mlx-lm's cache interface over our paged pools, so mlx-lm's model code runs on the paged engine.

An mlx-lm attention layer reads `cache.offset` (rope), calls `cache.update_and_fetch(k, v)`
and attends with the mask its model built through `cache.make_mask(...)`. `PagedCache`
answers all three from one StepBatch: new K/V go into the pools at the step's slots, and
every sequence's keys come back gathered through its block table, padded to the longest
context and masked. Recurrent layers (Mamba, short convolutions) get mlx-lm's own cache
class holding the batch's states stacked on the batch axis; the engine keeps them per
sequence between steps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.models.cache import (
    ArraysCache,
    CacheList,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from mlxlocal.cache.paged import KVPools, KVShape, StepBatch
from mlxlocal.metal.paged_attention import step_mask

log = logging.getLogger("mlxlocal.engine")

State = list  # one recurrent layer's arrays (ArraysCache.cache entries), batch axis first


class NotPageable(Exception):
    """The model's cache has a part the paged engine cannot hold; the message says which."""


class PagedCache:
    """What one mlx-lm attention layer sees for one step (mlx-lm's KVCache interface)."""

    def __init__(self, pools: KVPools, layer: int, batch: StepBatch, window: int | None):
        self.pools, self.layer, self.batch, self.window = pools, layer, batch, window

    @property
    def offset(self) -> int | mx.array:
        return self.batch.positions

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.pools.write(self.layer, self.batch, keys, values)
        # A window layer's keys start where its window starts, and so does its mask
        # (make_mask below, asked through this layer or another window layer).
        return self.pools.gather(self.layer, self.batch, self.window)

    def make_mask(self, N: int, window_size: int | None = None, return_array: bool = False, **_):
        window = window_size or self.window
        bs = self.pools.block_size
        mask = self.batch.window_mask(N, window, bs) if self.window is not None else self.batch.mask(N, window)
        if return_array and not isinstance(mask, mx.array):
            first = self.batch.window_start(window, bs) * bs if self.window is not None else 0
            mask = step_mask(self.batch.context_lens, N, max(self.batch.host_context_lens), window, first)
        return mask

    def is_trimmable(self) -> bool:  # mlx-lm's prompt-cache helpers ask; the engine trims, not the model
        return False


class QuantizedPagedCache(PagedCache):
    """A full-attention layer over quantized pools, for a model that attends through mlx-lm's
    quantized sdpa (it asks the cache for `bits`): keys and values are handed over packed, as
    QuantizedKVCache does, so nothing is dequantized per step."""

    def __init__(self, pools: KVPools, layer: int, batch: StepBatch):
        super().__init__(pools, layer, batch, None)
        self.bits, self.group_size = pools.bits, pools.group_size

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[tuple, tuple]:
        self.pools.write(self.layer, self.batch, keys, values)
        return self.pools.gather(self.layer, self.batch, decode=False)


@dataclass(frozen=True)
class Slot:
    """One entry of the model's cache list: an attention layer, a recurrent layer, or a list."""

    kind: str  # "kv" | "state" | "list"
    index: int = 0  # kv: attention layer in the pools; state: recurrent layer
    window: int | None = None
    state_cls: type | None = None
    size: int = 0
    children: tuple[Slot, ...] = ()


class CacheLayout:
    """Where each entry of `model.make_cache()` lives on the paged engine."""

    def __init__(self, model):
        self.n_kv = 0
        self.n_state = 0
        self.windows: list[int | None] = []  # per attention layer, in pool order
        self.slots = [self._slot(c) for c in make_prompt_cache(model)]
        self.model = model
        self._packed: dict[tuple[int, int], bool] = {}

    def _slot(self, cache) -> Slot:
        # Exact types only: a subclass may keep state the paged pools know nothing about.
        if type(cache) is KVCache or (type(cache) is RotatingKVCache and cache.keep == 0):
            window = cache.max_size if type(cache) is RotatingKVCache else None
            self.windows.append(window)
            self.n_kv += 1
            return Slot("kv", self.n_kv - 1, window=window)
        if type(cache) is ArraysCache:
            self.n_state += 1
            return Slot("state", self.n_state - 1, state_cls=type(cache), size=len(cache.cache))
        if type(cache) is CacheList:
            return Slot("list", children=tuple(self._slot(c) for c in cache.caches))
        raise NotPageable(f"its cache holds a {type(cache).__name__}, which the paged engine cannot page")

    @property
    def recurrent(self) -> bool:
        return self.n_state > 0

    def probe(self) -> tuple[list[KVShape], mx.Dtype, int]:
        """Run two tokens through the model on mlx-lm's own cache: the K/V shape of every
        attention layer, their dtype, and the bytes of one sequence's recurrent state."""
        caches = make_prompt_cache(self.model)
        mx.eval(self.model(mx.array([[0, 1]]), cache=caches))
        shapes: list[KVShape] = []
        dtype, state_bytes = mx.float32, 0

        def walk(slot: Slot, cache) -> None:
            nonlocal dtype, state_bytes
            if slot.kind == "kv":
                k, v = cache.keys, cache.values
                shapes.append(KVShape(k.shape[1], k.shape[3], v.shape[1], v.shape[3]))
                dtype = k.dtype
            elif slot.kind == "state":
                state_bytes += sum(a.nbytes for a in cache.cache if a is not None)
            else:
                for s, c in zip(slot.children, cache.caches):
                    walk(s, c)

        for slot, cache in zip(self.slots, caches):
            walk(slot, cache)
        return shapes, dtype, state_bytes

    def takes_packed(self, bits: int, group_size: int) -> bool:
        """Whether the model's attention takes packed K/V from a cache with `bits`, as
        mlx-lm's QuantizedKVCache hands them over: tried once, two tokens on such caches."""
        key = (bits, group_size)
        if key not in self._packed:
            caches = [QuantizedKVCache(group_size, bits) if type(c) is KVCache else c
                      for c in make_prompt_cache(self.model)]
            try:
                mx.eval(self.model(mx.array([[0, 1]]), cache=caches))
                self._packed[key] = True
            except Exception as e:  # its code handles keys as arrays: they come dequantized
                self._packed[key] = False
                log.info("%s cannot attend over packed K/V (%s): its keys come dequantized",
                         type(self.model).__module__, e)
        return self._packed[key]

    def build(self, pools: KVPools, batch: StepBatch, states: list[list[State] | None]) -> list:
        """The cache list for one forward: `states[i]` is sequence i's recurrent state (one
        State per recurrent layer), or None before its first token."""
        packed = pools.bits is not None and self.takes_packed(pools.bits, pools.group_size)

        def make(slot: Slot):
            if slot.kind == "kv" and packed and slot.window is None:
                return QuantizedPagedCache(pools, slot.index, batch)
            if slot.kind == "kv":
                return PagedCache(pools, slot.index, batch, slot.window)
            if slot.kind == "list":
                return CacheList(*(make(s) for s in slot.children))
            cache = slot.state_cls(slot.size)
            if states[0] is not None:  # a batch is all fresh (a first chunk) or all resumed
                per_seq = [s[slot.index] for s in states]
                cache.cache = list(per_seq[0]) if len(per_seq) == 1 else [
                    None if per_seq[0][e] is None else mx.concatenate([s[e] for s in per_seq])
                    for e in range(slot.size)]
            return cache

        return [make(s) for s in self.slots]

    def collect(self, caches: list, batch_size: int) -> list[list[State]]:
        """After a forward: each sequence's new recurrent state, in batch order."""
        found: list[tuple[int, list]] = []

        def walk(slot: Slot, cache) -> None:
            if slot.kind == "state":
                found.append((slot.index, cache.cache))
            elif slot.kind == "list":
                for s, c in zip(slot.children, cache.caches):
                    walk(s, c)

        for slot, cache in zip(self.slots, caches):
            walk(slot, cache)
        found.sort(key=lambda f: f[0])
        if batch_size == 1:
            return [[list(arrays) for _, arrays in found]]
        return [[[None if a is None else a[i : i + 1] for a in arrays] for _, arrays in found]
                for i in range(batch_size)]
