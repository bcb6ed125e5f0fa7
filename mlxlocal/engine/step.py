"""The paged engine's phases from the forward on: submit it, sample, then hand out.

A forward goes to evaluation once the previous one has ended (`_submit`: the pools are then
written in place). A step's logits are sampled in one batched call (the grammar masks first,
one call for all constrained rows); the tokens stay lazy arrays (`Sampled`) while the next
step's forward is queued, then one host read per batch hands them out (`_take`).
`StepPhases` is PagedEngine's base: the methods use the engine's pools, runner, speculator,
scheduler, grammars, profile, `_fence`, `_accept`, `_fail` and `_guarded`.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import mlx.core as mx

from mlxlocal.engine import constraint, sampling
from mlxlocal.engine.runner import step_inputs
from mlxlocal.engine.sequence import Sequence, Status
from mlxlocal.errors import NonFiniteLogitsError

log = logging.getLogger("mlxlocal.engine")


class Sampled(NamedTuple):
    """One sequence's token from a step, in flight until the next step hands it out."""

    seq: Sequence
    token: mx.array  # [1], lazy
    logprobs: list[mx.array]  # sampling.logprob_arrays: [] unless the request asked for them
    src: tuple[mx.array, int] | None  # (the batch's token array, row): the next decode feeds it
    check: tuple[mx.array, int] | None  # (its logits' log-sum-exps, row): finite or not


class StepPhases:
    """Forward submission, sampling and hand-out for PagedEngine (its base class)."""

    def _forward(self, seqs: list[Sequence], n: int) -> mx.array:
        """Feed n tokens of each sequence and start their evaluation; return last-position
        logits [B, V] (being evaluated)."""

        def state() -> list[mx.array]:
            arrays = self.pools.state() + self.runner.state(seqs)
            return arrays + self.spec.state() if self.spec is not None else arrays

        submit = lambda: self._submit(state())  # noqa: E731
        if self.spec is not None:
            self.spec.mirror(seqs, n, submit=submit)  # the draft sees every token the target does
        follow = self.spec is not None and self.spec.follows
        if follow:  # MTP: its module takes this forward's hidden states with the tokens fed
            starts = [s.num_computed for s in seqs]
            inputs = step_inputs(seqs, starts, n)
        logits = self.runner.forward(self.pools, seqs, n, submit=submit)
        if follow:
            self.spec.follow(seqs, starts, inputs)
        if (prof := self.profile) is not None:
            prof.lap("build")
        self._submit([logits] + state())
        return logits

    def _submit(self, arrays: list[mx.array]) -> None:
        """Evaluate a forward once the previous one is done. MLX writes a pool in place only
        when nothing else holds it, and a forward in flight holds the pools it reads until it
        ends: started earlier, every layer's write would copy its whole pool (8 streams:
        1,064 tok/s with 4,097 blocks, 1,668 with 289). Sampling is evaluated apart, so the
        wait ends with the previous forward and the graph was built meanwhile."""
        self._wait_forward()
        if (prof := self.profile) is not None:
            prof.lap("wait")
        # A fresh array of this evaluation: the arrays given may be pools, which the next
        # write rebinds to its own (pending) result.
        self._fence = [mx.zeros((1,))]
        mx.async_eval(arrays + self._fence)
        if prof is not None:
            prof.lap("submit")

    def _wait_forward(self) -> None:
        """Until the last forward sent to evaluation has ended (its fence: an array of its
        evaluation, which waits for all of it)."""
        mx.eval(self._fence)

    def _take(self, previous: list[Sampled]) -> None:
        """Hand out the tokens a step sampled: one host read per sampled batch (and one of
        its log-sum-exps: not finite, the logits were not)."""
        values: dict[int, list] = {}

        def read(array: mx.array, row: int):
            if id(array) not in values:
                values[id(array)] = array.tolist()
            return values[id(array)][row]
        for seq, token, lp, src, check in previous:
            if seq.pending is token:
                seq.pending = seq.pending_from = None
            if src is not None:
                token = read(*src)
            if seq.status is Status.FINISHED:
                continue
            if check is not None and not math.isfinite(read(*check)[0]):
                self._non_finite(seq)
            else:
                self._guarded(seq, self._accept, seq, token, lp)

    def _non_finite(self, seq: Sequence) -> None:
        """Its logits went NaN or infinite: its token means nothing, so it ends here."""
        log.warning("request %d: non-finite logits after %d tokens; ending it", seq.id, seq.num_generated)
        self._fail(seq, NonFiniteLogitsError(seq.num_generated))

    def _constrain(self, ready: list[tuple[list[Sequence], mx.array]]) -> tuple[list, list]:
        """Drop what no longer needs sampling (finished, or given the grammar's forced
        tokens to feed next step); the grammar masks of what does, one call for all."""
        kept, constrained = [], []
        alone = len(self.scheduler.running) == 1 and not self.scheduler.waiting
        for seqs, logits in ready:
            live = []
            for i, seq in enumerate(seqs):
                if seq.status is Status.FINISHED:
                    continue
                # Jump forward: feed the grammar's only continuation in one forward instead
                # of one step per token. Only when running alone: in a batch it would wait
                # for the step's one prefill slot while the others decode.
                if alone and seq.constraint is not None and seq.params.logprobs is None:
                    self._guarded(seq, self._force, seq)
                    if seq.status is Status.FINISHED or seq.remaining:
                        continue
                live.append(i)
                if seq.constraint is not None:
                    constrained.append(seq)
            if live:
                kept.append(([seqs[i] for i in live], logits if len(live) == len(seqs) else logits[mx.array(live)]))
        if not constrained:
            return kept, [None] * len(kept)
        try:
            mask = constraint.allowed_tokens(self.grammars, [seq.constraint for seq in constrained])
        except Exception as e:
            for seq in constrained:
                self._fail(seq, e)
            return self._constrain(kept)
        row_of = {id(seq): j for j, seq in enumerate(constrained)}
        masks = []
        for seqs, _ in kept:
            rows = [i for i, seq in enumerate(seqs) if id(seq) in row_of]
            at = [row_of[id(seqs[i])] for i in rows]
            # One group holding every constrained row, in order (a steady decode batch): as is.
            masks.append((rows, mask if at == list(range(len(constrained))) else mask[mx.array(at)]) if rows else None)
        return kept, masks

    def _force(self, seq: Sequence) -> None:
        """Append the grammar's forced tokens as if sampled; the next step feeds them."""
        for token in seq.constraint.forced():
            seq.stats.forced_tokens += 1
            self._accept(seq, token)
            if seq.status is Status.FINISHED:
                return

    def _sample(self, seqs: list[Sequence], logits: mx.array,
                allowed: tuple | None = None) -> list[Sampled]:
        """Each sequence's token: one batched call for all (`src` None when sampled one by
        one). `allowed`: (rows, masks) of the sequences with a grammar."""
        for seq in seqs:
            seq.sampler.lse = None  # set by the call: a stale one must not be read
        try:
            tokens, logprobs = sampling.sample_batch([s.sampler for s in seqs], logits,
                                                     [s.tokens for s in seqs], [s.pending for s in seqs], allowed)
            # The next decode feeds the batch's token array as a whole (runner.step_inputs).
            return [Sampled(seq, token, lp, (tokens, i), seq.sampler.lse)
                    for i, (seq, token, lp) in enumerate(zip(seqs, mx.split(tokens, len(seqs)), logprobs))]
        except Exception:
            # Keys are untouched when it raises: one by one, a faulty request fails alone.
            log.exception("batched sampling failed; sampling %d requests one by one", len(seqs))
        sampled: list[Sampled] = []
        mask_of = dict(zip(allowed[0], mx.split(allowed[1], len(allowed[0])))) if allowed else {}
        for i, seq in enumerate(seqs):
            try:
                token, logprobs = seq.sampler(logits[i : i + 1], seq.tokens, seq.pending, mask_of.get(i))
                arrays = sampling.logprob_arrays(seq.params.logprobs, token, logprobs)
                sampled.append(Sampled(seq, token, arrays, None, seq.sampler.lse))
            except Exception as e:
                log.exception("sampling failed for request %d", seq.id)
                self._fail(seq, e)
        return sampled
