"""Model runners: turn a step's sequences into one forward over the paged KV pools.

The engine hands a runner B sequences and n (1 for a decode batch, a chunk length for
one prefilling sequence) and gets back last-position logits [B, V]. The runner owns the
batch layout (slot mapping, block tables, positions) and how its model reads the pools:
native models through `PagedLayerView`s, mlx-lm models through mlx-lm's cache interface
(`PagedCache`), with recurrent states kept per sequence and snapshotted at block
boundaries for hybrid SSM models.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol, cast

import mlx.core as mx

from mlxlocal.cache import KVPools, KVShape, PagedLayerView, StepBatch
from mlxlocal.cache.blocks import id_runs
from mlxlocal.cache.mlx_lm_views import CacheLayout, NotPageable
from mlxlocal.cache.states import StateSnapshots
from mlxlocal.engine.sequence import Sequence

log = logging.getLogger("mlxlocal.engine")


# Block ids in a step's tables from which tables on runs are built on the device (a few ops,
# ~7 us here) rather than from the host lists (~0.17 us an id: 173 us for 8 x 1024).
DEVICE_TABLE_IDS = 512
# Runs of consecutive blocks a table may have and still be read by slices (a shared prefix,
# then the sequence's own blocks, then another: a few), not gathered.
MAX_SEGMENTS = 8


def run_start(table: list[int]) -> int | None:
    """First block of a table whose ids are consecutive (one slice of the pools), else None."""
    if not table or table[-1] - table[0] != len(table) - 1:
        return None
    return table[0] if table == list(range(table[0], table[-1] + 1)) else None


def run_tables(runs: list[int], lengths: list[int]) -> mx.array:
    """[B, max length] block tables of sequences on runs (padding reads block 0: masked)."""
    width = mx.arange(max(lengths), dtype=mx.int32)[None, :]
    return mx.where(width < mx.array(lengths)[:, None], mx.array(runs)[:, None] + width, 0)


def table_segments(seq) -> list[tuple[int, int]] | None:
    """seq's block table as runs of consecutive ids, [(first id, blocks), ...] (attention reads
    each by a slice), or None past MAX_SEGMENTS; only the ids added since the last call are
    checked: in place a table only grows (every other change makes a new list, checked whole)."""
    table, cached = seq.block_table, seq.run_cache
    if cached is not None and cached[0] is table and 0 < cached[1] <= len(table):
        segments = cached[2]
        if segments is not None and cached[1] < len(table):
            segments = _segments(table[cached[1]:], list(segments))
    else:
        start = run_start(table)  # most tables: one run, checked in one comparison
        segments = [(start, len(table))] if start is not None else _table_runs(table)
    seq.run_cache = (table, len(table), segments)
    return segments


def _table_runs(table: list[int]) -> list[tuple[int, int]] | None:
    """A whole table's runs (None past MAX_SEGMENTS): where a long one breaks found by numpy,
    not by a Python loop over its ids (a 16k-token prompt after a prefix hit: 1,025)."""
    if len(table) < 64:
        return _segments(table, [])
    runs = id_runs(table)
    return None if len(runs) > MAX_SEGMENTS else [(first, n) for _, first, n in runs]


def _segments(ids: list[int], segments: list[tuple[int, int]]) -> list[tuple[int, int]] | None:
    """`segments` (runs of the ids before these) extended by `ids`; None past MAX_SEGMENTS."""
    for b in ids:
        first, n = segments[-1] if segments else (-2, 0)
        if first + n == b:
            segments[-1] = (first, n + 1)
        elif len(segments) == MAX_SEGMENTS:
            return None
        else:
            segments.append((b, 1))
    return segments


def step_batch(seqs: list[Sequence], starts: list[int], n: int, block_size: int,
               windowed: bool = False) -> StepBatch:
    """Where n new tokens of each sequence go (from position starts[i]) and what it sees;
    `windowed`: the model has sliding-window layers, with block ids of their own."""
    positions = [p + i for p in starts for i in range(n)]
    index = [(j, p // block_size) for j, p0 in enumerate(starts) for p in range(p0, p0 + n)]

    def tables(of: list[list[int]], holes: bool = False) -> tuple[mx.array, mx.array]:
        width = max(len(t) for t in of)
        # Padding, and the holes of window tables (-1: blocks that left the window), read
        # block 0: masked. Full tables have no holes: no per-block pass over them each step.
        rows = [[max(b, 0) for b in t] for t in of] if holes else of
        return (mx.array([of[j][i] for j, i in index]),
                mx.array([t + [0] * (width - len(t)) for t in rows]))

    full = [s.block_table for s in seqs]
    segments = [table_segments(s) for s in seqs]
    runs = [x[0][0] if x is not None and len(x) == 1 else None for x in segments]
    if None in runs or sum(map(len, full)) < DEVICE_TABLE_IDS:
        slot_blocks, block_tables = tables(full)
    else:  # every table a run: built on the device from B numbers, not from every block id
        slot_blocks = mx.array([runs[j] + i for j, i in index])
        block_tables = run_tables(runs, [len(t) for t in full])
    window_slots, window_tables = tables([s.window_table for s in seqs], holes=True) if windowed else (None, None)
    host_slot = None
    if len(seqs) == 1 and n == 1:
        table = seqs[0].block_table
        host_slot = (table[starts[0] // block_size], starts[0] % block_size)
    # Rope positions: each token's slot, unless cache edits moved the sequence's positions.
    rope = [p if s.edit is None else s.edit.position(p) for s, p in zip(seqs, starts)]
    return StepBatch(
        positions=rope[0] if len(seqs) == 1 else mx.array(rope),
        slot_blocks=slot_blocks,
        slot_offsets=mx.array([p % block_size for p in positions]),
        block_tables=block_tables,
        context_lens=mx.array([p + n for p in starts]),
        host_context_lens=[p + n for p in starts],
        window_slot_blocks=window_slots,
        window_block_tables=window_tables,
        host_slot=host_slot,
        host_run=runs[0] if len(seqs) == 1 else None,
        host_segments=segments,
    )


def step_inputs(seqs: list[Sequence], starts: list[int], n: int) -> mx.array:
    """[B, n] token ids; a decode's last token may still be in flight (a lazy array)."""
    if n == 1:
        src = [s.pending_from if s.pending is not None and p == len(s.tokens) else None for s, p in zip(seqs, starts)]
        if src[0] is not None and all(x is not None and x[0] is src[0][0] for x in src):
            # The whole decode batch was sampled together: its token array is the input.
            tokens, rows = src[0][0], [x[1] for x in src]
            if rows != list(range(tokens.shape[0])):
                tokens = tokens[mx.array(rows)]
            return tokens.reshape(-1, 1).astype(mx.uint32)
        return mx.concatenate([
            s.pending.reshape(1, 1).astype(mx.uint32) if s.pending is not None and p == len(s.tokens)
            else mx.array([[s.tokens[p]]], mx.uint32)
            for s, p in zip(seqs, starts)
        ])
    return mx.array([s.tokens[p : p + n] for s, p in zip(seqs, starts)])


def warm_thread(runner, pools: KVPools, blocks) -> None:
    """One decode forward of a scratch sequence on the calling thread (the engine's, before
    any request): MLX traces each compiled function (RMSNorm, RoPE) anew on a thread's own
    stream (0.1 ms each: 0.4 ms of a new engine's first request here), and long-context
    attention's second CPU stream starts. Our models on plain pools only."""
    from mlxlocal.engine.types import SamplingParams
    from mlxlocal.metal.fused import _second_stream

    mx.eval(mx.zeros((1,), stream=_second_stream()))
    if type(runner) is not NativeRunner or type(pools) is not KVPools or any(pools.windowed):
        return
    table = blocks.allocate(1)  # written at position 0, then free again: never read
    try:
        seq = Sequence(id=-1, prompt=[0], params=SamplingParams(), sampler=cast(Any, None),
                       out=cast(Any, None), handle=cast(Any, None), block_table=table)
        mx.eval(runner.run(pools, [seq], [0], mx.zeros((1, 1), mx.uint32)))
    finally:
        blocks.release(table)


class Runner(Protocol):
    """What the paged engine drives: one forward over the paged pools per step. The last
    three members are the cluster's: a leader runner (parallel.py, pipeline.py) mirrors its
    pools to the followers and stops the engine through `on_lost` when a rank stops answering."""

    model: Any
    shapes: list[KVShape]
    windows: list[int | None]
    dtype: mx.Dtype
    recurrent: bool  # hybrid models: per-sequence states, snapshotted at block boundaries
    state_bytes: int  # one sequence's recurrent state (0 without)
    snapshots: StateSnapshots | None  # set by the engine, which knows the memory budget

    def forward(self, pools: KVPools, seqs: list[Sequence], n: int,
                submit: Callable[[], None] | None = None) -> mx.array: ...

    def run(self, pools: KVPools, seqs: list[Sequence], starts: list[int], inputs: mx.array,
            every: bool = False) -> mx.array: ...

    def state(self, seqs: list[Sequence]) -> list[mx.array]: ...

    on_lost: Callable[[str], None] | None

    def new_pools(self, *args, **kwargs) -> KVPools: ...

    def close(self) -> None: ...


class OneRank:
    """The cluster members of a runner on one process: plain pools, nobody to lose."""

    on_lost: Callable[[str], None] | None = None
    pools_resizable = True  # its pools may grow and shrink (KVPools.resize)

    def new_pools(self, *args, **kwargs) -> KVPools:
        return KVPools(*args, **kwargs)

    def close(self) -> None:
        pass


class NativeRunner(OneRank):
    """Our own models: each layer attends straight from the pools (paged attention)."""

    recurrent = False
    state_bytes = 0
    snapshots: StateSnapshots | None = None

    def __init__(self, model, shapes: list[KVShape], windows: list[int | None]):
        self.model, self.shapes, self.windows = model, shapes, windows
        self.dtype = model.model.embed_tokens(mx.array([0])).dtype

    def forward(self, pools: KVPools, seqs: list[Sequence], n: int,
                submit: Callable[[], None] | None = None) -> mx.array:
        starts = [s.num_computed for s in seqs]
        return self.run(pools, seqs, starts, step_inputs(seqs, starts, n))

    def run(self, pools: KVPools, seqs: list[Sequence], starts: list[int], inputs: mx.array,
            every: bool = False) -> mx.array:
        """Feed inputs [B, n] at positions starts[i].. (not each sequence's own num_computed:
        speculative drafts and verification); logits [B, n, V] with `every`, else [B, V]."""
        batch = step_batch(seqs, starts, inputs.shape[1], pools.block_size, any(pools.windowed))
        views = [PagedLayerView(pools, i, batch, w) for i, w in enumerate(self.windows)]
        logits = self.model(inputs, views, last_only=not every)
        return logits if every else logits[:, -1, :]

    def state(self, seqs: list[Sequence]) -> list[mx.array]:
        return []


class MlxLmRunner(OneRank):
    """mlx-lm's model code on the paged pools; recurrent layers' states held per sequence."""

    def __init__(self, model, layout: CacheLayout):
        self.model, self.layout = model, layout
        self.windows = layout.windows
        self.shapes, self.dtype, self.state_bytes = layout.probe()
        self.recurrent = layout.recurrent
        self.snapshots: StateSnapshots | None = None  # set by the engine, which knows the budget
        # Some models' code cannot take per-sequence rope offsets: found out on the first
        # batched decode, after which such a model decodes one sequence per forward.
        self.batched_decode: bool | None = None

    def forward(self, pools: KVPools, seqs: list[Sequence], n: int,
                submit: Callable[[], None] | None = None) -> mx.array:
        """`submit`: evaluates the pools' writes so far, called between two forwards of one
        call (a write after a pending read of the same pool would copy it)."""
        starts = [s.num_computed for s in seqs]
        if n > 1 and starts[0] + n == len(seqs[0].tokens):
            # mlx-lm models return logits for every position: run the chunk but its last
            # token, whose logits alone are needed, then that token in a forward of its own.
            self._run(pools, seqs, starts, n - 1)
            if submit is not None:
                submit()
            return self._run(pools, seqs, [starts[0] + n - 1], 1)
        if len(seqs) > 1 and self.batched_decode is None:
            try:
                logits = self._run(pools, seqs, starts, n)
                self.batched_decode = True
                return logits
            except Exception as e:  # a rewrite of the same slots below is harmless
                log.warning("%s cannot decode a batch in one forward (%s); one sequence at a time",
                            type(self.model).__module__, e)
                self.batched_decode = False
        if len(seqs) > 1 and not self.batched_decode:
            logits = []
            for s, p in zip(seqs, starts):
                if logits and submit is not None:
                    submit()
                logits.append(self._run(pools, [s], [p], n))
            return mx.concatenate(logits)
        return self._run(pools, seqs, starts, n)

    def run(self, pools: KVPools, seqs: list[Sequence], starts: list[int], inputs: mx.array,
            every: bool = False) -> mx.array:
        """NativeRunner.run for mlx-lm models (speculative drafts and verification): no
        snapshots are kept, since the fed tokens may yet be rejected."""
        if len(seqs) > 1 and self.batched_decode is False:
            return mx.concatenate([self._run(pools, [s], [p], 0, inputs[i : i + 1], every, False)
                                   for i, (s, p) in enumerate(zip(seqs, starts))])
        return self._run(pools, seqs, starts, 0, inputs, every, False)

    def _run(self, pools: KVPools, seqs: list[Sequence], starts: list[int], n: int,
             inputs: mx.array | None = None, every: bool = False, snapshot: bool = True) -> mx.array:
        inputs = step_inputs(seqs, starts, n) if inputs is None else inputs
        n = inputs.shape[1]
        batch = step_batch(seqs, starts, n, pools.block_size, any(pools.windowed))
        states = [s.state_at(p) for s, p in zip(seqs, starts)] if self.recurrent else [None]
        if self.recurrent and any(st is None for st in states) and any(starts):
            raise RuntimeError("a recurrent state is missing for a sequence that has computed tokens")
        caches = self.layout.build(pools, batch, states)
        logits = self.model(inputs, cache=caches)
        logits = logits if every else logits[:, -1, :]
        if self.recurrent:
            for s, p, new in zip(seqs, starts, self.layout.collect(caches, len(seqs))):
                s.recurrent_prev, s.recurrent = s.recurrent, (p + n, new)
                if snapshot and (p + n) % pools.block_size == 0 and self.snapshots is not None:
                    self.snapshots.put(s.block_table[(p + n) // pools.block_size - 1], new)
        return logits

    def state(self, seqs: list[Sequence]) -> list[mx.array]:
        """The arrays this step's states are made of (evaluated with the step)."""
        if not self.recurrent:
            return []
        return [a for s in seqs if s.recurrent for layer in s.recurrent[1] for a in layer if a is not None]


def layer_windows(mc) -> list[int | None]:
    """Each layer's sliding window (None: full attention) of a native model's config."""
    return [mc.sliding_window if t == "sliding_attention" else None for t in mc.layer_types]


def make_runner(loaded) -> Runner:
    """The runner for a loaded model; raises NotPageable when its cache cannot be paged."""
    mc = loaded.model_config
    if loaded.shard is not None:  # rank 0 of a cluster: the runner its plan leads with
        return loaded.shard.plan.leader(loaded)
    if loaded.info.native:
        shapes = KVPools.uniform(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim)
        return NativeRunner(loaded.model, shapes, layer_windows(mc))
    return MlxLmRunner(loaded.model, CacheLayout(loaded.model))


__all__ = ["MlxLmRunner", "NativeRunner", "NotPageable", "layer_windows", "make_runner", "step_batch"]
