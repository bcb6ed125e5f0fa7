"""Logits of whole windows computed through the paged engine's K/V pools, quantized or not.

`mlxlocal perplexity --kv-bits` scores the text with the K/V stored exactly as the engine
stores them: the same runner (native views, or mlx-lm's model code on PagedCache), KVPools
with bits, and attention over the quantized blocks, each window a sequence of its own
blocks, a batch of windows one prefill step.
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx

from mlxlocal.cache import KVPools, PagedLayerView
from mlxlocal.engine.runner import NativeRunner, make_runner, step_batch


class PagedScorer:
    """logits(windows [B, L]) -> [B, L, vocab], K/V through pools of `bits` (None: model dtype)."""

    def __init__(self, loaded, max_batch: int, max_len: int, bits: int | None, group_size: int = 64,
                 block_size: int = 16):
        self.runner = runner = make_runner(loaded)
        self.block_size = block_size
        self.per_seq = -(-max_len // block_size)
        n = max_batch * self.per_seq
        windowed = [w is not None for w in runner.windows]
        # Window layers get as many blocks as the others: every window is short enough.
        self.pools = KVPools(runner.shapes, n, block_size, runner.dtype, windowed, n if any(windowed) else 0,
                             bits=bits, group_size=group_size)

    def logits(self, windows: mx.array) -> mx.array:
        B, L = windows.shape
        tables = [list(range(i * self.per_seq, i * self.per_seq + -(-L // self.block_size))) for i in range(B)]
        seqs = [SimpleNamespace(tokens=row, block_table=t, window_table=t, edit=None, run_cache=None)
                for row, t in zip(windows.tolist(), tables)]
        starts = [0] * B
        batch = step_batch(seqs, starts, L, self.block_size, any(self.pools.windowed))
        r = self.runner
        if isinstance(r, NativeRunner):
            views = [PagedLayerView(self.pools, i, batch, w) for i, w in enumerate(r.windows)]
            return r.model(windows, views)
        # mlx-lm's model code; recurrent layers (if any) start from a fresh state per window.
        return r.model(windows, cache=r.layout.build(self.pools, batch, [None] * B))
