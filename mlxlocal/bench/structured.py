"""Structured output speed: decode tok/s with a JSON-schema grammar ÷ without it.

The same engine and prompts, constrained and free runs alternating, at batch 1 and 8 (or
the given batches). Both decode greedily; free runs ignore EOS and generate -g tokens,
constrained ones stop where the document is complete (at most -g). Decode tok/s is per
stream (tokens after the first ÷ time from first to last token), summed over the batch.
Tokens the grammar forced (fed in one forward when a request runs alone) are counted
apart, since they cost no step of their own.
"""

from __future__ import annotations

import statistics
from typing import Any

from mlxlocal.bench.common import log, median, random_prompt, run_streams


def _decode_tps(streams) -> float | None:
    rates = [s.decode_tps for s in streams]
    return sum(rates) if all(r is not None for r in rates) else None


def structured_bench(loaded, grammar, *, prompt_tokens: int, gen_tokens: int, batches: tuple[int, ...] = (1, 8),
                     repeats: int = 3, warmup: int = 1) -> dict[str, Any]:
    from mlxlocal.engine import SamplingParams, open_engine

    mc = loaded.model_config
    vocab = mc.vocab_size if mc else loaded.config.get("vocab_size", 32000)
    top = max(batches)
    engine = open_engine(loaded, prefix_cache=False, max_num_seqs=top,
                         kv_tokens=top * (prompt_tokens + gen_tokens + 32))
    free = SamplingParams(max_tokens=gen_tokens, ignore_eos=True)
    constrained = SamplingParams(max_tokens=gen_tokens, grammar=grammar)
    rows = []
    try:
        for b in batches:
            prompts = [random_prompt(prompt_tokens, vocab, seed=2000 + i) for i in range(b)]
            for w in range(warmup):
                log(f"batch {b}: warm-up {w + 1}/{warmup}")
                run_streams(engine, prompts, free)
                run_streams(engine, prompts, constrained)
            runs: dict[str, list] = {"free": [], "constrained": []}
            for r in range(repeats):
                log(f"batch {b}: repeat {r + 1}/{repeats}")
                for kind, params in (("free", free), ("constrained", constrained)):
                    streams = run_streams(engine, prompts, params)
                    runs[kind].append(dict(
                        decode_tps=_decode_tps(streams),
                        tokens=sum(len(s.times) for s in streams),
                        forced=sum(s.stats.forced_tokens for s in streams),
                        complete=sum(bool(s.stats.grammar_complete) for s in streams),
                    ))
            free_tps = median([x["decode_tps"] for x in runs["free"]])
            cons_tps = median([x["decode_tps"] for x in runs["constrained"]])
            cons = runs["constrained"]
            rows.append(dict(
                batch=b, free_decode_tps=free_tps, constrained_decode_tps=cons_tps,
                ratio=cons_tps / free_tps if free_tps else None,
                constrained_tokens=statistics.fmean(x["tokens"] for x in cons) / b,
                forced_share=sum(x["forced"] for x in cons) / max(sum(x["tokens"] for x in cons), 1),
                complete_share=sum(x["complete"] for x in cons) / (b * repeats),
                runs=runs,
            ))
    finally:
        engine.shutdown()
    return dict(prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, repeats=repeats, warmup=warmup,
                grammar=grammar.param, batches=rows)
