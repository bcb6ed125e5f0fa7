"""Workload scenarios: a multi-turn agent trace (prefix cache on vs off, optionally mlx-lm's
prompt cache) and concurrent streams (aggregate decode tok/s at 1, 2, 4, ... N streams)."""

from __future__ import annotations

import json
import time
from typing import Any

from mlxlocal.bench.common import (
    StreamTimes,
    log,
    median,
    random_prompt,
    run_streams,
    window_decode_tps,
)

# ------------------------------------------------------------------ agent trace
SYSTEM_SENTENCES = [
    "You are a coding agent working in a local repository on the user's machine.",
    "Read files before you change them, and run the tests after every change.",
    "Call one tool at a time and wait for its result before deciding the next step.",
    "Prefer small, reviewable edits; never rewrite a file you have not read.",
    "When a command fails, read the error, form a hypothesis, and check it with a tool.",
    "Report what you changed and why in two or three short sentences at the end.",
    "Never invent file names or function names; search the repository when unsure.",
    "Keep secrets out of logs and never print environment variables.",
]

TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a text file from the repository.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "Path relative to the repository root."},
            "start_line": {"type": "integer"}, "end_line": {"type": "integer"}},
            "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Replace the contents of a file.",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["path", "content"]}}},
    {"type": "function", "function": {
        "name": "run_command", "description": "Run a shell command and return stdout, stderr, exit code.",
        "parameters": {"type": "object", "properties": {
            "command": {"type": "string"}, "timeout_s": {"type": "integer", "default": 60}},
            "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "search_code", "description": "Search the repository for a regular expression.",
        "parameters": {"type": "object", "properties": {
            "pattern": {"type": "string"}, "glob": {"type": "string"}},
            "required": ["pattern"]}}},
]

# (user message, tool name, arguments, tool result) per turn
AGENT_STEPS = [
    ("The tests in tests/test_parser.py fail. Find out why.", "run_command",
     {"command": "pytest tests/test_parser.py -x -q"},
     "FAILED tests/test_parser.py::test_nested - AssertionError: expected 3 tokens, got 2\n1 failed, 11 passed"),
    ("Look at the tokenizer the parser uses.", "search_code", {"pattern": "def tokenize", "glob": "*.py"},
     "src/parser/lexer.py:41: def tokenize(text: str) -> list[Token]:"),
    ("Read that function.", "read_file", {"path": "src/parser/lexer.py", "start_line": 35, "end_line": 70},
     "def tokenize(text: str) -> list[Token]:\n    out = []\n    for m in PATTERN.finditer(text):\n"
     "        if m.group(0).strip():\n            out.append(Token(m.lastgroup, m.group(0)))\n    return out"),
    ("Fix the bug so nested brackets produce separate tokens.", "write_file",
     {"path": "src/parser/lexer.py", "content": "PATTERN = re.compile(r'(?P<LB>\\[)|(?P<RB>\\])|(?P<W>\\w+)')"},
     "wrote 1 line to src/parser/lexer.py"),
    ("Run the tests again.", "run_command", {"command": "pytest tests/test_parser.py -q"}, "12 passed in 0.41s"),
    ("Now run the whole suite.", "run_command", {"command": "pytest -q"}, "148 passed in 9.8s"),
    ("Check the other callers of tokenize still work.", "search_code", {"pattern": "tokenize\\("},
     "src/parser/parse.py:12\nsrc/cli.py:88\ntests/test_lexer.py:7"),
    ("Summarize the change.", "read_file", {"path": "CHANGELOG.md"}, "## Unreleased\n"),
]


def build_agent_turns(engine, system_tokens: int, turns: int) -> list[list[int]]:
    """Token ids of the conversation at each turn: system + tools, then per step
    user -> assistant tool call -> tool result; turn k ends with user message k."""
    text, i = "", 0
    while len(engine.encode_text(text)) < system_tokens:
        text += SYSTEM_SENTENCES[i % len(SYSTEM_SENTENCES)] + " "
        i += 1
    messages: list[dict[str, Any]] = [{"role": "system", "content": text.strip()}]
    out = []
    for k in range(turns):
        user, tool, args, result = AGENT_STEPS[k % len(AGENT_STEPS)]
        messages.append({"role": "user", "content": user})
        out.append(engine.encode_chat(messages, tools=TOOLS))
        call_id = f"call_{k}"
        messages.append({"role": "assistant", "content": "", "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": tool, "arguments": json.dumps(args)}}]})
        messages.append({"role": "tool", "tool_call_id": call_id, "content": result})
    return out


def _engine_turn(engine, ids: list[int], max_tokens: int) -> dict:
    from mlxlocal.engine import SamplingParams

    t0 = time.perf_counter()
    first, stats, tokens = None, None, []
    for c in engine.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)):
        if c.token is not None:
            first = first or time.perf_counter()
            tokens.append(c.token)
        if c.stats is not None:
            stats = c.stats
    if first is None or stats is None:
        raise RuntimeError("the engine's stream ended without a token or its stats")
    return dict(ttft_s=first - t0, cached_tokens=stats.cached_tokens, prompt_tokens=len(ids), tokens=tokens)


class MlxLmPromptCache:
    """mlx-lm's prompt cache reused across turns as its server does: keep the longest common
    prefix with the new prompt (trim_prompt_cache), prefill the rest. Greedy decoding. One
    turn at a time, so the bench can interleave its turns with ours."""

    def __init__(self, model):
        import mlx.core as mx
        from mlx_lm.generate import generate_step
        from mlx_lm.models.cache import make_prompt_cache

        self.model, self.mx, self.generate_step = model, mx, generate_step
        for _ in generate_step(mx.array([5] * 8), model, max_tokens=2, sampler=self.greedy):  # warm-up
            pass
        self.cache, self.cached_tokens = make_prompt_cache(model), []

    def greedy(self, x):
        return self.mx.argmax(x, axis=-1)

    def turn(self, ids: list[int], max_tokens: int) -> dict:
        from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

        t0 = time.perf_counter()
        limit = min(len(self.cached_tokens), len(ids) - 1)  # keep >= 1 token to feed
        common = next((i for i in range(limit) if self.cached_tokens[i] != ids[i]), limit)
        if len(self.cached_tokens) > common:
            if can_trim_prompt_cache(self.cache):
                trim_prompt_cache(self.cache, len(self.cached_tokens) - common)
            else:
                self.cache, common = make_prompt_cache(self.model), 0
        tokens, ttft = [], None
        for tok, _ in self.generate_step(self.mx.array(ids[common:]), self.model, prompt_cache=self.cache,
                                         max_tokens=max_tokens, sampler=self.greedy):
            if ttft is None:
                ttft = time.perf_counter() - t0
            tokens.append(int(tok))
        self.cached_tokens = (ids + tokens)[: self.cache[0].offset]
        return dict(ttft_s=ttft, cached_tokens=common, prompt_tokens=len(ids), tokens=tokens)


def agent_scenario(loaded, *, system_tokens: int, turns: int = 6, max_tokens: int = 8, repeats: int = 1,
                   compare: str | None = None, cache_on: bool = True) -> dict:
    """Per-turn TTFT with the prefix cache on and off (two fresh engines per repeat) and
    mlx-lm's prompt cache, turns interleaved on/off/mlx-lm, the first mode rotating between
    repeats; medians over repeats."""
    from mlxlocal.engine import SamplingParams, open_engine

    probe = open_engine(loaded, kv_tokens=64, max_num_seqs=1)
    trace = build_agent_turns(probe, system_tokens, turns)
    probe.shutdown()
    modes = (["on"] if cache_on else []) + ["off"]
    ref_model = None
    if compare == "mlx-lm":
        import mlx_lm

        log(f"loading {loaded.info.path} with mlx_lm.load ...")
        ref_model = mlx_lm.load(str(loaded.info.path))[0]  # the model alone
    kv = 2 * (len(trace[-1]) + max_tokens) + 256
    runs: dict[str, list[list[dict]]] = {m: [] for m in modes + (["mlx_lm"] if ref_model else [])}
    order: list[str] = []
    for r in range(repeats):
        log(f"agent repeat {r + 1}/{repeats}: {turns} turns, prompt {len(trace[0])}..{len(trace[-1])} tokens")
        engines = {m: open_engine(loaded, prefix_cache=(m == "on"), kv_tokens=kv, max_num_seqs=2) for m in modes}
        theirs = MlxLmPromptCache(ref_model) if ref_model is not None else None
        try:
            warm = SamplingParams(max_tokens=2, ignore_eos=True)
            for e in engines.values():  # unrelated prompt: starts the thread, shares nothing
                for _ in e.generate([7] * 8, warm):
                    pass
            # Every mode takes each turn in turn (the first rotating between repeats), mlx-lm's
            # prompt cache among them: the same machine state for all, turn by turn.
            names = modes + (["mlx_lm"] if theirs is not None else [])
            rot = names[r % len(names):] + names[: r % len(names)]
            rep: dict[str, list[dict]] = {m: [] for m in names}
            for ids in trace:
                for m in rot:
                    if m == "mlx_lm":
                        assert theirs is not None  # "mlx_lm" is among the names only with theirs
                        rep[m].append(theirs.turn(ids, max_tokens))
                    else:
                        rep[m].append(_engine_turn(engines[m], ids, max_tokens))
                    order.append(m)
        finally:
            for e in engines.values():
                e.shutdown()
        for m in names:
            runs[m].append(rep[m])
    per_turn = {m: [median([rep[t]["ttft_s"] for rep in rs]) for t in range(turns)] for m, rs in runs.items()}
    cached = {m: [rs[0][t]["cached_tokens"] for t in range(turns)] for m, rs in runs.items()}
    last = {m: v[-1] for m, v in per_turn.items()}
    ratios = {}
    if "on" in last:
        ratios["off_over_on"] = last["off"] / last["on"]
    if "mlx_lm" in last:
        ratios["off_over_mlx_lm"] = last["off"] / last["mlx_lm"]
        if "on" in last:
            ratios["mlx_lm_over_on"] = last["mlx_lm"] / last["on"]
    same = {m: all(rep[t]["tokens"] == runs["off"][0][t]["tokens"] for rep in rs for t in range(turns))
            for m, rs in runs.items()}
    return dict(turns=turns, system_tokens=system_tokens, max_tokens=max_tokens, repeats=repeats,
                tools=len(TOOLS), prompt_tokens=[len(t) for t in trace], modes=list(runs),
                ttft_per_turn_s=per_turn, cached_tokens_per_turn=cached, last_turn_ttft_s=last,
                ratios_last_turn=ratios, greedy_tokens_match_off=same, order=order)


# ------------------------------------------------------------------ concurrent streams
def stream_levels(n: int) -> list[int]:
    levels, k = [], 1
    while k < n:
        levels.append(k)
        k *= 2
    return levels + [n]


def mlx_lm_batch_streams(model, prompts: list[list[int]], gen_tokens: int) -> list[StreamTimes]:
    """mlx-lm's continuous batching (BatchGenerator, its defaults, greedy, no stop tokens:
    EOS ignored as in ours): all prompts inserted at once, each token timestamped on arrival."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=gen_tokens, completion_batch_size=max(32, len(prompts)))
    try:
        t0 = time.perf_counter()
        uids = gen.insert(prompts, [gen_tokens] * len(prompts))
        streams = {u: StreamTimes(t0) for u in uids}
        while responses := gen.next_generated():
            now = time.perf_counter()
            for r in responses:
                streams[r.uid].times.append(now)
    finally:
        gen.close()
    return [streams[u] for u in uids]


def _level_run(streams: list[StreamTimes]) -> dict:
    end = max(s.times[-1] for s in streams)
    return dict(decode_tps=window_decode_tps(streams),
                e2e_tps=sum(len(s.times) for s in streams) / (end - streams[0].t0),
                ttft_s=max(s.ttft for s in streams), generated=sum(len(s.times) for s in streams))


def _rows(raw: dict[int, list[dict]], levels: list[int]) -> list[dict]:
    return [dict(streams=k, decode_tps=median([x["decode_tps"] for x in raw[k]]),
                 e2e_tps=median([x["e2e_tps"] for x in raw[k]]),
                 max_ttft_s=median([x["ttft_s"] for x in raw[k]]),
                 decode_tps_runs=[x["decode_tps"] for x in raw[k]],
                 generated=raw[k][0]["generated"]) for k in levels]


def concurrent_scenario(loaded, *, concurrency: int, prompt_tokens: int, gen_tokens: int,
                        repeats: int = 1, warmup: int = 1, compare: str | None = None) -> dict:
    """Aggregate decode tok/s (all streams decoding: after the last first token until the
    first stream ends) and end-to-end tok/s at 1, 2, 4, ... N streams; same prompts. With
    compare="mlx-lm", mlx-lm's BatchGenerator on the same prompts right after each of ours
    (A B A B), medians over repeats, and ratios ours / mlx-lm per stream count."""
    from mlxlocal.engine import SamplingParams, open_engine

    vocab = loaded.model_config.vocab_size if loaded.model_config else loaded.config["vocab_size"]
    prompts = [random_prompt(prompt_tokens, vocab, seed=2000 + i) for i in range(concurrency)]
    ref = None
    if compare == "mlx-lm":
        import mlx_lm

        log(f"loading {loaded.info.path} with mlx_lm.load ...")
        ref = mlx_lm.load(str(loaded.info.path))[0]  # the model; no tokenizer needed
    engine = open_engine(loaded, prefix_cache=False, max_num_seqs=max(concurrency, 1),
                         kv_tokens=concurrency * (prompt_tokens + gen_tokens + 32))
    params = SamplingParams(max_tokens=gen_tokens, ignore_eos=True, temperature=0)
    levels = stream_levels(concurrency)
    raw: dict[int, list[dict]] = {k: [] for k in levels}
    raw_ref: dict[int, list[dict]] = {k: [] for k in levels}
    order: list[str] = []
    try:
        for _ in range(warmup):
            run_streams(engine, prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))
            if ref is not None:
                mlx_lm_batch_streams(ref, prompts[:2], 4)
        for r in range(repeats):
            for k in (levels if r % 2 == 0 else levels[::-1]):
                log(f"concurrent repeat {r + 1}/{repeats}: {k} stream(s)")
                raw[k].append(_level_run(run_streams(engine, prompts[:k], params)))
                order.append(f"mlxlocal:{k}")
                if ref is not None:
                    raw_ref[k].append(_level_run(mlx_lm_batch_streams(ref, prompts[:k], gen_tokens)))
                    order.append(f"mlx-lm:{k}")
    finally:
        engine.shutdown()
    rows = _rows(raw, levels)
    one, top = rows[0], rows[-1]
    out: dict[str, Any] = dict(
        concurrency=concurrency, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens, repeats=repeats,
        levels=rows, decode_ratio=top["decode_tps"] / one["decode_tps"], e2e_ratio=top["e2e_tps"] / one["e2e_tps"],
        order=order)
    if ref is not None:
        ref_rows = _rows(raw_ref, levels)
        for row, rr in zip(rows, ref_rows):
            row["mlx_lm_decode_tps"], row["mlx_lm_e2e_tps"] = rr["decode_tps"], rr["e2e_tps"]
            row["mlx_lm_max_ttft_s"], row["mlx_lm_decode_tps_runs"] = rr["max_ttft_s"], rr["decode_tps_runs"]
            row["mlx_lm_generated"] = rr["generated"]
            row["decode_ratio_vs_mlx_lm"] = _ratio(row["decode_tps"], rr["decode_tps"])
            row["e2e_ratio_vs_mlx_lm"] = _ratio(row["e2e_tps"], rr["e2e_tps"])
        out["mlx_lm_method"] = "mlx_lm.generate.BatchGenerator (defaults; greedy; no stop tokens)"
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None
