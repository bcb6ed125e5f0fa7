"""Sessions scenario: peak memory serving N concurrent chat sessions of ~P tokens each.

Each session: a first turn (a P-token prompt, G greedy tokens), then a second turn (the
first turn's prompt + reply + NEW_TURN_TOKENS new tokens) that reuses the session's cache.

- mlxlocal: one paged engine whose pool is sized for the sessions, one pinned Session per
  conversation; the first turns are submitted at once (continuous batching), the second
  turns one after another (so their TTFTs are comparable with mlx-lm's).
- mlx-lm: its own approach as mlx_lm.server / mlx_lm.chat keep it: one prompt cache per
  session (make_prompt_cache), each turn run through generate_step on that cache; first
  turns one after another (generate_step runs one sequence), all caches kept alive.

Memory: before each run, gc + mx.clear_cache, baseline = mx.get_active_memory() (the
weights of every loaded model and anything else alive), then mx.reset_peak_memory(); the
reported figure is peak - baseline, i.e. the memory the run itself adds on top of the
resident weights (K/V caches, pool, activations, scratch). Runs alternate A B A B.
"""

from __future__ import annotations

import gc
import threading
import time
from typing import Any

from mlxlocal.bench.common import log, median, random_prompt

NEW_TURN_TOKENS = 32  # new tokens in each session's second turn


def _baseline() -> int:
    import mlx.core as mx

    gc.collect()
    mx.clear_cache()
    base = int(mx.get_active_memory())
    mx.reset_peak_memory()
    return base


def _second_turn(first_prompt: list[int], reply: list[int], vocab: int, seed: int) -> list[int]:
    return first_prompt + reply + random_prompt(NEW_TURN_TOKENS, vocab, seed)


def _drain(handle, out: list) -> None:
    try:
        out.extend(c.token for c in handle if c.token is not None)
    except BaseException as e:  # re-raised by the caller
        out.append(e)


def run_ours(loaded, prompts: list[list[int]], gen_tokens: int, vocab: int) -> dict:
    import mlx.core as mx

    from mlxlocal.engine import SamplingParams, open_engine

    n, p = len(prompts), len(prompts[0])
    params = SamplingParams(max_tokens=gen_tokens, ignore_eos=True, temperature=0)
    base = _baseline()
    # Pool sized for every session's two turns (+ a block of slack each): allocated inside
    # the measured window, so the peak counts the whole pool, used or not.
    engine = open_engine(loaded, prefix_cache=False, max_num_seqs=n,
                         kv_tokens=n * (p + 2 * gen_tokens + NEW_TURN_TOKENS + 16))
    try:
        pool_bytes = engine.kv_pool.get("bytes")
        sessions = [engine.new_session() for _ in prompts]
        t0 = time.perf_counter()
        handles = [engine.submit(ids, params, session=s) for ids, s in zip(prompts, sessions)]
        replies: list[list[int]] = [[] for _ in prompts]
        threads = [threading.Thread(target=_drain, args=(h, out), daemon=True) for h, out in zip(handles, replies)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        first_s = time.perf_counter() - t0
        for out in replies:
            if out and isinstance(out[-1], BaseException):
                raise out[-1]
        ttft, cached = [], []
        for i, s in enumerate(sessions):
            ids = _second_turn(prompts[i], replies[i], vocab, seed=3000 + i)
            t1, first, stats = time.perf_counter(), None, None
            for ch in engine.generate(ids, params, session=s):
                if ch.token is not None and first is None:
                    first = time.perf_counter()
                if ch.stats is not None:
                    stats = ch.stats
            if first is None or stats is None:
                raise RuntimeError("the second turn's stream ended without a token or its stats")
            ttft.append(first - t1)
            cached.append(stats.cached_tokens)
        peak = int(mx.get_peak_memory())
    finally:
        engine.shutdown()
    del engine
    return dict(peak_memory_bytes=peak, baseline_bytes=base, peak_over_baseline_bytes=peak - base,
                kv_pool_bytes=pool_bytes, first_turns_s=first_s, second_turn_ttft_s=ttft,
                second_turn_cached_tokens=cached)


def run_mlx_lm(model, prompts: list[list[int]], gen_tokens: int, vocab: int) -> dict:
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    def greedy(x):
        return mx.argmax(x, axis=-1)

    base = _baseline()
    caches, replies = [], []
    t0 = time.perf_counter()
    for ids in prompts:
        cache = make_prompt_cache(model)
        replies.append([int(t) for t, _ in generate_step(mx.array(ids), model, prompt_cache=cache,
                                                         max_tokens=gen_tokens, sampler=greedy)])
        caches.append(cache)
    first_s = time.perf_counter() - t0
    ttft, cached = [], []
    for i, (ids0, cache) in enumerate(zip(prompts, caches)):
        ids = _second_turn(ids0, replies[i], vocab, seed=3000 + i)
        common = cache[0].offset  # prompt + reply minus the last token (never fed)
        t1, first = time.perf_counter(), None
        for _ in generate_step(mx.array(ids[common:]), model, prompt_cache=cache,
                               max_tokens=gen_tokens, sampler=greedy):
            first = first or time.perf_counter()
        if first is None:
            raise RuntimeError("mlx-lm's second turn generated no token")
        ttft.append(first - t1)
        cached.append(common)
    peak = int(mx.get_peak_memory())
    kv = sum(c.nbytes for cache in caches for c in cache)
    del caches
    return dict(peak_memory_bytes=peak, baseline_bytes=base, peak_over_baseline_bytes=peak - base,
                kv_cache_bytes=kv, first_turns_s=first_s, second_turn_ttft_s=ttft,
                second_turn_cached_tokens=cached)


def sessions_scenario(loaded, *, sessions: int, prompt_tokens: int, gen_tokens: int, repeats: int = 1,
                      warmup: int = 1, compare: str | None = None) -> dict:
    """Peak memory (over the resident baseline) and second-turn TTFT, ours vs mlx-lm's."""
    mc = loaded.model_config
    vocab = mc.vocab_size if mc else loaded.config["vocab_size"]
    context = mc.context_length if mc else int(loaded.config.get("max_position_embeddings", 4096))
    room = context - 2 * gen_tokens - NEW_TURN_TOKENS - 1
    note = None
    if prompt_tokens > room:
        note = (f"session prompt clipped from {prompt_tokens} to {room} tokens: context {context} "
                f"must hold prompt + {gen_tokens} + {NEW_TURN_TOKENS} + {gen_tokens}")
        log(f"note: {note}")
        prompt_tokens = room
    prompts = [random_prompt(prompt_tokens, vocab, seed=4000 + i) for i in range(sessions)]
    ref = None
    if compare == "mlx-lm":
        import mlx_lm

        log(f"loading {loaded.info.path} with mlx_lm.load ...")
        ref = mlx_lm.load(str(loaded.info.path))[0]  # the model; no tokenizer needed
    small = [q[:32] for q in prompts[:2]]
    for _ in range(warmup):
        run_ours(loaded, small, 2, vocab)
        if ref is not None:
            run_mlx_lm(ref, small, 2, vocab)
    runs: dict[str, list[dict]] = {"mlxlocal": []}
    if ref is not None:
        runs["mlx_lm"] = []
    order: list[str] = []
    for r in range(repeats):
        log(f"sessions repeat {r + 1}/{repeats}: {sessions} sessions x {prompt_tokens} tokens")
        runs["mlxlocal"].append(run_ours(loaded, prompts, gen_tokens, vocab))
        order.append("mlxlocal")
        if ref is not None:
            runs["mlx_lm"].append(run_mlx_lm(ref, prompts, gen_tokens, vocab))
            order.append("mlx-lm")
    summary: dict[str, Any] = {}
    for name, rs in runs.items():
        summary[name] = dict(
            peak_over_baseline_bytes=median([x["peak_over_baseline_bytes"] for x in rs]),
            peak_memory_bytes=median([x["peak_memory_bytes"] for x in rs]),
            baseline_bytes=median([x["baseline_bytes"] for x in rs]),
            second_turn_ttft_s=median([median(x["second_turn_ttft_s"]) for x in rs]),
            second_turn_cached_tokens=rs[0]["second_turn_cached_tokens"],
            first_turns_s=median([x["first_turns_s"] for x in rs]),
        )
    summary["mlxlocal"]["kv_pool_bytes"] = runs["mlxlocal"][0]["kv_pool_bytes"]
    ratios = None
    if ref is not None:
        summary["mlx_lm"]["kv_cache_bytes"] = runs["mlx_lm"][0]["kv_cache_bytes"]
        ours, theirs = summary["mlxlocal"], summary["mlx_lm"]
        ratios = dict(peak_over_baseline=_ratio(ours["peak_over_baseline_bytes"], theirs["peak_over_baseline_bytes"]),
                      second_turn_ttft=_ratio(ours["second_turn_ttft_s"], theirs["second_turn_ttft_s"]))
    return dict(sessions=sessions, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens,
                new_turn_tokens=NEW_TURN_TOKENS, context_length=context, clip_note=note, repeats=repeats,
                warmup=warmup, weight_bytes=loaded.info.weights.total_bytes,
                memory_note="peak - baseline; baseline = active memory before the run (weights of "
                            "every loaded model), after gc and mx.clear_cache",
                summary=summary, runs=runs, ratios=ratios, order=order)


def _ratio(a, b):
    return a / b if a is not None and b else None
