"""Paged K/V storage in MLX arrays, and the per-step LayerKV views the models attend through."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from mlxlocal.cache import quantized
from mlxlocal.metal import paged_attention
from mlxlocal.metal.attention import key_slices, rows_index, segment_attention, sequence_rows
from mlxlocal.metal.kernel import metal_available
from mlxlocal.metal.paged_attention import kernel_taken, step_mask
from mlxlocal.metal.paged_attention_quant import paged_attention_quantized, quantized_kernel_taken

# Longest context from which decode reads each sequence's runs of blocks by slices: below,
# one gather of the batch (and one attention call) costs less than B calls, or than a
# sequence's few partial attentions merged (measured here).
IN_PLACE_KEYS = 4096


@dataclass(frozen=True)
class KVShape:
    """One attention layer's K and V rows per token (MLA-style models differ in K and V)."""

    k_heads: int
    k_dim: int
    v_heads: int
    v_dim: int


class KVPools:
    """Per attention layer, K and V pools of shape [heads, num_blocks, block_size, dim].

    Head-major, so a block's keys per head are contiguous: a sequence whose blocks form a
    run is a slice in the [heads, keys, dim] shape attention takes, and a gathered one
    needs no transpose (metal/attention.py).

    Sliding-window layers (`windowed`) have pools of their own block ids, `window_blocks`
    of them: they only ever hold the last window of each sequence (cache/window.py).
    With `bits` (8 or 4) every pool is the (packed, scales, biases) triple of mx.quantize
    over the last axis, `group_size` elements per scale (cache/quantized.py): rows are
    quantized as they are written and dequantized as they are read.
    """

    editable = True  # cache edits move rows; a cluster's mirrored pools refuse them

    def __init__(self, shapes: list[KVShape], num_blocks: int, block_size: int, dtype: mx.Dtype,
                 windowed: list[bool] | None = None, window_blocks: int = 0,
                 bits: int | None = None, group_size: int = 64):
        quantized.check([d for s in shapes for d in (s.k_dim, s.v_dim)], bits, group_size)
        self.bits, self.group_size = bits, group_size
        self.windowed = windowed or [False] * len(shapes)
        sizes = [window_blocks if w else num_blocks for w in self.windowed]
        pool = lambda n, h, d: quantized.empty(n, block_size, h, d, dtype, bits, group_size)  # noqa: E731
        self._pool = pool
        self.shapes = shapes
        self.k = [pool(n, s.k_heads, s.k_dim) for n, s in zip(sizes, shapes)]
        self.v = [pool(n, s.v_heads, s.v_dim) for n, s in zip(sizes, shapes)]
        mx.eval(self.state())
        self.block_size = block_size
        self.num_blocks = num_blocks

    def resize(self, num_blocks: int) -> None:
        """The full-attention layers' pools made num_blocks long: grown with empty blocks
        (one copy of each pool), or cut (the ids past the end are free)."""
        n = self.num_blocks
        for pools in (self.k, self.v):
            for i, (w, s) in enumerate(zip(self.windowed, self.shapes)):
                if w:
                    continue
                parts = quantized.parts(pools[i])
                if num_blocks > n:
                    h, d = (s.k_heads, s.k_dim) if pools is self.k else (s.v_heads, s.v_dim)
                    more = quantized.parts(self._pool(num_blocks - n, h, d))
                    new = [mx.concatenate([a, b], axis=1) for a, b in zip(parts, more)]
                else:
                    new = [mx.contiguous(a[:, :num_blocks]) for a in parts]
                pools[i] = tuple(new) if isinstance(pools[i], tuple) else new[0]
                mx.eval(pools[i])  # one layer at a time: the old and new copies of one only
        self.num_blocks = num_blocks

    @staticmethod
    def uniform(n_layers: int, n_kv_heads: int, head_dim: int) -> list[KVShape]:
        return [KVShape(n_kv_heads, head_dim, n_kv_heads, head_dim)] * n_layers

    @staticmethod
    def bytes_per_block(shapes: list[KVShape], block_size: int, dtype: mx.Dtype,
                        bits: int | None = None, group_size: int = 64) -> int:
        quantized.check([d for s in shapes for d in (s.k_dim, s.v_dim)], bits, group_size)
        row = lambda h, d: quantized.bytes_per_row(h, d, dtype, bits, group_size)  # noqa: E731
        return block_size * sum(row(s.k_heads, s.k_dim) + row(s.v_heads, s.v_dim) for s in shapes)

    def tables(self, layer: int, batch: StepBatch) -> tuple[mx.array, mx.array]:
        """(slot blocks, block tables) of this step in the id space of the layer's pools."""
        if self.windowed[layer]:
            return batch.window_slot_blocks, batch.window_block_tables
        return batch.slot_blocks, batch.block_tables

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state())

    @property
    def block_nbytes(self) -> int:
        """Bytes one more block of the full-attention pools takes (what resize grows by)."""
        return sum(a.nbytes // max(1, a.shape[1]) for i, w in enumerate(self.windowed) if not w
                   for pool in (self.k[i], self.v[i]) for a in quantized.parts(pool))

    def nbytes_at(self, num_blocks: int) -> int:
        """What the pools would take resized to num_blocks (the window pools keep their size)."""
        return self.nbytes + (num_blocks - self.num_blocks) * self.block_nbytes

    def _encode(self, x: mx.array) -> tuple[mx.array, ...]:
        return quantized.encode(x, self.bits, self.group_size)

    def _decode(self, xs) -> mx.array:
        return quantized.decode(xs, self.bits, self.group_size)

    def copy_block(self, src: int, dst: int) -> None:
        """Copy block src's K/V rows into block dst in every full-attention layer
        (copy-on-write reuse; models with windowed layers reuse whole blocks only)."""
        layers = [i for i, windowed in enumerate(self.windowed) if not windowed]
        pools = [p for i in layers for pool in (self.k[i], self.v[i]) for p in quantized.parts(pool)]
        # The block as arrays of their own first: a pool updated from a view of itself cannot
        # be updated in place, and MLX would copy the whole pool (146 ms per 268 MB pool here).
        blocks = [mx.contiguous(p[:, src]) for p in pools]
        mx.eval(blocks)
        for p, b in zip(pools, blocks):
            p[:, dst] = b

    def move_rows(self, src_blocks: mx.array, src_offsets: mx.array, dst_blocks: mx.array,
                  dst_offsets: mx.array, rotate: tuple | None = None) -> None:
        """Copy K/V rows (one per token) to other slots in every layer (cache edits).
        `rotate` = (rows, old positions, new positions, fn(layer, keys, old, new)):
        those rows' keys are re-rotated on the way; values are copied as they are."""
        for i in range(len(self.k)):
            kp, vp = quantized.parts(self.k[i]), quantized.parts(self.v[i])
            k = [p[:, src_blocks, src_offsets] for p in kp]  # [heads, rows, ...]
            v = [p[:, src_blocks, src_offsets] for p in vp]
            if rotate is not None:
                rows, old, new, fn = rotate
                # Quantized keys: dequantized, re-rotated, quantized again. Attention only ever
                # saw the dequantized keys, so this rotates exactly what the model attended to;
                # the second rounding is one more error of the size of the first.
                keys = self._decode([x[:, rows] for x in k]).swapaxes(0, 1)  # [rows, heads, dim]
                moved = self._encode(fn(i, keys, old, new).swapaxes(0, 1))
                for x, m in zip(k, moved):
                    x[:, rows] = m
            # Arrays of their own first, one layer at a time (see copy_block).
            mx.eval(k, v)
            for p, x in zip(kp + vp, k + v):
                p[:, dst_blocks, dst_offsets] = x

    def write(self, layer: int, batch: StepBatch, k: mx.array, v: mx.array) -> None:
        """Store new k/v [B, H, L, D] at the step's slots, in the order of the slot mapping
        (quantized first, each token's row on its own, with bits set)."""
        kp, vp = quantized.parts(self.k[layer]), quantized.parts(self.v[layer])
        if batch.host_slot is not None and not self.windowed[layer]:
            # One token of one sequence: [1, H, 1, D] is [H, 1, 1, D] (no copy), a slice update.
            b, o = batch.host_slot
            for pool, x in ((kp, k), (vp, v)):
                for p, row in zip(pool, self._encode(x.reshape(x.shape[1], 1, 1, x.shape[3]))):
                    p[:, b : b + 1, o : o + 1] = row
            return
        for pool, x in ((kp, k), (vp, v)):
            index = batch.write_index(x.shape[0], x.shape[1], x.shape[2], self.windowed[layer])
            for p, rows in zip(pool, self._encode(x)):
                p[index] = rows

    def gather(self, layer: int, batch: StepBatch, window: int | None = None,
               decode: bool = True) -> tuple:
        """Every sequence's keys and values [B, H, n_keys, D] from position 0 (a `window`
        layer: from its window_start block), through its block table (positions past a
        sequence's context are masked by the caller); quantized pools come back dequantized
        (with `decode`) or as their (packed, scales, biases) rows.
        A run of blocks is read by a slice, a gather by one flat index: neither transposes."""
        n_keys = max(batch.host_context_lens)
        _, tables = self.tables(layer, batch)
        if window is not None:
            start = batch.window_start(window, self.block_size)
            tables, n_keys = tables[:, start:], n_keys - start * self.block_size
        run = None if self.windowed[layer] else batch.host_run
        out = []
        for pool in (self.k[layer], self.v[layer]):
            parts = quantized.parts(pool)
            index = None if run is not None else batch.rows_index(layer, self, parts[0])
            if index is not None and window is not None:
                index = index[:, :, start:]
            rows = [sequence_rows(p, tables, n_keys, index, run) for p in parts]
            out.append(self._decode(rows) if decode or self.bits is None else tuple(rows))
        return out[0], out[1]

    def state(self) -> list[mx.array]:
        return [p for pool in self.k + self.v for p in quantized.parts(pool)]


@dataclass
class StepBatch:
    """Where one forward's tokens go and what each sequence sees.

    B sequences, each with L new tokens (decode: L = 1; a prefill chunk: B = 1).
    """

    positions: int | mx.array  # rope offset of the first new token: int, or [B]
    slot_blocks: mx.array  # [B * L] block id of each new token
    slot_offsets: mx.array  # [B * L] offset inside that block
    block_tables: mx.array  # [B, max_blocks] int32 (padded with a valid id; masked)
    context_lens: mx.array  # [B] tokens in context after this step
    host_context_lens: list[int] = field(default_factory=list)  # the same, on the host
    # The same for windowed layers' own block ids (holes where blocks left the window: masked).
    window_slot_blocks: mx.array | None = None
    window_block_tables: mx.array | None = None
    # One sequence on the host, for the CPU-cheap paths of the full-attention layers: the
    # single new token's (block, offset), written by a slice update instead of a scatter;
    # the first block when its table is a run of consecutive ids, read by a slice instead
    # of a gather (a lone sequence usually gets consecutive blocks from the free list).
    host_slot: tuple[int, int] | None = None
    host_run: int | None = None
    # Each sequence's table as runs of consecutive blocks [(first, blocks), ...] (None: too
    # many): decode at long context reads each run by a slice (in_place), e.g. a shared
    # prefix and then the sequence's own blocks, never gathering the context.
    host_segments: list[list[tuple[int, int]] | None] | None = None
    _masks: dict = field(default_factory=dict)  # per-step values every layer shares: masks, window starts

    def write_index(self, B: int, heads: int, L: int, windowed: bool) -> tuple[mx.array, ...]:
        """(head, block, offset) of every new row, each [B, heads, L]: the new K or V
        [B, heads, L, dim] scatters into a pool as it is, no transpose. Built once per step
        for every layer (fewer graph nodes per layer than a slice-and-arrays update)."""
        key = ("write", heads, windowed)
        if key not in self._masks:
            blocks = self.window_slot_blocks if windowed else self.slot_blocks
            shape = (B, heads, L)
            self._masks[key] = (mx.broadcast_to(mx.arange(heads)[None, :, None], shape),
                                mx.broadcast_to(blocks.reshape(B, 1, L), shape),
                                mx.broadcast_to(self.slot_offsets.reshape(B, 1, L), shape))
        return self._masks[key]

    def rows_index(self, layer: int, pools: KVPools, pool: mx.array) -> mx.array:
        """The flat row-block index of this step's tables into pools like `pool` (layer's),
        built once per step for every layer of the same heads and id space."""
        windowed = pools.windowed[layer]
        key = ("rows", windowed, pool.shape[0], pool.shape[1])
        if key not in self._masks:
            tables = self.window_block_tables if windowed else self.block_tables
            self._masks[key] = rows_index(tables, pool.shape[0], pool.shape[1])
        return self._masks[key]

    def in_place(self, L: int) -> list[list[tuple[int, int]]] | None:
        """Each sequence's runs, where a decode step at long context reads them by slices
        rather than one gather of every context (full layers). With Metal, only a batch on
        one run each, as measured there (the kernel dispatch chose MLX's attention); several
        runs merged and a lone sequence's split were measured on the CPU backend only."""
        key = ("in place", L)
        if key not in self._masks:  # asked by every full layer: once per step
            segments, lens = self.host_segments, self.host_context_lens
            if L != 1 or segments is None or None in segments or max(lens) < IN_PLACE_KEYS:
                segments = None
            elif metal_available() and (len(lens) == 1 or any(len(x) > 1 for x in segments)):
                segments = None
            self._masks[key] = segments
        return self._masks[key]

    def slices(self, i: int, block_size: int) -> tuple[list, int]:
        """Sequence i's key_slices (in_place's runs, cut to its context), once per step."""
        key = ("slices", i, block_size)
        if key not in self._masks:
            assert self.host_segments is not None and self.host_segments[i] is not None
            self._masks[key] = key_slices(self.host_segments[i], self.host_context_lens[i],
                                          block_size)
        return self._masks[key]

    def window_start(self, window: int, block_size: int) -> int:
        """First block any query of this step sees in a `window` layer: keys before it are
        neither gathered nor masked (they left every sequence's window)."""
        key = ("start", window)
        if key not in self._masks:  # asked by every window layer, for K and V: once per step
            L = self.slot_offsets.shape[0] // len(self.host_context_lens)
            self._masks[key] = min(max(0, c - L - window + 1) for c in self.host_context_lens) // block_size
        return self._masks[key]

    def window_mask(self, L: int, window: int, block_size: int) -> mx.array | str | None:
        """The mask of a window layer whose keys start at window_start's block."""
        first = self.window_start(window, block_size) * block_size
        if first == 0:
            return self.mask(L, window)
        key = (L, window, "from", first)
        if key not in self._masks:
            self._masks[key] = step_mask(self.context_lens, L, max(self.host_context_lens), window, first)
        return self._masks[key]

    def mask(self, L: int, window: int | None) -> mx.array | str | None:
        """The attention mask of this step, built once and shared by every layer."""
        key = (L, window)
        if key not in self._masks:
            longest = max(self.host_context_lens)
            if len(self.host_context_lens) == 1 and (window is None or longest <= window):
                # One sequence, keys cut to its context: plain causal (or nothing for L = 1).
                self._masks[key] = "causal" if L > 1 else None
            else:
                self._masks[key] = step_mask(self.context_lens, L, longest, window)
        return self._masks[key]


class PagedLayerView:
    """LayerKV for one layer and one step: scatter new K/V into the pools, then attend."""

    def __init__(self, pools: KVPools, layer: int, batch: StepBatch, window: int | None):
        self.pools, self.layer, self.batch, self.window = pools, layer, batch, window

    @property
    def offset(self) -> int | mx.array:
        return self.batch.positions

    def attend(self, q: mx.array, k: mx.array, v: mx.array, scale: float) -> mx.array:
        b, pools = self.batch, self.pools
        pools.write(self.layer, b, k, v)
        L, bs, w = q.shape[2], pools.block_size, self.window
        k_pool, v_pool, tables = pools.k[self.layer], pools.v[self.layer], pools.tables(self.layer, b)[1]
        segments = b.in_place(L) if w is None else None
        if segments is not None and not self._kernel(q, k_pool, v_pool, tables):
            return mx.concatenate([self._one(i, q[i : i + 1], scale) for i in range(q.shape[0])])
        # A window layer reads from the first block any query of this step still sees.
        run = b.host_run if w is None else None
        kw = dict(n_keys=max(b.host_context_lens), mask=b.mask(L, None) if w is None else b.window_mask(L, w, bs),
                  first_block=run, window_start=0 if w is None else b.window_start(w, bs),
                  index=None if run is not None else b.rows_index(self.layer, pools, quantized.parts(k_pool)[0]))
        if pools.bits is not None:
            return paged_attention_quantized(q, k_pool, v_pool, tables, b.context_lens, scale,
                                             pools.group_size, pools.bits, w, **kw)
        return paged_attention(q, k_pool, v_pool, tables, b.context_lens, scale, w, **kw)

    def _kernel(self, q, k_pool, v_pool, tables) -> bool:
        """Whether the dispatch takes the paged kernel, which reads the pools in place anyway."""
        if self.pools.bits is not None:
            return quantized_kernel_taken(q, k_pool, v_pool, tables, self.pools.group_size,
                                          self.pools.bits, None)
        return kernel_taken(q, k_pool, v_pool, tables, None)

    def _one(self, i: int, q: mx.array, scale: float) -> mx.array:
        """Sequence i's decode attention over its runs of blocks: slices, cut to its context
        (quantized: straight on the packed rows, nothing dequantized)."""
        pools = self.pools
        return segment_attention(q, pools.k[self.layer], pools.v[self.layer],
                                 self.batch.slices(i, pools.block_size), scale, pools.group_size,
                                 pools.bits)
