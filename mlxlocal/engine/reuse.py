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
from mlxlocal.cache.states import StateSnapshots
from mlxlocal.cache.window import HOLE, WindowBlocks
from mlxlocal.engine.edits import EditState, first_touched
from mlxlocal.engine.sequence import Sequence
from mlxlocal.engine.session import Session, common_prefix


class PrefixReuse:
    def __init__(self, blocks: BlockManager, windows: WindowBlocks | None, snapshots: StateSnapshots | None):
        self.blocks, self.windows, self.snapshots = blocks, windows, snapshots
        self.block_size = blocks.block_size
        blocks.on_free, blocks.on_move = self._block_freed, self._block_moved

    @property
    def whole_blocks(self) -> bool:
        """Hybrid and window models never reuse part of a block (no state mid-block)."""
        return self.windows is not None or self.snapshots is not None

    def _block_freed(self, block: int) -> None:
        """A full-attention block went back to the free list: what was keyed by it goes."""
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
        s = seq.session
        held: EditState | None = s.edit
        want = seq.edit.pending if seq.edit is not None else []
        applied = [e for e, _ in held.applied] if held is not None else []
        full = held.full if held is not None else s.tokens
        prompt = seq.edit.full if seq.edit is not None else seq.tokens
        common = common_prefix(full, prompt)
        if want[len(applied):]:
            common = min(common, want[len(applied)].at)
        if want[: len(applied)] != applied or (applied and common < max(e.at for e in applied)):
            self.release_session(s)
            return 0
        if held is None:  # a plain history: the first edit starts here
            return self._attach(seq, common)
        slots = held.slot_of(common) if common <= len(held.full) else len(held.origin)
        st = seq.edit
        st.origin = held.origin[:slots] + list(range(common, len(prompt)))
        st.positions = [held.position(i) for i in range(slots)]
        st.shift, st.applied, st.pending = held.shift, list(held.applied), want[len(applied):]
        st.dropped = held.dropped
        seq.prompt = s.tokens[:slots] + prompt[common:]
        seq.tokens = list(seq.prompt)
        self._attach(seq, slots)
        if seq.num_computed < slots:  # copy on write cut the reuse short: recompute from a clean state
            self.blocks.release(seq.block_table)
            seq.block_table, seq.num_computed = [], 0
            seq.edit = EditState.start(prompt, want)
            seq.prompt, seq.tokens = list(prompt), list(prompt)
        return seq.num_computed

    def _attach(self, seq: Sequence, common: int) -> int:
        """Take over the session's blocks holding its first `common` tokens."""
        s, bs = seq.session, self.block_size
        keep = -(-common // bs)
        if common % bs and keep and (self.blocks.refs[s.block_table[keep - 1]] > 1
                                     or (self.blocks.radix and self.blocks.radix.contains(s.block_table[keep - 1]))):
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
        computed = seq.tokens[: seq.num_computed]
        partial = seq.session is None
        if seq.edit is not None and seq.edit.applied:
            # Blocks from the first edited one on hold a history of their own: only the
            # prefix before it is what any request computing these tokens would have.
            computed, partial = computed[: first_touched(seq.edit.applied[0][0]) // self.block_size * self.block_size], False
        seq.block_table = self.blocks.cache_prefix(computed, seq.block_table, partial=partial)
        if self.windows is not None and self.blocks.radix is not None:
            n_full = len(computed) // self.block_size
            self.windows.keep(seq.block_table[:n_full], seq.window_table[:n_full])

    def release_session(self, session: Session) -> None:
        """Give back everything a (paged) session holds (on the engine thread)."""
        self.blocks.release(session.block_table)
        if self.windows is not None:
            self.windows.release(session.window_table)
        session.tokens, session.block_table, session.window_table, session.recurrent = [], [], [], None
        session.edit = None
