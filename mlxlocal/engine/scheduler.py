"""Continuous batching: which sequences run this step, and with how many tokens.

Every step decodes one token for each running sequence that has finished its prompt,
and spends what is left of the step's token budget on one prefill chunk (a partially
prefilled sequence first, else the head of the waiting queue). When a decode needs a
block and none can be had, the newest running sequence is preempted: its blocks are
freed and it goes back to the front of the queue to be recomputed later.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from mlxlocal.cache import BlockManager, OutOfBlocks
from mlxlocal.cache.window import WindowBlocks
from mlxlocal.engine.edits import first_touched, restart
from mlxlocal.engine.sequence import Sequence, Status

ROOM_BLOCKS = 1024  # most growth room a new run asks for (16k tokens at block size 16)


@dataclass
class Plan:
    decode: list[Sequence] = field(default_factory=list)
    prefill: Sequence | None = None
    prefill_tokens: int = 0
    # Sequences that cannot continue at all (alone, and the pool is too small).
    starved: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.decode and self.prefill is None


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int = 16, max_step_tokens: int = 512,
                 copy_block: Callable[[int, int], None] | None = None,
                 resume: Callable[[Sequence], None] | None = None, windows: WindowBlocks | None = None,
                 snapshot_chunks: bool = False, apply_edit: Callable[[Sequence], None] | None = None,
                 match_edited: Callable[[Sequence], bool] | None = None,
                 restore: Callable[..., tuple[int, list[int]]] | None = None):
        self.blocks = blocks
        self.windows = windows  # sliding-window layers' blocks, if the model has such layers
        self.copy_block = copy_block  # KVPools.copy_block: reuse a partly matching block by copying it
        # Hybrid and sliding-window models: cut a matched prefix back to where their extra
        # state (a recurrent-state snapshot, the window's blocks) is there, and restore it.
        self.resume = resume
        self.snapshot_chunks = snapshot_chunks  # hybrids: chunks end where snapshots are wanted
        self.apply_edit = apply_edit  # a cache edit due now (engine.edits); raises OutOfBlocks
        self.match_edited = match_edited  # a request with edits: reuse of blocks under its history
        self.restore = restore  # the disk tier: a prefix's blocks past the RAM cache read back
        self.block_size = blocks.block_size
        self.max_num_seqs = max_num_seqs
        self.max_step_tokens = max_step_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.prefix_hit_tokens = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # --- blocks --------------------------------------------------------------------
    def reserve(self, seq: Sequence, n_tokens: int) -> bool:
        """Make sure seq's block table covers its next n_tokens positions."""
        need = -(-(seq.num_computed + n_tokens) // self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        # Where the table can grow in place, or a run with room for what it may still need:
        # a sequence on one run of blocks is read by attention as a slice, not a gather.
        table = seq.block_table
        ahead = len(seq.prompt) + seq.max_tokens - seq.num_computed - n_tokens
        room = min(max(0, -(-ahead // self.block_size)), ROOM_BLOCKS)
        try:
            new = self.blocks.allocate(need, after=table[-1] if table else None, room=room)
        except OutOfBlocks:
            return False
        if self.windows is not None:
            try:
                seq.window_table += self.windows.allocate(need)
            except OutOfBlocks:
                self.blocks.release(new)
                return False
        seq.block_table += new
        return True

    def trim(self, seq: Sequence, n_tokens: int) -> None:
        """Give back the blocks past seq's first n_tokens positions (speculative rollback)."""
        keep = -(-n_tokens // self.block_size)
        if len(seq.block_table) > keep:
            self.blocks.release(seq.block_table[keep:])
            seq.block_table = seq.block_table[:keep]  # a new list: in place, tables only grow
        if self.windows is not None and len(seq.window_table) > keep:
            self.windows.release(seq.window_table[keep:])
            del seq.window_table[keep:]

    def free(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_table)
        seq.block_table = []
        if self.windows is not None:
            self.windows.release(seq.window_table)
        seq.window_table = []

    def preempt(self, seq: Sequence) -> None:
        """Free seq's blocks and requeue it first; it recomputes prompt + output so far."""
        self.running.remove(seq)
        self.free(seq)
        seq.num_computed = 0
        seq.forget_state()
        restart(seq)
        seq.status = Status.WAITING
        seq.preemptions += 1
        self.waiting.appendleft(seq)

    def admit(self, seq: Sequence) -> None:
        """Waiting -> running: reuse the cached prefix (all but the last token), to the token."""
        if not seq.block_table:
            edited = seq.edit is not None and seq.edit.pending and not seq.edit.applied
            if not (edited and self.match_edited is not None and self.match_edited(seq)):
                shared = seq.tokens[:-1]
                if edited:  # untagged blocks: only the prefix no edit touches
                    shared = shared[: min(first_touched(e) for e in seq.edit.pending)]
                seq.block_table, seq.num_computed = self.blocks.match_tokens(shared, self.copy_block)
                restored = 0
                # The disk tier goes on where RAM's full blocks end before the prompt's do (all
                # of them: the last token's block too, which the match above copies from).
                probe = shared if edited else seq.tokens
                in_ram = seq.block_table[: seq.num_computed // self.block_size]  # full blocks
                if self.restore is not None and len(in_ram) < len(probe) // self.block_size:
                    chains = seq.prefetch.chains if seq.prefetch is not None else None
                    restored, in_ram = self.restore(probe, None, chains, in_ram, seq.prompt_ids)
                    if restored:  # matched again, on from the blocks the cache now holds
                        self.blocks.release(seq.block_table)
                        seq.block_table, seq.num_computed = self.blocks.match_tokens(
                            shared, self.copy_block, held=in_ram)
                seq.prefetch = None
                if self.resume is not None:
                    self.resume(seq)
                if restored and seq.preemptions == 0:
                    seq.stats.disk_tokens = min(restored, seq.num_computed)
            if seq.preemptions == 0:
                seq.stats.cached_tokens = seq.num_computed
                self.prefix_hit_tokens += seq.num_computed
        seq.status = Status.RUNNING
        self.running.append(seq)

    # --- planning ------------------------------------------------------------------
    def plan(self) -> Plan:
        plan = Plan()
        if self.windows is not None:  # blocks that left every window go back first
            for seq in self.running:
                self.windows.trim(seq.window_table, seq.num_computed,
                                  seq.block_table if self.blocks.radix is not None else None)
        blocked = [seq for seq in self.running if not self._edits_due(seq)]
        if blocked and len(self.running) == 1:
            plan.starved += blocked  # alone, and no room for its edit's copies
            return plan
        for seq in sorted(self.running, key=lambda s: s.id):
            if seq.status is not Status.RUNNING or not seq.may_decode or seq in blocked:
                continue
            while not self.reserve(seq, 1):
                victim = max(self.running, key=lambda s: s.id)
                if victim is seq and len(self.running) == 1:
                    plan.starved.append(seq)
                    break
                self.preempt(victim)
                if victim is seq:
                    break
            else:
                plan.decode.append(seq)

        budget = self.max_step_tokens - len(plan.decode)
        if budget <= 0:
            return plan
        # A token still in flight cannot be prefilled: only the known ones count here.
        prefilling = [s for s in self.running if len(s.tokens) - s.num_computed > 1]
        candidate = min((s for s in prefilling if s not in blocked), key=lambda s: s.id, default=None)
        if candidate is None and self.waiting and len(self.running) < self.max_num_seqs \
                and not self._prefetching(self.waiting[0]):
            head = self.waiting.popleft()
            try:
                self.admit(head)
            except BaseException:
                self.waiting.appendleft(head)  # failed with the step's others, never lost
                raise
            if not self._edits_due(head) or not self.reserve(head, self._chunk(head, budget)):
                self._unadmit(head)
                if not self.running:
                    plan.starved.append(head)
                return plan
            candidate = head
        if candidate is not None:
            n = self._chunk(candidate, budget)
            if n > 0 and self.reserve(candidate, n):
                plan.prefill, plan.prefill_tokens = candidate, n
        return plan

    def _prefetching(self, seq: Sequence) -> bool:
        """seq's disk blocks are still being read ahead while others decode: it waits (the
        engine thread would otherwise read them with every stream stalled), for a while at
        most (disk/prefetch.py). Alone, it is admitted at once."""
        return seq.prefetch is not None and bool(self.running) and seq.prefetch.pending()

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """Tokens of seq's next prefill chunk: within the budget, ending where a hybrid's
        snapshot or a cache edit is due."""
        n = min(len(seq.tokens) - seq.num_computed, budget)
        if self.snapshot_chunks:
            n = self._snapshot_chunk(seq, n)
        if seq.edit is not None and seq.edit.pending:
            n = min(n, seq.edit.next_edit_slot() - seq.num_computed)
        return n

    def _edits_due(self, seq: Sequence) -> bool:
        """Apply the cache edits due before seq's next chunk; False when the pool has no
        room for their copies now."""
        while seq.edit is not None and seq.edit.pending and seq.edit.next_edit_slot() == seq.num_computed:
            try:
                self.apply_edit(seq)
            except OutOfBlocks:
                return False
        return True

    def _snapshot_chunk(self, seq: Sequence, n: int) -> int:
        """Hybrids: end the chunk where a state snapshot is wanted: at the end of the prefix
        others already share (seq.snapshot_at), else at the last block boundary it reaches."""
        start, end = seq.num_computed, seq.num_computed + n
        if start < seq.snapshot_at < end:
            return seq.snapshot_at - start
        boundary = end // self.block_size * self.block_size
        return boundary - start if boundary > start else n

    def _unadmit(self, seq: Sequence) -> None:
        """Not enough room to start seq now: back to the front of the queue."""
        self.running.remove(seq)
        if seq.session is None:
            # A session's blocks stay pinned; anyone else gives the shared prefix back.
            self.free(seq)
            if seq.preemptions == 0:
                self.prefix_hit_tokens -= seq.stats.cached_tokens
                seq.stats.cached_tokens = 0
            seq.num_computed = 0
            seq.forget_state()
            restart(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED
