"""What one cache edit costs next to what it saves: apply_edit timed against a prefill.

  PYTHONPATH=. .venv/bin/python scripts/akv_edit_cost.py [--model SPEC] [--contexts 1024,4096]

For each context length: a session holds that many tokens; the next turn drops a span of
a quarter of them starting at 10% in (an old tool output) and appends 32 new tokens, as
drop alone, drop + reposition of everything after the gap, and "text engineering" (the
span deleted from the prompt, so the session recomputes everything after it). Reported:
the turn's time to first token (edit + prefill of the new tokens, or the recompute), the
edit's own time (engine.edits.apply_edit, measured inside the engine), and the tokens the
next decode attends. Medians of --repeats alternating runs. CPU numbers are not Mac
numbers: the edit is a memory copy (plus a rotation of moved keys), bandwidth-bound.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from mlxlocal.engine import CacheEdit, EngineConfig, PagedEngine, SamplingParams
from mlxlocal.engine import edits as cache_edits
from mlxlocal.source.loader import load


def turn(eng, first: list[int], second: list[int], edits, repeats: int) -> dict:
    ttft, edit_s, attended = [], [], 0
    timed: list[float] = []
    real = cache_edits.apply_edit

    def timed_apply(*a, **k):
        t = time.perf_counter()
        out = real(*a, **k)
        timed.append(time.perf_counter() - t)
        return out

    cache_edits.apply_edit = timed_apply
    try:
        for _ in range(repeats):
            s = eng.new_session()
            list(eng.generate(first, SamplingParams(max_tokens=1, ignore_eos=True), session=s))
            timed.clear()
            chunks = list(eng.generate(second, SamplingParams(max_tokens=2, ignore_eos=True), session=s, edits=edits))
            ttft.append(chunks[-1].stats.ttft_s)
            edit_s.append(sum(timed))
            attended = s.cached_len
            s.reset()
    finally:
        cache_edits.apply_edit = real
    return {"ttft_ms": 1e3 * statistics.median(ttft), "edit_ms": 1e3 * statistics.median(edit_s),
            "attended": attended}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="synthetic:tiny:context=20000")
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    loaded = load(args.model)
    rows = []
    if not args.json:
        print(f"model {args.model}; drop of a quarter of the context at 10%; 32 new tokens; medians of {args.repeats}")
        print(f"{'context':>8} {'mode':<18} {'TTFT ms':>9} {'edit ms':>9} {'attended':>9}", flush=True)
    for n in (int(x) for x in args.contexts.split(",")):
        eng = PagedEngine(loaded, EngineConfig(kv_tokens=2 * n + 256, prefix_cache=False))
        try:
            # Random ids: a periodic prompt would let text engineering's shortened prompt match
            # the session's cache far past the cut.
            rng = random.Random(n)
            vocab = min(eng.vocab_size or 1000, 30000)
            first = [rng.randrange(vocab) for _ in range(n)]
            new = [rng.randrange(vocab) for _ in range(32)]
            a, b = n // 10, n // 10 + n // 4
            # The session computed `first` and sampled one token it never fed: the next prompt
            # starts with first + that token, so find it from a plain turn.
            s = eng.new_session()
            reply = [c.token for c in eng.generate(first, SamplingParams(max_tokens=1, ignore_eos=True), session=s)
                     if c.token is not None]
            s.reset()
            held = first + reply
            second = held + new
            modes = {
                "standard": (second, None),
                "drop": (second, [CacheEdit(at=len(held), drop=((a, b),))]),
                "drop+reposition": (second, [CacheEdit(at=len(held), drop=((a, b),),
                                                       reposition=((b, len(held)),), close_tail=True)]),
                "text engineering": (held[:a] + held[b:] + new, None),
            }
            for mode, (prompt, edits) in modes.items():
                r = turn(eng, first, prompt, edits, args.repeats)
                rows.append({"context": n, "mode": mode, **r})
                if not args.json:  # as they come: a long run shows its rows early
                    print(f"{n:>8} {mode:<18} {r['ttft_ms']:>9.1f} {r['edit_ms']:>9.1f} {r['attended']:>9}", flush=True)
        finally:
            eng.shutdown()
    if args.json:
        print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
