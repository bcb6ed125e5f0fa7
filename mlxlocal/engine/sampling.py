"""Sampling with one RNG key per request, so a request samples the same alone or batched.

`Sampler` samples one request; `sample_batch` samples a whole decode batch in one go and
picks exactly the tokens (and logprobs) the per-request Samplers would, bit for bit, with
each request's key advancing as its Sampler's does (tests/test_sampling.py checks it). That
rests on MLX's categorical drawing a single row by inverse CDF (MLX >= 0.32.1), which
`_draw` repeats per row; were MLX to change it, those tests fail.

The logits go through, in order:
1. repetition_penalty (mlx-lm's: multiplicative, over the last 20 tokens, prompt included);
2. frequency_penalty / presence_penalty (OpenAI's: additive, over the generated tokens only);
3. logit_bias (added as given);
then log-softmax (the logprobs reported to the caller, so they show the effect of 1-3),
4. a grammar's mask, for requests that have one: disallowed tokens to -inf and the rest
   renormalised (the reported logprobs stay the model's own, before the mask),
then greedy argmax (temperature 0), or top-p, min-p, top-k and temperature as mlx-lm does.

Numerics: the ids drawn are always in [0, V), and a row whose adjusted logits are not finite
(NaN or +inf anywhere, or all -inf: its log-sum-exp is not finite, which the engine reads
back from `Sampler.lse` with the token) ends with NonFiniteLogitsError instead of feeding a
meaningless token on. 1/T scales the logprobs in float32: in float16 it overflows.
"""

from __future__ import annotations

import math
import random

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_repetition_penalty

from mlxlocal.engine.types import SamplingParams

# Below this temperature sampling is argmax in all but name, and 1/T (or logprob * 1/T)
# can overflow float32 into inf/NaN, so such requests are sampled greedily.
MIN_TEMPERATURE = 1e-5


class Sampler:
    def __init__(self, params: SamplingParams, prompt_len: int | None = None):
        """`prompt_len`: how many leading tokens of the history are the prompt (not counted
        by the frequency/presence penalties); None takes the history of the first call.
        """
        self.params = params
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        # Validated seeds are in [0, 2**63); the modulo keeps construction from raising anyway.
        # The key is row `_row` of `_keys`: sample_batch advances a batch's keys with one
        # split and leaves each Sampler pointing at its row, so no per-request slicing.
        self._keys, self._row = mx.random.key(int(seed) % 2**63).reshape(1, 2), 0
        self.penalty = (
            make_repetition_penalty(params.repetition_penalty)
            if params.repetition_penalty != 1.0 else None
        )
        self.prompt_len = prompt_len
        # Generated-token counts, updated from the history's new tail on each call, so a
        # step costs O(distinct generated tokens), never O(vocab) in Python.
        self.counts: dict[int, int] = {}
        self.counted = 0
        self._bias: tuple[int, mx.array, mx.array] | None = None  # (vocab, ids, values)
        # The last call's log-sum-exp of the adjusted logits, lazy: (lse [n, 1], this request's
        # row). Not finite: the logits it sampled from were not, and its token means nothing.
        # (Read back as is: an isfinite op would cost more on the device than the read.)
        self.lse: tuple[mx.array, int] | None = None

    @property
    def key(self) -> mx.array:
        return self._keys[self._row]

    @key.setter
    def key(self, key: mx.array) -> None:
        self._keys, self._row = key.reshape(1, 2), 0

    @property
    def adjusts(self) -> bool:
        """Whether adjust() changes the logits (penalties or logit_bias)."""
        p = self.params
        return bool(self.penalty is not None or p.frequency_penalty or p.presence_penalty or p.logit_bias)

    def __call__(self, logits: mx.array, history: list[int], pending: mx.array | None = None,
                 allowed: mx.array | None = None) -> tuple[mx.array, mx.array]:
        """logits [1, V] -> (token id [1], logprobs [1, V] before filtering), both lazy.

        `history` is prompt + generated so far (it only grows); `pending` is the token after
        it when its value is not known yet (pipelined steps); `allowed` [1, V] bool: the
        only tokens that may be picked (a grammar's mask).
        """
        p = self.params
        logprobs = self.adjust(logits, history, pending)
        lse = mx.logsumexp(logprobs, axis=-1, keepdims=True)
        self.lse = (lse, 0)
        full = logprobs = logprobs - lse
        if allowed is not None:
            logprobs = mask_logprobs(logprobs, allowed)
        if p.temperature < MIN_TEMPERATURE:
            return mx.argmax(logprobs, axis=-1), full
        # Same filter order as mlx-lm's make_sampler.
        if 0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if p.min_p != 0.0:
            logprobs = apply_min_p(logprobs, p.min_p, 1)
        if 0 < p.top_k < logprobs.shape[-1]:  # k >= vocab keeps everything
            logprobs = apply_top_k(logprobs, p.top_k)
        self.key, sub = mx.random.split(self.key)
        scaled = logprobs.astype(mx.float32) * (1.0 / p.temperature)
        # categorical's draw lands past the last id on NaN weights: kept in the vocabulary.
        return mx.minimum(mx.random.categorical(scaled, key=sub), logprobs.shape[-1] - 1), full

    def adjust(self, logits: mx.array, history: list[int], pending: mx.array | None = None) -> mx.array:
        """The logits after repetition penalty, frequency/presence penalties and logit_bias:
        every engine applies these here, before its own sampling."""
        p = self.params
        if self.prompt_len is None:
            self.prompt_len = len(history)
        if self.penalty is not None:
            recent = mx.array(history[-20:], mx.uint32)
            if pending is not None:
                recent = mx.concatenate([recent, pending.reshape(1).astype(mx.uint32)])[-20:]
            logits = self.penalty(recent, logits)
        if p.frequency_penalty or p.presence_penalty:
            logits = self._count_penalties(logits, history, pending)
        if p.logit_bias:
            logits = self._apply_bias(logits)
        return logits

    def _count_penalties(self, logits: mx.array, history: list[int], pending: mx.array | None) -> mx.array:
        p = self.params
        start = self.prompt_len + self.counted
        for i in range(start, len(history)):
            self.counts[history[i]] = self.counts.get(history[i], 0) + 1
        self.counted += max(0, len(history) - start)
        vocab = logits.shape[-1]
        seen = [t for t in self.counts if 0 <= t < vocab]
        ids = mx.array(seen, mx.uint32)
        values = mx.array([p.frequency_penalty * self.counts[t] + p.presence_penalty for t in seen], mx.float32)
        if pending is not None:
            # Its value is not known on the host: its penalty is worked out lazily, the
            # presence part only if the known counts have not charged it already.
            tok = pending.reshape(1).astype(mx.uint32)
            new = mx.logical_not(mx.any(ids == tok)) if seen else mx.array(True)
            extra = p.frequency_penalty + p.presence_penalty * new.astype(mx.float32)
            ids = mx.concatenate([ids, tok])
            values = mx.concatenate([values, extra.reshape(1)])
        if ids.size == 0:
            return logits
        # Scatter-add: a repeated id (pending already seen) gets both of its amounts.
        return logits.at[:, ids].subtract(values.astype(logits.dtype))

    def _apply_bias(self, logits: mx.array) -> mx.array:
        vocab = logits.shape[-1]
        if self._bias is None or self._bias[0] != vocab:
            # Ids past the vocabulary (EngineBase.validate rejects them) are dropped, not indexed.
            items = [(t, v) for t, v in self.params.logit_bias.items() if int(t) < vocab]
            self._bias = (vocab, mx.array([int(t) for t, _ in items], mx.uint32),
                          mx.array([float(v) for _, v in items], mx.float32))
        _, ids, values = self._bias
        if ids.size == 0:
            return logits
        return logits.at[:, ids].add(values.astype(logits.dtype))


# Batched sampling ---------------------------------------------------------------------
# Per-request samplers draw with mx.random.categorical on [1, V] logits, which MLX does by
# inverse CDF with one uniform per draw; _draw does the same per row, each row with its own
# key, so the tokens match exactly.
_split_rows = mx.vmap(mx.random.split)
_uniform_rows = mx.vmap(lambda key: mx.random.uniform(shape=(1,), key=key))


@mx.compile  # bit ops and exactly rounded arithmetic: the same bits compiled, ~30 us less tracing
def _advance_keys(keys: mx.array) -> tuple[mx.array, mx.array]:
    """keys [n, 2] -> (next keys [n, 2], uniforms [n, 1]): Sampler's split, then its draw's
    uniform from the second half, row by row."""
    split = _split_rows(keys)
    return split[:, 0], _uniform_rows(split[:, 1])


def sample_batch(samplers: list[Sampler], logits: mx.array, histories: list[list[int]],
                 pendings: list[mx.array | None], allowed: tuple[list[int], mx.array] | None = None
                 ) -> tuple[mx.array, list[list[mx.array]]]:
    """logits [B, V] -> (token ids [B], per row [chosen logprob, top ids, top logprobs] as
    the request asked: [] for none, [chosen] for logprobs=0), all lazy.

    `allowed`: (rows, mask [len(rows), V] bool), the grammar masks of the rows that have one.
    Row i gets the token samplers[i](logits[i:i+1], histories[i], pendings[i], its mask)
    would give, and its key advances the same way. Only penalties and logit_bias cost per-row ops;
    greedy and plain-temperature batches take a fixed number of ops whatever B is.
    Each Sampler's key is updated only once everything is built, so a call that raises
    leaves them as they were (the caller may then sample the rows one by one).
    """
    b, vocab = logits.shape
    adjusted = {}
    for i, s in enumerate(samplers):
        if s.prompt_len is None:
            s.prompt_len = len(histories[i])
        if s.adjusts:
            adjusted[i] = s.adjust(logits[i : i + 1], histories[i], pendings[i])
    if adjusted:
        logits = _replace_rows(logits, list(adjusted), mx.concatenate(list(adjusted.values())))
    lse = mx.logsumexp(logits, axis=-1, keepdims=True)
    logprobs = chosen = logits - lse
    if allowed is not None:
        rows, mask = allowed
        chosen = _on_rows(logprobs, rows, lambda r: mask_logprobs(r, mask))

    drawn = [i for i, s in enumerate(samplers) if s.params.temperature >= MIN_TEMPERATURE]
    tokens = mx.argmax(chosen, axis=-1) if len(drawn) < b else None
    if drawn:
        params = [samplers[i].params for i in drawn]
        x = _filter(chosen if len(drawn) == b else chosen[mx.array(drawn)], params, vocab)
        # In float32 as Sampler's product: 1/T overflows float16 (T < 1.5e-5).
        inv_t = mx.array([1.0 / p.temperature for p in params], mx.float32)
        keys, uniforms = _advance_keys(_stack_keys([samplers[i] for i in drawn]))
        sampled = _draw(_f32(x) * inv_t[:, None], uniforms)
        tokens = sampled if len(drawn) == b else _replace_rows(tokens, drawn, sampled)
    rows = _logprob_rows(samplers, logprobs, tokens)
    if drawn:
        for j, i in enumerate(drawn):
            samplers[i]._keys, samplers[i]._row = keys, j
    for i, s in enumerate(samplers):
        s.lse = (lse, i)
    return tokens, rows


def logprob_arrays(k: int | None, token: mx.array, logprobs: mx.array) -> list[mx.array]:
    """[chosen logprob, top ids, top logprobs] of one sampled token (logprobs [1, V]) when
    the request asked for k top logprobs: [] for None, [chosen] for 0."""
    if k is None:
        return []
    chosen = mx.take_along_axis(logprobs, token.reshape(1, 1), axis=-1)
    if k == 0:
        return [chosen]
    top = mx.argsort(-logprobs, axis=-1)[:, :k]
    return [chosen, top, mx.take_along_axis(logprobs, top, axis=-1)]


def mask_logprobs(logprobs: mx.array, allowed: mx.array) -> mx.array:
    """Log-probabilities over the allowed tokens only, renormalised (top-p and min-p read
    them as a distribution)."""
    x = mx.where(allowed, logprobs, -float("inf"))
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def _replace_rows(x: mx.array, rows: list[int], values: mx.array) -> mx.array:
    """x with x[rows[j]] = values[j]: one concatenate and one gather, whatever len(rows)."""
    n = x.shape[0]
    if len(rows) == n and rows == list(range(n)):
        return values
    source = dict(zip(rows, range(n, n + len(rows))))
    return mx.concatenate([x, values])[mx.array([source.get(i, i) for i in range(n)])]


def _on_rows(x: mx.array, rows: list[int], fn) -> mx.array:
    """fn applied to rows of x only (fn sees them stacked), the others kept."""
    if len(rows) == x.shape[0]:
        return fn(x)
    return _replace_rows(x, rows, fn(x[mx.array(rows)]))


def _filter(x: mx.array, params: list[SamplingParams], vocab: int) -> mx.array:
    """Sampler's top-p, min-p and top-k, in its order, each only on the rows that use it."""
    top_p = [j for j, p in enumerate(params) if 0 < p.top_p < 1.0]
    if top_p:
        # mlx-lm's own compiled filter with top_p as a column: the same ops as a scalar.
        values = mx.array([[params[j].top_p] for j in top_p], mx.float32)
        x = _on_rows(x, top_p, lambda r: apply_top_p(r, values))
    min_p = [j for j, p in enumerate(params) if p.min_p != 0.0]
    if min_p:
        log_min_p = mx.array([[math.log(params[j].min_p)] for j in min_p], mx.float32).astype(x.dtype)

        def keep_likely(r: mx.array) -> mx.array:  # apply_min_p with min_tokens_to_keep=1
            return mx.where(r < mx.max(r, axis=-1, keepdims=True) + log_min_p, -float("inf"), r)
        x = _on_rows(x, min_p, keep_likely)
    by_k: dict[int, list[int]] = {}
    for j, p in enumerate(params):
        if 0 < p.top_k < vocab:
            by_k.setdefault(p.top_k, []).append(j)
    for k, rows in by_k.items():
        # argpartition breaks ties its own way: one call per distinct k keeps it Sampler's.
        x = _on_rows(x, rows, lambda r, k=k: apply_top_k(r, k))
    return x


def _draw(x: mx.array, u: mx.array) -> mx.array:
    """mx.random.categorical's inverse-CDF draw per row: x [n, V] logits, u [n, 1] uniforms."""
    x = _f32(x)  # as MLX promotes it (float64 aside, which MLX does not run)
    m = mx.max(x, axis=-1, keepdims=True)
    # exp(x - m) is NaN when m is infinite; MLX then draws uniformly among the maxima.
    w = mx.where(mx.isinf(m), (x == m).astype(x.dtype), mx.exp(x - m))
    cdf = mx.cumsum(w, axis=-1, inclusive=False)
    target = u * mx.sum(w, axis=-1, keepdims=True)
    # searchsorted(cdf, target, "right") - 1 on a sorted cdf is a count; cdf[0] = 0 <= target
    # always, so it is the count past cdf[0], which is 0 (not 0 - 1 wrapped to 2**32 - 1, an
    # id past the vocabulary) on NaN weights.
    return (cdf[:, 1:] <= target).sum(axis=-1).astype(mx.uint32)


def _f32(x: mx.array) -> mx.array:
    return x if x.dtype == mx.float32 else x.astype(mx.float32)


def _stack_keys(samplers: list[Sampler]) -> mx.array:
    """The samplers' keys as [n, 2]: a steady batch's keys are last step's array as is,
    otherwise one gather per array they come from."""
    groups: dict[int, tuple[mx.array, list[int], list[int]]] = {}
    for pos, s in enumerate(samplers):
        group = groups.setdefault(id(s._keys), (s._keys, [], []))
        group[1].append(pos)
        group[2].append(s._row)
    parts, order = [], []
    for keys, positions, rows in groups.values():
        whole = rows == list(range(keys.shape[0]))
        parts.append(keys if whole else keys[mx.array(rows)])
        order += positions
    stacked = parts[0] if len(parts) == 1 else mx.concatenate(parts)
    if order != list(range(len(samplers))):
        where = {p: j for j, p in enumerate(order)}
        stacked = stacked[mx.array([where[p] for p in range(len(samplers))])]
    return stacked


def _logprob_rows(samplers: list[Sampler], logprobs: mx.array, tokens: mx.array) -> list[list[mx.array]]:
    """Chosen and top logprobs for the rows that asked: one gather and one argsort for all."""
    asked = [i for i, s in enumerate(samplers) if s.params.logprobs is not None]
    out: list[list[mx.array]] = [[] for _ in samplers]
    if not asked:
        return out
    if len(asked) < len(samplers):
        index = mx.array(asked)
        logprobs, tokens = logprobs[index], tokens[index]
    chosen = mx.split(mx.take_along_axis(logprobs, tokens.reshape(-1, 1), axis=-1), len(asked))
    k_max = max(samplers[i].params.logprobs for i in asked)
    if k_max:
        top = mx.argsort(-logprobs, axis=-1)[:, :k_max]
        ids = mx.split(top, len(asked))
        values = mx.split(mx.take_along_axis(logprobs, top, axis=-1), len(asked))
    for j, i in enumerate(asked):
        k = samplers[i].params.logprobs
        out[i] = [chosen[j]] if k == 0 else [chosen[j], ids[j][:, :k], values[j][:, :k]]
    return out
