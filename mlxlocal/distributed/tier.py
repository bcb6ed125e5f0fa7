"""The disk tier in a cluster: every rank keeps its part of each block (its KV heads or its
layers) in a store of its own, named by the model's fingerprint and the rank.

Rank 0's tier (cache/disk/tier.py) decides everything, as for one process, and mirrors it: a
run of blocks it queued is written by every other rank from the same pool blocks (TierSave);
a file it read back is read by every other rank into the same blocks (TierRead), and the
blocks are used only if every rank's own file verified (their answers gathered in one
all_sum). Window layers' rows go with their block, into the window blocks rank 0 took, and a
prompt's partial last block goes alike (TierSaveTail, TierReadTail). A rank whose file is
missing, corrupt or dropped by its writer so costs a prefill, never a mix of KV from
different runs."""

from __future__ import annotations

import logging
from dataclasses import asdict

import mlx.core as mx
import numpy as np

from mlxlocal.cache.disk.format import Fingerprint, np_dtype
from mlxlocal.cache.disk.store import DiskStore
from mlxlocal.cache.disk.tier import DiskTier, array_layout, host_array
from mlxlocal.distributed.channel import Channel
from mlxlocal.distributed.messages import TierOpen, TierRead, TierReadTail, TierSave, TierSaveTail
from mlxlocal.distributed.report import gather_rank_numbers

log = logging.getLogger("mlxlocal.engine")


class TierMirror:
    """Rank 0's side (DiskTier's `mirror`): the other ranks open their stores at creation."""

    def __init__(self, channel: Channel, engine: int, root: str, budget: int, fingerprint: Fingerprint):
        self.channel, self.engine = channel, engine
        fields = {k: v for k, v in asdict(fingerprint).items() if k != "shard"}
        channel.send(TierOpen(engine, str(root), int(budget), fields))

    def saved(self, keys: list[str], blocks: list[int], windows: list[int]) -> None:
        self.channel.send(TierSave(self.engine, keys, blocks, windows))

    def read(self, file: str, skip: int, keys: list[str], blocks: list[int],
             windows: list[int]) -> bool:
        return self._ask(TierRead(self.engine, file, skip, keys, blocks, windows))

    def saved_tail(self, key: str, block: int, rows: int) -> None:
        self.channel.send(TierSaveTail(self.engine, key, block, rows))

    def read_tail(self, key: str, block: int, rows: int) -> bool:
        return self._ask(TierReadTail(self.engine, key, block, rows))

    def _ask(self, msg: TierRead | TierReadTail) -> bool:
        """Send a read; True when every other rank answers that its file verified."""
        with self.channel.turn():  # the message and its answers, with no forward between
            self.channel.send(msg)
            answers = gather_rank_numbers(self.channel.group, [1])
        return all(a[0] for a in answers)


class RankTier(DiskTier):
    """A follower's tier: no block manager of its own; it writes and reads its part of the
    blocks (runs, window rows, a prompt's tail) where rank 0 says."""

    def write_run(self, keys: list[str], ids: list[int],
                  windows: list[int] | None = None) -> bool:
        """This rank's part of the blocks rank 0 queued as one file (keys), from pool `ids`,
        with the window blocks kept at their positions (`windows`, -1: none) as rank 0's."""
        index = mx.array(ids)
        rows = [p[:, index] for p in self._parts()]
        kept = [(r, w) for r, w in enumerate(windows or []) if w >= 0]
        wrows = [p[:, mx.array([w for _, w in kept])] for p in self._window_parts()] if kept else []
        mx.eval(rows, wrows)
        arrays = {n: host_array(r) for n, r in zip(self.names, rows)}
        whost = [host_array(r) for r in wrows]
        for col, (r, _) in enumerate(kept):
            arrays.update({f"b{r}.{name}": h[:, col] for name, h in zip(self.window_names, whost)})
        return self.store.put_run(keys, arrays)

    def read_run(self, file: str, skip: int, keys: list[str], ids: list[int],
                 windows: list[int] | None = None) -> bool:
        """This rank's part of the blocks `keys` (the file's from `skip` on) into pool `ids`,
        and their window rows into window blocks `windows` (-1: none); True when the file
        verified."""
        views = self._pool_views()
        want = {skip + j: w for j, w in enumerate(windows or []) if w >= 0}
        fit = [(part[:, 0].shape, part.dtype.size) for part in self._window_parts()]
        rows: dict[int, list[np.ndarray]] = {}

        def place(names: list[str], table: dict) -> dict | None:
            if names[skip:skip + len(keys)] != keys or not self._fits(array_layout(table), len(names)):
                return None
            sinks = self._sinks(views, skip, ids, len(names))
            for r in want:
                found = [table.get(f"b{r}.{name}") for name in self.window_names]
                if any(f is None or (tuple(f[1]), np_dtype(f[0]).itemsize) != w
                       for f, w in zip(found, fit)):
                    return None  # rank 0 has these rows: this rank's file must too, alike
                rows[r] = [np.empty(shape, np_dtype(dtype)) for dtype, shape in found]
                sinks.update({f"b{r}.{name}": [memoryview(a).cast("B")]
                              for name, a in zip(self.window_names, rows[r])})
            return sinks

        if views is None or self.store.read_into(file, place) is None:
            return False
        self._put_windows([(None, rows[r], w) for r, w in want.items()])
        return True

    def write_tail(self, key: str, block: int, rows: int) -> bool:
        """This rank's first `rows` rows of pool `block` as the tail file `key`."""
        parts = [p[:, block, :rows] for p in self._parts()]
        mx.eval(parts)
        return self.store.put(key, {name: host_array(x) for name, x in zip(self.names, parts)})

    def read_tail(self, key: str, block: int, k: int) -> bool:
        """This rank's rows of tail file `key`, the first k into pool `block`; True when the
        file verified and fits."""
        got = self.store.get_run(key)
        if got is None:
            return False
        arrays = got[0]
        layout = {n: (a[:, None].shape, a.dtype.itemsize) for n, a in arrays.items()}
        rows = next(iter(arrays.values())).shape[1] if arrays else 0
        if not k <= rows or not self._fits(layout, 1, rows):
            return False
        self._put_rows(block, arrays, k)
        mx.eval(self._parts())
        return True


def open_store(msg: TierOpen, pools, rank: int, ranks: int) -> RankTier:
    """A follower's tier on its pools: its own store, the fingerprint rank 0's but for the rank."""
    fp = Fingerprint(**msg.fingerprint, shard=f"{rank}/{ranks}")
    return RankTier(DiskStore(msg.root, msg.budget, fp, about={"rank": rank}), pools, None)


def read(tier: RankTier | None, msg: TierRead | TierReadTail, group) -> None:
    """A follower's part of a read-back (a run of blocks, or a prompt's tail); it always
    answers (rank 0 waits in the all_sum)."""
    ok = False
    try:
        if isinstance(msg, TierReadTail):
            ok = tier is not None and tier.read_tail(msg.key, msg.block, msg.rows)
        else:
            ok = tier is not None and tier.read_run(msg.file, msg.skip, msg.keys, msg.blocks,
                                                    msg.windows)
    except Exception:  # answered as a miss: the blocks are prefilled instead
        log.exception("disk tier: reading blocks back failed on this rank")
    gather_rank_numbers(group, [int(ok)])
