"""Decode tok/s: the whole model in one process vs pipeline stages with m micro-batches.

    mlx.launch --backend ring -n 2 --python .venv/bin/python scripts/bench_pipeline.py MODEL_DIR \
        [--rounds 3] [--batches 1,8] [--tokens 16]

Rank 0 runs both engines (the whole model: load(tp=1); the stages: load(pp=N)) on the same
greedy requests, alternating the order each round, checks they produce the same tokens and
prints medians: tok/s, and per forward rank 0's own stage time vs its wait for the rest of
the pipeline (the wait shrinks when micro-batches overlap across ranks).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mlxlocal.distributed.channel import world  # noqa: E402
from mlxlocal.distributed.follower import Follower  # noqa: E402
from mlxlocal.engine import SamplingParams, open_engine  # noqa: E402
from mlxlocal.source.loader import load  # noqa: E402


def prompts(b: int, shift: int) -> list[list[int]]:
    return [[(i * 37 + 11 + (j + shift) * 101) % 300 for i in range(16)] for j in range(b)]


def run(engine, b: int, shift: int, tokens: int) -> tuple[float, list]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    out: list = [None] * b

    def go(i: int) -> None:
        out[i] = [c.token for c in engine.generate(prompts(b, shift)[i], params) if c.token is not None]

    threads = [threading.Thread(target=go, args=(i,)) for i in range(b)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return b * tokens / (time.perf_counter() - t), out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--micro", default="1,2,4", help="micro-batch counts to compare")
    args = ap.parse_args()
    pp = world().size()
    opts = dict(block_size=16, max_num_seqs=8, prefix_cache=False)  # every round computes
    engines = {"whole": open_engine(load(args.model, tp=1), **opts), "pp": open_engine(load(args.model, pp=pp), **opts)}
    variants = [("whole", 1)] + [("pp", int(m)) for m in args.micro.split(",")]
    res: dict[str, dict[str, list[float]]] = {}
    for b in map(int, args.batches.split(",")):
        for r in range(args.rounds):
            outs = {}
            for name, m in variants if r % 2 == 0 else variants[::-1]:
                runner = engines[name].runner
                if name == "pp":
                    runner.micro_batches, runner.stage_seconds, runner.wait_seconds = m, 0.0, 0.0
                    f0 = runner.forwards
                tps, outs[name, m] = run(engines[name], b, r, args.tokens)
                row = res.setdefault(f"batch {b} {name}" + (f" m={m}" if name == "pp" else ""), {})
                row.setdefault("tok/s", []).append(tps)
                if name == "pp":
                    n = runner.forwards - f0
                    row.setdefault("stage ms", []).append(1000 * runner.stage_seconds / n)
                    row.setdefault("wait ms", []).append(1000 * runner.wait_seconds / n)
            if any(o != outs["whole", 1] for o in outs.values()):
                raise SystemExit("the stages' tokens differ from the whole model's")
    for key, row in res.items():
        print(f"{key:18s} " + "  ".join(f"{k} {statistics.median(v):7.1f}" for k, v in row.items())
              + f"   (tok/s runs: {', '.join(f'{x:.1f}' for x in row['tok/s'])})", flush=True)
    for e in engines.values():
        e.shutdown()


if __name__ == "__main__":
    if os.environ.get("MLX_RANK", "0") != "0":
        Follower(world()).serve()
    else:
        main()
