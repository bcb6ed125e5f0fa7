"""Weight layout for the MLX reference matmul: projections stored column-major where faster.

`x @ W.T` with W [N, K] row-major, as checkpoints store it, is the transposed-operand case of
the BLAS MLX's CPU backend calls, which there runs 1.2-1.6x slower than the same product on
a [K, N] row-major operand. Storing W as the transpose of a contiguous [K, N] array (a
column-major view: same shape, same values, so every consumer is unchanged) makes `W.T` that
operand. Where weights are copied at load anyway (no Metal: nothing is memory-mapped in
place) each distinct projection shape is timed in both layouts at decode rows and takes the
faster; on Metal the mapped weights stay as they are (our kernels and MLX's read row-major).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import mlx.core as mx

from mlxlocal.metal import dispatch
from mlxlocal.metal.fused import seconds
from mlxlocal.metal.kernel import dtype_name, metal_available

COLUMN, ROW = "ours (column-major)", "mlx built-in (row-major)"
ROWS = (1, 8)  # decode rows timed; the sum decides
TIMED_N = 2048  # output rows timed at most: a 150k-row vocabulary head is timed on a slice
REPEATS = 3


CHUNK = 256  # rows transposed at a time: a chunk stays in cache (3x faster on a 150k vocabulary)


def column_major(w: mx.array) -> mx.array:
    """The same [N, K] values, laid out so that w.T is a row-contiguous [K, N] array."""
    if w.shape[0] <= CHUNK:
        return mx.contiguous(w.T).T
    parts = [mx.contiguous(w[i : i + CHUNK].T) for i in range(0, w.shape[0], CHUNK)]
    return mx.concatenate(parts, axis=1).T


class Layouts:
    """Per (N, K, dtype): COLUMN or ROW, timed once per process (`timer(fn)`: seconds)."""

    def __init__(self, timer: Callable[[Callable[[], mx.array]], float] | None = None):
        self.timer = timer or _seconds
        self.made: dict[tuple[int, int, str], tuple[str, float, float]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def key(w: mx.array) -> tuple[int, int, str]:
        return (w.shape[0], w.shape[1], dtype_name(w.dtype))

    def column(self, w: mx.array) -> bool:
        key = self.key(w)
        with self._lock:
            if key not in self.made:
                self.made[key] = self._measure(min(w.shape[0], TIMED_N), w.shape[1], w.dtype)
        return self.made[key][0] == COLUMN

    def _measure(self, n: int, k: int, dtype: mx.Dtype) -> tuple[str, float, float]:
        rnd = mx.random.key(0)  # not the global key: that one is the seeded sampling's
        w = mx.random.normal((n, k), key=rnd).astype(dtype)
        wc = column_major(w)
        xs = [mx.random.normal((m, k), key=rnd).astype(dtype) for m in ROWS]
        mx.eval(w, wc, xs)
        col = row = 0.0
        for x in xs:
            c, r = [], []
            for _ in range(REPEATS):  # alternating
                c.append(self.timer(lambda x=x: x @ wc.T))
                r.append(self.timer(lambda x=x: x @ w.T))
            col += sorted(c)[REPEATS // 2]
            row += sorted(r)[REPEATS // 2]
        return (COLUMN if col < row else ROW), col * 1e6, row * 1e6

    def plan(self, weights: Iterable[mx.array] | None = None) -> list[dict]:
        """The choices so far (for these weights' shapes, when given), as dispatch.Choice
        dicts (bench and `show` print them)."""
        if weights is not None and (metal_available() or dispatch.mode() != "auto"):
            return []  # not measured: forced, or no layout change on Metal
        keys = None if weights is None else {self.key(w) for w in weights}
        return [{"op": "weight_layout", "key": {"N": n, "K": k, "dtype": dt}, "path": path,
                 "how": "measured", "ours_us": round(c, 3), "mlx_us": round(r, 3)}
                for (n, k, dt), (path, c, r) in sorted(self.made.items())
                if keys is None or (n, k, dt) in keys]


def _seconds(fn: Callable[[], mx.array]) -> float:
    return seconds(fn, calls=2, rounds=1)


layouts = Layouts()


def relayout(owners: Iterable[tuple[object, str]]) -> int:
    """Store each (module, parameter name)'s float 2-D weight column-major where the layout
    measures faster (`--kernels ours`: always; `mlx` or Metal: never). Returns the number
    of weights moved; each is evaluated at once, so the row-major copy is freed as it goes."""
    m = dispatch.mode()
    if metal_available() or m == "mlx":
        return 0
    moved = 0
    for module, name in owners:
        w = module[name]  # type: ignore[index]
        if w.ndim != 2 or not mx.issubdtype(w.dtype, mx.floating):
            continue
        if m == "ours" or layouts.column(w):
            module[name] = column_major(w)  # type: ignore[index]
            mx.eval(module[name])  # type: ignore[index]
            moved += 1
    return moved
