"""Per-request sampling with its own RNG key, so a request samples the same alone or batched.

The logits go through, in order:
1. repetition_penalty (mlx-lm's: multiplicative, over the last 20 tokens, prompt included);
2. frequency_penalty / presence_penalty (OpenAI's: additive, over the generated tokens only);
3. logit_bias (added as given);
then log-softmax (the logprobs reported to the caller, so they show the effect of 1-3),
then greedy argmax (temperature 0), or top-p, min-p, top-k and temperature as mlx-lm does.
"""

from __future__ import annotations

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
        self.key = mx.random.key(int(seed) % 2**63)
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

    def __call__(self, logits: mx.array, history: list[int], pending: mx.array | None = None
                 ) -> tuple[mx.array, mx.array]:
        """logits [1, V] -> (token id [1], logprobs [1, V] before filtering), both lazy.

        `history` is prompt + generated so far (it only grows); `pending` is the token after
        it when its value is not known yet (pipelined steps).
        """
        p = self.params
        logprobs = self.adjust(logits, history, pending)
        logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
        if p.temperature < MIN_TEMPERATURE:
            return mx.argmax(logprobs, axis=-1), logprobs
        full = logprobs
        # Same filter order as mlx-lm's make_sampler.
        if 0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if p.min_p != 0.0:
            logprobs = apply_min_p(logprobs, p.min_p, 1)
        if 0 < p.top_k < logprobs.shape[-1]:  # k >= vocab keeps everything
            logprobs = apply_top_k(logprobs, p.top_k)
        self.key, sub = mx.random.split(self.key)
        return mx.random.categorical(logprobs * (1.0 / p.temperature), key=sub), full

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
