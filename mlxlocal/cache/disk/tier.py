"""DiskTier: the seam between the prefix cache in RAM and the block files on disk.

Write-through: when a prompt's full blocks enter the radix tree (PrefixReuse.cache_prefix),
the ones not yet on disk are copied out of the pools in one gather per pool, on the engine
thread, and queued for the store's writer (which drops work rather than wait). On admission,
a prompt whose cached prefix in RAM ends before its full blocks do continues on disk: the
next blocks, as long as they verify, are read back into fresh pool blocks in one scatter per
pool and join the radix tree, so the normal match finds them. Keys are chain hashes (with
the blocks' cache-edit tags) in a store per model fingerprint: KV is never reused across a
change of weights, dtype, KV precision, rope, block size or tokenizer.

A block's file carries all the state a resume at its end needs: a draft model's K/V (its pools
share the block ids), a hybrid's recurrent-state snapshot and a sliding-window layer's block at
that position, where the RAM cache kept them (per-block arrays "b<r>.<name>").

In a cluster each rank keeps its part of the KV in a store of its own (its fingerprint names
the rank): rank 0's tier decides, and its `mirror` has the other ranks write the same runs and
read the same files (distributed/tier.py's RankTier); a file is used only where every rank
verified its own.
"""

from __future__ import annotations

import logging
import time
from functools import partial
from typing import Protocol

import mlx.core as mx
import numpy as np

from mlxlocal.cache import quantized
from mlxlocal.cache.blocks import BlockManager, OutOfBlocks, id_runs
from mlxlocal.cache.disk.format import Fingerprint, np_dtype
from mlxlocal.cache.disk.keys import PrefixKeys, chain_hashes
from mlxlocal.cache.disk.prefetch import Prefetch, Prefetcher
from mlxlocal.cache.disk.store import DiskStore, norm_key
from mlxlocal.cache.paged import KVPools
from mlxlocal.cache.states import StateSnapshots
from mlxlocal.cache.window import WindowBlocks

log = logging.getLogger("mlxlocal.engine")
RUN_BYTES = 64 << 20  # most bytes one file holds: the LRU's unit
SEARCH_BACK = 4096  # blocks a lookup walks back for the file that holds its first one
KNOWN_KEYS = 1 << 20  # keys remembered as on disk (a million blocks: 16M tokens at 16 a block)
NO_CHAIN, TAIL, TAIL_TOKENS = bytes(16), ("tail",), "t"  # a prompt's partial last block


class Mirror(Protocol):
    """The other ranks of a cluster, each with its part of every block (distributed/leader.py)."""

    def saved(self, keys: list[str], blocks: list[int], windows: list[int]) -> None:
        """Rank 0 queued these blocks as one file: the others write their parts the same way
        (`windows`: per block, the window block kept at its position, -1: none)."""

    def read(self, file: str, skip: int, keys: list[str], blocks: list[int],
             windows: list[int]) -> bool:
        """Rank 0 read `keys` (the file's blocks from `skip`) into `blocks` (their window
        rows into `windows`): the others read theirs; True when every rank's verified."""

    def saved_tail(self, key: str, block: int, rows: int) -> None:
        """Rank 0 queued the first `rows` rows of pool `block` as the tail file `key`."""

    def read_tail(self, key: str, block: int, rows: int) -> bool:
        """Rank 0 read the first `rows` rows of tail file `key` into `block`: the others read
        theirs; True when every rank's verified."""


class DiskTier:
    def __init__(self, store: DiskStore, pools: KVPools, blocks: BlockManager | None,
                 snapshots: StateSnapshots | None = None, *, draft_pools: KVPools | None = None,
                 windows: WindowBlocks | None = None, mirror: Mirror | None = None):
        # blocks: None on a cluster's other ranks (rank 0's tier says which blocks).
        self.store, self.pools, self.blocks = store, pools, blocks
        self.snapshots = snapshots  # hybrids: a block's recurrent-state snapshot goes with it
        self.windows = windows  # sliding-window layers: the window block kept at a block's position
        self.mirror = mirror
        # No partial last blocks for these (no recurrent state mid-block, window blocks whole).
        self.whole_blocks = snapshots is not None or windows is not None
        self._block_pools = [("", pools)]
        if draft_pools is not None:
            self._block_pools.append(("d", draft_pools))
        self.block_size = pools.block_size
        # Every block-indexed pool array, named "<layer>.<k|v>.<part>" (quantized pools have 3
        # parts; a draft model's layers "d<layer>"); sliding-window layers' "w<layer>.<k|v>.<part>".
        self.names = [f"{tag}{i}.{kv}.{j}" for tag, i, kv, j, _ in self._arrays(windowed=False)]
        self.window_names = [f"w{i}.{kv}.{j}" for _, i, kv, j, _ in self._arrays(windowed=True)]
        self._on_disk: set[bytes | tuple] = set()  # keys written or read by this process
        # Pool blocks whose content is on disk (until freed: forget), so a prefix served from
        # RAM skips the save without hashing its tokens.
        self._saved: set[int] = set()
        self._chain_of: dict[int, bytes] = {}  # pool block -> its chain hash, while it holds it
        self._tails: dict[int, tuple] = {}  # pool block -> (chain before it, its tokens) written
        self.restored_blocks = 0
        self.restore_seconds = 0.0
        self.prefetcher = Prefetcher(store, lambda chain, i: self._key(chain, None, i), SEARCH_BACK)

    @classmethod
    def open(cls, root: str, budget: int, model_dir: str, pools: KVPools, blocks: BlockManager,
             dtype: mx.Dtype, kv_bits: int | None, kv_group_size: int,
             model_name: str | None = None, snapshots: StateSnapshots | None = None, *,
             draft: tuple | None = None,
             windows: WindowBlocks | None = None, cluster=None) -> DiskTier:
        """The store for this model's fingerprint under root (made if new); `draft`: a draft
        model's (directory, dtype, pools[, kind]), its K/V kept with the blocks and its fingerprint
        in the store's. `cluster`: rank 0 of a cluster (its runner): the store is this rank's,
        and the other ranks open theirs through it (its tier_mirror)."""
        def fingerprint(path: str, dtype: mx.Dtype, bits: int | None, group: int, extra: str = ""):
            return Fingerprint.from_model_dir(
                path, dtype=str(dtype).removeprefix("mlx.core."), kv_bits=bits,
                kv_group_size=group, block_size=blocks.block_size, draft=extra,
                shard=cluster.shard_label if cluster is not None else "")

        # A draft's K/V by its kind too: a model's MTP module and the model as its own draft
        # share a directory and a dtype.
        drafted = ("" if draft is None else
                   fingerprint(draft[0], draft[1], None, 0).digest + ":".join(["", *draft[3:]]))
        fp = fingerprint(model_dir, dtype, kv_bits, kv_group_size, drafted)
        about = {"model": model_name or str(model_dir), "path": str(model_dir),
                 **({"draft": str(draft[0])} if draft is not None else {})}
        mirror = cluster.tier_mirror(root, budget, fp) if cluster is not None else None
        return cls(DiskStore(root, budget, fp, about=about), pools, blocks, snapshots,
                   draft_pools=draft[2] if draft is not None else None, windows=windows,
                   mirror=mirror)

    def _arrays(self, windowed: bool) -> list[tuple[str, int, str, int, mx.array]]:
        """(pools' tag, layer, k|v, part, array) of the block-indexed pools (windowed=False) or
        of the sliding-window layers' pools (True), in a fixed order."""
        pools_list = [("", self.pools)] if windowed else self._block_pools
        return [(tag, i, kv, j, part) for tag, pools in pools_list for i in range(len(pools.k))
                if pools.windowed[i] == windowed
                for kv, pool in (("k", pools.k[i]), ("v", pools.v[i]))
                for j, part in enumerate(quantized.parts(pool))]

    def _parts(self) -> list[mx.array]:
        """The block-indexed pool arrays, in `names` order (fetched anew: resizes replace them)."""
        return [a[-1] for a in self._arrays(windowed=False)]

    def _window_parts(self) -> list[mx.array]:
        return [a[-1] for a in self._arrays(windowed=True)]

    @staticmethod
    def _key(chain: bytes, tags: list | None, i: int):
        tag = tags[i] if tags is not None and i < len(tags) else None
        return chain if tag is None else (chain, tag)

    # --- write-through ----------------------------------------------------------------
    def save(self, tokens: list[int], table: list[int], tags: list | None = None) -> int:
        """Queue the full blocks of `tokens` (held in `table`) that are not on disk yet;
        returns how many were queued."""
        bs = self.block_size
        n_full = min(len(tokens) // bs, len(table))
        if n_full == 0 or self._saved.issuperset(table[:n_full]):
            if tags is None:  # a prefix served from RAM: no hashing of 16k tokens per request
                self._save_tail(tokens, table, n_full)
            return 0
        chains = chain_hashes(tokens[: n_full * bs], bs, tags)
        self._chain_of.update(zip(table[:n_full], chains))
        keys = [self._key(c, tags, i) for i, c in enumerate(chains)]
        todo = [i for i, k in enumerate(keys) if k not in self._on_disk and k not in self.store]
        missing = set(todo)
        self._saved.update(b for i, b in enumerate(table[:n_full]) if i not in missing)
        if tags is None:
            self._save_tail(tokens, table, n_full)
        if not todo:
            return 0
        ids = mx.array([table[i] for i in todo])
        rows = [p[:, ids] for p in self._parts()]  # [heads, len(todo), block_size, ...] each
        kept = self.windows.kept if self.windows is not None else {}
        at = {x: kept[table[i]] for x, i in enumerate(todo) if table[i] in kept}
        wrows = [p[:, mx.array(list(at.values()))] for p in self._window_parts()] if at else []
        mx.eval(rows, wrows)
        host = [host_array(r) for r in rows]  # views of the evaluated arrays: no MLX op off this thread
        whost = [host_array(r) for r in wrows]
        column = {x: c for c, x in enumerate(at)}  # todo index -> its window block's column
        per_file = max(1, RUN_BYTES // max(1, sum(h[:, 0].nbytes for h in host)))
        queued = 0
        for j, _, n in id_runs(todo):  # consecutive blocks of the chain: a file each, RUN_BYTES at most
            for a in range(j, j + n, per_file):
                b = min(a + per_file, j + n)
                run = [keys[todo[x]] for x in range(a, b)]
                arrays = {name: h[:, a:b] for name, h in zip(self.names, host)}
                for r in range(a, b):  # hybrids: each block's snapshot, where it has one
                    arrays.update(self._state(table[todo[r]], f"b{r - a}."))
                    if r in column:  # window layers: the block kept at its position
                        arrays.update({f"b{r - a}.{name}": h[:, column[r]]
                                       for name, h in zip(self.window_names, whost)})
                if not self.store.put_run(run, arrays):
                    return queued  # the writer is behind: the rest waits for a later save
                if self.mirror is not None:  # the other ranks write their parts alike
                    self.mirror.saved([norm_key(k) for k in run],
                                      [table[todo[x]] for x in range(a, b)],
                                      [kept.get(table[todo[x]], -1) for x in range(a, b)])
                self._known(run)
                self._saved.update(table[todo[x]] for x in range(a, b))
                queued += len(run)
        return queued

    def forget(self, block: int) -> None:
        """A pool block was freed: its next content is not on disk."""
        self._saved.discard(block)
        self._chain_of.pop(block, None)
        self._tails.pop(block, None)

    def _known(self, keys) -> None:
        """Keys now on disk; forgotten past KNOWN_KEYS (bounded memory: a forgotten one is at
        worst written again)."""
        if len(self._on_disk) > KNOWN_KEYS:
            self._on_disk.clear()
        self._on_disk.update(keys)

    def _save_tail(self, tokens: list[int], table: list[int], n_full: int) -> None:
        """The tokens past the last full block (a prompt's partial last block), keyed by the
        chain before them: restored with the blocks, the prompt needs no recompute of them.
        Hybrids resume at block boundaries only: none kept for them."""
        bs, r = self.block_size, len(tokens) - n_full * self.block_size
        if not 0 < r < bs or len(table) <= n_full or self.whole_blocks:
            return
        prev = self._chain_of.get(table[n_full - 1]) if n_full else NO_CHAIN
        block, tail = table[n_full], tuple(tokens[n_full * bs:])
        if prev is None or self._tails.get(block) == (prev, tail):
            return
        rows = [p[:, block, :r] for p in self._parts()]  # [heads, r, ...]
        mx.eval(rows)
        arrays = {name: host_array(x) for name, x in zip(self.names, rows)}
        arrays[TAIL_TOKENS] = np.array(tail, np.int64)
        if self.store.put((prev, TAIL), arrays):
            self._tails[block] = (prev, tail)
            if self.mirror is not None:  # the other ranks write their rows of it alike
                self.mirror.saved_tail(norm_key((prev, TAIL)), block, r)

    def _restore_tail(self, tokens: list[int], prev: bytes) -> tuple[int, int] | None:
        """(a pool block, k): the first k tokens past the last full block, read back into a
        fresh block; None when the disk has none of them."""
        bs = self.block_size
        rest = tokens[len(tokens) // bs * bs:]
        got = self.store.get_run((prev, TAIL)) if rest and not self.whole_blocks else None
        if got is None:
            return None
        arrays = got[0]
        stored = arrays.get(TAIL_TOKENS)
        if stored is None or stored.ndim != 1:
            return None
        k = next((i for i, (a, b) in enumerate(zip(stored.tolist(), rest)) if a != b), min(len(stored), len(rest)))
        layout = {n: (a[:, None].shape, a.dtype.itemsize) for n, a in arrays.items() if n != TAIL_TOKENS}
        if not k or not self._fits(layout, 1, len(stored)):
            return None
        new = self._allocate(1)
        if not new:
            return None
        self._put_rows(new[0], arrays, k)
        if self.mirror is not None and not self.mirror.read_tail(norm_key((prev, TAIL)), new[0], k):
            self.blocks.release(new)  # another rank's rows did not verify: prefilled instead
            return None
        return new[0], k

    def _put_rows(self, block: int, arrays: dict, k: int) -> None:
        """The first k rows of a tail file's arrays into pool `block`."""
        for part, name in zip(self._parts(), self.names):
            rows = mx.array(arrays[name][:, :k])
            part[:, block, :k] = rows.view(part.dtype) if rows.dtype != part.dtype else rows

    def _state(self, block: int, prefix: str) -> dict:
        """Hybrids: the block's recurrent-state snapshot as named host arrays ({} if none):
        "<prefix>s.n" the entries per layer, "<prefix>s.<layer>.<entry>[~bfloat16]" each."""
        state = self.snapshots.peek(block) if self.snapshots is not None else None
        if state is None:
            return {}
        out: dict = {prefix + "s.n": np.array([len(layer) for layer in state], np.int64)}
        for i, layer in enumerate(state):
            for j, a in enumerate(layer):
                if a is not None:
                    mx.eval(a)
                    out[f"{prefix}s.{i}.{j}" + ("~bfloat16" if a.dtype == mx.bfloat16 else "")] = host_array(a)
        return out

    def _put_state(self, block: int, arrays: dict, prefix: str) -> None:
        if self.snapshots is None or prefix + "s.n" not in arrays:
            return
        state = []
        for i, n in enumerate(arrays[prefix + "s.n"].tolist()):
            layer = []
            for j in range(n):
                name = f"{prefix}s.{i}.{j}"
                if name in arrays:
                    layer.append(mx.array(arrays[name]))
                elif name + "~bfloat16" in arrays:
                    layer.append(mx.array(arrays[name + "~bfloat16"]).view(mx.bfloat16))
                else:
                    layer.append(None)
            state.append(layer)
        self.snapshots.put(block, state)

    # --- read-back ----------------------------------------------------------------------
    def restore(self, tokens: list[int], tags: list | None = None,
                chains: list[bytes] | None = None, in_ram: list[int] | None = None,
                ids: np.ndarray | None = None) -> tuple[int, list[int]]:
        """Read the full blocks of `tokens` past what the prefix cache holds back from disk,
        into the radix tree (cached, unreferenced); returns the tokens restored, and the full
        blocks the cache now holds for them (a hint: the caller's match goes on below them).
        `chains`: their chain hashes, where a prefetch already worked them out; `in_ram`: the
        caller's match of them in RAM, if it has one; `ids`: the request's prompt as int64s
        (their bytes are what the keys hash), used where `tokens` is that prompt (as long: a
        request's tokens only grow from it, and a probe short of them is a prefix)."""
        radix, bs = self.blocks.radix, self.block_size
        n_full = len(tokens) // bs
        if radix is None or n_full == 0:
            return 0, []
        t0 = time.perf_counter()
        held = radix.match_partial(tokens[: n_full * bs], False, tags, held=in_ram)[0]
        m = len(held)
        if m == n_full:  # RAM holds them all (a prompt's last block, past its shared part)
            return 0, held
        self.blocks.share(held)  # meanwhile, so that nothing this reads evicts them
        try:
            if chains is None or len(chains) != n_full or tags is not None:
                same = ids is not None and len(ids) == len(tokens)
                chains = PrefixKeys(ids if same else tokens, bs, tags)  # the keys it looks at
            try:
                new = self._read_back(_Keys(chains, tags, self._key), m)
            except Exception:  # the tier only saves time: the request is served by prefill
                log.exception("disk tier: reading blocks back failed")
                return 0, held
            if not new:
                return 0, held
            n = m + len(new)
            self._saved.update(new)  # on disk: a save of them writes nothing
            self._chain_of[new[-1]] = chains[n - 1]  # a tail after them is keyed by it
            tail = self._restore_tail(tokens, chains[n - 1]) if n == n_full and tags is None else None
            if tail is not None:  # the partial block joins as a partial leaf (copied on reuse)
                mx.eval(self._parts())
                new.append(tail[0])
                table = self.blocks.cache_prefix(tokens[: n * bs + tail[1]], held + new, partial=True)
            else:
                table = self.blocks.cache_prefix(tokens[: n * bs], held + new, tags=tags)
            self.blocks.release(table)
            held = []
            restored = (n - m) * bs + (tail[1] if tail is not None else 0)
            self.restored_blocks += len(new)
            self.restore_seconds += time.perf_counter() - t0
            return restored, table[:n]
        finally:
            self.blocks.release(held)

    def prefetch(self, tokens: list[int]) -> Prefetch | None:
        """Read ahead, on the prefetch thread, the files restore(tokens) would read. None:
        RAM holds every full block, or the prefetch queue is full."""
        bs = self.block_size
        n_full = len(tokens) // bs
        if self.blocks.radix is None or n_full == 0:
            return None
        in_ram = len(self.blocks.radix.match(tokens[: n_full * bs]))
        if in_ram == n_full:
            return None
        return self.prefetcher.submit(tokens[: n_full * bs], bs, in_ram)

    def _read_back(self, keys: _Keys, start: int) -> list[int]:
        """Fresh pool blocks holding keys[start:]'s blocks read from disk, file after file,
        up to the first missing, unfit or corrupt one. Each file streams straight into the
        pools' memory (one copy of each byte) and verifies; a file that does not verify
        leaves its blocks unused, never KV."""
        views = self._pool_views()
        new: list[int] = []
        i = start
        # Window layers: only the blocks a query at the end sees come back (the pool is small).
        window_from = self.windows.first_needed(len(keys) * self.block_size) if self.windows else 0
        while views is not None and i < len(keys):
            got = self._read_file(keys, i, views, window_from)
            if got is None:
                break
            ids, hi = got
            new += ids
            i += len(ids)
            if i < hi:  # the pool ran short
                break
        return new

    def _read_file(self, keys: _Keys, i: int, views: list[np.ndarray],
                   window_from: int) -> tuple[list[int], int] | None:
        """(fresh blocks holding keys[i:]'s next run from one file, the index past what the
        file could give): a file is named by its first block's key, so the search walks back
        from i (most often it starts right there)."""
        for c in range(i, max(-1, i - SEARCH_BACK), -1):
            if keys[c] not in self.store:
                continue
            done: dict = {}
            try:
                place = partial(self._place, keys, c, i, views=views, done=done,
                                window_from=window_from - c)
                got = self.store.read_into(keys[c], place)
            except BaseException:
                self.blocks.release(done.get("ids", []))
                raise
            if got is not None:
                extras = [(done["ids"][r - (i - c)], arrays, f"b{r}.")
                          for r, arrays in done["extras"].items()]
                placed = self._window_blocks(extras)  # every rank puts its window rows there
                if self.mirror is not None and not self._mirrored(keys, c, i, done, placed):
                    # Another rank's part did not verify: unused, and rank 0's copy goes too,
                    # so the next save writes the run again on every rank.
                    self.blocks.release(done["ids"])
                    if self.windows is not None:
                        self.windows.release([w for _, _, w in placed])
                    self.store.remove(keys[c])
                    self._on_disk.difference_update(keys[x] for x in range(c, c + done["hi"]))
                    return None
                for b, arrays, prefix in extras:
                    self._put_state(b, arrays, prefix)
                self._put_windows(placed)
                return done["ids"], c + done["hi"]
            if done.get("ids"):  # it did not verify: what was read into them is garbage
                self.blocks.release(done["ids"])
                return None
        return None

    def _mirrored(self, keys: _Keys, c: int, i: int, done: dict, placed: list) -> bool:
        """The other ranks read their parts of the blocks rank 0 just read (every one verified),
        their window rows into the window blocks rank 0 took for them."""
        ids = done["ids"]
        at = {b: w for b, _, w in placed}
        return self.mirror.read(norm_key(keys[c]), i - c,
                                [norm_key(keys[i + r]) for r in range(len(ids))], ids,
                                [at.get(b, -1) for b in ids])

    def _place(self, keys: _Keys, c: int, i: int, names: list[str], table: dict, *,
               views: list[np.ndarray], done: dict, window_from: int) -> dict | None:
        """read_into's place(): where the bytes of the file named keys[c] go. Its blocks from
        i on, as far as they are this chain's, go into fresh pool blocks; the others are
        read for the checksum and dropped; a block's own arrays (hybrids' snapshots, window
        layers' blocks from the file's block `window_from` on) into host arrays."""
        lo, end = i - c, min(len(names), len(keys) - c)
        # A key covers all before it: the file's last block ours, every one is. Else the file
        # goes on with another prompt's blocks from where they part.
        hi = end if lo < end and names[end - 1] == norm_key(keys[c + end - 1]) else next(
            (x for x in range(lo, end) if names[x] != norm_key(keys[c + x])), end)
        n = len(names)
        if hi <= lo or not self._fits(array_layout(table), n):
            return None
        ids = self._allocate(hi - lo)
        if not ids:
            return None
        if any(v.shape != p.shape for v, p in zip(views, self._parts())):
            fresh = self._pool_views()  # the pools grew to make room for these blocks
            if fresh is None:
                self.blocks.release(ids)
                return None
            views[:] = fresh
        done.update(ids=ids, hi=hi, extras={})
        sinks = self._sinks(views, lo, ids, n)
        for name, (dtype, shape) in table.items() if self.whole_blocks else ():
            block, dot, rest = name[1:].partition(".")
            if name[0] != "b" or not dot or not block.isdigit():
                continue
            r = int(block)
            if not lo <= r < lo + len(ids) or (rest.startswith("w") and r < window_from):
                continue  # read for the checksum, dropped
            arr = done["extras"].setdefault(r, {})[name] = np.empty(shape, np_dtype(dtype))
            sinks[name] = [memoryview(arr).cast("B")]
        return sinks

    def _sinks(self, views: list[np.ndarray], lo: int, ids: list[int], n: int) -> dict:
        """read_into's buffers for a file of n blocks whose blocks lo.. go into pool `ids`
        (the others read for the checksum and dropped)."""
        sinks: dict = {}
        runs = id_runs(ids)
        for view, name in zip(views, self.names):
            per_block = view[0, 0].nbytes
            segments: list = []
            for p in range(view.shape[0]):
                segments.append(lo * per_block)
                for _, start, k in runs:
                    segments.append(memoryview(view[p, start:start + k]).cast("B"))
                segments.append((n - lo - len(ids)) * per_block)
            sinks[name] = [s for s in segments if not isinstance(s, int) or s]
        return sinks

    def _window_blocks(self, extras: list[tuple[int, dict, str]]) -> list[tuple]:
        """Window layers: for the blocks read back ((full block, arrays, prefix) of each) whose
        window rows came with them and fit, fresh window blocks: [(full block, rows, window
        block)]; one whose rows are missing or do not fit is left out (a resume stops short)."""
        parts = self._window_parts()
        if self.windows is None or not parts:
            return []
        want = [(part[:, 0].shape, part.dtype.size) for part in parts]
        found = [(b, [arrays.get(prefix + name) for name in self.window_names])
                 for b, arrays, prefix in extras]
        found = [(b, got) for b, got in found if all(
            a is not None and (a.shape, a.dtype.itemsize) == w for a, w in zip(got, want))]
        while found:
            try:
                ids = self.windows.allocate(len(found))
                return [(b, got, w) for (b, got), w in zip(found, ids)]
            except OutOfBlocks:
                found = found[1:]  # the last blocks are the ones a resume needs
        return []

    def _put_windows(self, placed: list[tuple]) -> None:
        """The window rows of _window_blocks' choice into their window blocks, kept for their
        full block as the RAM cache keeps them (rank 0; the other ranks: rows only)."""
        parts = self._window_parts()
        if not placed or not parts:
            return
        index = mx.array([w for _, _, w in placed])
        for j, part in enumerate(parts):
            rows = mx.array(np.stack([got[j] for _, got, _ in placed], axis=1))
            part[:, index] = rows.view(part.dtype) if rows.dtype != part.dtype else rows
        mx.eval(parts)
        if self.windows is not None:
            for b, _, w in placed:
                self.windows.kept[b] = w  # the allocation's reference is the cache's

    def _pool_views(self) -> list[np.ndarray] | None:
        """The pools' memory as writable numpy arrays (evaluated first: a step in flight
        finishes), or None where one is not plainly laid out (then nothing is read back)."""
        views = []
        for part in self._parts():
            v = np.array(part.view(mx.uint16) if part.dtype == mx.bfloat16 else part, copy=False)
            if not (v.flags.c_contiguous and v.flags.writeable):
                log.warning("disk tier: a KV pool is not contiguous in memory; no read-back")
                return None
            views.append(v)
        return views

    def _fits(self, layout: dict, n: int, rows: int | None = None) -> bool:
        """The file's arrays ({name: (shape, itemsize)}) are this pool's n blocks (of `rows`
        rows: a tail's): a stale layout is a miss, never KV."""
        for part, name in zip(self._parts(), self.names):
            want = (part.shape[0], n, rows or part.shape[2], *part.shape[3:])
            if layout.get(name) != (want, part.dtype.size):
                return False
        return True

    def _allocate(self, n: int) -> list[int]:
        """Up to n fresh blocks (fewer where the pool is short)."""
        while n:
            try:
                return self.blocks.allocate(n)
            except OutOfBlocks:
                n //= 2
        return []

    def stats(self) -> dict:
        st = self.store.stats()
        return {"disk_hit_blocks": self.restored_blocks, "disk_read_bytes": st["read_bytes"],
                "disk_write_blocks": st["writes"], "disk_write_bytes": st["write_bytes"],
                "disk_dropped_writes": st["dropped_writes"],
                "disk_corrupt_removed": st["corrupt_removed"], "disk_bytes": st["bytes_on_disk"]}

    def close(self, timeout: float = 5.0) -> None:
        self.store.close(timeout)


def host_array(a: mx.array) -> np.ndarray:
    """An evaluated array as numpy (bfloat16 as its bits: numpy has no such dtype)."""
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
        mx.eval(a)
    return np.array(a, copy=False)


def array_layout(table: dict) -> dict:
    """A file's array table ({name: (dtype name, shape)}) as _fits reads it."""
    return {k: (shape, np_dtype(dtype).itemsize) for k, (dtype, shape) in table.items()}


class _Keys:
    """keys[i]: block i's store key (its prefix key, with its tag where it has one), worked
    out when asked: a restore looks at a file's first and last blocks, not all of them."""

    def __init__(self, chains, tags: list | None, key):
        self.chains, self.tags, self.key = chains, tags, key

    def __len__(self) -> int:
        return len(self.chains)

    def __getitem__(self, i: int):
        return self.key(self.chains[i], self.tags, i)
