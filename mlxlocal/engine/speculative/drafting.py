"""Speculative decoding in the paged engine: draft a few tokens per sequence, verify them all
in one forward of the target, keep the longest accepted run, roll the rest back.

Drafters: prompt lookup (`LookupIndex`: the tokens that followed the latest earlier
occurrence of the sequence's longest matching suffix n-gram, over prompt and output) and a
draft model (`ModelDrafter`: a small model sharing the tokenizer, its K/V in pools of its
own indexed by the same block ids, so it follows every forward the target runs and a
cached or shared block holds the draft's K/V too).

Acceptance is exact rejection sampling (Leviathan et al., Chen et al., 2023): a drafted
token d, drawn from q, is kept with probability min(1, p(d) / q(d)); at the first rejection
the token is drawn from max(p - q, 0) renormalised, after a fully accepted draft one more
from p. Every output token is then distributed as p, the request's own sampling
distribution (Sampler's: logit_bias, top-p, min-p, top-k, temperature). Greedy requests are
the case where p (and a greedy draft's q) are one-hot: a draft survives while it equals the
target's argmax, and the token after is the argmax, as without speculation.

Rollback: a rejected token's K/V stays in its slot past the sequence's context (never read,
overwritten by the next forward) and blocks past the kept tokens go back to the pool.
Hybrid models' recurrent state after the verify forward has seen the rejected tokens: the
state from before it (held, not copied) comes back and the next forward feeds the accepted
tokens again.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx

from mlxlocal.cache import KVPools
from mlxlocal.engine.runner import make_runner
from mlxlocal.engine.sampling import MIN_TEMPERATURE, _draw, _filter, _replace_rows, logprob_arrays
from mlxlocal.engine.sequence import Sequence, Status
from mlxlocal.engine.types import SpeculativeConfig
from mlxlocal.errors import ModelLoadError
from mlxlocal.source.loader import check_draft_tokenizer


class LookupIndex:
    """Prompt lookup over one sequence's tokens: n-gram -> where its latest occurrence ends,
    extended as tokens are appended (each token is indexed once)."""

    def __init__(self, ngram_min: int, ngram_max: int):
        self.ngram_min, self.ngram_max = ngram_min, ngram_max
        self.ends: dict[int, dict[tuple, int]] = {n: {} for n in range(ngram_min, ngram_max + 1)}
        self.indexed = 0  # n-grams ending before this position are in `ends`

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the longest suffix of `tokens` seen before."""
        last = len(tokens) - 1
        # Only n-grams with a known continuation (ending at or before the last token's
        # position); the suffix itself is looked up, never matched against itself.
        for end in range(max(self.indexed, self.ngram_min), last + 1):
            for n in range(self.ngram_min, min(self.ngram_max, end) + 1):
                self.ends[n][tuple(tokens[end - n : end])] = end
        self.indexed = max(self.indexed, last + 1)
        for n in range(min(self.ngram_max, len(tokens)), self.ngram_min - 1, -1):
            end = self.ends[n].get(tuple(tokens[-n:]))
            if end is not None:
                # Copy what followed; past the end the copy reads itself (a period shorter
                # than k repeats), as the text would go on if it kept repeating.
                out: list[int] = []
                for j in range(k):
                    out.append(tokens[end + j] if end + j < len(tokens) else out[end + j - len(tokens)])
                return out
        return []


MISSES, PAUSE = 3, 16


@dataclass
class SpecState:
    """One sequence's speculation: how many tokens it drafts next, its lookup index, and the
    RNG key its draft samples with (split off its Sampler's at the first sampled draft)."""

    k: int
    index: LookupIndex | None = None
    key: mx.array | None = None
    misses: int = 0  # verify steps in a row that accepted nothing
    pause: int = 0  # decode steps to go without drafting
    mtp: tuple | None = None  # MTP: (first position, model hidden states) not yet fed (mtp.py)

    def adapt(self, drafted: int, accepted: int, k_max: int) -> None:
        """One more than was accepted last time; a fully accepted draft doubles. After
        MISSES steps in a row with nothing accepted, PAUSE plain steps before drafting again:
        a drafter that keeps missing costs its drafts and verify width for nothing."""
        self.k = min(k_max, 2 * self.k) if accepted == drafted else max(1, accepted + 1)
        self.misses = self.misses + 1 if accepted == 0 else 0
        if self.misses >= MISSES:
            self.misses, self.pause = 0, PAUSE


class ModelDrafter:
    """A draft model on pools of its own with the target's block ids: `mirror` feeds it
    whatever the target is fed, `propose` drafts k tokens per sequence (batched)."""

    follows = False  # it takes no hidden states of the target's (MTPDrafter does)

    def __init__(self, loaded, target):
        try:
            check_draft_tokenizer(target, loaded)
        except ModelLoadError as e:
            raise ValueError(f"draft model {loaded.info.name} cannot draft for {target.info.name}: {e}") from None
        self.runner = make_runner(loaded)  # NotPageable: the draft's cache cannot be paged
        if self.runner.recurrent or any(w is not None for w in self.runner.windows):
            raise ValueError(f"draft model {loaded.info.name} has recurrent or sliding-window layers; "
                             "a draft model must be plain attention")
        self.name = loaded.info.name
        self.model_dir = str(loaded.info.path)  # the disk tier fingerprints it with the target
        self.dtype = self.runner.dtype
        self.pools: KVPools | None = None

    @property
    def disk_draft(self) -> tuple:
        """What the disk tier keys this draft's K/V by: (directory, dtype, pools)."""
        return self.model_dir, self.dtype, self.pools

    def bytes_per_block(self, block_size: int) -> int:
        return KVPools.bytes_per_block(self.runner.shapes, block_size, self.runner.dtype)

    def allocate(self, num_blocks: int, block_size: int) -> None:
        self.pools = KVPools(self.runner.shapes, num_blocks, block_size, self.runner.dtype)

    def mirror(self, seqs: list[Sequence], n: int, submit: Callable[[], None] | None = None) -> None:
        self.runner.forward(self.pools, seqs, n, submit=submit)  # only its K/V writes matter

    def propose(self, seqs: list[Sequence], K: int) -> tuple[mx.array, mx.array | None]:
        """(drafts [B, K], q [B, K, V] for the rows whose draft was sampled, else None);
        the draft's K/V ends up covering every drafted token (K + 1 feeds)."""
        starts = [s.num_computed for s in seqs]
        x = mx.array([[s.tokens[p]] for s, p in zip(seqs, starts)], mx.uint32)
        sampled = [i for i, s in enumerate(seqs) if s.params.temperature >= MIN_TEMPERATURE]
        drafts, qs = [], []
        for j in range(K + 1):
            logits = self.runner.run(self.pools, seqs, [p + j for p in starts], x)
            if j == K:
                break
            token, probs = draw_draft(logits, seqs, sampled)
            qs += [probs] if sampled else []
            drafts.append(token)
            x = token.reshape(-1, 1)
            # Evaluated before the next feed writes the pools: a write while this feed's
            # reads are pending would copy each whole pool (engine/paged.py: _submit).
            mx.eval([token] + qs[-1:] + self.pools.state())
        q = mx.stack(qs, axis=1) if sampled else None
        return mx.stack(drafts, axis=1), q

    def state(self) -> list[mx.array]:
        return self.pools.state()

    def copy_block(self, src: int, dst: int) -> None:
        self.pools.copy_block(src, dst)


def draw_draft(logits: mx.array, seqs: list[Sequence],
               sampled: list[int]) -> tuple[mx.array, mx.array]:
    """One drafted token per row of logits [B, V] (the argmax; rows `sampled`: drawn from the
    request's own distribution with its speculation key) and the distribution q it came from."""
    _, probs, _ = distribution(logits, seqs)
    token = mx.argmax(probs, axis=-1).astype(mx.uint32)
    if sampled:
        keys = []
        for i in sampled:
            state = seqs[i].spec
            state.key, sub = mx.random.split(state.key)
            keys.append(mx.random.uniform(shape=(1,), key=sub))
        drawn = _draw(mx.log(probs[mx.array(sampled)]), mx.stack(keys))
        token = _replace_rows(token, sampled, drawn)
    return token, probs


def distribution(logits: mx.array, seqs: list[Sequence]) -> tuple[mx.array, mx.array, mx.array]:
    """Rows of logits [R, V], row r sampled for seqs[r] -> (logprobs after logit_bias: what
    is reported, probs: the distribution the request samples from, one-hot when greedy,
    lse [R]: the log-sum-exp of the row's logits, not finite when they were not)."""
    R, V = logits.shape
    biased = [r for r, s in enumerate(seqs) if s.params.logit_bias]
    if biased:
        rows = [seqs[r].sampler._apply_bias(logits[r : r + 1]) for r in biased]
        logits = _replace_rows(logits, biased, mx.concatenate(rows))
    lse = mx.logsumexp(logits, axis=-1, keepdims=True)
    logprobs = logits - lse
    drawn = [r for r, s in enumerate(seqs) if s.params.temperature >= MIN_TEMPERATURE]
    if len(drawn) < R:  # greedy rows: one-hot at the argmax
        probs = (mx.arange(V)[None] == mx.argmax(logprobs, axis=-1)[:, None]).astype(mx.float32)
    if drawn:
        params = [seqs[r].params for r in drawn]
        x = _filter(logprobs if len(drawn) == R else logprobs[mx.array(drawn)], params, V)
        inv_t = mx.array([1.0 / p.temperature for p in params], mx.float32)  # 1/T overflows float16
        p = mx.softmax(x.astype(mx.float32) * inv_t[:, None], axis=-1)
        probs = p if len(drawn) == R else _replace_rows(probs, drawn, p)
    return logprobs, probs, lse.reshape(-1)


def accept_drafts(p: mx.array, q: mx.array | None, drafts: mx.array, ks: list[int],
                  u_accept: mx.array, u_draw: mx.array) -> tuple[mx.array, mx.array]:
    """The rejection sampler. p [B, K+1, V]: the target's distribution at each drafted
    position and after the last; q [B, K, V] the draft's (None: one-hot, a drafter that
    proposes deterministically); drafts [B, K]; ks: row i's real draft length (the rest is
    padding); uniforms u_accept [B, K], u_draw [B, K+1].

    -> (accepted [B, K] bool: draft j kept if all before it were, token [B, K+1]: the token
    to emit after j accepted drafts: from max(p - q, 0) at a rejected position j < k_i,
    from p at position k_i).
    """
    B, n, V = p.shape
    K = n - 1
    d = drafts.astype(mx.int32)[..., None]
    p_d = mx.take_along_axis(p[:, :K], d, axis=-1)[..., 0]
    one_hot = mx.arange(V)[None, None] == d
    q_full = one_hot.astype(mx.float32) if q is None else q
    q_d = 1.0 if q is None else mx.take_along_axis(q, d, axis=-1)[..., 0]
    accepted = u_accept * q_d < p_d  # min(1, p/q) without dividing by a zero q
    residual = mx.maximum(p[:, :K] - q_full, 0.0)
    drafted = (mx.arange(K)[None] < mx.array(ks)[:, None])[..., None]
    residual = mx.where(drafted, residual, p[:, :K])
    # A rejection leaves some mass in p - q; were it to round to nothing, p itself.
    empty = residual.sum(axis=-1, keepdims=True) <= 0
    residual = mx.where(empty, p[:, :K], residual)
    final = mx.concatenate([residual, p[:, K:]], axis=1)
    token = _draw(mx.log(final.reshape(B * n, V)), u_draw.reshape(B * n, 1)).reshape(B, n)
    return accepted, token


class Speculator:
    """The engine's speculative step: which decode sequences draft, the drafts, one verify
    forward, the accepted tokens handed to `accept`, the rest rolled back."""

    def __init__(self, config: SpeculativeConfig, runner, pools: KVPools, scheduler, context_length: int,
                 drafter: ModelDrafter | None = None):
        self.config, self.runner, self.pools, self.scheduler = config, runner, pools, scheduler
        self.context_length = context_length
        self.drafter = drafter
        # The drafter takes the model's hidden states after each forward (MTP).
        self.follows = drafter is not None and drafter.follows
        self.steps = self.drafted = self.accepted = 0
        self.rows = 0  # sequences verified, summed over the steps: one forward of each

    def eligible(self, seq: Sequence) -> bool:
        """Speculation keeps the request's distribution only where p does not depend on the
        drafted tokens themselves: no penalties, no grammar (those decode one token a step);
        the draft model's K/V cannot follow a cache edit."""
        p, s = seq.params, seq.sampler
        return (p.speculative and seq.constraint is None and s is not None and s.penalty is None
                and not p.frequency_penalty and not p.presence_penalty
                and (self.drafter is None or seq.edit is None))

    def wants_known_tokens(self, running: list[Sequence]) -> bool:
        """A sequence that may draft this step needs its last token's value on the host."""
        return any(s.pending is not None and self.eligible(s) for s in running)

    def select(self, decode: list[Sequence]) -> tuple[list[Sequence], list[list[int] | int]]:
        """The decode sequences that verify drafts this step (their blocks reserved for the
        verify forward) and, per sequence, its drafted tokens (prompt lookup) or draft length."""
        chosen, drafts = [], []
        for seq in decode:
            if seq.pending is not None or not self.eligible(seq):
                continue
            if seq.spec is None:
                index = None if self.drafter else LookupIndex(self.config.ngram_min, self.config.ngram_max)
                seq.spec = SpecState(self.config.num_draft_tokens, index)
            if seq.spec.pause:
                seq.spec.pause -= 1
                continue
            if self.follows and not self.drafter.ready(seq):
                continue  # the model's hidden state before its last token is not at hand
            room = min(seq.spec.k, seq.max_tokens - seq.num_generated - 1,
                       self.context_length - len(seq.tokens) - 1)
            if room <= 0:
                continue
            draft = seq.spec.index.propose(seq.tokens, room) if seq.spec.index else room
            if draft:
                chosen.append(seq)
                drafts.append(draft)
        if not chosen:
            return [], []
        K = max(d if isinstance(d, int) else len(d) for d in drafts)
        keep = [i for i, seq in enumerate(chosen)
                if len(seq.tokens) + K < self.context_length and self.scheduler.reserve(seq, K + 1)]
        return [chosen[i] for i in keep], [drafts[i] for i in keep]

    def mirror(self, seqs: list[Sequence], n: int, submit: Callable[[], None] | None = None) -> None:
        """The draft model fed the tokens the target is fed (`submit`: Runner.forward's)."""
        if self.drafter is not None:
            self.drafter.mirror(seqs, n, submit=submit)

    def follow(self, seqs: list[Sequence], starts: list[int], inputs: mx.array) -> None:
        """After the target's forward of inputs [B, n] at starts (MTP: feed the module)."""
        keep = [self.eligible(seq) for seq in seqs]
        for seq, ok in zip(seqs, keep):
            if ok and seq.spec is None:
                seq.spec = SpecState(self.config.num_draft_tokens)
        self.drafter.follow(seqs, starts, inputs, keep)

    def state(self) -> list[mx.array]:
        return self.drafter.state() if self.drafter is not None else []

    def verify(self, seqs: list[Sequence], drafts: list, accept: Callable[[Sequence, int, list], None],
               non_finite: Callable[[Sequence], None]) -> None:
        """Draft (a draft model), verify every sequence's drafts in one forward, hand out the
        accepted tokens and the one after, roll back the rest; `non_finite` ends a sequence
        whose target logits went NaN or infinite where its tokens were picked."""
        ks = [d if isinstance(d, int) else len(d) for d in drafts]
        K = max(ks)
        starts = [s.num_computed for s in seqs]
        for seq in seqs:
            if seq.params.temperature >= MIN_TEMPERATURE and seq.spec.key is None:
                seq.sampler.key, seq.spec.key = mx.random.split(seq.sampler.key)
        if self.drafter is not None:
            draft_tokens, q = self.drafter.propose(seqs, K)
        else:  # lookup drafts are exact tokens; short ones padded (their rows are not read)
            draft_tokens = mx.array([d + [d[-1]] * (K - len(d)) for d in drafts], mx.uint32)
            q = None
        last = mx.array([[s.tokens[p]] for s, p in zip(seqs, starts)], mx.uint32)
        inputs = mx.concatenate([last, draft_tokens.astype(mx.uint32)], axis=1)
        if self.follows:
            self.drafter.mirror(seqs, K + 1)  # the verify forward's hidden states recorded
        logits = self.runner.run(self.pools, seqs, starts, inputs, every=True)  # [B, K+1, V]
        B, n, V = logits.shape
        hidden = self.drafter.hidden(B, n) if self.follows else None
        row_seqs = [s for s in seqs for _ in range(n)]
        logprobs, p, lse = distribution(logits.reshape(B * n, V), row_seqs)
        if q is not None and q.shape[-1] != V:  # a draft with a padded vocabulary of another width
            q = q[..., :V] if q.shape[-1] > V else mx.pad(q, [(0, 0), (0, 0), (0, V - q.shape[-1])])
        u_accept, u_draw = self._uniforms(seqs, n)
        accepted, token = accept_drafts(p.reshape(B, n, V), q, draft_tokens, ks, u_accept, u_draw)
        # With the draft's last feed, whose writes would otherwise wait for the next forward
        # and be evaluated there with reads of theirs: the pools then copy (paged.py: _submit).
        mx.eval(accepted, token, draft_tokens, lse, self.state())
        accepted, token, draft_tokens = accepted.tolist(), token.tolist(), draft_tokens.tolist()
        finite = [[math.isfinite(v) for v in row] for row in lse.reshape(B, n).tolist()]
        logprobs = logprobs.reshape(B, n, V)
        self.steps += 1
        self.rows += B
        for i, seq in enumerate(seqs):
            k, start = ks[i], starts[i]
            m = next((j for j in range(k) if not accepted[i][j]), k)
            if not all(finite[i][: m + 1]):
                non_finite(seq)
                continue
            emit = draft_tokens[i][:m] + [token[i][m]]
            seq.spec.adapt(k, m, self.config.num_draft_tokens)
            seq.stats.draft_tokens += k
            seq.stats.accepted_tokens += m
            self.drafted, self.accepted = self.drafted + k, self.accepted + m
            # A hybrid's state saw every fed token: unless all were kept, back to the state
            # before the forward; the next forward feeds the accepted tokens again.
            rewind = self.runner.recurrent and not (m == k == K)
            if rewind:
                seq.recurrent, seq.recurrent_prev = seq.recurrent_prev, None
            if hidden is not None:
                self.drafter.verified(seq, start, hidden[i : i + 1], m, rewind)
            self.scheduler.trim(seq, start + m + 2)
            asked = seq.params.logprobs
            for e, tok in enumerate(emit):
                seq.num_computed = start if rewind else start + 1 + e
                lp = logprob_arrays(asked, mx.array([tok]), logprobs[i, e : e + 1]) if asked is not None else []
                accept(seq, tok, lp)
                # Finished, or the engine wrote tokens after this one (a thinking budget's
                # marker): the drafts after it are not the sequence's any more.
                if seq.status is Status.FINISHED or len(seq.tokens) > start + 2 + e:
                    break

    def _uniforms(self, seqs: list[Sequence], n: int) -> tuple[mx.array, mx.array]:
        """Per row 2n uniforms from the request's own key chain (zeros for greedy rows,
        where p and q are one-hot and nothing is random)."""
        rows = []
        for seq in seqs:
            if seq.params.temperature < MIN_TEMPERATURE:
                rows.append(mx.zeros((2 * n,)))
                continue
            seq.spec.key, sub = mx.random.split(seq.spec.key)
            rows.append(mx.random.uniform(shape=(2 * n,), key=sub))
        u = mx.stack(rows)
        return u[:, : n - 1], u[:, n:]


__all__ = ["LookupIndex", "ModelDrafter", "SpecState", "Speculator", "accept_drafts", "distribution",
           "draw_draft"]
