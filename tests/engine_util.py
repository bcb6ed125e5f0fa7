"""Helpers for engine tests that compare against mlx-lm's own generation."""

from __future__ import annotations

import threading

import mlx.core as mx
import mlx_lm
from conftest import wait_for
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


def idle(eng) -> dict:
    assert wait_for(lambda: eng.stats()["running"] + eng.stats()["waiting"] == 0)
    return eng.stats()


def assert_no_leak(eng) -> None:
    """Nothing held once the engine is idle and the prefix cache cleared: blocks, window
    blocks, state snapshots."""
    st = idle(eng)
    assert st["blocks_used"] == 0, st
    assert eng.call(lambda: eng.blocks.num_referenced) == 0
    eng.call(eng.blocks.clear_prefix_cache)
    st = eng.stats()
    assert st["blocks_free"] == st["blocks_total"] and st["blocks_cached"] == 0, st
    assert eng.call(lambda: len(set(eng.blocks.free))) == eng.num_blocks  # no duplicates
    if eng.runner.recurrent:  # every state snapshot went with its block
        assert eng.call(lambda: len(eng.runner.snapshots)) == 0
    if eng.windows is not None:  # and every window block
        assert eng.call(lambda: (eng.windows.num_referenced, len(eng.windows.kept))) == (0, 0)


def drain(handle, timeout: float = 30.0):
    """Consume a handle (or its started iterator) on another thread: (chunks, error).
    Fails the test if it hangs."""
    out: dict = {"chunks": [], "error": None}

    def run():
        try:
            for chunk in handle:
                out["chunks"].append(chunk)
        except BaseException as e:  # noqa: BLE001 - the error is what the test looks at
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"request still waiting after {timeout} s"
    return out["chunks"], out["error"]


def tokens(chunks) -> list[int]:
    return [c.token for c in chunks if c.token is not None]
