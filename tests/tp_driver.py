"""Run by tests/test_tensor_parallel.py under `mlx.launch -n N`: rank 0 drives a tensor-parallel
engine and checks it against the same model loaded whole (tp=1) in the same process; the other
ranks follow it (engine/parallel.py). Prints one JSON line per model on rank 0.

  python tests/tp_driver.py MODEL_DIR [MODEL_DIR ...]
"""

from __future__ import annotations

import json
import os
import sys
import threading

from mlx.utils import tree_flatten

if os.environ.get("MLX_RANK", "0") != "0":
    from mlxlocal.engine.parallel import follower_main

    sys.exit(follower_main())

from mlxlocal.engine import SamplingParams, open_engine  # noqa: E402
from mlxlocal.source.loader import load  # noqa: E402


def prompt_of(n: int, shift: int = 0) -> list[int]:
    return [(i * 37 + 11 + shift * 101) % 300 for i in range(n)]


def greedy(eng, prompt: list[int], n: int) -> list[int]:
    chunks = eng.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
    return [c.token for c in chunks if c.token is not None]


def weight_bytes(loaded) -> int:
    return sum(v.nbytes for _, v in tree_flatten(loaded.model.parameters()))


def check(path: str) -> dict:
    sharded, whole = load(path), load(path, tp=1)
    tp = open_engine(sharded, block_size=16, max_num_seqs=8)
    # A second engine on the same sharded model: the followers keep pools per engine.
    tp2 = open_engine(sharded, block_size=16, max_num_seqs=8)
    ref = open_engine(whole, block_size=16, max_num_seqs=8)
    prompts = [prompt_of(20 + 7 * i, i) for i in range(8)]
    batch1 = greedy(tp, prompts[0], 24) == greedy(ref, prompts[0], 24)
    got: list = [None] * 8

    def run(i: int) -> None:
        got[i] = greedy(tp if i % 2 else tp2, prompts[i], 16)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    want = [greedy(ref, p, 16) for p in prompts]
    # A prompt extending an earlier one: served from the prefix cache, on every rank's pools.
    longer = prompts[3] + want[3][:5]
    before = tp.stats()["prefix_hit_tokens"]
    prefix = greedy(tp, longer, 8) == greedy(ref, longer, 8)  # prompts[3] ran on tp (odd)
    hits = tp.stats()["prefix_hit_tokens"] - before
    for e in (tp, tp2, ref):
        e.shutdown()
    return {"model": path, "batch1": batch1, "batch8": got == want, "prefix": prefix, "prefix_hit_tokens": hits,
            "bytes_rank0": weight_bytes(sharded), "bytes_whole": weight_bytes(whole),
            "heads": sharded.shard.plan.local_heads}


if __name__ == "__main__":
    for model in sys.argv[1:]:
        print(json.dumps(check(model)), flush=True)
