"""Timing helpers shared by the local speed run (local.py) and the scenarios (scenarios.py),
and the percentile summaries of the endpoint benchmark (endpoint.py, report.py).

Both import from here and local.py imports scenarios, so the dependency runs one way:
local -> scenarios -> common. Aggregate decode tok/s counts the tokens of all streams inside
the window where every stream is decoding (after the last first token, until the first ends).
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def reset_peak() -> None:
    import mlx.core as mx

    mx.reset_peak_memory()


def peak_memory() -> int:
    import mlx.core as mx

    return int(mx.get_peak_memory())


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    """n token ids, deterministic in seed, clear of the special tokens at the top of the vocab."""
    rng = random.Random(seed)
    hi = max(20, vocab - 256)
    return [rng.randrange(10, hi) for _ in range(n)]


def mean_sd(xs: list[float]) -> dict:
    xs = [x for x in xs if x is not None]
    if not xs:
        return dict(mean=None, sd=None, n=0)
    return dict(mean=statistics.fmean(xs), sd=statistics.stdev(xs) if len(xs) > 1 else 0.0, n=len(xs))


def median(xs: list[float]) -> float:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else float("nan")


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), q in [0, 100]."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: list[float]) -> dict[str, float | int | None]:
    vals = [v for v in values if v is not None]
    return {
        "n": len(vals),
        "mean": sum(vals) / len(vals) if vals else None,
        "p50": percentile(vals, 50),
        "p90": percentile(vals, 90),
        "p99": percentile(vals, 99),
        "min": min(vals) if vals else None,
        "max": max(vals) if vals else None,
    }


# ------------------------------------------------------------------ timing one stream
@dataclass
class StreamTimes:
    t0: float
    times: list[float] = field(default_factory=list)
    stats: Any = None  # the engine's GenerationStats (None for mlx-lm)
    tokens: list[int] = field(default_factory=list)  # the ids, in order (engine streams)

    @property
    def ttft(self) -> float:
        return self.times[0] - self.t0

    @property
    def decode_tps(self) -> float | None:
        n = len(self.times)
        span = self.times[-1] - self.times[0] if n else 0.0
        return (n - 1) / span if n > 1 and span > 0 else None


async def _drain(handle, st: StreamTimes) -> None:
    """Read one request handle on the event loop, timestamping each token as it arrives."""
    async for batch in handle.batches():
        now = time.perf_counter()
        for c in batch:
            if c.token is not None:
                st.times.append(now)
                st.tokens.append(c.token)
            if c.finish_reason is not None:
                st.stats = c.stats


def run_streams(engine, prompts: list[list[int]], params) -> list[StreamTimes]:
    """Submit all prompts at once and read every stream on one event loop, as the server
    does (the engine wakes the loop once per step for all of them)."""

    async def main() -> list[StreamTimes]:
        loop = asyncio.get_running_loop()
        t0 = time.perf_counter()
        streams = [(engine.submit(p, params, loop=loop), StreamTimes(t0)) for p in prompts]
        await asyncio.gather(*(_drain(h, st) for h, st in streams))
        return [st for _, st in streams]

    return asyncio.run(main())


def window_decode_tps(streams: list[StreamTimes]) -> float | None:
    """Aggregate decode tok/s while every stream decodes (see module docstring)."""
    if any(len(s.times) < 2 for s in streams):
        return None
    w0 = max(s.times[0] for s in streams)
    w1 = min(s.times[-1] for s in streams)
    n = sum(1 for s in streams for t in s.times if w0 < t <= w1)
    return n / (w1 - w0) if w1 > w0 and n else None
