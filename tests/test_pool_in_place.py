"""The KV pools are written in place: no step copies a pool (engine/paged.py: _submit).

MLX updates an array in place only when nothing else holds it; a forward still in flight
holds the pools it reads, so a write submitted before it ends copies the whole pool. A copy
shows as a peak of memory one pool part above what the engine holds.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from engine_util import prompt_of

from mlxlocal.engine import SamplingParams, SpeculativeConfig, open_engine
from mlxlocal.source.loader import load_from_dir

BLOCKS = 8192  # 16 MiB per pool part of the tiny models: a copy stands out


def excess_peak(eng, prompts: list[list[int]], n: int = 48) -> tuple[int, int]:
    """(peak memory above what was held before, the largest pool part), over one batch."""
    def run():
        handles = [eng.submit(p, SamplingParams(max_tokens=n, ignore_eos=True)) for p in prompts]
        return [[c.token for c in h if c.token is not None] for h in handles]

    run()  # warm: every transient buffer size seen once, in MLX's cache
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    out = run()
    assert all(len(t) == n for t in out)
    part = max(a.nbytes for a in eng.call(eng.pools.state))
    return mx.get_peak_memory() - base, part


@pytest.fixture(scope="module")
def models(tiny_models, gemma_model):
    return {"native": load_from_dir(tiny_models["qwen3"]), "mlx-lm": load_from_dir(gemma_model)}


@pytest.mark.parametrize("path", ["native", "mlx-lm"])
def test_batched_decode_and_prefill_write_the_pools_in_place(models, path):
    eng = open_engine(models[path], kv_blocks=BLOCKS, prefix_cache=False, max_num_seqs=8)
    try:
        # Eight prompts: prefill chunks beside decode steps, then an 8-sequence decode batch.
        excess, part = excess_peak(eng, [prompt_of(40 + 9 * i, shift=i) for i in range(8)])
    finally:
        eng.shutdown()
    assert excess < part // 2, f"peak {excess / 2**20:.1f} MiB above the pools: a pool was copied"


def test_speculative_steps_write_both_pools_in_place(models):
    target = models["native"]
    eng = open_engine(target, kv_blocks=BLOCKS, prefix_cache=False, max_num_seqs=4,
                      speculative=SpeculativeConfig("draft", draft=target))
    try:
        excess, part = excess_peak(eng, [prompt_of(30 + 5 * i, shift=i) for i in range(4)])
    finally:
        eng.shutdown()
    assert excess < part // 2, f"peak {excess / 2**20:.1f} MiB above the pools: a pool was copied"


def test_a_first_token_goes_out_before_the_next_forward_is_submitted(models):
    """The first token is handed out before the decode after it is submitted: a submit may
    block until most of that forward has run (MLX's CPU backend), which would add a whole
    forward to the time to first token. Later tokens still go out while the next runs."""
    eng = open_engine(models["native"], kv_blocks=256, prefix_cache=False)
    seen: list[tuple[int, bool]] = []  # per forward submitted: (tokens out, first one out)
    real = type(eng)._submit

    def submit(arrays):
        for seq in eng.scheduler.running:
            seen.append((len(seq.tokens) - len(seq.prompt), bool(seq.out.t_first)))
        real(eng, arrays)

    eng._submit = submit
    try:
        chunks = eng.generate(prompt_of(40), SamplingParams(max_tokens=4, ignore_eos=True))
        out = [c.token for c in chunks if c.token is not None]
    finally:
        eng.shutdown()
    assert len(out) == 4
    assert seen[0] == (0, False)  # the prompt's forward
    assert seen[1] == (1, True)  # the first decode: the first token already out
    assert seen[2] == (1, True)  # the next: submitted before the second token is taken


def test_an_engine_shut_down_gives_its_memory_back(tiny_models):
    """An engine is freed whole once shut down and dropped (weights, pools), engine after
    engine: as a server unloading idle models needs. Objects frozen out of the collector's
    scans while it ran (gc.freeze at its start) are unfrozen at shutdown, else its cycles
    would never be collected."""
    import gc

    def once():
        eng = open_engine(load_from_dir(tiny_models["qwen3"]), kv_blocks=512)
        chunks = eng.generate(prompt_of(20), SamplingParams(max_tokens=2, ignore_eos=True))
        out = [c.token for c in chunks if c.token is not None]
        eng.shutdown()
        assert len(out) == 2

    once()  # MLX's caches and compiled kernels, once
    gc.collect()
    mx.synchronize()
    base = mx.get_active_memory()
    for _ in range(3):
        once()
        gc.collect()
        mx.synchronize()
    assert mx.get_active_memory() - base < 1 << 20, "a shut-down engine's arrays are still alive"
