"""Cache edits: a sequence's prompt tokens leaving its KV cache, the rest repositioned.

A request with edits keeps, beside its tokens, where each cache slot came from in the
prompt it was given (`origin`, "full" coordinates) and the rope position its key was
rotated with. Slots never leave the middle of a block table: an edit rebuilds the table
from the first block it touches, copying the kept rows into fresh blocks (re-rotating the
keys of moved tokens on the way), so every attention path keeps reading dense tables and
blocks others share (prefix cache, an earlier turn) are never written.

Drop alone keeps every position: tokens computed later take their own prompt index as
their position, exactly as if the dropped keys were masked out. Repositioned spans follow
the kept token before them without a gap; an edit with `close_tail` moves the tokens
computed after it the same way.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left
from dataclasses import dataclass, field

import mlx.core as mx

from mlxlocal.cache import BlockManager, KVPools
from mlxlocal.cache.rope_edit import layer_ropes, rerotate
from mlxlocal.engine.types import CacheEdit


def check_edits(edits: list[CacheEdit], prompt_len: int) -> None:
    """ValueError naming the first edit that does not fit the prompt (CacheEdit's rules)."""
    last_at = 0
    dropped: list[tuple[int, int]] = []
    for i, e in enumerate(edits):
        if not isinstance(e, CacheEdit):
            raise ValueError(f"cache edits must be CacheEdit, got {type(e).__name__}")
        where = f"cache edit {i} (at {e.at})"
        if not 0 < e.at < prompt_len:
            raise ValueError(f"{where}: `at` must be inside the prompt (1..{prompt_len - 1}); the last "
                             "prompt token is always computed after every edit")
        if e.at < last_at:
            raise ValueError(f"{where}: edits must be sorted by `at`")
        last_at = e.at
        if not e.drop:
            raise ValueError(f"{where}: drops nothing")
        for kind, spans in (("drop", e.drop), ("reposition", e.reposition)):
            end = -1
            for a, b in spans:
                if not (0 <= a < b <= e.at):
                    raise ValueError(f"{where}: {kind} span [{a}, {b}) is not a non-empty span before `at`")
                if a < end:
                    raise ValueError(f"{where}: {kind} spans must be sorted and not overlap")
                end = b
        for a, b in e.drop:
            if any(a < y and x < b for x, y in dropped):
                raise ValueError(f"{where}: drop span [{a}, {b}) overlaps a span an earlier edit dropped")
        for a, b in e.reposition:
            if any(a < y and x < b for x, y in dropped + list(e.drop)):
                raise ValueError(f"{where}: reposition span [{a}, {b}) holds dropped tokens")
        dropped += list(e.drop)


def edit_key(edit: CacheEdit, prompt: list[int]) -> str:
    """What an applied edit means for the cache: the edit and the tokens it dropped (two
    conversations dropping different text at the same spans leave different K/V)."""
    h = hashlib.blake2b(repr((edit.at, edit.drop, edit.reposition, edit.close_tail)).encode(), digest_size=16)
    for a, b in edit.drop:
        h.update(repr(prompt[a:b]).encode())
    return h.hexdigest()


def first_touched(edit: CacheEdit) -> int:
    """The first prompt index whose cache state the edit changes."""
    return min([a for a, _ in edit.drop] + [a for a, _ in edit.reposition])


@dataclass
class EditState:
    """A sequence's edit bookkeeping, in the coordinates of the prompt it was given."""

    full: list[int]  # the prompt as submitted (a session's: the conversation, replies included)
    pending: list[CacheEdit]  # edits not yet applied, by `at`
    origin: list[int] = field(default_factory=list)  # prompt index of every prompt slot
    positions: list[int] = field(default_factory=list)  # rope positions of the first slots (explicit)
    shift: int = 0  # rope position - prompt index, for the slots past `positions`
    applied: list[tuple[CacheEdit, str]] = field(default_factory=list)  # (edit, edit_key), in order
    dropped: int = 0  # prompt tokens out of the cache
    repositioned: int = 0  # keys re-rotated for this request

    @classmethod
    def start(cls, prompt: list[int], edits: list[CacheEdit]) -> EditState:
        return cls(full=list(prompt), pending=list(edits), origin=list(range(len(prompt))))

    def origin_of(self, slot: int) -> int:
        """Prompt index of a slot; generated tokens follow the prompt."""
        return self.origin[slot] if slot < len(self.origin) else len(self.full) + slot - len(self.origin)

    def position(self, slot: int) -> int:
        return self.positions[slot] if slot < len(self.positions) else self.origin_of(slot) + self.shift

    def slot_of(self, index: int) -> int:
        """Slots whose prompt index is below `index`."""
        return bisect_left(self.origin, index)

    def next_edit_slot(self) -> int | None:
        """The slot count at which the next pending edit applies (its `at`, as a slot)."""
        return self.slot_of(self.pending[0].at) if self.pending else None

    def layout(self, edit: CacheEdit, n: int) -> Layout:
        """Where the n computed slots go under `edit`; updates nothing."""
        gone = [s for a, b in edit.drop for s in range(self.slot_of(a), self.slot_of(b))]
        if gone and gone[-1] >= n:
            raise RuntimeError("a cache edit reached slots that are not computed")
        dropped = set(gone)
        keep = [s for s in range(n) if s not in dropped]
        old = [self.position(s) for s in range(n)]
        new = [old[s] for s in keep]
        kept_origin = [self.origin[s] for s in keep]
        moved: list[int] = []  # indices into keep
        for a, b in edit.reposition:
            for j in range(bisect_left(kept_origin, a), bisect_left(kept_origin, b)):
                new[j] = new[j - 1] + 1 if j else 0
                if new[j] != old[keep[j]]:  # already in place: nothing to re-rotate
                    moved.append(j)
        return Layout(gone, keep, old, new, moved)

    def commit(self, edit: CacheEdit, lay: Layout) -> None:
        """The edit is done: origins, positions and history follow it."""
        gone = set(lay.gone)
        self.origin = [o for i, o in enumerate(self.origin) if i not in gone]
        self.positions = lay.new
        if edit.close_tail:  # else later tokens keep the positions they were heading for
            self.shift = (self.positions[-1] + 1 if self.positions else 0) - edit.at
        self.pending.pop(0)
        self.applied.append((edit, edit_key(edit, self.full)))
        self.dropped += len(lay.gone)
        self.repositioned += len(lay.moved)


@dataclass
class Layout:
    gone: list[int]  # dropped slots
    keep: list[int]  # kept slots, in order
    old: list[int]  # rope position of every computed slot before the edit
    new: list[int]  # rope position of every kept slot after it
    moved: list[int]  # kept slots (indices into keep) whose position changes: keys re-rotated


def block_tags(st: EditState, n_blocks: int, block_size: int) -> list[str | None]:
    """The edit history each of the first n_blocks blocks' K/V went through: the applied
    edits that touched a token at or before the block's last one (None: no edit did)."""
    tags: list[str | None] = []
    touched = [(first_touched(e), key) for e, key in st.applied]
    for i in range(n_blocks):
        last = st.origin_of((i + 1) * block_size - 1)
        keys = [key for t, key in touched if t <= last]
        tags.append(hashlib.blake2b("".join(keys).encode(), digest_size=16).hexdigest() if keys else None)
    return tags


def replay(prompt: list[int], edits: list[CacheEdit]) -> EditState:
    """The bookkeeping after every edit, with nothing computed: the kept view of a prompt."""
    st = EditState.start(prompt, edits)
    while st.pending:
        e = st.pending[0]
        st.commit(e, st.layout(e, st.slot_of(e.at)))
    return st


def simulate(prompt_len: int, edits: list[CacheEdit]) -> tuple[int, int, int]:
    """(slots the prompt keeps, the most slots it holds at once, rope position of its last
    token) after every edit: what submit checks against the pool and the context."""
    st = replay([0] * prompt_len, edits)
    peak = dropped = 0
    for e in edits:  # slots held just before each edit
        peak = max(peak, e.at - dropped)
        dropped += sum(b - a for a, b in e.drop)
    return len(st.origin), max(peak, len(st.origin)), st.position(len(st.origin) - 1)


def fit(prompt_len: int, edits: list[CacheEdit], context_length: int) -> tuple[int, int]:
    """Check edits against the prompt and the context: (the context the reply starts from:
    tokens kept or, if higher, the next rope position; the most tokens held at once)."""
    check_edits(edits, prompt_len)
    kept, peak, last = simulate(prompt_len, edits)
    if last + 1 >= context_length:
        raise ValueError(f"after its cache edits the prompt's last token sits at rope position {last}, past "
                         f"the model's context ({context_length}): reposition the kept messages, "
                         "or start a new conversation")
    return max(kept, last + 1), peak


def restart(seq) -> None:
    """Back to the prompt as submitted, every edit pending again: a sequence that lost its
    blocks (preempted) recomputes the same history."""
    st: EditState | None = seq.edit
    if st is None or not st.applied:
        return
    generated = seq.tokens[len(seq.prompt):]
    seq.edit = EditState.start(st.full, [e for e, _ in st.applied] + st.pending)
    seq.prompt = list(st.full)
    seq.tokens = seq.prompt + generated


class Rotator:
    """Re-rotates one layer's keys from old to new rope positions with the model's ropes
    (cache/rope_edit.py). Building it raises RepositionError (a ValueError) for a model
    whose rope cannot be moved."""

    def __init__(self, model):
        self.ropes = layer_ropes(model)  # per pool layer; None: no rope there

    def __call__(self, layer: int, keys: mx.array, old: mx.array, new: mx.array) -> mx.array:
        spec = self.ropes[layer]
        return keys if spec is None else rerotate(keys, old, new, spec)


def apply_edit(seq, pools: KVPools, blocks: BlockManager, rotate: Rotator | None) -> int:
    """Apply seq's next pending edit (its first `at` prompt tokens are computed): drop the
    spans' slots, re-rotate the moved keys, rebuild the block table from the first block
    touched. Returns the slots dropped. Raises OutOfBlocks, with nothing changed, when
    the copies do not fit the pool."""
    st: EditState = seq.edit
    edit, bs, n = st.pending[0], pools.block_size, seq.num_computed
    lay = st.layout(edit, n)
    touched = lay.gone[:1] + [lay.keep[j] for j in lay.moved[:1]]
    first = min(touched) if touched else n
    start_block = first // bs
    j0 = bisect_left(lay.keep, start_block * bs)  # kept slots before the first touched block stay put
    rows = lay.keep[j0:]
    table, old = seq.block_table, seq.block_table[start_block:]
    n_new = -(-(j0 + len(rows)) // bs) - start_block if rows else 0
    in_place = all(blocks.refs[b] == 1 for b in old)
    if in_place:
        # Ours alone: rewritten where they are (the rows are read before any is written),
        # so an edit never needs more blocks than it frees, however full the pool.
        blocks.detach(old)
        dest = old[:n_new]
    else:  # someone else reads them: fresh blocks (OutOfBlocks here leaves seq untouched)
        dest = blocks.allocate(n_new)
    dst = [(dest[(j0 + i) // bs - start_block], (j0 + i) % bs) for i in range(len(rows))]
    rot = [j - j0 for j in lay.moved]  # rows start at kept index j0 <= every moved one
    if rows:
        pools.move_rows(mx.array([table[s // bs] for s in rows]), mx.array([s % bs for s in rows]),
                        mx.array([b for b, _ in dst]), mx.array([o for _, o in dst]),
                        rotate=None if not rot else (
                            mx.array(rot), mx.array([lay.old[rows[i]] for i in rot]),
                            mx.array([lay.new[j0 + i] for i in rot]), rotate))
    blocks.release(old[n_new:] if in_place else old)
    seq.block_table = table[:start_block] + dest
    for s in reversed(lay.gone):
        del seq.tokens[s]
        del seq.prompt[s]
    seq.num_computed = n - len(lay.gone)
    st.commit(edit, lay)
    return len(lay.gone)


def held_by_session(st: EditState, computed: list[int]) -> EditState:
    """What a session keeps of a finished request's edits: the conversation so far (prompt
    and computed reply) as its coordinates, an origin for every computed slot."""
    n_prompt = len(st.origin)
    generated = computed[n_prompt:]
    origin = st.origin + [st.origin_of(i) for i in range(n_prompt, len(computed))]
    return EditState(full=st.full + generated, pending=[], origin=origin[: len(computed)],
                     positions=st.positions, shift=st.shift, applied=list(st.applied), dropped=st.dropped)
