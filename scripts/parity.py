"""Parity table: mlxlocal vs mlx-lm on the same model directories.

For each model and prompt length: do greedy tokens match, and how far apart are the
logits? Works with any --model spec, e.g.

    python scripts/parity.py synthetic:tiny synthetic:tiny-llama ./my-model qwen3-0.6b
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import make_prompt_cache

from mlxlocal.engine import SamplingParams, open_engine
from mlxlocal.source.hub import resolve
from mlxlocal.source.loader import load_from_dir


def check(spec: str, lengths: list[int], n_tokens: int) -> list[dict]:
    path = resolve(spec).path
    ours, (ref, _) = load_from_dir(path), mlx_lm.load(str(path))
    engine = open_engine(ours)
    vocab = ours.model_config.vocab_size if ours.model_config else 1000
    rows = []
    for n in lengths:
        prompt = [(i * 37 + 11) % vocab for i in range(n)]
        x = mx.array(prompt)[None]
        diff = mx.abs(ours.model(x, ours.make_cache()) - ref(x, cache=make_prompt_cache(ref))).max().item()
        expected = [int(t) for t, _ in generate_step(mx.array(prompt), ref, max_tokens=n_tokens,
                                                     sampler=lambda z: mx.argmax(z, -1))]
        got = [c.token for c in engine.generate(prompt, SamplingParams(max_tokens=n_tokens, ignore_eos=True))
               if c.token is not None]
        same = sum(a == b for a, b in zip(got, expected))
        rows.append(dict(model=spec, family=ours.info.model_type, prompt=n, tokens_equal=f"{same}/{len(expected)}",
                         max_logit_diff=diff))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+")
    ap.add_argument("--lengths", default="1,7,33,120")
    ap.add_argument("--tokens", type=int, default=24)
    args = ap.parse_args()
    lengths = [int(v) for v in args.lengths.split(",")]
    print(f"{'model':32} {'family':8} {'prompt':>6} {'greedy':>8} {'max |dlogit|':>13}")
    for spec in args.models:
        for r in check(spec, lengths, args.tokens):
            print(f"{r['model']:32} {r['family']:8} {r['prompt']:>6} {r['tokens_equal']:>8} {r['max_logit_diff']:>13.2e}")


if __name__ == "__main__":
    main()
