"""The MTP drafter: the model's own multi-token-prediction module(s) draft k tokens per step.

Position i of the MTP module's K/V holds (the model's hidden state h_i, token i+1), as the
module was trained. The token after i is known only once it is sampled, so each sequence
carries the model hidden states not yet fed (`SpecState.mtp`: first position, rows) and
every forward of the model feeds the module what it can: after a forward over positions
p..p+n-1 the module takes positions from the pending one up to p+n-2, and h_{p+n-1} waits.

Drafting (`propose`) feeds what is pending with the last token, whose output predicts the
next token; chained, the module's own output stands in for h (a checkpoint's further
modules are not used: the first repeats, as only its K/V follows the model). The verify
forward's hidden states for the accepted tokens and the one after become pending again:
they are what the drafts were not. The module's K/V lives in pools of its own with the
model's block ids, so cached, shared and copied blocks hold it too (as a draft model's
does, drafting.py). A sequence resumed from the prefix cache has no hidden state pending: it
drafts from its next forward on.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlxlocal.cache import KVPools, KVShape
from mlxlocal.cache.mlx_lm_views import PagedCache
from mlxlocal.engine.runner import step_batch
from mlxlocal.engine.sampling import MIN_TEMPERATURE
from mlxlocal.engine.sequence import Sequence
from mlxlocal.engine.speculative.drafting import draw_draft
from mlxlocal.models.mtp import HiddenTap, TargetParts


class MTPDrafter:
    """Drafts with a loaded model's MTP modules (`loaded.mtp`), following its every forward."""

    runner = None  # no model of its own for warm_up to measure
    follows = True  # fed the model's hidden states after each of its forwards (follow)

    def __init__(self, loaded):
        if not loaded.mtp:
            raise ValueError(f"{loaded.info.name} has no MTP modules to draft with "
                             "(see `mlxlocal show`: a conversion may have dropped them)")
        if loaded.info.native:
            raise ValueError("MTP drafting runs on mlx-lm-path models (DeepSeek, GLM, Qwen3.5)")
        self.module = loaded.mtp[0]  # a checkpoint's further modules are not used (see above)
        self.target = TargetParts(loaded.model)
        self.tap = HiddenTap.of(loaded.model)
        self.model_dir = str(loaded.info.path)  # the disk tier keys its K/V with the model's
        self.shapes, self.dtype = self._probe()
        self.pools: KVPools | None = None

    def _probe(self) -> tuple[list[KVShape], mx.Dtype]:
        """The module's K/V row shape, from two tokens through it on mlx-lm's own cache."""
        cache = KVCache()
        hidden = mx.zeros((1, 2, self.target.args.hidden_size))
        mx.eval(self.module(mx.array([[0, 1]]), hidden, cache, self.target))
        k, v = cache.keys, cache.values
        return [KVShape(k.shape[1], k.shape[3], v.shape[1], v.shape[3])], k.dtype

    @property
    def disk_draft(self) -> tuple:
        """What the disk tier keys this K/V by: the model's directory and dtype and its kind
        (the model as its own draft model shares the first two)."""
        return self.model_dir, self.dtype, self.pools, "mtp"

    def bytes_per_block(self, block_size: int) -> int:
        return KVPools.bytes_per_block(self.shapes, block_size, self.dtype)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        self.pools = KVPools(self.shapes, num_blocks, block_size, self.dtype)

    def state(self) -> list[mx.array]:
        return self.pools.state()

    def copy_block(self, src: int, dst: int) -> None:
        self.pools.copy_block(src, dst)

    # --- following the model ---------------------------------------------------------
    def mirror(self, seqs: list[Sequence], n: int,
               submit: Callable[[], None] | None = None) -> None:
        self.tap.clear()  # before the model's forward: what it records is that forward's

    def hidden(self, batch: int, n: int) -> mx.array:
        """The model's hidden states [batch, n, D] of its forward since mirror()."""
        return self.tap.take(batch, n)

    def follow(self, seqs: list[Sequence], starts: list[int], inputs: mx.array,
               keep: list[bool]) -> None:
        """After the model's forward of inputs [B, n] at starts: feed the module what became
        feedable, keep the last hidden state pending (`keep`: the sequences that may draft)."""
        B, n = inputs.shape
        hidden = self.hidden(B, n)
        groups: dict[int, list[int]] = {}
        rows_of, tokens_of, first_of = {}, {}, {}
        for i, seq in enumerate(seqs):
            if not keep[i]:
                continue
            first, rows = self._pending(seq, starts[i])
            new, fed = hidden[i : i + 1, : n - 1], inputs[i : i + 1].astype(mx.uint32)
            if rows is None:  # positions start.. take the tokens after them: inputs[1:]
                rows, tokens = new, fed[:, 1:]
            else:
                rows = mx.concatenate([rows, new], axis=1)
                known = seq.tokens[first + 1 : starts[i]]
                if known:
                    fed = mx.concatenate([mx.array([known], mx.uint32), fed], axis=1)
                tokens = fed
            seq.spec.mtp = (starts[i] + n - 1, hidden[i : i + 1, n - 1 :])
            if rows.shape[1]:
                rows_of[i], tokens_of[i], first_of[i] = rows, tokens, first
                groups.setdefault(rows.shape[1], []).append(i)
        for idx in groups.values():  # one feed per number of rows: positions differ, counts not
            self._feed([seqs[i] for i in idx], [first_of[i] for i in idx],
                       mx.concatenate([tokens_of[i] for i in idx]),
                       mx.concatenate([rows_of[i] for i in idx]))

    def verified(self, seq: Sequence, start: int, hidden: mx.array, kept: int,
                 rewind: bool) -> None:
        """After a verify forward at `start` whose first `kept` + 1 positions stand: their
        model hidden states [1, K+1, D] wait for the tokens after them (a rewound hybrid
        feeds those positions again: nothing waits)."""
        seq.spec.mtp = None if rewind else (start, hidden[:, : kept + 1])

    def ready(self, seq: Sequence) -> bool:
        """Drafting needs the model's hidden state at the position before the last token."""
        return self._pending(seq, seq.num_computed)[1] is not None

    @staticmethod
    def _pending(seq: Sequence, start: int) -> tuple[int, mx.array | None]:
        """(first pending position, its rows) when they lead up to `start`, else start and
        none (a new sequence, a prefix from the cache, a preempted one starting over)."""
        state = seq.spec.mtp if seq.spec is not None else None
        if state is not None and state[0] + state[1].shape[1] == start:
            return state[0], state[1]
        return start, None

    def _feed(self, seqs: list[Sequence], firsts: list[int], tokens: mx.array, hidden: mx.array,
              last: list[int] | None = None) -> tuple[mx.array, mx.array]:
        """Feed tokens [B, m] with hidden [B, m, D] at positions firsts[i].. into the module's
        K/V; -> (logits [B, V], outputs [B, 1, D]) at each row's index last[i] (default m-1)."""
        batch = step_batch(seqs, firsts, tokens.shape[1], self.pools.block_size)
        cache = PagedCache(self.pools, 0, batch, None)
        logits, out = self.module(tokens, hidden, cache, self.target)
        if last is None or all(x == tokens.shape[1] - 1 for x in last):
            return logits[:, -1, :], out[:, -1:, :]
        rows, at = mx.arange(len(seqs)), mx.array(last)
        return logits[rows, at], out[rows, at][:, None]

    # --- drafting ---------------------------------------------------------------------
    def propose(self, seqs: list[Sequence], K: int) -> tuple[mx.array, mx.array | None]:
        """(drafts [B, K], q [B, K, V] for the rows whose draft was sampled, else None)."""
        starts = [s.num_computed for s in seqs]
        logits_rows: dict[int, mx.array] = {}
        out_rows: dict[int, mx.array] = {}
        for idx, width in self._padded_groups(seqs, K):
            group = [seqs[i] for i in idx]
            firsts = [s.spec.mtp[0] for s in group]
            counts = [s.spec.mtp[1].shape[1] for s in group]
            # Rows padded on the right, past the last token: those positions are the drafts'
            # own, written by the chain below before anything reads them (causal).
            tokens = mx.array([s.tokens[f + 1 : s.num_computed + 1] + [s.tokens[-1]] * (width - c)
                               for s, f, c in zip(group, firsts, counts)], mx.uint32)
            hidden = mx.concatenate([mx.pad(s.spec.mtp[1], [(0, 0), (0, width - c), (0, 0)])
                                     for s, c in zip(group, counts)])
            logits, out = self._feed(group, firsts, tokens, hidden, [c - 1 for c in counts])
            for j, i in enumerate(idx):
                logits_rows[i], out_rows[i] = logits[j : j + 1], out[j : j + 1]
        for seq in seqs:
            seq.spec.mtp = None  # fed; the verify forward's hidden states come next
        logits = mx.concatenate([logits_rows[i] for i in range(len(seqs))])
        hidden = mx.concatenate([out_rows[i] for i in range(len(seqs))])
        sampled = [i for i, s in enumerate(seqs) if s.params.temperature >= MIN_TEMPERATURE]
        drafts, qs = [], []
        for j in range(K):
            token, probs = draw_draft(logits, seqs, sampled)
            qs += [probs] if sampled else []
            drafts.append(token)
            if j == K - 1:
                break
            logits, hidden = self._feed(seqs, [p + j for p in starts], token.reshape(-1, 1), hidden)
            # Evaluated before the next feed writes the pools (a write while this feed's reads
            # are pending would copy each whole pool: engine/paged.py, _submit).
            mx.eval([logits, hidden] + self.pools.state())
        q = mx.stack(qs, axis=1) if sampled else None
        return mx.stack(drafts, axis=1), q

    @staticmethod
    def _padded_groups(seqs: list[Sequence], K: int) -> list[tuple[list[int], int]]:
        """Sequences whose pending rows one feed can take, padded to the group's widest:
        padding stays within the K + 1 positions the verify step reserved."""
        order = sorted(range(len(seqs)), key=lambda i: -seqs[i].spec.mtp[1].shape[1])
        groups: list[tuple[list[int], int]] = []
        for i in order:
            count = seqs[i].spec.mtp[1].shape[1]
            if groups and groups[-1][1] - count <= K:
                groups[-1][0].append(i)
            else:
                groups.append(([i], count))
        return groups
