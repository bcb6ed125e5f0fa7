"""Rich tables for `mlxlocal bench` results, and the optional matplotlib plots: local runs
(speed, scenarios) and endpoint runs (--url)."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table

from mlxlocal.bench.common import percentile
from mlxlocal.errors import EndpointBenchError


def _num(x, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _ms(x) -> str:
    return "-" if x is None else f"{x * 1000:.1f} ms"


def _mib(x) -> str:
    return "-" if x is None else f"{x / 2**20:.1f} MiB"


FORMATS = {"prefill_tps": ("prefill tok/s", _num), "decode_tps": ("decode tok/s", _num),
           "ttft_s": ("TTFT", _ms), "peak_memory_bytes": ("peak memory", _mib)}


def _pm(stat: dict, fmt) -> str:
    if stat["mean"] is None:
        return "-"
    return f"{fmt(stat['mean'])} ± {fmt(stat['sd'])}"


def print_report(res: dict, console: Console | None = None) -> None:
    con = console or Console()
    con.print(f"[bold]model[/] {res['model']}  ({res['model_note']})")
    con.print(f"backend {res['backend']}, {res['params']}, weights {_mib(res['weight_bytes'])}")
    if res.get("kv_bits"):
        con.print(f"KV cache quantized to {res['kv_bits']} bits (--kv-bits)")
    if "kernels" in res:
        print_kernels(res["kernels"], con)
    if "speed" in res:
        print_speed(res["speed"], con)
    if "profile" in res:
        from mlxlocal.bench.profile import print_profile

        print_profile(res["profile"], con)
    if "contexts" in res:
        from mlxlocal.bench.contexts import print_contexts

        print_contexts(res["contexts"], con)
    if "agent" in res:
        print_agent(res["agent"], con)
    if "akv" in res:
        from mlxlocal.bench.edits import print_edits

        print_edits(res["akv"], con)
    if "concurrent" in res:
        print_concurrent(res["concurrent"], con)
    if "sessions" in res:
        print_sessions(res["sessions"], con)
    if "restart" in res:
        from mlxlocal.bench.restart import print_restart

        print_restart(res["restart"], con)
    if "structured" in res:
        print_structured(res["structured"], con)
    if "speculative" in res:
        from mlxlocal.bench.speculative import print_speculative

        print_speculative(res["speculative"], con)


def kernel_lines(k: dict) -> list[str]:
    """Where the decode ops' path choices come from (mode, Metal, cache file)."""
    if not k["metal"]:
        return [f"kernels: reference (no Metal): every dispatch point runs its MLX reference (on a Mac the "
                f"choices are cached in {k['cache']})"]
    return [f"kernels: --kernels {k['mode']} on {k['chip']}, choices cached in {k['cache']}"]


def kernel_table(k: dict, title: str = "decode ops: path per op and shape") -> Table | None:
    from mlxlocal.engine import describe_plan

    if not k["plan"]:
        return None
    t = Table(title=title, title_justify="left")
    for col in ("op", "shape", "dtype", "path"):
        t.add_column(col, overflow="fold")
    for row in describe_plan(k["plan"]):
        t.add_row(*row)
    return t


def print_kernels(k: dict, con: Console) -> None:
    for line in kernel_lines(k):
        con.print(line, highlight=False)
    t = kernel_table(k)
    con.print(t if t is not None else "no mlxlocal dispatch points: this model runs on mlx-lm's code")


def print_structured(s: dict, con: Console) -> None:
    t = Table(title=f"structured output ({s['grammar']}): prompt {s['prompt_tokens']}, up to {s['gen_tokens']} "
                    f"tokens, greedy, medians of {s['repeats']} alternating runs")
    for col in ("batch", "free decode tok/s", "constrained tok/s", "constrained ÷ free", "tokens/doc",
                "forced", "complete"):
        t.add_column(col, justify="right")
    for r in s["batches"]:
        t.add_row(str(r["batch"]), _num(r["free_decode_tps"], "{:.1f}"), _num(r["constrained_decode_tps"], "{:.1f}"),
                  _num(r["ratio"], "x{:.2f}"), f"{r['constrained_tokens']:.0f}", f"{r['forced_share']:.0%}",
                  f"{r['complete_share']:.0%}")
    con.print(t)


def print_speed(s: dict, con: Console) -> None:
    agg = " (aggregate over the batch)" if s["batch"] > 1 else ""
    t = Table(title=f"speed: prompt {s['prompt_tokens']}, generate {s['gen_tokens']}, batch {s['batch']}, "
                    f"mean ± sd of {s['repeats']} after {s['warmup']} warm-up{agg}")
    t.add_column("metric")
    t.add_column("mlxlocal", justify="right")
    if "mlx_lm" in s:
        t.add_column("mlx-lm", justify="right")
        t.add_column("ours ÷ mlx-lm", justify="right")
    for key, (label, fmt) in FORMATS.items():
        row = [label, _pm(s["mlxlocal"][key], fmt)]
        if "mlx_lm" in s:
            ratio = (s.get("ratios") or {}).get(key)
            row += [_pm(s["mlx_lm"][key], fmt), _num(ratio, "x{:.2f}")]
        t.add_row(*row)
    con.print(t)
    if "mlx_lm" in s:
        con.print(f"run order: {' '.join(s['order'])}" + (f"  ({s['ratios_note']})" if s.get("ratios_note") else ""))
    if s.get("cluster"):
        print_cluster(s["cluster"], con)
    r = s.get("roofline")
    if r:
        t = Table(title="decode roofline (batch 1: bandwidth ÷ bytes read per token)")
        t.add_column("bandwidth")
        t.add_column("bytes/token", justify="right")
        t.add_column("bound tok/s", justify="right")
        t.add_column("measured tok/s", justify="right")
        t.add_column("fraction", justify="right")
        t.add_row(f"{r['bandwidth_gbps']:.1f} GB/s", f"{r['bytes_per_token'] / 2**20:.2f} MiB",
                  _num(r["bound_tps"]), _num(r["measured_decode_tps"]), _num(r["fraction"], "{:.0%}"))
        con.print(t)
        con.print(f"bandwidth from {r['bandwidth_source']}; bytes/token = weights {_mib(r['weight_bytes'])} "
                  f"+ KV {r['kv_bytes_per_token']} B × mean context {r['mean_context']:.0f}"
                  + (f" (one rank's share) + {r['comm_s_per_token'] * 1e3:.2f} ms on the links per token"
                     if r.get("comm_s_per_token") else ""))
        if r["fraction"] and r["fraction"] > 1:
            con.print("[yellow]above the bound: the weights fit in CPU caches (tiny model) or the "
                      "bandwidth figure is too low[/]")


def print_cluster(c: dict, con: Console) -> None:
    """bench under a launch: what each rank holds and what the links cost per decode step."""
    split = "heads (tensor parallel)" if c["mode"] == "tensor" else "layers (pipeline parallel)"
    t = Table(title=f"{c['ranks']} ranks, the model split by {split}")
    t.add_column("rank")
    t.add_column("weights", justify="right")
    t.add_column("peak memory", justify="right")
    for rank, (w, peak) in enumerate(zip(c["weight_bytes"], c["peak_memory_bytes"])):
        t.add_row(str(rank), _mib(w), _mib(peak))
    con.print(t)
    share = f" ({c['comm_fraction']:.0%} of a decode step)" if c.get("comm_fraction") is not None else ""
    what = (f"{c['collectives_per_step']} all_sums of the activations" if c["mode"] == "tensor"
            else "the hidden state once around the ring")
    con.print(f"communication per decode step: {c['comm_s_per_step'] * 1e3:.2f} ms{share}: {what} "
              f"({c['link_bytes_per_step'] / 1024:.1f} KiB through each rank's link) and the step's message "
              f"to the followers ({c['message_s_per_step'] * 1e3:.2f} ms), timed alone")


def print_agent(a: dict, con: Console) -> None:
    t = Table(title=f"agent trace: {a['turns']} turns, system ~{a['system_tokens']} tokens + {a['tools']} tool "
                    f"schemas, {a['max_tokens']} tokens per reply, median TTFT of {a['repeats']}")
    t.add_column("turn", justify="right")
    t.add_column("prompt", justify="right")
    names = {"on": "prefix cache on", "off": "prefix cache off", "mlx_lm": "mlx-lm prompt cache"}
    for m in a["modes"]:
        t.add_column(f"{names[m]} TTFT", justify="right")
        t.add_column("cached", justify="right")
    for i in range(a["turns"]):
        row = [str(i + 1), str(a["prompt_tokens"][i])]
        for m in a["modes"]:
            row += [_ms(a["ttft_per_turn_s"][m][i]), str(a["cached_tokens_per_turn"][m][i])]
        t.add_row(*row)
    con.print(t)
    r = a["ratios_last_turn"]
    parts = [f"{k.replace('_over_', ' ÷ ').replace('mlx_lm', 'mlx-lm')} x{v:.2f}" for k, v in r.items()]
    con.print(f"last-turn TTFT ratios: {', '.join(parts) or '-'}; greedy tokens match cache-off: "
              f"{a['greedy_tokens_match_off']}")


def print_concurrent(c: dict, con: Console) -> None:
    ref = "mlx_lm_method" in c
    t = Table(title=f"concurrent streams: prompt {c['prompt_tokens']}, generate {c['gen_tokens']}, "
                    f"median of {c['repeats']}")
    t.add_column("streams", justify="right")
    t.add_column("aggregate decode tok/s", justify="right")
    t.add_column("end-to-end tok/s", justify="right")
    t.add_column("max TTFT", justify="right")
    if ref:
        t.add_column("mlx-lm decode tok/s", justify="right")
        t.add_column("mlx-lm e2e tok/s", justify="right")
        t.add_column("decode ours ÷ mlx-lm", justify="right")
    for row in c["levels"]:
        cells = [str(row["streams"]), _num(row["decode_tps"]), _num(row["e2e_tps"]), _ms(row["max_ttft_s"])]
        if ref:
            cells += [_num(row["mlx_lm_decode_tps"]), _num(row["mlx_lm_e2e_tps"]),
                      _num(row["decode_ratio_vs_mlx_lm"], "x{:.2f}")]
        t.add_row(*cells)
    con.print(t)
    con.print(f"{c['concurrency']} streams ÷ 1: decode x{c['decode_ratio']:.2f}, end-to-end x{c['e2e_ratio']:.2f}")
    if ref:
        con.print(f"mlx-lm: {c['mlx_lm_method']}; runs alternate ours, mlx-lm per stream count")


def print_sessions(s: dict, con: Console) -> None:
    t = Table(title=f"sessions: {s['sessions']} x {s['prompt_tokens']}-token prompt + {s['gen_tokens']} tokens, "
                    f"then +{s['new_turn_tokens']} tokens on the cache; median of {s['repeats']}")
    t.add_column("")
    names = {"mlxlocal": "mlxlocal (paged, pinned sessions)", "mlx_lm": "mlx-lm (prompt cache per session)"}
    for name in s["summary"]:
        t.add_column(names[name], justify="right")
    if s["ratios"]:
        t.add_column("ours ÷ mlx-lm", justify="right")
    r = s["ratios"] or {}
    rows = [("peak memory over baseline", "peak_over_baseline_bytes", _mib, "peak_over_baseline"),
            ("peak memory (raw)", "peak_memory_bytes", _mib, None),
            ("baseline (resident weights)", "baseline_bytes", _mib, None),
            ("second-turn TTFT (median)", "second_turn_ttft_s", _ms, "second_turn_ttft"),
            ("first turns (wall)", "first_turns_s", lambda x: f"{x:.2f} s", None)]
    for label, key, fmt, rk in rows:
        cells = [label] + [fmt(v[key]) for v in s["summary"].values()]
        if s["ratios"]:
            cells.append(_num(r.get(rk), "x{:.2f}") if rk else "")
        t.add_row(*cells)
    t.add_row("second-turn cached tokens", *[str(v["second_turn_cached_tokens"][0]) for v in s["summary"].values()],
              *([""] if s["ratios"] else []))
    con.print(t)
    if s.get("clip_note"):
        con.print(f"[yellow]{s['clip_note']}[/]")
    con.print(f"memory: {s['memory_note']}; weights {_mib(s['weight_bytes'])} per copy")


# ------------------------------------------------------------------ plot
class PlotUnavailable(RuntimeError):
    pass


def write_plot(res: dict, path: str | Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'mlxlocal[bench]' (or matplotlib)") from e
    # Prefill and decode rates differ by 10-100x: each gets its own linear axis (one log axis
    # made the decode bars slivers above its floor).
    panels = [k for k in ("prefill", "decode") if "speed" in res] + [k for k in ("agent", "concurrent") if k in res]
    if not panels:
        raise PlotUnavailable("--plot draws the speed run and the agent / concurrent scenarios only")
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4), squeeze=False)
    for ax, key in zip(axes[0], panels):
        if key == "agent":
            a = res["agent"]
            turns = list(range(1, a["turns"] + 1))
            for m, label in (("on", "prefix cache on"), ("off", "prefix cache off"), ("mlx_lm", "mlx-lm")):
                if m in a["ttft_per_turn_s"]:
                    ax.plot(turns, [v * 1000 for v in a["ttft_per_turn_s"][m]], marker="o", label=label)
            ax.set(title="agent trace: TTFT per turn", xlabel="turn", ylabel="TTFT (ms)")
            ax.set_xticks(turns)
            ax.legend()
        elif key == "concurrent":
            c = res["concurrent"]
            xs = [r["streams"] for r in c["levels"]]
            ax.plot(xs, [r["decode_tps"] for r in c["levels"]], marker="o", label="aggregate decode")
            ax.plot(xs, [r["e2e_tps"] for r in c["levels"]], marker="s", label="end to end")
            if "mlx_lm_method" in c:
                ax.plot(xs, [r["mlx_lm_decode_tps"] for r in c["levels"]], marker="^", linestyle="--",
                        label="mlx-lm aggregate decode")
            ax.set(title="throughput vs streams", xlabel="concurrent streams", ylabel="tok/s")
            ax.set_xscale("log", base=2)
            ax.legend()
        else:  # prefill or decode
            s = res["speed"]
            who = [("mlxlocal", "mlxlocal")] + ([("mlx_lm", "mlx-lm")] if "mlx_lm" in s else [])
            values = [s[k][f"{key}_tps"]["mean"] or 0 for k, _ in who]
            bars = ax.bar([label for _, label in who], values, color=["C0", "C1"][: len(who)])
            ax.bar_label(bars, fmt="%.0f")
            what = f"prompt {s['prompt_tokens']}" if key == "prefill" else f"generate {s['gen_tokens']}"
            ax.set(title=f"{key} ({what})", ylabel="tok/s")
    fig.suptitle(res["model"])
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


# ------------------------------------------------------------------ endpoint runs (--url)
# The endpoint benchmark's result dict (bench/endpoint.py) has its own shape: latency
# percentiles per request rather than mean ± sd per run, so its table and plot are separate.
def require_matplotlib():
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise EndpointBenchError("--plot needs matplotlib: pip install matplotlib") from e
    return Figure


def write_endpoint_plot(result: dict, path: str) -> None:
    """TTFT and ITL histograms (milliseconds) to a PNG."""
    Figure = require_matplotlib()
    samples = result.get("_samples") or {}
    fig = Figure(figsize=(10, 4), tight_layout=True)
    for ax, key, title in ((fig.add_subplot(1, 2, 1), "ttft_s", "TTFT"),
                           (fig.add_subplot(1, 2, 2), "itl_s", "ITL (per SSE event)")):
        vals = [v * 1000 for v in samples.get(key, [])]
        if vals:
            ax.hist(vals, bins=min(50, max(5, len(vals) // 2)))
            for q, style in ((50, "-"), (90, "--"), (99, ":")):
                ax.axvline(percentile(vals, q), color="k", linestyle=style, label=f"p{q}")
            ax.legend()
        ax.set_title(f"{title}, n={len(vals)}")
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
    fig.suptitle(f"{result['model']} @ {result['url']}, concurrency {result['concurrency']}")
    fig.savefig(path, dpi=110)


def print_endpoint_table(result: dict, console=None) -> None:
    console = console or Console()

    def ms(v):
        return "-" if v is None else f"{v * 1000:.1f}"

    table = Table(title=f"Endpoint bench: {result['model']} @ {result['url']}")
    table.add_column("metric")
    for c in ("mean", "p50", "p90", "p99"):
        table.add_column(c, justify="right")
    for key, label in (("ttft_s", "TTFT (ms)"), ("tpot_s", "TPOT (ms)"),
                       ("itl_s", "ITL per event (ms)"), ("e2e_s", "E2E latency (ms)")):
        s = result[key]
        table.add_row(label, *(ms(s[c]) for c in ("mean", "p50", "p90", "p99")))
    d = result["decode_tps_per_request"]
    table.add_row("decode tok/s per request", *("-" if d[c] is None else f"{d[c]:.1f}"
                                                for c in ("mean", "p50", "p90", "p99")))
    console.print(table)
    errs = ", ".join(f"{k}: {v}" for k, v in result["errors"].items()) or "none"
    tpe = result["tokens_per_event"]
    lines = [
        f"requests: {result['completed']}/{result['requests']} ok, concurrency {result['concurrency']}, "
        f"{result['duration_s']:.2f} s",
        f"errors: {errs}",
        f"request throughput: {result['request_throughput']:.2f} req/s",
        f"output throughput: {result['output_throughput']:.1f} tok/s "
        f"({result['total_completion_tokens']} completion tokens, {result['total_prompt_tokens']} prompt tokens)",
        f"token counts: {result['token_count_method']} (prompt: {result['prompt_token_count_method']})",
        f"prompts: {result['prompt_source']}",
        f"tokens per SSE event: {'-' if tpe is None else f'{tpe:.2f}'}",
    ]
    if result.get("cached_prompt_tokens") is not None:
        lines.append(f"cached prompt tokens (server-reported): {result['cached_prompt_tokens']}")
    for k, msg in result["error_samples"].items():
        lines.append(f"  {k}: {msg}")
    for line in lines:
        console.print(line, highlight=False)
    for n in result["notes"]:
        console.print(f"note: {n}", style="dim", highlight=False)

