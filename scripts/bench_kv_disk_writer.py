"""Decode speed with the disk tier's writer busy, against the same engine without a tier.

    python scripts/bench_kv_disk_writer.py [MODEL] [-c 4] [-p 2048] [-g 128] [-n 3]

Each run: -c streams of -g tokens decode while, on another sequence, a new -p token prompt
has just been prefilled, so its blocks (and the streams' own) are being written down by the
tier's writer thread. Runs alternate with / without --kv-disk on one loaded model; medians.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import threading
import time

from mlxlocal.bench.common import random_prompt
from mlxlocal.engine import EngineConfig, PagedEngine, SamplingParams
from mlxlocal.source.loader import load


def one_run(loaded, disk: str | None, streams: int, p: int, g: int, seed: int) -> tuple[float, int]:
    """(aggregate decode tok/s of the streams after their first tokens, blocks written)."""
    cfg = EngineConfig(kv_tokens=(streams + 1) * (p + g + 64), max_num_seqs=streams + 1,
                       **({"kv_disk": 1 << 40, "kv_disk_dir": disk} if disk else {}))
    eng = PagedEngine(loaded, cfg)
    vocab = loaded.model_config.vocab_size if loaded.model_config else loaded.config["vocab_size"]
    short = SamplingParams(max_tokens=g, ignore_eos=True, temperature=0)
    # The streams start (prompts of 64 tokens), then a long prompt whose blocks the writer takes.
    handles = [eng.submit(random_prompt(64, vocab, seed + i), short) for i in range(streams)]
    firsts: list[float] = []
    lasts: list[float] = []
    counts: list[int] = []

    def drain(h):
        n, first = 0, None
        for c in h:
            if c.token is not None:
                n += 1
                first = first or time.perf_counter()
        firsts.append(first or 0.0)
        lasts.append(time.perf_counter())
        counts.append(n)
    threads = [threading.Thread(target=drain, args=(h,)) for h in handles]
    for t in threads:
        t.start()
    list(eng.generate(random_prompt(p, vocab, seed + 99), SamplingParams(max_tokens=1, ignore_eos=True)))
    for t in threads:
        t.join()
    written = eng.tier.store.stats()["writes"] if eng.tier is not None else 0
    eng.shutdown()
    return (sum(counts) - streams) / (max(lasts) - max(firsts)), written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="synthetic:tiny")
    ap.add_argument("-c", "--streams", type=int, default=4)
    ap.add_argument("-p", "--prompt-tokens", type=int, default=2048)
    ap.add_argument("-g", "--gen-tokens", type=int, default=128)
    ap.add_argument("-n", "--repeats", type=int, default=3)
    args = ap.parse_args()
    loaded = load(args.model)
    rates: dict[str, list[float]] = {"off": [], "on": []}
    one_run(loaded, None, args.streams, args.prompt_tokens, args.gen_tokens, 0)  # warm-up
    for r in range(args.repeats):
        for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
            root = tempfile.mkdtemp(prefix="mlxlocal-writer-") if mode == "on" else None
            try:
                rate, written = one_run(loaded, root, args.streams, args.prompt_tokens, args.gen_tokens,
                                        1000 * (r + 1))
            finally:
                if root:
                    shutil.rmtree(root, ignore_errors=True)
            rates[mode].append(rate)
            print(f"repeat {r + 1} {mode:>3}: {rate:7.1f} tok/s" + (f" ({written} blocks written)" if root else ""))
    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    print(f"decode, {args.streams} streams: without the tier {off:.1f} tok/s, with its writer busy "
          f"{on:.1f} tok/s (x{on / off:.3f}); medians of {args.repeats}")


if __name__ == "__main__":
    main()
