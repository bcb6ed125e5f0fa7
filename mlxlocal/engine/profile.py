"""StepProfile: where each engine step's time goes, for `mlxlocal bench profile`.

Set `engine.profile = StepProfile()` and PagedEngine.step records, per step, the host time of
its phases (schedule, build, sample, output) and its evaluation time: wait (for the previous
forward to end, so that the pools are written in place, and for the previous step's tokens)
and submit (mx.async_eval). On a Mac the GPU runs while the host builds the next
step, so a step with little evaluation time is host-bound. Unset (None), no timing at all.
"""

from __future__ import annotations

import time

import mlx.core as mx

HOST_PHASES = ("schedule", "build", "sample", "output")
# Inside MLX's evaluation: async_eval (which also blocks while too many tasks are in flight)
# and the waits (for the previous forward, for the previous tokens).
EVAL_PHASES = ("submit", "wait")
PHASES = HOST_PHASES + EVAL_PHASES


class StepProfile:
    """Filled by the engine thread; read once the requests it timed are done."""

    def __init__(self) -> None:
        # one dict per step: t0, t1 (perf_counter), decode (sequences), prefill (tokens), phases
        self.steps: list[dict] = []
        self._cur: dict = {}
        self._t = 0.0

    def start(self) -> None:
        self._t = time.perf_counter()
        self._cur = dict.fromkeys(PHASES, 0.0)
        self._cur["t0"] = self._t

    def lap(self, phase: str) -> None:
        t = time.perf_counter()
        self._cur[phase] += t - self._t
        self._t = t

    def wait(self, previous: list[tuple]) -> None:
        """Block on the previous step's token arrays (what _take would block on), timed."""
        mx.eval([src[0] for *_, src, _ in previous if src is not None])
        self.lap("wait")

    def end(self, decode: int, prefill: int) -> None:
        self._cur.update(t1=self._t, decode=decode, prefill=prefill)
        self.steps.append(self._cur)
