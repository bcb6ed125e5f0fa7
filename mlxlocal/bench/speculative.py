"""Speculative decoding: plain ÷ speculative decode on the same loaded model.

Engines over one loaded model (the same weights), one plain and one speculating with the
drafter asked for (--draft-model D or --prompt-lookup; with --mtp, the model's MTP heads
beside prompt lookup and a --draft-model if given, each against the plain one). A trained
fixture's own held-out text where its directory has some (bench_prompts.json), else two
prompts through the chat
template: a repetitive one (a JSON list to copy with one edit: prompt lookup finds its
n-grams; fewer items where the context is short) and a free-text one. Greedy, EOS ignored,
-g tokens per stream; at batch 1 (and -b B when asked); after the warm-up, `repeats` passes,
each one plain and one speculative run (in ABBA order). Per cell, medians over the passes:

- acceptance: drafted tokens the model accepted ÷ tokens drafted (GenerationStats);
- accepted per verify step: the engine's spec_accepted ÷ spec_steps over the run (a verify
  step is one forward over every stream's drafts: at batch B, summed over the streams);
- tokens per forward: a stream's tokens ÷ the forwards that made them (each forward of a
  sequence yields one token of the model's own plus the drafts it accepted), plain = 1;
- decode tok/s (summed over the batch's streams) and speculative ÷ plain per pass;
- identical: every speculative stream's tokens equal the plain stream's (greedy outputs must
  not change; a "NO" here is a bug, not noise).

On random weights a separate draft model is a losing bet (its guesses are rejected); the
self-draft (the model drafts for itself: acceptance 100%) and prompt lookup on the
repetitive prompt show the mechanism, a real model and draft on a Mac the real number.
"""

from __future__ import annotations

import json
from typing import Any

from mlxlocal.bench.common import log, median, run_streams
from mlxlocal.errors import ContextLengthError

_ITEMS = [{"sku": f"A-{100 + i}", "name": name, "qty": (i * 7) % 5 + 1, "price": round(2.5 + i * 1.25, 2)}
          for i, name in enumerate(["bolt", "washer", "hinge", "bracket", "spring", "gasket", "rivet", "clamp",
                                    "pulley", "bearing", "spacer", "bushing"])]
FREE = ("Write a short story about a lighthouse keeper who finds a message in a bottle: the sea, the weather, "
        "and what the message says.")


def repetitive(items: int) -> str:
    return ("Return this JSON list unchanged, except that every \"qty\" is doubled. Reply with the JSON only.\n"
            "```json\n" + json.dumps(_ITEMS[:items], indent=2) + "\n```")


def prompt_ids(engine, room: int) -> dict[str, list[int]]:
    """Both prompts through the chat template; the JSON list cut to fewer items where the
    model's context leaves less than `room` tokens of prompt."""
    def encode(text: str) -> list[int]:
        return engine.encode_chat([{"role": "user", "content": text}])

    ids = {"repetitive": encode(repetitive(len(_ITEMS))), "free": encode(FREE)}
    items = len(_ITEMS)
    while len(ids["repetitive"]) > room and items > 1:
        items -= 1
        ids["repetitive"] = encode(repetitive(items))
    for kind, prompt in ids.items():
        if len(prompt) > room:
            raise ContextLengthError(len(prompt), engine.context_length, f"the {kind} bench prompt")
    return ids


def _decode_tps(streams) -> float | None:
    rates = [s.decode_tps for s in streams]
    return sum(rates) if all(r is not None for r in rates) else None


def _run(engine, prompts: list[list[int]], params) -> dict:
    before = engine.stats()
    streams = run_streams(engine, prompts, params)
    after = engine.stats()
    steps = after["spec_steps"] - before["spec_steps"]
    accepted_engine = after["spec_accepted"] - before["spec_accepted"]
    drafted = sum(s.stats.draft_tokens for s in streams)
    accepted = sum(s.stats.accepted_tokens for s in streams)
    tokens = sum(len(s.tokens) for s in streams)
    return dict(
        decode_tps=_decode_tps(streams), tokens=tokens, drafted=drafted, accepted=accepted,
        acceptance=accepted / drafted if drafted else None,
        accepted_per_step=accepted_engine / steps if steps else None,
        # every forward of a sequence yields one token of its own: forwards = tokens - accepted
        tokens_per_forward=tokens / (tokens - accepted) if tokens > accepted else None,
        outputs=[s.tokens for s in streams],
        distinct=len({t for s in streams for t in s.tokens}) / max(len(streams[0].tokens), 1),
    )


def own_prompts(loaded) -> dict[str, list[int]] | None:
    """A trained fixture's held-out text (synthetic/trained.py: bench_prompts.json), token ids:
    its drafts mean something only on text of the kind it learnt."""
    path = loaded.info.path / "bench_prompts.json"
    if not path.is_file():
        return None
    return {str(k): [int(t) for t in v] for k, v in json.loads(path.read_text()).items()}


def speculative_bench(loaded, choices, *, gen_tokens: int, batches: tuple[int, ...] = (1,), repeats: int = 3,
                      warmup: int = 1) -> dict[str, Any]:
    """choices: the SpeculationChoice (mlxlocal.engine), or several side by side (bench spec
    --mtp: MTP, prompt lookup, a draft model), each a speculative engine against one plain one."""
    from mlxlocal.engine import SamplingParams, open_engine, prompt_encoder

    choices = choices if isinstance(choices, list) else [choices]
    top, most = max(batches), max(c.num_draft_tokens for c in choices)
    chat = prompt_encoder(loaded)
    ids = own_prompts(loaded) or prompt_ids(chat, chat.context_length - gen_tokens - most - 1)
    # Room for every stream's prompt, reply and a verify step's drafts.
    kv = top * (max(len(p) for p in ids.values()) + gen_tokens + most + 32)
    plain = open_engine(loaded, prefix_cache=False, max_num_seqs=top, kv_tokens=kv)
    params = SamplingParams(max_tokens=gen_tokens, ignore_eos=True, temperature=0)
    rows = []
    try:
        for choice in choices:
            spec = open_engine(loaded, prefix_cache=False, max_num_seqs=top, kv_tokens=kv, speculative=choice)
            try:
                for b in batches:
                    for kind, prompt in ids.items():
                        row = _cell(plain, spec, [prompt] * b, params, f"{kind}, batch {b}", repeats, warmup)
                        rows.append(dict(_row(kind, b, len(prompt), row), drafter=choice.method))
            finally:
                spec.shutdown()
    finally:
        plain.shutdown()
    return dict(drafter=choices[0].as_dict(), drafters=[c.as_dict() for c in choices],
                describe="; ".join(c.describe() for c in choices), gen_tokens=gen_tokens, repeats=repeats,
                warmup=warmup, rows=rows, own_prompts=own_prompts(loaded) is not None)


def _cell(plain, spec, prompts: list[list[int]], params, label: str, repeats: int, warmup: int) -> list[dict]:
    """The passes of one prompt at one batch: plain and speculative alternating (ABBA)."""
    for w in range(warmup):
        log(f"{label}: warm-up {w + 1}/{warmup}")
        run_streams(plain, prompts, params)
        run_streams(spec, prompts, params)
    passes = []
    for r in range(repeats):
        log(f"{label}: pass {r + 1}/{repeats}")
        if r % 2 == 0:  # ABBA order: a drift over time favours neither
            p, s = _run(plain, prompts, params), _run(spec, prompts, params)
        else:
            s, p = _run(spec, prompts, params), _run(plain, prompts, params)
        passes.append(dict(plain=p, spec=s, identical=p["outputs"] == s["outputs"],
                           ratio=s["decode_tps"] / p["decode_tps"] if s["decode_tps"] and p["decode_tps"] else None))
    return passes


def _row(kind: str, batch: int, prompt_tokens: int, passes: list[dict]) -> dict:
    def med(key: str, side: str = "spec"):
        return median([p[side][key] for p in passes])

    ratio = median([p["ratio"] for p in passes])
    return dict(
        prompt=kind, batch=batch, prompt_tokens=prompt_tokens,
        acceptance=_none_if_nan(med("acceptance")), accepted_per_step=_none_if_nan(med("accepted_per_step")),
        tokens_per_forward=_none_if_nan(med("tokens_per_forward")),
        plain_decode_tps=_none_if_nan(med("decode_tps", "plain")), spec_decode_tps=_none_if_nan(med("decode_tps")),
        ratio=_none_if_nan(ratio), identical=all(p["identical"] for p in passes),
        # distinct tokens ÷ tokens of the plain reply: near 0, the reply loops (random weights
        # often do), and prompt lookup matches the reply itself whatever the prompt
        reply_distinct=med("distinct", "plain"),
        verdict=_verdict(ratio),
        passes=[dict(plain={k: v for k, v in p["plain"].items() if k != "outputs"},
                     spec={k: v for k, v in p["spec"].items() if k != "outputs"},
                     identical=p["identical"], ratio=p["ratio"]) for p in passes],
    )


LOOPING = 0.2  # a plain reply with fewer distinct tokens than this share is called looping

# Alternating runs of the same engine twice differ by a few per cent on a busy CPU: a ratio
# this close to 1 is called even rather than a win or a loss.
NOISE = 0.05


def _verdict(ratio: float | None) -> str | None:
    if ratio is None or ratio != ratio:
        return None
    return "wins" if ratio > 1 + NOISE else "loses" if ratio < 1 - NOISE else "even"


def _none_if_nan(x):
    return None if x is None or x != x else x


def print_speculative(s: dict, con) -> None:
    from rich import box
    from rich.table import Table

    t = Table(title=f"speculative decoding, {s['describe']}: {s['gen_tokens']} tokens per stream, greedy, "
                    f"medians of {s['repeats']} passes (plain and speculative alternating)", box=box.SIMPLE,
              pad_edge=False, collapse_padding=True)
    several = len(s.get("drafters", [])) > 1
    for col in (("drafter",) if several else ()) + ("prompt", "b", "accept", "acc/step", "tok/fwd", "plain",
                                                     "spec", "spec÷plain", "same"):
        t.add_column(col, justify="left" if col in ("prompt", "drafter") else "right", no_wrap=True)

    def f(x, fmt):
        return "-" if x is None else fmt.format(x)

    for r in s["rows"]:
        verdict = {"wins": " wins", "loses": " [yellow]loses[/]", "even": " even"}.get(r["verdict"], "")
        t.add_row(*([r.get("drafter", "")] if several else []), r["prompt"], str(r["batch"]), f(r["acceptance"], "{:.0%}"), f(r["accepted_per_step"], "{:.2f}"),
                  f(r["tokens_per_forward"], "{:.2f}"), f(r["plain_decode_tps"], "{:.1f}"),
                  f(r["spec_decode_tps"], "{:.1f}"), f(r["ratio"], "x{:.2f}") + verdict,
                  "yes" if r["identical"] else "[bold red]NO[/]")
    con.print(t)
    if s.get("own_prompts"):
        con.print("prompts: the model's own held-out text (bench_prompts.json: a trained fixture's kind of text)")
    con.print("b: streams; accept: drafted tokens accepted ÷ drafted; acc/step: accepted per verify step; tok/fwd: "
              "tokens per forward of a sequence (plain: 1); plain, spec: decode tok/s; same: greedy outputs "
              "identical to plain decoding")
    con.print(f"wins / loses: speculative ÷ plain beyond ±{NOISE:.0%} (the noise of alternating runs here), "
              "else even")
    looping = [f"{r['prompt']} (b {r['batch']})" for r in s["rows"] if r["reply_distinct"] < LOOPING]
    if looping:
        con.print(f"the plain reply loops on {', '.join(looping)}: under {LOOPING:.0%} of its tokens distinct "
                  "(a random or tiny model's greedy reply): easy to draft, by lookup in the reply itself or a "
                  "draft model, whatever the prompt")
    if any(r["verdict"] == "loses" for r in s["rows"]):
        why = ("a draft model runs a forward of its own per drafted token; a self-draft or a draft as large as the "
               "model cannot win, it shows the mechanism (acceptance)" if s["drafter"]["method"] == "draft" and not several
               else "looking up and verifying drafts costs more than the accepted tokens save")
        con.print(f"where speculation loses: {why}")
