"""Time a decode batch's sampling: per request (Sampler, one call per row) vs sample_batch.

  python scripts/bench_sampling.py [--vocab 32000] [--steps 200] [--rounds 5] [--json]

Each case runs --steps sampling steps on fixed random logits [B, V] (the model is not run),
building the step's lazy graph and evaluating it as the engine does; old and new alternate
within one process, and the median over --rounds of the per-step time is reported, in all
and for building the graph alone (host time, which the engine overlaps with the forward).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx

from mlxlocal.engine.paged import PagedEngine
from mlxlocal.engine.sampling import Sampler, sample_batch
from mlxlocal.engine.types import SamplingParams

CASES = {
    "greedy": lambda i: SamplingParams(),
    "t0.7/top_p0.9": lambda i: SamplingParams(temperature=0.7, top_p=0.9, seed=i),
    "mixed": lambda i: [SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9, seed=i),
                        SamplingParams(temperature=1.0, seed=i, logprobs=5),
                        SamplingParams(temperature=0.8, top_k=40, frequency_penalty=0.5, seed=i)][i % 4],
}


def per_request(samplers, logits, histories):
    out = []
    for i, s in enumerate(samplers):
        token, logprobs = s(logits[i : i + 1], histories[i], None)
        out += [token] + PagedEngine._logprob_arrays(_Seq(s.params), token, logprobs)
    return out


def batched(samplers, logits, histories):
    tokens, logprobs = sample_batch(samplers, logits, histories, [None] * len(samplers))
    return mx.split(tokens, len(samplers)) + [a for row in logprobs for a in row]


class _Seq:  # what _logprob_arrays reads of a Sequence
    def __init__(self, params):
        self.params = params


def run(fn, make, b, vocab, steps, logits) -> tuple[float, float]:
    """(seconds per step building the lazy graph, seconds per step in all)."""
    samplers = [Sampler(make(i)) for i in range(b)]
    histories = [[1, 2, 3] for _ in range(b)]
    build = 0.0
    t0 = time.perf_counter()
    for step in range(steps):
        t1 = time.perf_counter()
        out = fn(samplers, logits[step % len(logits)], histories)
        build += time.perf_counter() - t1
        mx.eval(out)
        del out  # freeing the step's buffers is not building the next graph
    return build / steps, (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    results = []
    for b in [int(x) for x in args.batch.split(",")]:
        logits = [mx.random.normal((b, args.vocab), key=mx.random.key(k)) * 3 for k in range(4)]
        mx.eval(logits)
        for name, make in CASES.items():
            times = {"per_request": [], "batched": []}
            fns = [("per_request", per_request), ("batched", batched)]
            run(per_request, make, b, args.vocab, 10, logits)  # warm-up (and mx.compile traces)
            run(batched, make, b, args.vocab, 10, logits)
            for r in range(args.rounds):
                for label, fn in fns if r % 2 == 0 else fns[::-1]:
                    times[label].append(run(fn, make, b, args.vocab, args.steps, logits))
            (old_build, old), (new_build, new) = (
                [statistics.median(t[j] for t in times[k]) * 1e3 for j in (0, 1)]
                for k in ("per_request", "batched"))
            results.append(dict(batch=b, case=name, per_request_ms=round(old, 3), batched_ms=round(new, 3),
                                per_request_build_ms=round(old_build, 3), batched_build_ms=round(new_build, 3)))
            if not args.json:
                print(f"B={b:<3} {name:<14} per-request {old:8.3f} ms/step (graph {old_build:6.3f})"
                      f"   batched {new:8.3f} ms/step (graph {new_build:6.3f})", flush=True)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
