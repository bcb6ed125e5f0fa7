"""The disk tier in a cluster: every rank keeps its part of each block (its KV heads or its
layers) in a store of its own, named by the model's fingerprint and the rank.

Rank 0's tier (cache/disk/tier.py) decides everything, as for one process, and mirrors it: a
run of blocks it queued is written by every other rank from the same pool blocks (TierSave);
a file it read back is read by every other rank into the same blocks (TierRead), and the
blocks are used only if every rank's own file verified (their answers gathered in one
all_sum). A rank whose file is missing, corrupt or dropped by its writer so costs a prefill,
never a mix of KV from different runs."""

from __future__ import annotations

import logging
from dataclasses import asdict

from mlxlocal.cache.disk.format import Fingerprint
from mlxlocal.cache.disk.store import DiskStore
from mlxlocal.cache.disk.tier import DiskTier
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
        with self.channel.turn():  # the message and its answers, with no forward between
            self.channel.send(TierRead(self.engine, file, skip, keys, blocks, windows))
            answers = gather_rank_numbers(self.channel.group, [1])
        return all(a[0] for a in answers)

    def saved_tail(self, key: str, block: int, rows: int) -> None:
        self.channel.send(TierSaveTail(self.engine, key, block, rows))

    def read_tail(self, key: str, block: int, rows: int) -> bool:
        with self.channel.turn():
            self.channel.send(TierReadTail(self.engine, key, block, rows))
            answers = gather_rank_numbers(self.channel.group, [1])
        return all(a[0] for a in answers)


def open_store(msg: TierOpen, pools, rank: int, ranks: int) -> DiskTier:
    """A follower's tier on its pools: its own store, the fingerprint rank 0's but for the rank."""
    fp = Fingerprint(**msg.fingerprint, shard=f"{rank}/{ranks}")
    return DiskTier(DiskStore(msg.root, msg.budget, fp, about={"rank": rank}), pools, None)


def read(tier: DiskTier | None, msg: TierRead | TierReadTail, group) -> None:
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
