"""KV-cache benchmark: paged-KV waste, batched decode scaling, multi-turn TTFT vs mlx-lm.

All numbers come from one process:

1. waste: 64 mixed-length sequences run together; eng.stats()["waste"] is sampled while
   they run (max, and at the moment all 64 are resident) and compared with the waste a
   contiguous per-sequence cache would have for the same tokens (preallocated to the max
   context, or grown in mlx-lm's 256-token KVCache steps), computed analytically.
2. decode scaling: aggregate decode tok/s of 8 concurrent streams / 1 stream, same prompts.
3. multi-turn: a 5-turn chat (long system prompt + growing history). TTFT per turn with the
   prefix cache on (stateless requests: radix cache only; and a persistent session), off,
   and mlx-lm's prompt cache reused across turns (trimmed to the common prefix as mlx-lm's
   server does). Same token ids for every engine, greedy, alternating runs, median of reps.

The default model is built on the fly (random weights, Qwen3 architecture, hidden 256,
4 layers, vocab 8192): larger than the test models but quick on the CPU backend. Any
--model spec works too (e.g. synthetic:qwen3-0.6b:layers=4, slow on a CPU).

    python scripts/bench_cache.py [--model SPEC] [--reps 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import mlx.core as mx

from mlxlocal.engine import SamplingParams, open_engine
from mlxlocal.source.loader import load, load_from_dir

DEFAULT_CONFIG = dict(
    model_type="qwen3", hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, intermediate_size=768, vocab_size=8192,
    max_position_embeddings=4096, rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=True,
)
MLX_LM_STEP = 256  # mlx_lm.models.cache.KVCache.step


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def rand_prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    hi = max(20, vocab - 256)  # stay clear of the special tokens (highest ids)
    return [rng.randrange(10, hi) for _ in range(n)]


class Consumer(threading.Thread):
    """Drain one request handle, timestamping every chunk as it arrives."""

    def __init__(self, handle):
        super().__init__(daemon=True)
        self.handle, self.times, self.stats, self.reason = handle, [], None, None

    def run(self):
        for c in self.handle:
            if c.token is not None:
                self.times.append(time.perf_counter())
            if c.finish_reason is not None:
                self.stats, self.reason = c.stats, c.finish_reason


# ---------------------------------------------------------------- 1. KV waste
def bench_waste(lm, n_seqs: int, lo: int, hi: int, max_tokens: int, block_size: int) -> dict:
    vocab = lm.model_config.vocab_size
    context = lm.model_config.context_length
    rng = random.Random(1234)
    lengths = [rng.randint(lo, hi) for _ in range(n_seqs)]
    prompts = [rand_prompt(rng, n, vocab) for n in lengths]
    kv_tokens = sum(n + max_tokens + 2 * block_size for n in lengths)
    eng = open_engine(lm, block_size=block_size, kv_tokens=kv_tokens, max_num_seqs=n_seqs,
                      prefix_cache=True)
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    consumers = [Consumer(eng.submit(p, params)) for p in prompts]
    for c in consumers:
        c.start()
    samples, resident = [], None
    while any(c.is_alive() for c in consumers):
        s = eng.stats()
        if s["running"] or s["waiting"]:
            samples.append(s["waste"])
        if resident is None and s["running"] == n_seqs and s["waiting"] == 0 and all(c.times for c in consumers):
            # Every sequence holds its blocks and has finished its prompt: snapshot.
            gen = [len(c.times) for c in consumers]
            resident = dict(stats=s, generated=gen)
            break
        time.sleep(0.02)
    for c in consumers:  # the snapshot is taken: no need to run them out
        c.handle.cancel()
    for c in consumers:
        c.join()
    wall = time.perf_counter() - t0
    eng.shutdown()

    out = dict(n_seqs=n_seqs, prompt_len_min=min(lengths), prompt_len_max=max(lengths),
               prompt_len_mean=sum(lengths) / n_seqs, max_tokens=max_tokens, block_size=block_size,
               context_length=context, samples=len(samples), wall_s=wall,
               paged_waste_max=max(samples) if samples else float("nan"),
               paged_waste_mean=sum(samples) / len(samples) if samples else float("nan"))
    if resident is None:
        out["all_resident"] = False
        return out
    # K/V stored per sequence: the prompt plus every sampled token but the newest one.
    # Between the two stats() calls the engine may have stepped once: bracket it.
    stored = [n + max(g - 1, 0) for n, g in zip(lengths, resident["generated"])]
    total = sum(stored)

    def waste(alloc):
        return 1 - total / sum(alloc)

    out.update(
        all_resident=True,
        tokens_stored=total,
        paged_waste_at_all_resident=resident["stats"]["waste"],
        paged_blocks_used=resident["stats"]["blocks_used"],
        paged_waste_analytic=waste([math.ceil(s / block_size) * block_size for s in stored]),
        contig_256_step_waste=waste([math.ceil(s / MLX_LM_STEP) * MLX_LM_STEP for s in stored]),
        contig_max_needed_waste=waste([hi + max_tokens] * n_seqs),
        contig_max_context_waste=waste([context] * n_seqs),
    )
    # Same comparison at the end of generation (every sequence at prompt + max_tokens).
    final = [n + max_tokens for n in lengths]
    tf = sum(final)
    out["at_completion"] = dict(
        paged=1 - tf / sum(math.ceil(s / block_size) * block_size for s in final),
        contig_256_step=1 - tf / sum(math.ceil(s / MLX_LM_STEP) * MLX_LM_STEP for s in final),
        contig_max_needed=1 - tf / ((hi + max_tokens) * n_seqs),
        contig_max_context=1 - tf / (context * n_seqs),
    )
    return out


# ---------------------------------------------------------------- 2. decode scaling
def run_streams(eng, prompts, max_tokens) -> dict:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    consumers = [Consumer(eng.submit(p, params)) for p in prompts]
    for c in consumers:
        c.start()
    for c in consumers:
        c.join()
    t_end = max(c.times[-1] for c in consumers)
    total = sum(len(c.times) for c in consumers)
    # Pure decode window: after the last stream's first token (all prompts done) until the
    # first stream finishes (all streams decoding the whole time).
    w0 = max(c.times[0] for c in consumers)
    w1 = min(c.times[-1] for c in consumers)
    in_window = sum(1 for c in consumers for t in c.times if w0 < t <= w1)
    decode = in_window / (w1 - w0) if w1 > w0 and in_window else float("nan")
    return dict(end_to_end_tps=total / (t_end - t0), decode_tps=decode, window_tokens=in_window,
                tokens=total, wall_s=t_end - t0)


def bench_decode(lm, streams: int, prompt_len: int, max_tokens: int, reps: int) -> dict:
    rng = random.Random(99)
    prompts = [rand_prompt(rng, prompt_len, lm.model_config.vocab_size) for _ in range(streams)]
    eng = open_engine(lm, kv_tokens=streams * (prompt_len + max_tokens + 64), max_num_seqs=max(16, streams),
                      prefix_cache=False)  # no cache: every run prefills the same way
    run_streams(eng, prompts[:1], 4)  # warm-up
    single, multi = [], []
    for _ in range(reps):
        # 1 stream: each prompt alone; its decode tok/s is the median over the prompts.
        runs = [run_streams(eng, [p], max_tokens) for p in prompts]
        single.append(dict(decode_tps=median([r["decode_tps"] for r in runs]),
                           end_to_end_tps=median([r["end_to_end_tps"] for r in runs])))
        multi.append(run_streams(eng, prompts, max_tokens))
    eng.shutdown()
    s_dec = median([r["decode_tps"] for r in single])
    m_dec = median([r["decode_tps"] for r in multi])
    s_e2e = median([r["end_to_end_tps"] for r in single])
    m_e2e = median([r["end_to_end_tps"] for r in multi])
    return dict(streams=streams, prompt_len=prompt_len, max_tokens=max_tokens, reps=reps,
                decode_tps_1=s_dec, decode_tps_n=m_dec, decode_ratio=m_dec / s_dec,
                e2e_tps_1=s_e2e, e2e_tps_n=m_e2e, e2e_ratio=m_e2e / s_e2e,
                window_tokens_n=median([r["window_tokens"] for r in multi]))


# ---------------------------------------------------------------- 3. multi-turn
SYSTEM_SENTENCES = [
    "You are a careful assistant running on a local machine.",
    "Answer the question directly, then give a short reason.",
    "When the user asks for code, write small functions with clear names and type hints.",
    "Memory bandwidth decides how fast each token arrives, so keep answers short.",
    "Tools let you call functions, read files, and search the web when asked.",
    "Never invent file names; ask when something is unclear.",
    "Quantization stores each weight in four or eight bits with a scale and a bias.",
    "When the cache already holds the prompt, only the new tokens need to be computed.",
]
USER_TURNS = [
    "What does a prefix cache do in a local inference engine, and why does it help chat?",
    "Write a small Python function that returns the n-th Fibonacci number.",
    "Now explain how paged attention stores keys and values in fixed-size blocks.",
    "How much memory does the KV cache of a small model need for a long conversation?",
    "Summarize everything we discussed so far in three short sentences, please.",
]
ASSISTANT_TURNS = [
    "It keeps the keys and values of prompts it has seen, so a new request that starts "
    "the same way only computes its new tokens. Chat resends the whole history each turn.",
    "def fibonacci(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n"
    "    return a",
    "The cache is split into blocks of sixteen tokens. Each sequence has a table of block "
    "ids, so memory is allocated a block at a time and shared prefixes share blocks.",
    "Per token it is two times layers times key value heads times head size times bytes. "
    "For a small model that is a few tens of kilobytes per token.",
]


def build_turns(eng, system_tokens: int) -> list[list[int]]:
    text, i = "", 0
    while len(eng.encode_text(text)) < system_tokens:
        text += SYSTEM_SENTENCES[i % len(SYSTEM_SENTENCES)] + " "
        i += 1
    messages = [{"role": "system", "content": text.strip()}]
    turns = []
    for k, user in enumerate(USER_TURNS):
        messages.append({"role": "user", "content": user})
        turns.append(eng.encode_chat(messages))
        if k < len(ASSISTANT_TURNS):
            messages.append({"role": "assistant", "content": ASSISTANT_TURNS[k]})
    return turns


def run_engine_turns(lm, turns, max_tokens, mode: str) -> list[dict]:
    eng = open_engine(lm, kv_tokens=4 * (len(turns[-1]) + max_tokens) + 256, max_num_seqs=4,
                      prefix_cache=(mode != "off"))
    warm = [5] * 8  # unrelated prompt: starts the engine thread, shares nothing
    for _ in eng.generate(warm, SamplingParams(max_tokens=2, ignore_eos=True)):
        pass
    sess = eng.new_session() if mode == "session" else None
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    out = []
    for ids in turns:
        stats, tokens = None, []
        for c in eng.generate(ids, params, session=sess):
            if c.token is not None:
                tokens.append(c.token)
            if c.stats is not None:
                stats = c.stats
        out.append(dict(ttft_s=stats.ttft_s, cached=stats.cached_tokens, prompt=len(ids), tokens=tokens))
    eng.shutdown()
    return out


def run_mlx_lm_turns(model, turns, max_tokens) -> list[dict]:
    """mlx-lm's prompt cache reused across turns (trimmed to the common prefix, as its server)."""
    from mlxlocal.bench.scenarios import MlxLmPromptCache

    theirs = MlxLmPromptCache(model)
    return [dict(r, cached=r["cached_tokens"]) for r in (theirs.turn(ids, max_tokens) for ids in turns)]


def bench_multiturn(lm, system_tokens: int, max_tokens: int, reps: int) -> dict:
    import mlx_lm

    ref_model, _ = mlx_lm.load(str(lm.info.path))
    probe = open_engine(lm, kv_tokens=256, max_num_seqs=1)
    turns = build_turns(probe, system_tokens)
    probe.shutdown()
    modes = ["radix", "session", "off", "mlx_lm"]
    runs: dict[str, list[list[dict]]] = {m: [] for m in modes}
    for r in range(reps):
        order = modes[r % len(modes):] + modes[: r % len(modes)]  # rotate who goes first
        for m in order:
            log(f"  multi-turn rep {r + 1}/{reps}: {m}")
            if m == "mlx_lm":
                runs[m].append(run_mlx_lm_turns(ref_model, turns, max_tokens))
            else:
                runs[m].append(run_engine_turns(lm, turns, max_tokens, m))
    per_turn = {m: [median([rep[t]["ttft_s"] for rep in runs[m]]) for t in range(len(turns))] for m in modes}
    cached = {m: [runs[m][0][t]["cached"] for t in range(len(turns))] for m in modes}
    same = {m: all(rep[t]["tokens"] == runs["off"][0][t]["tokens"] for rep in runs[m] for t in range(len(turns)))
            for m in modes}
    t5 = {m: per_turn[m][-1] for m in modes}
    return dict(
        turns=len(turns), prompt_tokens=[len(t) for t in turns], system_tokens=system_tokens,
        max_tokens=max_tokens, reps=reps, ttft_per_turn_s=per_turn, cached_tokens_per_turn=cached,
        greedy_tokens_match_off=same, ttft_turn5_s=t5,
        ratios_turn5=dict(
            off_over_radix=t5["off"] / t5["radix"], off_over_session=t5["off"] / t5["session"],
            mlx_lm_over_radix=t5["mlx_lm"] / t5["radix"], mlx_lm_over_session=t5["mlx_lm"] / t5["session"],
            off_over_mlx_lm=t5["off"] / t5["mlx_lm"],
        ),
    )


# ---------------------------------------------------------------- main
def load_model(spec: str | None, tmp: Path):
    if spec:
        return load(spec), spec
    from mlxlocal.source.synthetic.weights import write_model_dir

    path = write_model_dir(tmp / "bench-qwen3-h256-l4", DEFAULT_CONFIG)
    return load_from_dir(path), "built: qwen3 h256 l4 v8192 fp32 (random weights)"


def print_plain(res: dict) -> None:
    w, d, m = res["waste"], res["decode"], res["multiturn"]
    print(f"model: {res['model']}   total {res['total_s']:.1f}s")
    print(f"\n1. KV waste: {w['n_seqs']} sequences, prompts {w['prompt_len_min']}..{w['prompt_len_max']} "
          f"(mean {w['prompt_len_mean']:.0f}), block {w['block_size']}, context {w['context_length']}")
    print(f"   paged waste sampled while running ({w['samples']} samples): max {w['paged_waste_max']:.1%}, "
          f"mean {w['paged_waste_mean']:.1%}")
    if w.get("all_resident"):
        print(f"   with all {w['n_seqs']} resident ({w['tokens_stored']} tokens stored, "
              f"{w['paged_blocks_used']} blocks):")
        print(f"     paged (engine stats)          {w['paged_waste_at_all_resident']:7.1%}")
        print(f"     paged (analytic, same tokens) {w['paged_waste_analytic']:7.1%}")
        print(f"     contiguous, 256-token steps   {w['contig_256_step_waste']:7.1%}   (mlx-lm KVCache)")
        print(f"     contiguous, max needed        {w['contig_max_needed_waste']:7.1%}   "
              f"(prealloc {w['prompt_len_max'] + w['max_tokens']} tokens)")
        print(f"     contiguous, max context       {w['contig_max_context_waste']:7.1%}   "
              f"(prealloc {w['context_length']} tokens)")
        c = w["at_completion"]
        print(f"   at completion (prompt + {w['max_tokens']}): paged {c['paged']:.1%}, 256-step "
              f"{c['contig_256_step']:.1%}, max needed {c['contig_max_needed']:.1%}, "
              f"max context {c['contig_max_context']:.1%}")
    else:
        print("   (never saw all sequences resident at once)")
    print(f"\n2. Decode: {d['streams']} streams vs 1, prompt {d['prompt_len']}, {d['max_tokens']} tokens, "
          f"median of {d['reps']}")
    print(f"   decode only : 1 stream {d['decode_tps_1']:.1f} tok/s, {d['streams']} streams "
          f"{d['decode_tps_n']:.1f} tok/s aggregate  -> x{d['decode_ratio']:.2f}")
    print(f"   end to end  : 1 stream {d['e2e_tps_1']:.1f} tok/s, {d['streams']} streams "
          f"{d['e2e_tps_n']:.1f} tok/s aggregate  -> x{d['e2e_ratio']:.2f}  (includes prefill)")
    print(f"\n3. Multi-turn: {m['turns']} turns, prompt tokens {m['prompt_tokens']}, {m['max_tokens']} "
          f"generated per turn, median TTFT of {m['reps']} alternating reps")
    names = {"radix": "prefix cache, new request/turn", "session": "prefix cache, persistent session",
             "off": "prefix cache off", "mlx_lm": "mlx-lm prompt cache (trimmed)"}
    print(f"   {'':34}" + "".join(f"{'turn ' + str(i + 1):>10}" for i in range(m["turns"])) + "   cached@5  same tokens")
    for k, name in names.items():
        row = "".join(f"{v * 1000:>8.0f}ms" for v in m["ttft_per_turn_s"][k])
        print(f"   {name:34}{row}   {m['cached_tokens_per_turn'][k][-1]:>8}  {m['greedy_tokens_match_off'][k]}")
    r = m["ratios_turn5"]
    print(f"   turn-5 TTFT ratios: off/radix x{r['off_over_radix']:.2f}, off/session x{r['off_over_session']:.2f}, "
          f"mlx-lm/radix x{r['mlx_lm_over_radix']:.2f}, mlx-lm/session x{r['mlx_lm_over_session']:.2f}, "
          f"off/mlx-lm x{r['off_over_mlx_lm']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None,
                    help="model spec (default: a built Qwen3 shape, hidden 256, 4 layers, vocab 8192)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--min-prompt", type=int, default=5)
    ap.add_argument("--max-prompt", type=int, default=300)
    ap.add_argument("--waste-tokens", type=int, default=96,
                    help="max_tokens per waste sequence: must exceed the steps needed to admit all of them")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--decode-prompt", type=int, default=64)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--system-tokens", type=int, default=300)
    ap.add_argument("--turn-tokens", type=int, default=16)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: waste,decode,multiturn")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        lm, name = load_model(args.model, Path(tmp))
        res: dict = dict(model=name, mlx_device=str(mx.default_device()))
        if "waste" not in skip:
            log("1/3 KV waste ...")
            res["waste"] = bench_waste(lm, args.seqs, args.min_prompt, args.max_prompt, args.waste_tokens, 16)
        if "decode" not in skip:
            log("2/3 decode scaling ...")
            res["decode"] = bench_decode(lm, args.streams, args.decode_prompt, args.decode_tokens, args.reps)
        if "multiturn" not in skip:
            log("3/3 multi-turn ...")
            res["multiturn"] = bench_multiturn(lm, args.system_tokens, args.turn_tokens, args.reps)
    res["total_s"] = time.perf_counter() - t0
    if args.json:
        print(json.dumps(res, indent=None, default=float))
    elif not skip:
        print_plain(res)
    else:
        print(json.dumps(res, indent=2, default=float))


if __name__ == "__main__":
    main()
