"""`bench profile`: where a decode step's time goes, ours and mlx-lm's, at batch 1 and 8.

Ours: the engine's StepProfile hook (mlxlocal.engine.profile) times each step's host phases
(schedule, build, sample, output) and its evaluation (submit: mx.async_eval; wait: for the
previous forward to end before the next is submitted, and the block on the previous step's
tokens); the step's wall time is the gap between consecutive step starts
(what the engine loop adds between steps shows as "loop"). mlx-lm: the same phases of its own
loops, timed from outside: generate_step at batch 1 (mlx_lm.generate), BatchGenerator beyond.
Its model call is "build", logsumexp and sampling "sample", mx.async_eval "submit", the block on
the previous tokens (y.item(), or mx.eval in BatchGenerator) "wait", the rest until the next
step "output". Only steps where every sequence decodes count. MLX's async_eval blocks while
too many tasks are in flight, so on a busy device submit holds device time too: host time is
the four host phases. Per run: means per step; over runs (alternating): medians.
"""

from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from typing import Any

from mlxlocal.bench.common import log, random_prompt, run_streams
from mlxlocal.engine import EVAL_PHASES, HOST_PHASES, PHASES, StepProfile
from mlxlocal.errors import EngineOptionError

SKIP = 2  # the first steady steps still carry the switch from prefill


def summarize_steps(steps: list[dict]) -> dict:
    """Mean per step of each phase, host and eval (their sums), wall, and loop (the rest)."""
    steps = steps[SKIP:] if len(steps) > SKIP + 2 else steps
    if not steps:
        return dict(steps=0)
    out = {p: statistics.fmean(s[p] for s in steps) for p in PHASES}
    out["host"] = sum(out[p] for p in HOST_PHASES)
    out["eval"] = sum(out[p] for p in EVAL_PHASES)
    out["wall"] = statistics.fmean(s["wall"] for s in steps)
    out["loop"] = out["wall"] - out["host"] - out["eval"]
    out["steps"] = len(steps)
    return out


def ours_steps(engine, prompts: list[list[int]], gen_tokens: int) -> list[dict]:
    """One timed run on the engine: its decode steps with every sequence in, each with its wall."""
    from mlxlocal.engine import SamplingParams

    prof = engine.profile = StepProfile()
    try:
        run_streams(
            engine, prompts, SamplingParams(max_tokens=gen_tokens, ignore_eos=True, temperature=0)
        )
    finally:
        engine.profile = None
    out = []
    for a, b in zip(prof.steps, prof.steps[1:]):
        if a["decode"] == len(prompts) and a["prefill"] == 0:
            out.append(dict(a, wall=b["t0"] - a["t0"]))
    return out


# ------------------------------------------------------------------ mlx-lm, timed from outside
class _Marks:
    """Phase starts, (name, time), while on; a step starts at each "schedule"."""

    def __init__(self) -> None:
        self.on = False
        self.marks: list[tuple[str, float]] = []

    def __call__(self, name: str) -> None:
        if self.on:
            self.marks.append((name, time.perf_counter()))

    def steps(self, keep: list[bool]) -> list[dict]:
        starts = [i for i, (n, _) in enumerate(self.marks) if n == "schedule"]
        out = []
        for k, (i, j) in enumerate(zip(starts, starts[1:])):
            step = dict.fromkeys(PHASES, 0.0)
            for (name, t), (_, t_next) in zip(self.marks[i:j], self.marks[i + 1 : j + 1]):
                step[name] += t_next - t
            step["wall"] = self.marks[j][1] - self.marks[i][1]
            if keep[k]:
                out.append(step)
        return out


class _TimedModel:
    """The model, its calls marked as build; everything else passed through."""

    def __init__(self, model, marks: _Marks):
        self.__dict__.update(_model=model, _marks=marks)

    def __call__(self, *args, **kwargs):
        self._marks("build")
        out = self._model(*args, **kwargs)
        self._marks("sample")
        return out

    def __getattr__(self, name):
        return getattr(self._model, name)


class _TimedMx:
    """mlx.core as mlx_lm.generate sees it, with its evaluations marked."""

    def __init__(self, mx, marks: _Marks):
        self._mx, self._marks = mx, marks

    def __getattr__(self, name):
        return getattr(self._mx, name)

    def async_eval(self, *args):
        self._marks("submit")
        self._mx.async_eval(*args)
        self._marks("wait")

    def eval(self, *args):
        self._marks("wait")
        self._mx.eval(*args)
        self._marks("output")


@contextmanager
def _timed_mlx_lm(marks: _Marks):
    import sys

    import mlx.core as mx
    import mlx_lm.generate  # noqa: F401  (the package's `generate` attribute is the function)

    gen = sys.modules["mlx_lm.generate"]
    gen.mx = _TimedMx(mx, marks)  # type: ignore[attr-defined]  # a module global of mlx-lm's
    try:
        yield
    finally:
        gen.mx = mx  # type: ignore[attr-defined]  # (ModuleType declares no attributes)


def mlx_lm_steps(model, prompts: list[list[int]], gen_tokens: int) -> list[dict]:
    """One timed run through mlx-lm: generate_step for one prompt, BatchGenerator for more."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator, generate_step

    marks = _Marks()
    timed: Any = _TimedModel(model, marks)  # duck-types the nn.Module mlx-lm's signatures name
    keep: list[bool] = []
    with _timed_mlx_lm(marks):
        if len(prompts) == 1:
            it = generate_step(
                mx.array(prompts[0]),
                timed,
                max_tokens=gen_tokens,
                sampler=lambda x: mx.argmax(x, axis=-1),
            )
            next(it)  # the prefill and the first token
            marks.on = True
            for _ in range(gen_tokens - 1):
                marks("schedule")
                next(it)
                marks("output")
                keep.append(True)
            marks("schedule")
        else:
            bg = BatchGenerator(
                timed, max_tokens=gen_tokens, completion_batch_size=max(32, len(prompts))
            )
            try:
                bg.insert(prompts, [gen_tokens] * len(prompts))
                while len(bg.next_generated()) < len(prompts):  # until every sequence decodes
                    pass
                marks.on = True
                while True:
                    marks("schedule")
                    responses = bg.next_generated()
                    marks("output")
                    if not responses:
                        break
                    keep.append(
                        len(responses) == len(prompts)
                        and all(r.finish_reason is None for r in responses)
                    )
            finally:
                bg.close()
    return marks.steps(keep)


# ------------------------------------------------------------------ the section
def profile_bench(
    loaded,
    *,
    prompt_tokens: int,
    gen_tokens: int,
    batches: tuple[int, ...] = (1, 8),
    repeats: int = 3,
    warmup: int = 1,
    compare: str | None = "mlx-lm",
) -> dict:
    """Per decode step: host phases and evaluation, ours and (compare) mlx-lm's, alternating."""
    from mlxlocal.engine import PagedEngine, open_engine

    mc = loaded.model_config
    vocab = mc.vocab_size if mc else loaded.config.get("vocab_size", 32000)
    top = max(batches)
    prompts = [random_prompt(prompt_tokens, vocab, seed=3000 + i) for i in range(top)]
    engine = open_engine(
        loaded,
        prefix_cache=False,
        max_num_seqs=top,
        kv_tokens=top * (prompt_tokens + gen_tokens + 32),
    )
    if not isinstance(engine, PagedEngine):
        engine.shutdown()
        raise EngineOptionError(
            f"--profile times the paged engine's steps; {loaded.info.name} runs on the dense one"
        )
    ref = None
    if compare == "mlx-lm":
        import mlx_lm

        log(f"loading {loaded.info.path} with mlx_lm.load ...")
        ref = mlx_lm.load(str(loaded.info.path))[0]  # the model; no tokenizer needed
    ours: dict[int, list[dict]] = {b: [] for b in batches}
    theirs: dict[int, list[dict]] = {b: [] for b in batches}
    order: list[str] = []
    try:
        for _ in range(warmup):
            for b in batches:
                run_streams(engine, prompts[:b], _greedy(8))
                if ref is not None:
                    mlx_lm_steps(ref, prompts[:b], 8)
        for r in range(repeats):
            for b in batches if r % 2 == 0 else batches[::-1]:
                log(f"profile repeat {r + 1}/{repeats}: batch {b}")
                ours[b].append(summarize_steps(ours_steps(engine, prompts[:b], gen_tokens)))
                order.append(f"mlxlocal:{b}")
                if ref is not None:
                    theirs[b].append(summarize_steps(mlx_lm_steps(ref, prompts[:b], gen_tokens)))
                    order.append(f"mlx-lm:{b}")
    finally:
        engine.shutdown()
    rows = []
    for b in batches:
        row: dict[str, Any] = dict(batch=b, mlxlocal=_median_runs(ours[b]), mlxlocal_runs=ours[b])
        if ref is not None:
            row.update(mlx_lm=_median_runs(theirs[b]), mlx_lm_runs=theirs[b])
            a, m = row["mlxlocal"].get("host"), row["mlx_lm"].get("host")
            row["host_ratio_vs_mlx_lm"] = a / m if a is not None and m else None
        rows.append(row)
    return dict(
        prompt_tokens=prompt_tokens,
        gen_tokens=gen_tokens,
        repeats=repeats,
        rows=rows,
        order=order,
        compare=compare,
    )


def _greedy(n: int):
    from mlxlocal.engine import SamplingParams

    return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0)


def _median_runs(runs: list[dict]) -> dict:
    runs = [r for r in runs if r.get("steps")]
    if not runs:
        return dict(steps=0)
    keys = PHASES + ("host", "eval", "wall", "loop")
    out = {k: statistics.median(r[k] for r in runs) for k in keys}
    out["steps"] = statistics.median(r["steps"] for r in runs)
    out["host_share"] = out["host"] / out["wall"] if out["wall"] > 0 else None
    return out


# ------------------------------------------------------------------ the report
def _us(x) -> str:
    return "-" if x is None else f"{x * 1e6:,.0f}"


def profile_lines(p: dict) -> list[str]:
    """What the table shows, in words: host per step vs the step, and vs mlx-lm's."""
    lines = []
    for row in p["rows"]:
        for who in ("mlxlocal", "mlx_lm"):
            s = row.get(who)
            if not s or not s.get("steps"):
                continue
            bound = (
                "host-bound: the device waits on the host"
                if s["eval"] < 0.2 * s["wall"]
                else "host time under the evaluation's: hidden where the device overlaps it"
            )
            lines.append(
                f"batch {row['batch']}, {who}: host {_us(s['host'])} µs "
                f"+ eval {_us(s['eval'])} µs "
                f"of a {_us(s['wall'])} µs step (host {s['host_share']:.0%}); {bound}"
            )
        if row.get("host_ratio_vs_mlx_lm"):
            lines.append(
                f"batch {row['batch']}: host per step ours ÷ mlx-lm "
                f"×{row['host_ratio_vs_mlx_lm']:.2f}"
            )
    return lines


def print_profile(p: dict, con) -> None:
    from rich.table import Table

    t = Table(
        title=f"decode step profile, µs per step (-p {p['prompt_tokens']} -g {p['gen_tokens']}, "
        f"medians of {p['repeats']} runs of per-step means)"
    )
    t.add_column("phase")
    cols = [(row, who) for row in p["rows"] for who in ("mlxlocal", "mlx_lm") if row.get(who)]
    for row, who in cols:
        t.add_column(
            f"{'ours' if who == 'mlxlocal' else 'mlx-lm'} b={row['batch']}", justify="right"
        )
    for key in HOST_PHASES + ("host",) + EVAL_PHASES + ("eval", "loop", "wall"):
        label = {
            "host": "host (sum)",
            "submit": "eval: submit",
            "wait": "eval: wait",
            "eval": "eval (sum)",
            "wall": "step wall",
        }.get(key, key)
        t.add_row(label, *[_us(row[who].get(key)) for row, who in cols])
    t.add_row("steps", *[f"{row[who].get('steps', 0):.0f}" for row, who in cols])
    con.print(t)
    for line in profile_lines(p):
        con.print(line, highlight=False)
