"""What a request can reuse of earlier work, and what it leaves for later ones.

One place for the rules, over the block manager and the extra state some models need:
- a session's next turn keeps its blocks up to the longest common prefix with the new
  prompt (copying rather than writing into a block someone else can see);
- a finished or first-token sequence puts its full blocks (and, with no session, its
  partial last block) in the prefix cache;
- hybrid SSM models resume only where a recurrent-state snapshot exists, sliding-window
  models only where the window's blocks are still kept: `resume` cuts a reused prefix
  back to the deepest block boundary where that holds.
"""

from __future__ import annotations

from mlxlocal.cache import BlockManager
from mlxlocal.cache.disk.tier import DiskTier
from mlxlocal.cache.states import StateSnapshots
from mlxlocal.cache.window import HOLE, WindowBlocks
from mlxlocal.engine.edits import EditState, block_tags, first_touched, replay
from mlxlocal.engine.sequence import Sequence
from mlxlocal.engine.session import Session, common_prefix


class PrefixReuse:
    def __init__(self, blocks: BlockManager, windows: WindowBlocks | None, snapshots: StateSnapshots | None):
        self.blocks, self.windows, self.snapshots = blocks, windows, snapshots
        self.tier: DiskTier | None = None  # the disk tier: cached full blocks written through
        self.block_size = blocks.block_size
        blocks.on_free, blocks.on_move = self._block_freed, self._block_moved

    @property
    def whole_blocks(self) -> bool:
        """Hybrid and window models never reuse part of a block (no state mid-block)."""
        return self.windows is not None or self.snapshots is not None

    def _block_freed(self, block: int) -> None:
        """A full-attention block went back to the free list: what was keyed by it goes."""
        if self.tier is not None:
            self.tier.forget(block)
        if self.snapshots is not None:
            self.snapshots.drop(block)
        if self.windows is not None:
            self.windows.forget(block)

    def _block_moved(self, old: int, new: int) -> None:
        if self.snapshots is not None:
            self.snapshots.move(old, new)
        if self.windows is not None:
            self.windows.move(old, new)
    def attach_session(self, seq: Sequence) -> int:
        """Reuse the session's blocks up to the longest common prefix with the new prompt;
        returns the tokens reused."""
        s = seq.session
        if seq.edit is not None or s.edit is not None:
            return self._attach_edited(seq)
        return self._attach(seq, common_prefix(s.tokens, seq.tokens))

    def _attach_edited(self, seq: Sequence) -> int:
        """A session or request with cache edits: the session's state is reusable up to the
        longest common prefix (in the conversation's own coordinates) only if every edit it
        applied is one the request asks for, at the same place, and no edit the request adds
        comes before that point; else the session starts over (an applied drop cannot be
        undone)."""
        s, bs = seq.session, self.block_size
        held: EditState | None = s.edit
        want = seq.edit.pending if seq.edit is not None else []
        applied = [e for e, _ in held.applied] if held is not None else []
        prompt = seq.edit.full if seq.edit is not None else seq.tokens
        common = common_prefix(held.full if held is not None else s.tokens, prompt)
        if want[len(applied):]:
            common = min(common, want[len(applied)].at)
        if want[: len(applied)] != applied or (applied and common < max(e.at for e in applied)):
            self.release_session(s)
            return 0
        if held is None:  # a plain history: the first edit starts here
            return self._attach(seq, common)
        slots = held.slot_of(common)
        if slots % bs and self._shared(s.block_table[slots // bs]):
            # Copy on write ends the reuse at a block boundary: still this history's state
            # only if every applied edit came before it.
            slots -= slots % bs
            common = held.origin_of(slots - 1) + 1 if slots else 0
            if slots == 0 or max(e.at for e in applied) > common:
                self.release_session(s)
                return 0
        st = seq.edit
        st.origin = held.origin[:slots] + list(range(common, len(prompt)))
        st.positions = [held.position(i) for i in range(slots)]
        st.shift, st.applied, st.pending = held.shift, list(held.applied), want[len(applied):]
        st.dropped = held.dropped
        seq.prompt = s.tokens[:slots] + prompt[common:]
        seq.tokens = list(seq.prompt)
        return self._attach(seq, slots)

    def _shared(self, block: int) -> bool:
        """Someone else can see this block: new tokens must not be written into it."""
        return self.blocks.refs[block] > 1 or bool(self.blocks.radix and self.blocks.radix.contains(block))

    def match_edited(self, seq: Sequence) -> bool:
        """A request with edits and nothing reused yet: the longest prefix of its kept view
        the prefix cache holds under the same edit history (tagged blocks, radix.py), cut
        back to where every edit it went through had already happened. False when no edited
        block is reused (the caller matches the unedited prefix instead)."""
        bs, st0 = self.block_size, seq.edit
        final = replay(st0.full, st0.pending)
        kept = [st0.full[o] for o in final.origin]
        n_full = (len(kept) - 1) // bs
        tags = block_tags(final, n_full, bs)
        # Blocks under this history past RAM's, read back from disk.
        restored, held = (self.tier.restore(kept[: n_full * bs], tags) if self.tier is not None
                          else (0, None))
        blocks, _ = self.blocks.match_tokens(kept[: n_full * bs], None, tags, held=held)
        m = len(blocks)

        def settled(m: int) -> bool:  # every edit that touched these blocks happened before their end
            last = final.origin[m * bs - 1]
            return all(e.at <= last + 1 for e, _ in final.applied if first_touched(e) <= last)

        while m and not settled(m):
            m -= 1
        if m == 0 or tags[m - 1] is None:
            self.blocks.release(blocks)
            return False
        self.blocks.release(blocks[m:])
        last = final.origin[m * bs - 1]
        done = [e for e, _ in final.applied if e.at <= last + 1]
        st = replay(st0.full, done)
        st.pending, st.repositioned = st0.pending[len(done):], 0
        generated = seq.tokens[len(seq.prompt):]
        seq.edit, seq.prompt = st, [st0.full[o] for o in st.origin]
        seq.tokens = seq.prompt + generated
        seq.block_table, seq.num_computed = blocks[:m], m * bs
        if seq.preemptions == 0:
            seq.stats.disk_tokens = min(restored, m * bs)
        return True

    def _attach(self, seq: Sequence, common: int) -> int:
        """Take over the session's blocks holding its first `common` tokens."""
        s, bs = seq.session, self.block_size
        keep = -(-common // bs)
        if common % bs and keep and self._shared(s.block_table[keep - 1]):
            # Copy on write: never write new tokens into a block someone else can see.
            keep -= 1
            common = keep * bs
        # Hand the blocks over before releasing any, so a failure never frees a block twice.
        kept, dropped = s.block_table[:keep], s.block_table[keep:]
        window, window_dropped = s.window_table[:keep], s.window_table[keep:]
        live = s.recurrent if common == len(s.tokens) else None
        s.tokens, s.block_table, s.window_table, s.recurrent, s.edit = [], [], [], None, None
        seq.block_table, seq.window_table, seq.num_computed = kept, window, common
        self.blocks.release(dropped)
        if self.windows is not None:
            self.windows.release(window_dropped)
        recurrent = self.snapshots is not None
        if recurrent and live is not None:  # the turn extends everything held
            seq.recurrent = (common, live)
        elif recurrent or (self.windows is not None and HOLE in window[self.windows.first_needed(common):]):
            # An edited turn: back to the deepest point whose state is still there.
            self.resume(seq)
        return seq.num_computed

    def resume(self, seq: Sequence) -> None:
        """Hybrid and sliding-window models: cut seq's reused prefix back to the deepest
        block boundary where their extra state is there (a recurrent-state snapshot; the
        window blocks before it), and start from that state (nothing reused if none)."""
        bs, snapshots, windows = self.block_size, self.snapshots, self.windows
        table = seq.block_table
        k = shared = seq.num_computed // bs

        def restorable(k: int) -> bool:
            return ((snapshots is None or snapshots.get(table[k - 1]) is not None)
                    and (windows is None or windows.restorable(table, k * bs)))

        while k and not restorable(k):
            k -= 1
        if k < shared and snapshots is not None:  # recomputing what others share: keep the state at its end
            seq.snapshot_at = shared * bs
        self.blocks.release(table[k:])
        seq.block_table, seq.num_computed = table[:k], k * bs
        if windows is not None:
            windows.release(seq.window_table)
            seq.window_table = windows.restore(seq.block_table, k * bs)
        seq.forget_state()
        if k and snapshots is not None:
            seq.recurrent = (k * bs, snapshots.get(table[k - 1]))
            snapshots.restored += 1

    def cache_prefix(self, seq: Sequence) -> None:
        """Share seq's computed full blocks with later requests through the prefix cache
        (with the window layers' blocks at those positions), and (no session pins it) its
        partial last block as a leaf they may copy from."""
        if seq.cached is not None and seq.cached[0] is seq.block_table \
                and seq.cached[1] == seq.num_computed:
            return  # in already (a request done with its first token: at the token, then at its end)
        computed = seq.tokens[: seq.num_computed]
        tags = None
        if seq.edit is not None and seq.edit.applied:
            # Blocks from the first edited one on hold a history of their own: keyed by it.
            tags = block_tags(seq.edit, len(computed) // self.block_size, self.block_size)
            seq.block_table = self.blocks.cache_prefix(computed, seq.block_table, tags=tags)
        else:
            seq.block_table = self.blocks.cache_prefix(computed, seq.block_table, partial=seq.session is None)
        if self.windows is not None and self.blocks.radix is not None:
            n_full = len(computed) // self.block_size
            self.windows.keep(seq.block_table[:n_full], seq.window_table[:n_full])
        if self.tier is not None:  # its full blocks (and the partial last one) written through,
            self.tier.save(computed, seq.block_table, tags)  # with the window blocks kept above
        seq.cached = (seq.block_table, seq.num_computed)

    def prefetch(self, seq: Sequence) -> None:
        """A new request's disk blocks read ahead off the engine thread (the scheduler admits
        it once they are in memory); one that reuses a session's or an edit's blocks reads none."""
        if self.tier is not None and seq.edit is None and not seq.block_table:
            seq.prefetch = self.tier.prefetch(seq.tokens)

    def release_session(self, session: Session) -> None:
        """Give back everything a (paged) session holds (on the engine thread)."""
        self.blocks.release(session.block_table)
        if self.windows is not None:
            self.windows.release(session.window_table)
        session.tokens, session.block_table, session.window_table, session.recurrent = [], [], [], None
        session.edit = None
