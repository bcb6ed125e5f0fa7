"""Per-request sampling with its own RNG key, so a request samples the same alone or batched."""

from __future__ import annotations

import random

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_repetition_penalty

from mlxlocal.engine.types import SamplingParams


class Sampler:
    def __init__(self, params: SamplingParams):
        self.params = params
        seed = params.seed if params.seed is not None else random.getrandbits(63)
        self.key = mx.random.key(seed)
        self.penalty = (
            make_repetition_penalty(params.repetition_penalty)
            if params.repetition_penalty != 1.0 else None
        )

    def __call__(self, logits: mx.array, history: list[int], pending: mx.array | None = None
                 ) -> tuple[mx.array, mx.array]:
        """logits [1, V] -> (token id [1], logprobs [1, V] before filtering), both lazy.

        `pending` is the previous token when its value is not known yet (pipelined steps).
        """
        p = self.params
        if self.penalty is not None:
            recent = mx.array(history[-20:], mx.uint32)
            if pending is not None:
                recent = mx.concatenate([recent, pending.reshape(1).astype(mx.uint32)])[-20:]
            logits = self.penalty(recent, logits)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if p.temperature == 0:
            return mx.argmax(logprobs, axis=-1), logprobs
        full = logprobs
        # Same filter order as mlx-lm's make_sampler.
        if 0 < p.top_p < 1.0:
            logprobs = apply_top_p(logprobs, p.top_p)
        if p.min_p != 0.0:
            logprobs = apply_min_p(logprobs, p.min_p, 1)
        if p.top_k > 0:
            logprobs = apply_top_k(logprobs, p.top_k)
        self.key, sub = mx.random.split(self.key)
        return mx.random.categorical(logprobs * (1.0 / p.temperature), key=sub), full
