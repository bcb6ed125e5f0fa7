"""Quantized KV pools (--kv-bits) against the model dtype: the table issue 18 asks for.

  PYTHONPATH=. .venv/bin/python scripts/kv_bits.py [--model SPEC] [--group-size N] [--tokens N]

For the model dtype, 8-bit and 4-bit K/V: memory per token (scales and biases included) and
÷ fp16; perplexity on the built-in text with the K/V stored as the engine stores them, and
its delta against the model dtype; blocks, tokens and --context-sized sequences that fit in
the same pool memory (--pool-memory); greedy agreement with mlx-lm over --tokens tokens (its
own model with QuantizedKVCache from the first token; fp: its plain cache), as the index of
the first divergent token (= --tokens: none); decode tok/s ÷ the model dtype's (medians of
--repeats alternating runs, one process). Rows are printed as they come. CPU numbers here
are not Mac numbers; on random weights perplexity is near log(vocab) either way.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import mlx.core as mx
import mlx_lm
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

from mlxlocal.cache import KVPools
from mlxlocal.engine import EngineConfig, PagedEngine, SamplingParams
from mlxlocal.engine.runner import make_runner
from mlxlocal.quant.quantize import perplexity
from mlxlocal.quant.text import BUILTIN_TEXT
from mlxlocal.source.loader import load

PRECISIONS = (None, 8, 4)
DEFAULT_MODEL = "tiny-hd64"


def load_model(spec: str, tmp: str):
    if spec != DEFAULT_MODEL:
        return load(spec)
    from mlxlocal.source.catalog import load_catalog
    from mlxlocal.source.synthetic.weights import write_model_dir

    preset = load_catalog().synthetic["tiny"]
    config = dict(preset.config, head_dim=64)
    return load(str(write_model_dir(Path(tmp) / "tiny-hd64", config, dtype="float16",
                                    chat_template=preset.chat_template)))


def name(bits: int | None) -> str:
    return "model dtype" if bits is None else f"{bits}-bit"


def mlx_lm_tokens(model, prompt: list[int], n: int, bits: int | None, group_size: int) -> list[int]:
    cache = [QuantizedKVCache(group_size, bits) for _ in make_prompt_cache(model)] if bits else None
    steps = generate_step(mx.array(prompt), model, max_tokens=n, sampler=lambda x: mx.argmax(x, axis=-1),
                          prompt_cache=cache)
    return [int(t) for t, _ in steps]


def ours(eng, prompt: list[int], n: int) -> tuple[list[int], float]:
    chunks = list(eng.generate(prompt, SamplingParams(max_tokens=n, ignore_eos=True)))
    return [c.token for c in chunks if c.token is not None], chunks[-1].stats.decode_tps


def first_divergence(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL, help=f"model spec; default {DEFAULT_MODEL}: synthetic:tiny's "
                    "shape with head_dim 64 (group 64 divides it) in float16, built in a temporary directory")
    ap.add_argument("--group-size", type=int, default=None, help="default: 64, or 32 if 64 does not divide head_dim")
    ap.add_argument("--tokens", type=int, default=64, help="greedy tokens compared with mlx-lm and timed")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=256, help="perplexity window")
    ap.add_argument("--pool-memory", type=int, default=64 << 20, help="bytes of the pools compared for capacity")
    ap.add_argument("--context", type=int, default=2048, help="tokens per sequence for the capacity column")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", action="store_true", help="one JSON object per row")
    args = ap.parse_args()

    tmp = tempfile.TemporaryDirectory()
    loaded = load_model(args.model, tmp.name)
    runner = make_runner(loaded)
    dims = {d for s in runner.shapes for d in (s.k_dim, s.v_dim)}
    gs = args.group_size or (64 if all(d % 64 == 0 for d in dims) else 32)
    vocab = loaded.model_config.vocab_size if loaded.model_config else 1000
    prompt = [(i * 7919 + 13) % vocab for i in range(args.prompt_tokens)]
    print(f"# {args.model}: {runner.dtype}, head dims {sorted(dims)}, group size {gs}, "
          f"{len(runner.shapes)} attention layers, {args.tokens} greedy tokens after {len(prompt)}", flush=True)

    ref_model = mlx_lm.load(str(loaded.info.path))[0]
    engines = {b: PagedEngine(loaded, EngineConfig(kv_memory=args.pool_memory, kv_bits=b, kv_group_size=gs,
                                                   max_num_seqs=1))
               for b in PRECISIONS}
    fp16 = KVPools.bytes_per_block(runner.shapes, 1, mx.float16)
    base_nll = None
    header = ("precision", "bytes/token", "÷fp16", "ppl", "Δnll", "blocks", "tokens", f"seqs@{args.context}",
              "mlx-lm agree", "fp agree")
    if not args.json:
        print(" | ".join(header), flush=True)
    rows = {}
    for b in PRECISIONS:
        eng = engines[b]
        per_tok = KVPools.bytes_per_block(runner.shapes, 1, runner.dtype, b, gs)
        ppl = perplexity(loaded, BUILTIN_TEXT, seq_len=args.seq_len, batch_size=4, kv_bits=b, kv_group_size=gs)
        base_nll = ppl.nll if b is None else base_nll
        got, _ = ours(eng, prompt, args.tokens)
        want = mlx_lm_tokens(ref_model, prompt, args.tokens, b, gs)
        fp_want = rows[None]["tokens"] if b is not None else got
        per_seq = -(-args.context // eng.config.block_size)
        row = dict(precision=name(b), bytes_per_token=per_tok, vs_fp16=round(per_tok / fp16, 4),
                   ppl=round(ppl.ppl, 4), delta_nll=round(ppl.nll - base_nll, 6), blocks=eng.num_blocks,
                   pool_tokens=eng.num_blocks * eng.config.block_size, seqs=eng.num_blocks // per_seq,
                   mlx_lm_first_divergence=first_divergence(got, want),
                   fp_first_divergence=first_divergence(got, fp_want), tokens=got)
        rows[b] = row
        if args.json:
            print(json.dumps({k: v for k, v in row.items() if k != "tokens"}), flush=True)
        else:
            print(" | ".join(str(row[k]) for k in ("precision", "bytes_per_token", "vs_fp16", "ppl", "delta_nll",
                                                   "blocks", "pool_tokens", "seqs", "mlx_lm_first_divergence",
                                                   "fp_first_divergence")), flush=True)

    # Decode speed: alternating runs, one engine per precision, prefix cache on (same prompt:
    # every run after the first prefills nothing), medians.
    for eng in engines.values():
        ours(eng, prompt, 4)  # warm-up
    tps: dict = {b: [] for b in PRECISIONS}
    for _ in range(args.repeats):
        for b in PRECISIONS:
            tps[b].append(ours(engines[b], prompt, args.tokens)[1])
    med = {b: statistics.median(v) for b, v in tps.items()}
    for b in PRECISIONS:
        line = dict(precision=name(b), decode_tps=round(med[b], 1), vs_model_dtype=round(med[b] / med[None], 3))
        print(json.dumps(line) if args.json else f"decode {line['precision']}: {line['decode_tps']} tok/s, "
              f"÷ model dtype {line['vs_model_dtype']}", flush=True)
    for eng in engines.values():
        eng.shutdown()
    tmp.cleanup()


if __name__ == "__main__":
    from mlxlocal.errors import MlxLocalError

    try:
        main()
    except MlxLocalError as e:  # e.g. a --group-size the model's head_dim cannot take
        raise SystemExit(f"error: {e}") from None
