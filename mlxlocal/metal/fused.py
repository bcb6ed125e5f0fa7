"""RMSNorm, RoPE and prefill attention for backends where mx.fast's are not single kernels.

On Metal (and CUDA) `mx.fast.rms_norm`, `mx.fast.rope` and the sdpa are single kernels. On
MLX's CPU backend they fall back to their definitions in primitive ops, evaluated one op at a
time: ~80 us a norm and ~200 us a rope at decode shapes here, most of a small model's step.
The same definitions under `mx.compile` run as fused kernels, bitwise equal (the fallback
computes exactly this); attention with several queries takes its keys transposed first, so
the scores' matmul is not the BLAS's slow transposed-operand case. Which one runs is measured
once per size class in each process, as the kernel dispatch does; `--kernels mlx` forces
mx.fast, `ours` these.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import rope_utils

from mlxlocal.metal import dispatch
from mlxlocal.metal.kernel import metal_available

FUSED, BUILTIN = "ours (compiled)", "mlx built-in"
COMPOSED = "ours (composed)"  # plain ops, not one compiled kernel
OURS_SHOWN = {"decode_attention": COMPOSED}  # how the plan names an op's FUSED side
REPEATS = 5  # alternating timings per side; the median decides


# ------------------------------------------------------------------ the compositions
def rms_norm_reference(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    return mx.fast.rms_norm(x, weight, eps)


def _rms_norm(x: mx.array, weight: mx.array, eps: mx.array) -> mx.array:
    # MLX's own fallback: float32 statistics, the normalised row cast back, then the weight.
    x32 = x.astype(mx.float32)
    y = x32 * mx.rsqrt(mx.mean(mx.square(x32), axis=-1, keepdims=True) + eps)
    return weight * y.astype(x.dtype)


def _angles(positions: mx.array, inv_freqs: mx.array, like: mx.array) -> tuple[mx.array, mx.array]:
    """cos and sin [B or 1, 1, L, dims/2] of positions [B or 1, L] (float32, scaled): angles
    in float32, the rotation in the dtype of `like` (x's), as MLX's fallback computes them."""
    theta = positions[:, None, :, None] * inv_freqs
    return mx.cos(theta).astype(like.dtype), mx.sin(theta).astype(like.dtype)


def _rotate(x: mx.array, cos: mx.array, sin: mx.array, traditional: bool) -> mx.array:
    """x [..., L, D] rotated; the dims past 2 * cos.shape[-1] pass through (partial rotary)."""
    dims = 2 * cos.shape[-1]
    rot = x[..., :dims]
    if traditional:  # pairs (2j, 2j + 1)
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = mx.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).reshape(rot.shape)
    else:  # pairs (j, j + dims/2)
        x1, x2 = rot[..., : dims // 2], rot[..., dims // 2 :]
        out = mx.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)
    return out if dims == x.shape[-1] else mx.concatenate([out, x[..., dims:]], axis=-1)


def sdpa_reference(q: mx.array, k: mx.array, v: mx.array, scale: float,
                   mask: mx.array | str | None) -> mx.array:
    return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask)


def sdpa_keys_transposed(q: mx.array, k: mx.array, v: mx.array, scale: float,
                         mask: mx.array | str | None) -> mx.array:
    """mx.fast's definition of attention, with the keys copied to [D, S] first: the scores'
    matmul then takes both operands as they lie (a prefill chunk's many queries amortize the
    copy; the transposed-operand matmul is the slow case of the CPU backend's BLAS). Without
    Metal, the second half of the KV heads runs on a second CPU stream: MLX runs each CPU
    stream on a thread of its own, and its ops on one thread each (two cores: 1.8x here)."""
    Hq, Hkv = q.shape[1], k.shape[1]
    if Hkv < 2 or Hkv % 2 or metal_available():
        return _attend_keys_transposed(q, k, v, scale, mask)
    h, hq = Hkv // 2, Hq // 2
    halves = []
    for i, stream in enumerate((None, _second_stream())):
        part = mask
        if isinstance(mask, mx.array) and mask.ndim == 4 and mask.shape[1] == Hq:
            part = mask[:, i * hq : (i + 1) * hq]
        with mx.stream(stream or mx.default_stream(mx.default_device())):
            heads, kv = slice(i * hq, (i + 1) * hq), slice(i * h, (i + 1) * h)
            halves.append(_attend_keys_transposed(q[:, heads], k[:, kv], v[:, kv], scale, part))
    return mx.concatenate(halves, axis=1)


_second = threading.local()  # .stream: MLX streams belong to the thread that made them


def _second_stream() -> mx.Stream:
    stream = getattr(_second, "stream", None)
    if stream is None:
        stream = _second.stream = mx.new_stream(mx.cpu)
    return stream


def _attend_keys_transposed(q: mx.array, k: mx.array, v: mx.array, scale: float,
                            mask: mx.array | str | None) -> mx.array:
    B, Hq, L, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    r = Hq // Hkv
    scores = (q * scale).reshape(B, Hkv, r * L, D) @ mx.contiguous(k.swapaxes(-1, -2))
    if mask is not None:
        scores = scores.reshape(B, Hkv, r, L, S)
        if isinstance(mask, str):  # "causal": the queries are the last L positions
            mask = mx.arange(S)[None] <= (S - L + mx.arange(L))[:, None]
        elif mask.ndim == 4:  # [B, 1 or Hq, L, S] -> the folded heads' layout
            mask = mask.reshape(mask.shape[0], -1 if mask.shape[1] == 1 else Hkv,
                                1 if mask.shape[1] == 1 else r, L, S)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask
        scores = scores.reshape(B, Hkv, r * L, S)
    weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights @ v).reshape(B, Hq, L, D)


_compiled_rms = mx.compile(_rms_norm)
_compiled_angles = mx.compile(_angles)
_compiled_rotate = {t: mx.compile(lambda x, c, s, t=t: _rotate(x, c, s, t)) for t in (False, True)}


# ------------------------------------------------------------------ rope modules we rotate
class RopeArgs:
    """What mx.fast.rope gets from one of mlx-lm's rope modules (the kinds we rotate
    ourselves); `inv_freqs` as float32, built once. Layers with equal ropes share one, and
    with it the angles of the step's positions: computed once per step, not per layer."""

    def __init__(self, module: nn.Module):
        if type(module) is nn.RoPE:
            self.dims, self.traditional, self.scale = module.dims, module.traditional, module.scale
            half = module.dims // 2
            steps = mx.arange(half, dtype=mx.float32)
            self.inv_freqs = mx.exp(-steps * (math.log(module.base) / half))
            self.base: float | None = module.base
            self.freqs = None
        else:  # Llama3RoPE: frequencies fixed at construction
            self.dims, self.traditional, self.scale = module.dims, module.traditional, 1.0
            self.base, self.freqs = None, module._freqs
            self.inv_freqs = (1.0 / module._freqs).astype(mx.float32)
        mx.eval(self.inv_freqs)
        # .angles: (offset, L, dtype, cos, sin) of this thread's step
        self._last = threading.local()

    @staticmethod
    def of(module: nn.Module) -> RopeArgs | None:
        """Exact types only: a subclass (or YaRN's input scaling) may change the rotation."""
        if type(module) is not nn.RoPE and type(module) is not rope_utils.Llama3RoPE:
            return None
        freqs = getattr(module, "_freqs", None)
        key = (type(module), module.dims, module.traditional, getattr(module, "base", None),
               getattr(module, "scale", 1.0), None if freqs is None else tuple(freqs.tolist()))
        if key not in _shared:
            if len(_shared) > 64:
                _shared.clear()
            _shared[key] = RopeArgs(module)
        return _shared[key]

    def builtin(self, x: mx.array, offset: int | mx.array) -> mx.array:
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=self.base,
                            scale=self.scale, offset=offset, freqs=self.freqs)

    def fused(self, x: mx.array, offset: int | mx.array) -> mx.array:
        cos, sin = self._angles(offset, x.shape[-2], x.dtype)
        return _compiled_rotate[self.traditional](x, cos, sin)

    def _angles(self, offset: int | mx.array, L: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        last = getattr(self._last, "angles", None)
        # The step's offset array is the same object in every layer (an int: the same value).
        if last is not None and last[1] == L and last[2] == dtype and (last[0] is offset or (
                isinstance(offset, int) and isinstance(last[0], int) and last[0] == offset)):
            return last[3], last[4]
        steps = mx.arange(L, dtype=mx.float32)
        if isinstance(offset, mx.array) and offset.ndim == 1:  # one offset per batch row
            positions = (offset.astype(mx.float32)[:, None] + steps) * self.scale
        else:
            positions = ((steps + offset) * self.scale)[None]
        cos, sin = _compiled_angles(positions, self.inv_freqs, _dtype_token(dtype))
        self._last.angles = (offset, L, dtype, cos, sin)
        return cos, sin


_shared: dict[tuple, RopeArgs] = {}
_tokens: dict[mx.Dtype, mx.array] = {}


def _dtype_token(dtype: mx.Dtype) -> mx.array:
    """A one-element array of `dtype`: how a compiled function is told a dtype."""
    if dtype not in _tokens:
        _tokens[dtype] = mx.zeros((1,), dtype)
        mx.eval(_tokens[dtype])
    return _tokens[dtype]


# ------------------------------------------------------------------ the measured choice
class Choices:
    """Per (op, width, dtype, rows up to a power of two): FUSED or BUILTIN, timed once on
    inputs of the first call's shape."""

    def __init__(self, timer: Callable[[Callable[[], mx.array]], float] | None = None):
        self.timer = timer or seconds
        self.made: dict[tuple, tuple[str, float, float]] = {}  # key -> (path, fused us, builtin us)
        self._lock = threading.Lock()

    def fused(self, key: tuple, fused: Callable[[], mx.array],
              builtin: Callable[[], mx.array]) -> bool:
        hit = self.made.get(key)
        if hit is None:
            with self._lock:
                hit = self.made.get(key) or self._measure(key, fused, builtin)
        return hit[0] == FUSED

    def _measure(self, key: tuple, fused: Callable[[], mx.array], builtin: Callable[[], mx.array]):
        times: dict[str, list[float]] = {FUSED: [], BUILTIN: []}
        for _ in range(REPEATS):
            for path, fn in ((FUSED, fused), (BUILTIN, builtin)):
                times[path].append(self.timer(fn))
        f, b = (sorted(times[p])[REPEATS // 2] * 1e6 for p in (FUSED, BUILTIN))
        self.made[key] = hit = (FUSED if f < b else BUILTIN, f, b)
        return hit

    def plan(self, keys: set[tuple] | None = None) -> list[dict]:
        """The choices so far (of `keys` only, when given), as dispatch.Choice dicts (bench
        and `show` print them)."""
        out = []
        for k, (path, f, b) in sorted(self.made.items()):
            if keys is not None and k not in keys:
                continue
            op, d, dt, *rest = k
            shape = {"M": rest[0]} if len(rest) == 1 else dict(zip(("Hq", "Hkv", "L", "S"), rest))
            if path == FUSED:
                path = OURS_SHOWN.get(op, FUSED)
            out.append({"op": op, "key": {**shape, "D": d, "dtype": dt}, "path": path,
                        "how": "measured", "ours_us": round(f, 3), "mlx_us": round(b, 3)})
        return out


def seconds(fn: Callable[[], mx.array], calls: int = 8, rounds: int = 3) -> float:
    """Seconds per call, `calls` calls evaluated together (one evaluation's fixed cost, ~0.1 ms
    on the CPU, would otherwise hide the difference); a call slower than SLOW_CALL_S is timed
    once: the fixed cost is small beside it, and a prefill-sized op timed 24 times per side
    held a server's first request for seconds."""
    if fn not in _warm:
        mx.eval(fn())  # compiled and warm before the clock
        _warm.add(fn)
    t = time.perf_counter()
    mx.eval(fn())
    one = time.perf_counter() - t
    if one > SLOW_CALL_S:
        return one
    t = time.perf_counter()
    for _ in range(rounds):
        mx.eval([fn() for _ in range(calls)])
    return (time.perf_counter() - t) / (calls * rounds)


SLOW_CALL_S = 1e-3
_warm: weakref.WeakSet = weakref.WeakSet()  # the functions being timed, warmed once


choices = Choices()
_eps: dict[float, mx.array] = {}


def _use_fused(op: str, x: mx.array, fused: Callable[[mx.array], mx.array],
               builtin: Callable[[mx.array], mx.array]) -> bool:
    """Forced by the kernel mode, else the measured choice for x's width and dtype (timed on
    a random input of x's shape the first time)."""
    m = dispatch.mode()
    if m != "auto":
        return m == "ours"
    key = _key(op, x)
    if key in choices.made:
        return choices.made[key][0] == FUSED
    sample = _sample(x.shape, x.dtype)
    return choices.fused(key, lambda: fused(sample), lambda: builtin(sample))


def _key(op: str, x: mx.array) -> tuple:
    # Rows by powers of two: the compiled kernel wins at decode sizes, may lose at long prefills.
    rows = 1 << max(0, math.prod(x.shape[:-1]) - 1).bit_length()
    return (op, x.shape[-1], str(x.dtype).rsplit(".", 1)[-1], rows)


# The per-call path: (op, shape, dtype, mode) -> fused or not, the answer _use_fused gave.
_known: dict[tuple, bool] = {}


def reset() -> None:
    """Forget every choice (the next call of each shape measures again)."""
    choices.made.clear()
    _known.clear()


def _sample(shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    """A random timing input (the call's own input is lazy: part of the step being built)."""
    # Its own key: the global one is the seeded sampling's.
    s = mx.random.normal(shape, key=mx.random.key(0)).astype(dtype)
    mx.eval(s)
    return s


# ------------------------------------------------------------------ dispatch points
def rms_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array:
    """Dispatch point for RMSNorm: mx.fast.rms_norm, or its definition as one compiled kernel."""
    eps_ = _eps.get(eps)
    if eps_ is None:
        eps_ = _eps[eps] = mx.array(eps, mx.float32)
    known = ("rms_norm", x.shape, x.dtype, dispatch.mode())
    use = _known.get(known)
    if use is None:
        use = _known[known] = _use_fused("rms_norm", x, lambda s: _compiled_rms(s, weight, eps_),
                                         lambda s: rms_norm_reference(s, weight, eps))
    return _compiled_rms(x, weight, eps_) if use else rms_norm_reference(x, weight, eps)


SDPA_TIMED_QUERIES, SDPA_TIMED_KEYS = 128, 1024  # timed at most: the choice is per size class


def sdpa(q: mx.array, k: mx.array, v: mx.array, scale: float,
         mask: mx.array | str | None) -> mx.array:
    """Attention over contiguous K/V: mx.fast's, or (several queries: prefill chunks, draft
    verification) the same with the keys transposed first, where that measures faster. A
    decode step (one query) never copies its context."""
    L, S = q.shape[2], k.shape[2]
    if L == 1 or q.shape[1] % k.shape[1]:
        return sdpa_reference(q, k, v, scale, mask)
    m = dispatch.mode()
    if m == "auto":
        bucket = (min(1 << (L - 1).bit_length(), SDPA_TIMED_QUERIES),
                  min(1 << (S - 1).bit_length(), SDPA_TIMED_KEYS))
        dtype = str(q.dtype).rsplit(".", 1)[-1]
        key = ("sdpa", q.shape[-1], dtype, q.shape[1], k.shape[1], *bucket)
        if key not in choices.made:
            n, s = bucket[0], max(bucket)
            tq, tk, tv = (_sample((1, h, rows, q.shape[-1]), q.dtype)
                          for h, rows in ((q.shape[1], n), (k.shape[1], s), (k.shape[1], s)))
            choices.fused(key, lambda: sdpa_keys_transposed(tq, tk, tv, scale, "causal"),
                          lambda: sdpa_reference(tq, tk, tv, scale, "causal"))
        use = choices.made[key][0] == FUSED
    else:
        use = m == "ours"
    return (sdpa_keys_transposed if use else sdpa_reference)(q, k, v, scale, mask)


# Decode attention's choice per size class: up to this many keys, timed at it; above, at 4x.
DECODE_SMALL_KEYS = 1024


def decode_attention(qg: mx.array, k: mx.array) -> bool:
    """Whether a decode query's attention over plain K/V (qg [Hkv, G, D] scaled, k [Hkv, n,
    D]) takes attention.partial_powers_of_two rather than partial_matmul (mx.fast's
    definition): forced by the kernel mode, else measured once per size class. Called per
    slice and layer of every decode step: the answer is looked up, not worked out again."""
    known = ("decode_attention", qg.shape, k.dtype, k.shape[1] > DECODE_SMALL_KEYS,
             dispatch.mode())
    use = _known.get(known)
    if use is None:
        use = _known[known] = _decode_choice(qg, k, known[-1])
    return use


def _decode_choice(qg: mx.array, k: mx.array, m: str) -> bool:
    from mlxlocal.metal.attention import partial_matmul, partial_powers_of_two

    if m != "auto":
        return m == "ours"
    key = _decode_key(qg, k)
    if key not in choices.made:
        Hkv, G, D = qg.shape
        n = key[-1]
        tq, tk, tv = _sample((Hkv, G, D), qg.dtype), _sample((Hkv, n, D), k.dtype), \
            _sample((Hkv, n, D), k.dtype)
        return choices.fused(key, lambda: partial_powers_of_two(tq, tk, tv),
                             lambda: partial_matmul(tq, tk, tv))
    return choices.made[key][0] == FUSED


def _decode_key(qg: mx.array, k: mx.array) -> tuple:
    Hkv, G, D = qg.shape
    n = DECODE_SMALL_KEYS if k.shape[1] <= DECODE_SMALL_KEYS else 4 * DECODE_SMALL_KEYS
    return ("decode_attention", D, str(k.dtype).rsplit(".", 1)[-1], Hkv * G, Hkv, 1, n)


def warm_up_decode_attention(heads: list[tuple[int, int, int]], dtype: mx.Dtype) -> list[dict]:
    """decode_attention decided for each (Hq, Hkv, D) at both size classes before serving
    (a long context's first request would otherwise wait on the timing); the plan of these
    choices. Nothing on Metal, where the paged kernel or mx.fast's attention runs."""
    if metal_available():
        return []
    keys = set()
    for hq, hkv, d in heads:
        for n in (DECODE_SMALL_KEYS, 4 * DECODE_SMALL_KEYS):
            qg, k = mx.zeros((hkv, hq // hkv, d), dtype), mx.zeros((hkv, n, d), dtype)
            decode_attention(qg, k)
            keys.add(_decode_key(qg, k))
    return choices.plan(keys) if dispatch.mode() == "auto" else []


def rope(args: RopeArgs, x: mx.array, offset: int | mx.array) -> mx.array:
    """Dispatch point for the RoPE of one of mlx-lm's rope modules (RopeArgs.of)."""
    known = ("rope", x.shape, x.dtype, dispatch.mode())
    use = _known.get(known)
    if use is None:
        def at():  # offsets of the same kind, but not the step's own (lazy) array
            return offset if isinstance(offset, int) else mx.zeros(offset.shape, offset.dtype)
        use = _known[known] = _use_fused("rope", x, lambda s: args.fused(s, at()),
                                         lambda s: args.builtin(s, at()))
    return args.fused(x, offset) if use else args.builtin(x, offset)


def warm_up(norms: list[tuple[mx.array, float]], ropes: list[tuple[RopeArgs, int, int]],
            rows: list[int], dtype: mx.Dtype) -> list[dict]:
    """Decide ahead of serving, at each decode row count: `norms` (weight, eps) over rows of
    the weight's width, `ropes` (args, heads, head dim) over [rows, heads, 1, head dim]. The
    plan of these choices (none when the kernel mode forces a side)."""
    keys = set()
    for r in rows:
        for weight, eps in norms:
            x = mx.zeros((r, weight.shape[0]), dtype)
            rms_norm(x, weight, eps)
            keys.add(_key("rms_norm", x))
        for args, heads, d in ropes:
            x = mx.zeros((r, heads, 1, d), dtype)
            rope(args, x, 0)
            keys.add(_key("rope", x))
    return choices.plan(keys) if dispatch.mode() == "auto" else []
