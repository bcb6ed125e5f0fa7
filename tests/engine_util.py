"""Helpers for engine tests that compare against mlx-lm's own generation."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step

from mlxlocal.engine import SamplingParams


def prompt_of(n: int, shift: int = 0) -> list[int]:
    return [(i * 37 + 11 + shift * 101) % 300 for i in range(n)]


def run(eng, prompt: list[int], n: int, session=None):
    """Greedy, EOS ignored: (tokens, the final chunk's stats)."""
    chunks = list(eng.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True), session=session))
    return [c.token for c in chunks if c.token is not None], chunks[-1].stats


def mlx_lm_greedy(model_dir):
    """greedy(prompt, n): mlx-lm's generate_step on its own model and cache (the oracle)."""
    model = mlx_lm.load(str(model_dir))[0]

    def greedy(prompt: list[int], n: int) -> list[int]:
        steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1))
        return [int(t) for t, _ in steps]

    return greedy
