"""One rank of a pipeline-parallel check, started by mlx.launch (tests/test_pipeline_parallel.py).

argv: OUT_DIR PP N1 N8 MODEL_DIR...  Rank 0 loads each model over PP stages and, on its own, the whole
model (load(path, tp=1): the single-process path), runs the same greedy requests through
both engines (batch 1: N1 tokens, then 8 concurrent requests sharing a prefix: N8 tokens each, continuous
batching and the prefix cache) and writes one JSON line per model (and, for the first if N1 >= 8, one for a prompt-lookup speculative engine on the stages). The other ranks follow rank 0 and write
one JSON line when it releases them: their weight bytes per model and forwards run.
"""

from __future__ import annotations

import json
import os
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mlxlocal.distributed.channel import world  # noqa: E402
from mlxlocal.distributed.follower import Follower  # noqa: E402
from mlxlocal.distributed.tensor import weight_bytes  # noqa: E402
from mlxlocal.engine import SamplingParams, SpeculativeConfig, open_engine  # noqa: E402
from mlxlocal.source.loader import load  # noqa: E402

OUT = None  # this rank's lines, in a file of its own: mlx.launch's relay of stdout may cut lines


def emit(record: dict) -> None:
    with open(os.path.join(OUT, f"rank{os.environ.get('MLX_RANK', '0')}.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


class Recording(Follower):
    """A follower that also notes how many layers each engine's pools hold here."""

    pool_layers: dict = {}

    def _pools(self, msg) -> None:
        super()._pools(msg)
        self.pool_layers[msg.engine] = len(self.pools[msg.engine][1].k)


def follow() -> None:
    follower = Recording(world())
    forwards = follower.serve()
    emit({"rank": follower.group.rank(), "forwards": forwards,
                      "weight_bytes": {m: weight_bytes(r.model) for m, r in follower.runners.items()},
                      "layers": {m: [r.plan.start, r.plan.stop] for m, r in follower.runners.items()},
                      "pool_layers": sorted(set(follower.pool_layers.values()))})


def prompt_of(n: int, shift: int) -> list[int]:
    shared = [(i * 13 + 5) % 300 for i in range(24)]  # more than a block: the prefix cache reuses it
    return shared + [(i * 37 + 11 + shift * 101) % 300 for i in range(n)]


def generate(engine, prompt: list[int], n: int) -> list[int]:
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [c.token for c in engine.generate(prompt, params) if c.token is not None]


def batch(engine, prompts: list[list[int]], n: int) -> list[list[int]]:
    out: list = [None] * len(prompts)

    def go(i: int) -> None:
        out[i] = generate(engine, prompts[i], n)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def lead(pp: int, n1: int, n8: int, paths: list[str]) -> None:
    for path in paths:
        staged, whole = load(path, pp=pp), load(path, tp=1)
        engines = [open_engine(m, block_size=16, max_num_seqs=8) for m in (staged, whole)]
        prompts = [prompt_of(3 + 5 * i, i) for i in range(8)]
        one = [generate(e, prompts[0], n1) for e in engines]
        eight = [batch(e, prompts + [prompts[0]], n8) for e in engines]  # last one: a full prefix hit
        stats, runner = engines[0].stats(), engines[0].runner
        emit({
            "model": os.path.basename(path), "batch1": one, "batch8": eight,
            "weight_bytes": weight_bytes(staged.model), "whole_bytes": weight_bytes(whole.model),
            "layers": [staged.shard.plan.start, staged.shard.plan.stop], "model_id": staged.shard.model,
            "prefix_hit_tokens": stats.get("prefix_hit_tokens"), "forwards": runner.forwards,
            "micro_batches": runner.sent, "pool_layers": len(engines[0].pools.k),
        })
        for e in engines:
            e.shutdown()
        if path != paths[0] or n1 < 8:  # fewer tokens: nothing to draft from
            continue
        # Speculative verification feeds several tokens and wants every position's logits.
        spec = open_engine(staged, block_size=16, max_num_seqs=8, speculative=SpeculativeConfig("lookup"))
        emit({"lookup": generate(spec, prompts[0], n1), "spec_accepted": spec.stats()["spec_accepted"]})
        spec.shutdown()


if __name__ == "__main__":
    OUT = sys.argv.pop(1)
    if os.environ.get("MLX_RANK", "0") != "0":
        follow()
    else:
        lead(*map(int, sys.argv[1:4]), sys.argv[4:])
