"""`bench akv`: AKV cache engineering on a long agent trace.

A scripted agent trace (system prompt + tools, a task, then per step an assistant tool call
and a tool result of a few hundred to a few thousand tokens: file dumps, web pages, logs)
is driven through the engine on one session per mode, each mode on a fresh engine:

    standard             the conversation grows; every step reuses the session's cache
    akv_drop             keep-last-tool-outputs=K: older tool results leave the KV cache
                         (CacheEdit drops); the prompt's ids do not change
    akv_drop_reposition  the same, plus the keys after each gap re-rotated to close it
    text                 text engineering: older tool results replaced in the messages by a
                         short placeholder and the conversation re-rendered; the session's
                         longest common prefix then ends at the first replaced message and
                         everything after it is prefilled again

Every step generates a fixed number of tokens greedily (EOS ignored); the scripted tool
call then stands in for the reply, so all modes see the same conversation whatever the
model says (random weights say gibberish): only token counts and timings come from the
engine. Per step: prefill tokens (computed, not cached), cached tokens, tokens attended per
decode step (the prompt's tokens still in the cache), KV blocks in use, TTFT, decode tok/s.
API-equivalent cost in input-token units: uncached input + cached input x discount +
output x output price ratio (dropped tokens are not attended, so not billed).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

from mlxlocal.bench.common import log
from mlxlocal.bench.scenarios import SYSTEM_SENTENCES, TOOLS
from mlxlocal.edits import CompactionPolicy
from mlxlocal.edits.spans import ConversationSpans
from mlxlocal.engine import REPLY_MARKER

MODES = ("standard", "akv_drop", "akv_drop_reposition", "text")
PLACEHOLDER = "[tool output removed from the context: call the tool again if it is needed]"
# Tool result sizes in tokens, cycled: a real agent's mix of short answers and long dumps
# (mean 1000). Scaled down together when the trace would not fit the model's context.
SIZES = (400, 1500, 250, 2500, 600, 900, 300, 1800, 500, 1250)
MIN_RESULT_TOKENS = 40
TASK = ("The nightly build of the payments service fails since yesterday. Find the cause in the code, "
        "the logs and the docs, fix it, and tell me what you changed.")
FETCH_TOOL = {"type": "function", "function": {
    "name": "fetch_url", "description": "Fetch a web page and return its text.",
    "parameters": {"type": "object", "properties": {"url": {"type": "string"}}, "required": ["url"]}}}
EDIT_TOOLS = TOOLS + [FETCH_TOOL]


# ------------------------------------------------------------------ the scripted trace
def _code_line(i: int, n: int) -> str:
    kinds = (f"def handler_{i}_{n}(request, retries={n % 5}):",
             f"    total = sum(item.amount for item in request.items if item.id != {n})",
             f"    if total > LIMITS[{n % 7}]:  # refuse payments over the account's limit",
             f"        raise PaymentError('limit exceeded for order {i}-{n}')",
             f"    return ledger.record(request.account, total, batch={i * 100 + n})", "")
    return kinds[n % len(kinds)]


def _log_line(i: int, n: int) -> str:
    level = ("INFO", "INFO", "DEBUG", "WARN", "INFO", "ERROR")[n % 6]
    return (f"2026-11-29T02:{n % 60:02d}:{(n * 7) % 60:02d}Z {level} build[{i}] step {n}: "
            f"{'compiling module payments.ledger' if n % 3 else 'running test shard'} {n % 13}/13 "
            f"({(n * 37) % 1000} ms)")


def _page_line(i: int, n: int) -> str:
    sentences = ("The ledger service batches payments every five minutes and retries failed writes.",
                 "Limits are read from the accounts database when a batch starts, not per payment.",
                 "A migration that renames a column must ship before the code that reads the new name.",
                 "Nightly builds run the full integration suite against a fresh database snapshot.",
                 "Timeouts in the suite usually mean the snapshot was not restored before the run.")
    return f"[{i}.{n}] " + sentences[(i + n) % len(sentences)]


def _match_line(i: int, n: int) -> str:
    return f"src/payments/module_{n % 17}.py:{(n * 31) % 400 + 1}: limit = LIMITS[account.tier]  # {i}"


# (tool, arguments, line maker) cycled over the steps
CALLS = (
    ("read_file", lambda i: {"path": f"src/payments/ledger_{i}.py"}, _code_line),
    ("run_command", lambda i: {"command": f"make nightly SHARD={i}"}, _log_line),
    ("fetch_url", lambda i: {"url": f"https://docs.example.com/payments/runbook-{i}"}, _page_line),
    ("search_code", lambda i: {"pattern": "LIMITS\\[", "glob": f"src/**/{i}*.py"}, _match_line),
)


def tool_text(count, maker, i: int, tokens: int) -> str:
    """Lines from `maker` until the text is `tokens` tokens long (to within a line)."""
    probe = "\n".join(maker(i, n) for n in range(20))
    per_line = max(1.0, count(probe) / 20)
    lines = [maker(i, n) for n in range(max(1, round(tokens / per_line)))]
    while len(lines) > 1 and count("\n".join(lines)) > tokens:
        lines.pop()
    return "\n".join(lines)


@dataclass
class Trace:
    system: str
    task: str
    calls: list[dict[str, Any]]  # the assistant message of each step (one tool call)
    results: list[dict[str, Any]]  # the tool message of each step
    result_tokens: list[int]
    scale: float  # SIZES scale used to fit the context
    final_prompt_tokens: int

    def messages(self, steps: int) -> list[dict[str, Any]]:
        out = [{"role": "system", "content": self.system}, {"role": "user", "content": self.task}]
        for call, result in zip(self.calls[:steps], self.results[:steps]):
            out += [call, result]
        return out


def build_trace(engine, steps: int, system_tokens: int, budget: int) -> Trace:
    """The scripted trace, its tool results scaled (together) so the whole conversation
    stays within `budget` tokens."""
    def count(text: str) -> int:
        return len(engine.encode_text(text))

    system, i = "", 0
    while count(system) < system_tokens:
        system += SYSTEM_SENTENCES[i % len(SYSTEM_SENTENCES)] + " "
        i += 1
    scale = 1.0
    for _ in range(4):
        calls, results, sizes = [], [], []
        for k in range(steps):
            name, args, maker = CALLS[k % len(CALLS)]
            call_id = f"call_{k}"
            calls.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(args(k))}}]})
            text = tool_text(count, maker, k, max(MIN_RESULT_TOKENS, int(SIZES[k % len(SIZES)] * scale)))
            results.append({"role": "tool", "tool_call_id": call_id, "name": name, "content": text})
            sizes.append(count(text))
        trace = Trace(system.strip(), TASK, calls, results, sizes, scale, 0)
        trace.final_prompt_tokens = len(engine.encode_chat(trace.messages(steps), tools=EDIT_TOOLS))
        if trace.final_prompt_tokens <= budget:
            return trace
        # Everything but the results (system, tools, calls, template glue) stays; the results
        # share what is left of the budget.
        fixed = trace.final_prompt_tokens - sum(sizes)
        room = 0.97 * (budget - fixed)
        if room < steps * MIN_RESULT_TOKENS:
            break
        scale *= room / sum(sizes)
    from mlxlocal.errors import MlxLocalError

    raise MlxLocalError(f"the agent trace of {steps} steps does not fit {budget} tokens of context even with "
                        f"tool results of {MIN_RESULT_TOKENS} tokens: lower --turns or use a longer-context model")


def reply_ids(engine, before: list[dict[str, Any]], message: dict[str, Any]) -> list[int]:
    """The ids a model would generate for `message` (an assistant reply) after `before`:
    the template's rendering of it between the generation prompt and the end of turn."""
    fmt = engine.chat_format
    head = fmt.render(before, EDIT_TOOLS, add_generation_prompt=True)
    full = fmt.render(before + [message], EDIT_TOOLS, add_generation_prompt=False)
    marked = fmt.render(before + [{"role": "assistant", "content": REPLY_MARKER}], EDIT_TOOLS,
                        add_generation_prompt=False)
    end = marked.partition(REPLY_MARKER)[2]
    if full.startswith(head) and full.endswith(end):
        text = full[len(head):len(full) - len(end)]
    else:  # a template that renders earlier turns differently: the call as plain JSON
        text = json.dumps(message["tool_calls"][0]["function"])
    return fmt.encode(text)


def text_view(messages: list[dict[str, Any]], keep: int) -> list[dict[str, Any]]:
    """Text engineering: every tool result but the last `keep` replaced by the placeholder."""
    tools = [i for i, m in enumerate(messages) if m["role"] == "tool"]
    old = set(tools[: max(0, len(tools) - keep)])
    return [dict(m, content=PLACEHOLDER) if i in old else m for i, m in enumerate(messages)]


# ------------------------------------------------------------------ one mode
def run_mode(loaded, mode: str, trace: Trace, steps: int, keep: int, gen_tokens: int, kv_tokens: int,
             warmup: int = 1) -> dict:
    from mlxlocal.engine import SamplingParams, open_engine

    policy = {"akv_drop": CompactionPolicy(keep), "akv_drop_reposition": CompactionPolicy(keep, reposition=True)}
    spans = ConversationSpans(policy.get(mode))
    engine = open_engine(loaded, max_num_seqs=1, kv_tokens=kv_tokens)
    params = SamplingParams(max_tokens=gen_tokens, temperature=0, ignore_eos=True)
    rows: list[dict[str, Any]] = []
    try:
        for _ in range(warmup):  # warm-up requests that share nothing with the trace
            for _ in engine.generate([7] * 8, SamplingParams(max_tokens=2, ignore_eos=True)):
                pass
        session = engine.new_session()
        conv = trace.messages(0)
        ids: list[int] = []
        reply_at: int | None = None
        peak_blocks = 0
        for k in range(steps):
            if mode == "text":
                prompt, edits = engine.encode_chat(text_view(conv, keep), tools=EDIT_TOOLS), None
            else:
                prompt = spans.prompt(engine, conv, ids, reply_at, EDIT_TOOLS)
                edits = spans.edits(conv)
            stats, blocks = None, 0
            t0 = time.perf_counter()
            for chunk in engine.generate(prompt, params, session=session, edits=edits):
                if chunk.stats is not None:
                    stats = chunk.stats
                if chunk.token is not None or chunk.stats is not None:
                    blocks = max(blocks, engine.stats()["blocks_used"])
            wall = time.perf_counter() - t0
            if stats is None:  # the contract: a finished stream's last chunk carries the stats
                raise RuntimeError("the engine's stream ended without its stats")
            peak_blocks = max(peak_blocks, blocks)
            attended = stats.prompt_tokens - stats.dropped_tokens
            rows.append(dict(step=k + 1, prompt_tokens=stats.prompt_tokens, cached_tokens=stats.cached_tokens,
                             prefill_tokens=stats.prefill_tokens,
                             dropped_tokens=stats.dropped_tokens, repositioned_tokens=stats.repositioned_tokens,
                             attended_tokens=attended, output_tokens=stats.completion_tokens,
                             blocks_used=blocks, ttft_s=stats.ttft_s, decode_tps=stats.decode_tps, wall_s=wall))
            # The scripted call is the reply, whatever was generated: the same trace in every mode.
            call = trace.calls[k]
            if mode != "text":
                generated = reply_ids(engine, conv, call)
                spans.replied(engine, prompt, generated)
                ids = prompt + generated
            conv = conv + [call, trace.results[k]]
            reply_at = len(conv) - 2
        final: dict[str, Any] = dict(session_cached_len=session.cached_len,
                                     session_dropped_len=session.dropped_len, engine=engine.stats())
    finally:
        engine.shutdown()
    return dict(mode=mode, policy=policy[mode].describe() if mode in policy else None, steps=rows,
                peak_blocks=peak_blocks, block_size=final["engine"]["block_size"], final=final)


# ------------------------------------------------------------------ totals and ratios
def summarize(run: dict, discount: float, output_price: float) -> dict:
    rows = run["steps"]
    prefill = sum(r["prefill_tokens"] for r in rows)
    cached_attended = sum(max(0, r["attended_tokens"] - r["prefill_tokens"]) for r in rows)
    output = sum(r["output_tokens"] for r in rows)
    decode = [r["decode_tps"] for r in rows if r["decode_tps"]]
    return dict(
        prefill_tokens=prefill, cached_tokens=sum(r["cached_tokens"] for r in rows),
        cached_attended_tokens=cached_attended, output_tokens=output,
        dropped_tokens_last=rows[-1]["dropped_tokens"], attended_last=rows[-1]["attended_tokens"],
        attended_mean=sum(r["attended_tokens"] for r in rows) / len(rows),
        peak_blocks=run["peak_blocks"], ttft_total_s=sum(r["ttft_s"] for r in rows),
        ttft_last_s=rows[-1]["ttft_s"], ttft_max_s=max(r["ttft_s"] for r in rows),
        decode_tps_mean=sum(decode) / len(decode) if decode else None,
        cost=prefill + cached_attended * discount + output * output_price)


RATIO_KEYS = ("prefill_tokens", "attended_mean", "attended_last", "peak_blocks", "ttft_total_s", "cost")


def median_run(passes: list[dict]) -> dict:
    """One run from repeated passes of a mode: token counts from the first (the trace is
    scripted and greedy: every pass counts the same), timings the per-step medians."""
    run = dict(passes[0], steps=[dict(r) for r in passes[0]["steps"]], passes=len(passes))
    for i, row in enumerate(run["steps"]):
        for key in ("ttft_s", "decode_tps", "wall_s"):
            row[key] = statistics.median(p["steps"][i][key] for p in passes)
    return run


def edits_scenario(loaded, *, steps: int = 30, keep: int = 12, gen_tokens: int = 16, system_tokens: int = 400,
                 discount: float = 0.1, output_price: float = 4.0, modes: tuple[str, ...] = MODES,
                 repeats: int = 1, warmup: int = 1) -> dict:
    """Every mode on the same scripted trace, `repeats` passes alternating between the
    modes (a slow moment of the machine hits them alike); per-step rows (median timings),
    totals, ratios vs standard."""
    from mlxlocal.engine import open_engine

    probe = open_engine(loaded, kv_tokens=64, max_num_seqs=1)
    try:
        context = probe.context_length
        budget = context - gen_tokens - 64
        trace = build_trace(probe, steps, system_tokens, budget)
    finally:
        probe.shutdown()
    note = ("" if trace.scale >= 1 else
            f"tool results scaled to {trace.scale:.0%} of their sizes to fit the {context}-token context")
    log(f"akv: {steps} steps, tool results {min(trace.result_tokens)}..{max(trace.result_tokens)} tokens, "
        f"final prompt {trace.final_prompt_tokens} tokens, keep last {keep}" + (f"; {note}" if note else ""))
    kv_tokens = trace.final_prompt_tokens + 4 * gen_tokens + 256
    passes: dict[str, list[dict]] = {mode: [] for mode in modes}
    for r in range(repeats):
        for mode in modes:
            t0 = time.perf_counter()
            passes[mode].append(run_mode(loaded, mode, trace, steps, keep, gen_tokens, kv_tokens, warmup))
            log(f"akv: {mode} pass {r + 1}/{repeats} done in {time.perf_counter() - t0:.1f} s")
    runs = {mode: median_run(p) for mode, p in passes.items()}
    totals = {m: summarize(r, discount, output_price) for m, r in runs.items()}
    base = totals.get("standard")
    ratios = {m: {k: (t[k] / base[k] if base and base[k] else None) for k in RATIO_KEYS}
              for m, t in totals.items()} if base else {}
    return dict(steps=steps, keep=keep, gen_tokens=gen_tokens, context=context, system_tokens=system_tokens,
                repeats=repeats,
                tool_result_tokens=trace.result_tokens, tool_result_scale=trace.scale, note=note,
                final_prompt_tokens=trace.final_prompt_tokens, placeholder=PLACEHOLDER,
                prices=dict(input=1.0, cached_input=discount, output=output_price,
                            unit="uncached input token",
                            formula="uncached input + cached input x cached_input + output x output; "
                                    "dropped tokens are not attended and not billed"),
                modes=list(runs), runs=runs, totals=totals, ratios_vs_standard=ratios)


# ------------------------------------------------------------------ report
LABELS = {"standard": "standard", "akv_drop": "drop", "akv_drop_reposition": "drop+repos", "text": "text"}


def print_edits(a: dict, con) -> None:
    from rich.table import Table

    con.print(f"agent trace: {a['steps']} steps, tool results {min(a['tool_result_tokens'])}.."
              f"{max(a['tool_result_tokens'])} tokens (mean {sum(a['tool_result_tokens']) / a['steps']:.0f}), "
              f"final prompt {a['final_prompt_tokens']} of {a['context']} context tokens, "
              f"{a['gen_tokens']} generated per step; AKV keeps the last {a['keep']} tool results")
    if a["note"]:
        con.print(a["note"], style="dim")
    t = Table(title="totals over the trace", caption="attended: mean prompt tokens in the KV cache per decode "
              "step; blocks: peak KV blocks in use; TTFT: sum over the steps")
    for col in ("mode", "prefill", "attended", "dropped", "blocks", "TTFT", "tok/s", "cost"):
        t.add_column(col, justify="left" if col == "mode" else "right")
    for mode in a["modes"]:
        s = a["totals"][mode]
        dec = s["decode_tps_mean"]
        t.add_row(LABELS.get(mode, mode), str(s["prefill_tokens"]), f"{s['attended_mean']:.0f}",
                  str(s["dropped_tokens_last"]), str(s["peak_blocks"]), f"{s['ttft_total_s']:.2f} s",
                  f"{dec:.0f}" if dec else "-", f"{s['cost']:.0f}")
    con.print(t)
    steps = Table(title="per step: TTFT ms (tokens attended per decode step)")
    steps.add_column("step", justify="right")
    steps.add_column("prompt", justify="right")
    for mode in a["modes"]:
        steps.add_column(LABELS.get(mode, mode), justify="right")
    runs = [a["runs"][m]["steps"] for m in a["modes"]]
    for rows in zip(*runs):
        steps.add_row(str(rows[0]["step"]), str(rows[0]["prompt_tokens"]),
                      *(f"{r['ttft_s'] * 1000:.0f} ({r['attended_tokens']})" for r in rows))
    con.print(steps)
    if a["ratios_vs_standard"]:
        r = Table(title="ratios ÷ standard")
        for col in ("mode", "prefill", "attended", "attended (last step)", "blocks", "TTFT", "cost"):
            r.add_column(col, justify="left" if col == "mode" else "right")
        for mode in a["modes"]:
            if mode == "standard":
                continue
            x = a["ratios_vs_standard"][mode]
            r.add_row(LABELS.get(mode, mode), *(f"{x[k]:.2f}" if x[k] is not None else "-" for k in RATIO_KEYS))
        con.print(r)
    p = a["prices"]
    con.print(f"API cost in uncached-input-token units: input 1, cached input {p['cached_input']:g}, output "
              f"{p['output']:g} (--cached-discount, --output-price); dropped tokens are not billed. "
              f"{a['repeats']} pass(es) per mode, alternating, each on a fresh engine (timings: per-step "
              "medians); the trace is scripted (random weights would say gibberish): token counts and "
              "timings come from the engine.", style="dim")
