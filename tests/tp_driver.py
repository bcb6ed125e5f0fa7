"""Run by tests/test_tensor_parallel.py under `mlx.launch -n N`: rank 0 drives a tensor-parallel
engine and checks it against the same model loaded whole (tp=1) in the same process; the other
ranks follow it (mlxlocal/distributed). Prints one JSON line per model on rank 0.

  python tests/tp_driver.py MODEL_DIR [MODEL_DIR ...]
"""

from __future__ import annotations

import json
import os
import sys
import threading

from mlx.utils import tree_flatten

if os.environ.get("MLX_RANK", "0") != "0":
    from mlxlocal.distributed.follower import follower_main

    sys.exit(follower_main())

from mlxlocal.engine import SamplingParams, SpeculativeConfig, open_engine  # noqa: E402
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
    extra = {}
    if "--features" in sys.argv:
        extra = features(sharded, whole, prompts)
    for arg in sys.argv:
        if arg.startswith("--disk="):
            extra.update(disk(sharded, whole, arg.removeprefix("--disk=")))
    return {**extra, "model": path, "batch1": batch1, "batch8": got == want, "prefix": prefix, "prefix_hit_tokens": hits,
            "bytes_rank0": weight_bytes(sharded), "bytes_whole": weight_bytes(whole),
            "heads": getattr(sharded.shard.plan, "local_heads", None)}


def features(sharded, whole, prompts) -> dict:
    """8-bit KV pools, prompt-lookup speculation (a verify forward of every position) and a draft
    model (the whole model: drafts run on rank 0 alone) under tensor parallelism."""
    out = {}
    for name, kw, ref_kw in (
        ("kv8", {"kv_bits": 8, "kv_group_size": 32}, {"kv_bits": 8, "kv_group_size": 32}),
        ("lookup", {"speculative": SpeculativeConfig(method="lookup")}, {}),
        ("draft", {"speculative": SpeculativeConfig(method="draft", draft=whole)}, {}),
    ):
        tp = open_engine(sharded, block_size=16, max_num_seqs=8, **kw)
        ref = open_engine(whole, block_size=16, max_num_seqs=8, **ref_kw)
        repetitive = prompts[1] * 3  # lookup finds matches
        out[name] = all(greedy(tp, p, 20) == greedy(ref, p, 20) for p in (prompts[0], repetitive))
        if name != "kv8":
            out[name + "_accepted"] = tp.stats()["spec_accepted"]
        tp.shutdown()
        ref.shutdown()
    return out


def disk(sharded, whole, root: str) -> dict:
    """The disk tier in a cluster: an engine writes a prompt's blocks (each rank its part, in a
    store of its own), the next engine on the same stores reads them back and answers as the
    whole model; then rank 1's file is damaged and the next engine prefills instead."""
    from pathlib import Path

    from mlxlocal.engine import SamplingParams

    prompt = prompt_of(150, 5)
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=0)
    ref = open_engine(whole, block_size=16)
    chunks = [c for c in ref.generate(prompt, params) if c.token is not None]
    want, want_lps = [c.token for c in chunks], [c.logprob for c in chunks]
    ref.shutdown()
    worst = []  # per serve: the largest logprob difference from the whole model's

    def serve() -> tuple[list[int], int, dict]:
        eng = open_engine(sharded, block_size=16, kv_disk=64 << 20, kv_disk_dir=root)
        chunks = list(eng.generate(prompt, params))
        eng.tier.store.flush()
        stats = eng.stats()
        eng.shutdown()  # the other ranks' writers finish with their pools
        toks = [c for c in chunks if c.token is not None]
        worst.append(max(abs(c.logprob - w) for c, w in zip(toks, want_lps)))
        return [c.token for c in toks], chunks[-1].stats.disk_tokens, stats

    first, _, _ = serve()
    restored, disk_tokens, stats = serve()
    stores = {json.loads((d / "manifest.json").read_text()).get("shard"): d
              for d in Path(root).iterdir() if d.is_dir()}
    damaged = max(stores["1/2"].glob("*.kv"), key=lambda f: f.stat().st_size)
    damaged.write_bytes(damaged.read_bytes()[:-100])
    after, after_disk, after_stats = serve()
    healed, healed_disk, _ = serve()  # written again on both ranks by the prefill above
    tail = min(stores["1/2"].glob("*.kv"), key=lambda f: f.stat().st_size)  # the prompt's tail
    tail.write_bytes(tail.read_bytes()[:-10])
    tail_after, tail_disk, _ = serve()
    return {"tail_damaged_same": tail_after == want, "tail_damaged_disk_tokens": tail_disk,
            "logprob_error": max(worst),"disk_first": first == want, "disk_restored": restored == want, "disk_tokens": disk_tokens,
            "disk_hits": stats["disk_hit_blocks"], "disk_stores": sorted(stores),
            "damaged_same": after == want, "damaged_disk_tokens": after_disk,
            "damaged_removed": after_stats["disk_corrupt_removed"],
            "healed_same": healed == want, "healed_disk_tokens": healed_disk}


if __name__ == "__main__":
    for model in [a for a in sys.argv[1:] if not a.startswith("--")]:
        print(json.dumps(check(model)), flush=True)
