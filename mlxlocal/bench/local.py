"""Local speed run: the engine on fixed-length random prompts, optionally against mlx-lm.

Every run is timed the same way from the consumer's side, for mlxlocal and for mlx-lm:
TTFT = first token arrival - submit; prefill tok/s = prompt tokens / TTFT; decode tok/s =
(tokens - 1) / (last token - first token); peak memory = MLX peak after a reset before the
run. With a batch of B requests, aggregate decode tok/s counts the tokens of all streams
inside the window where every stream is decoding (after the last first token, until the
first stream ends).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from mlxlocal.bench import scenarios
from mlxlocal.bench.common import (
    StreamTimes,
    log,
    mean_sd,
    peak_memory,
    random_prompt,
    reset_peak,
    run_streams,
    window_decode_tps,
)
from mlxlocal.bench.roofline import (
    DTYPE_BYTES,
    decode_roofline,
    detect_bandwidth,
    kv_bytes_per_token,
)
from mlxlocal.bench.sessions import sessions_scenario

METAL_DEFAULTS = dict(model="synthetic:qwen3-0.6b", prompt_tokens=512, gen_tokens=128,
                      system_tokens=1500, turn_tokens=16, concurrency=8,
                      sessions=8, session_tokens=2048, session_gen_tokens=16, restart_tokens=32768,
                      akv_model="synthetic:qwen3-0.6b", akv_steps=30, akv_keep=12, akv_gen_tokens=32,
                      akv_repeats=3, spec_gen_tokens=128)
# The CPU backend (reference BLAS) runs the 0.6B shape at a few tok/s: use the tiny preset.
# The cache-edits trace (30 steps of tool results) needs more than tiny's 4096 positions.
CPU_DEFAULTS = dict(model="synthetic:tiny", prompt_tokens=256, gen_tokens=64,
                    system_tokens=400, turn_tokens=8, concurrency=8,
                    sessions=8, session_tokens=2048, session_gen_tokens=8, restart_tokens=16384,
                    akv_model="synthetic:tiny:context=10240", akv_steps=30, akv_keep=4, akv_gen_tokens=16,
                    akv_repeats=1, spec_gen_tokens=128)


def on_metal() -> bool:
    import mlx.core as mx

    return bool(mx.metal.is_available())


def defaults() -> dict:
    return dict(METAL_DEFAULTS if on_metal() else CPU_DEFAULTS, backend="metal" if on_metal() else "cpu")


def run_ours(engine, prompts: list[list[int]], gen_tokens: int) -> dict:
    from mlxlocal.engine import SamplingParams

    params = SamplingParams(max_tokens=gen_tokens, ignore_eos=True, temperature=0)
    reset_peak()
    streams = run_streams(engine, prompts, params)
    peak = peak_memory()
    one = streams[0]
    return dict(
        ttft_s=statistics.fmean(s.ttft for s in streams),
        # all prompt tokens / time until every stream has its first token
        prefill_tps=sum(len(p) for p in prompts) / (max(s.times[0] for s in streams) - one.t0),
        decode_tps=one.decode_tps if len(streams) == 1 else window_decode_tps(streams),
        per_stream_decode_tps=statistics.fmean(s.decode_tps or 0.0 for s in streams),
        engine_decode_tps=statistics.fmean(s.stats.decode_tps for s in streams if s.stats),
        engine_ttft_s=statistics.fmean(s.stats.ttft_s for s in streams if s.stats),
        generated=sum(len(s.times) for s in streams),
        peak_memory_bytes=peak,
    )


# ------------------------------------------------------------------ mlx-lm, same method
class MlxLmRunner:
    def __init__(self, path: str):
        import mlx_lm

        self.model, self.tokenizer = mlx_lm.load(path)[:2]  # no config: return_config=False

    def run(self, prompt: list[int], gen_tokens: int) -> dict:
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        reset_peak()
        st = StreamTimes(time.perf_counter())
        # generate_step never stops on EOS: the same as ignore_eos in the engine.
        for _tok, _ in generate_step(mx.array(prompt), self.model, max_tokens=gen_tokens,
                                     sampler=lambda x: mx.argmax(x, axis=-1)):
            st.times.append(time.perf_counter())
        return dict(ttft_s=st.ttft, prefill_tps=len(prompt) / st.ttft, decode_tps=st.decode_tps,
                    generated=len(st.times), peak_memory_bytes=peak_memory())


# ------------------------------------------------------------------ the speed section
METRICS = ("prefill_tps", "decode_tps", "ttft_s", "peak_memory_bytes")


def summarize(runs: list[dict]) -> dict:
    return {k: mean_sd([r[k] for r in runs]) for k in METRICS}


def speed_bench(loaded, *, prompt_tokens: int, gen_tokens: int, batch: int = 1, repeats: int = 3,
                warmup: int = 1, compare: str | None = None, bandwidth: float | None = None,
                kv: dict | None = None, ref: MlxLmRunner | None = None) -> dict:
    """Warm-up, then `repeats` timed runs (A B A B with mlx-lm); mean and sd of each metric.
    `ref`: an mlx-lm runner already loaded (compare="mlx-lm" loads one otherwise)."""
    from mlxlocal.engine import open_engine

    mc = loaded.model_config
    vocab = mc.vocab_size if mc else loaded.config.get("vocab_size", 32000)
    # Prefix cache off: every repeat prefills its whole prompt, as mlx-lm does.
    engine = open_engine(loaded, prefix_cache=False, max_num_seqs=max(batch, 1),
                         kv_tokens=batch * (prompt_tokens + gen_tokens + 32), **(kv or {}))
    if compare == "mlx-lm" and ref is None:
        log(f"loading {loaded.info.path} with mlx_lm.load ...")
        ref = MlxLmRunner(str(loaded.info.path))
    prompts = [random_prompt(prompt_tokens, vocab, seed=1000 + i) for i in range(batch)]
    try:
        for w in range(warmup):
            log(f"warm-up {w + 1}/{warmup}")
            run_ours(engine, prompts, gen_tokens)
            if ref is not None:
                ref.run(prompts[0], gen_tokens)
        ours, theirs, order = [], [], []
        for r in range(repeats):
            log(f"repeat {r + 1}/{repeats}")
            ours.append(run_ours(engine, prompts, gen_tokens))
            order.append("mlxlocal")
            if ref is not None:
                theirs.append(ref.run(prompts[0], gen_tokens))
                order.append("mlx-lm")
    finally:
        engine.shutdown()

    out: dict[str, Any] = dict(
        prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, batch=batch, repeats=repeats, warmup=warmup,
        prefix_cache=False, weight_bytes=loaded.info.weights.total_bytes,
        mlxlocal=summarize(ours), runs=ours, order=order,
    )
    out["mlxlocal"]["aggregate"] = batch > 1
    if mc is not None:
        kv_token = kv_bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
                                      DTYPE_BYTES.get(loaded.info.dtype, 2))
        pool = engine.kv_pool
        if pool.get("kv_bits"):  # quantized K/V: what the pool holds per token, scales included
            kv_token = pool["bytes"] // (pool["blocks"] * pool["block_size"])
        decode = out["mlxlocal"]["decode_tps"]["mean"]
        if batch > 1:  # the bound is per stream: compare the per-stream rate
            decode = statistics.fmean(r["per_stream_decode_tps"] for r in ours)
        weights, comm = loaded.info.weights.total_bytes, 0.0
        if getattr(loaded, "shard", None) is not None:  # under a launch: each rank's share, plus the links
            from mlxlocal.distributed import cluster_report

            out["cluster"] = cluster = cluster_report(loaded, batch)
            weights, comm = cluster["weight_bytes"][0], cluster["comm_s_per_step"]
            kv_token //= cluster["ranks"]
            cluster["comm_fraction"] = comm * decode if decode else None
        roof = decode_roofline(detect_bandwidth(bandwidth), weights, kv_token,
                               prompt_tokens + gen_tokens / 2, decode, comm)
        out["roofline"] = roof.as_dict()
    if ref is not None:
        out["mlx_lm"] = summarize(theirs)
        out["mlx_lm_runs"] = theirs
        out["mlx_lm_batch"] = 1
        if batch == 1:
            out["ratios"] = {k: _ratio(out["mlxlocal"][k]["mean"], out["mlx_lm"][k]["mean"]) for k in METRICS}
        else:
            out["ratios"] = None
            out["ratios_note"] = "mlx-lm runs one stream: ratios only at --batch 1"
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def kernels_used(loaded, d: dict, batch: int, scenario: str | None, concurrency: int | None,
                 kv: dict | None) -> dict:
    """Which path each decode op takes at the bench's largest batch (decided, and on Metal
    compiled and measured, before any timed run), with the mode and the choice cache file."""
    from mlxlocal.engine import EngineConfig, kernel_plan, kernel_status

    seqs = max(batch, concurrency or (d["concurrency"] if scenario in ("concurrent", "sessions") else 1))
    return dict(kernel_status(), plan=kernel_plan(loaded, EngineConfig(max_num_seqs=seqs, **(kv or {}))))


# ------------------------------------------------------------------ one bench invocation
def run_local(*, model: str | None = None, prompt_tokens: int | None = None, gen_tokens: int | None = None,
              batch: int = 1, repeats: int = 3, warmup: int = 1, compare: str | None = None,
              scenario: str | None = None, concurrency: int | None = None, bandwidth: float | None = None,
              prefix_cache: bool = True, turns: int | None = None, system_tokens: int | None = None,
               grammar=None, akv: dict | None = None, speculation=None, kv: dict | None = None,
              profile: bool = False, contexts: list[int] | None = None) -> dict:
    """Load the model and run the speed section, one scenario, (a grammar given) the
    structured-output comparison, (a SpeculationChoice given) plain vs speculative decode,
    (profile) the decode step profile or (contexts) the long-context table; one JSON-able dict."""
    import mlx.core as mx

    from mlxlocal.source.loader import load

    d = defaults()
    spec = model or d["akv_model" if akv is not None else "model"]
    note = "given with --model" if model else f"default for the {d['backend']} backend"
    if contexts and spec.startswith("synthetic:") and "context=" not in spec:
        spec += f":context={max(contexts)}"  # random weights: any context the table asks for
    if scenario == "restart" and spec.startswith("synthetic:") and "context=" not in spec:
        spec += f":context={(prompt_tokens or d['restart_tokens']) + 64}"
    p = prompt_tokens or d["prompt_tokens"]
    g = gen_tokens or d["gen_tokens"]
    log(f"loading {spec} ({note}) ...")
    loaded = load(spec)
    info = loaded.info
    res: dict[str, Any] = dict(
        model=spec, model_note=note, backend=d["backend"], device=str(mx.default_device()),
        model_path=str(info.path), native=info.native,
        params=f"{info.n_params / 1e6:.1f}M params, {info.dtype}, {info.quantization}",
        weight_bytes=info.weights.total_bytes, scenario=scenario, compare=compare,
        kv_bits=(kv or {}).get("kv_bits"),
    )
    res["kernels"] = kernels_used(loaded, d, batch, scenario, concurrency, kv)
    t0 = time.perf_counter()
    if speculation is not None:
        from mlxlocal.bench.speculative import speculative_bench

        res["speculative"] = speculative_bench(loaded, speculation, gen_tokens=gen_tokens or d["spec_gen_tokens"],
                                               batches=(1, batch) if batch > 1 else (1,), repeats=repeats,
                                               warmup=warmup)
    elif grammar is not None:
        from mlxlocal.bench.structured import structured_bench

        res["structured"] = structured_bench(loaded, grammar, prompt_tokens=p, gen_tokens=g,
                                             batches=(1, batch) if batch > 1 else (1, 8),
                                             repeats=repeats, warmup=warmup)
    elif profile:
        from mlxlocal.bench.profile import profile_bench

        res["profile"] = profile_bench(loaded, prompt_tokens=p, gen_tokens=g,
                                       batches=(1, batch if batch > 1 else 8), repeats=repeats,
                                       warmup=warmup, compare="mlx-lm")
    elif contexts:
        from mlxlocal.bench.contexts import contexts_bench

        res["contexts"] = contexts_bench(loaded, contexts, gen_tokens=gen_tokens or 16,
                                         repeats=repeats, warmup=warmup, compare=compare, kv=kv)
    elif scenario is None:
        res["speed"] = speed_bench(loaded, prompt_tokens=p, gen_tokens=g, batch=batch, repeats=repeats,
                                   warmup=warmup, compare=compare, bandwidth=bandwidth, kv=kv)
    elif scenario == "agent" and akv is not None:
        from mlxlocal.bench.edits import edits_scenario

        res["akv"] = edits_scenario(
            loaded, steps=turns or d["akv_steps"], keep=akv.get("keep") or d["akv_keep"],
            gen_tokens=gen_tokens or d["akv_gen_tokens"], system_tokens=system_tokens or d["system_tokens"],
            discount=akv["discount"], output_price=akv["output_price"],
            repeats=akv.get("repeats") or d["akv_repeats"], warmup=warmup)
    elif scenario == "agent":
        res["agent"] = scenarios.agent_scenario(
            loaded, system_tokens=system_tokens or d["system_tokens"], turns=turns or 6,
            max_tokens=gen_tokens or d["turn_tokens"], repeats=repeats, compare=compare, cache_on=prefix_cache)
    elif scenario == "concurrent":
        res["concurrent"] = scenarios.concurrent_scenario(
            loaded, concurrency=concurrency or d["concurrency"], prompt_tokens=p, gen_tokens=g,
            repeats=repeats, warmup=warmup, compare=compare)
    elif scenario == "sessions":
        res["sessions"] = sessions_scenario(
            loaded, sessions=concurrency or d["sessions"], prompt_tokens=prompt_tokens or d["session_tokens"],
            gen_tokens=gen_tokens or d["session_gen_tokens"], repeats=repeats, warmup=warmup, compare=compare)
    elif scenario == "restart":
        from mlxlocal.bench.restart import restart_scenario

        res["restart"] = restart_scenario(loaded, prompt_tokens=prompt_tokens or d["restart_tokens"],
                                          repeats=repeats, compare=compare)
    else:
        raise ValueError(f"unknown scenario {scenario!r} (agent | concurrent | sessions | restart)")
    res["elapsed_s"] = time.perf_counter() - t0
    return res
