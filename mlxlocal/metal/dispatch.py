"""Measured dispatch: our Metal kernel or MLX's built-in, chosen per (chip, op, shape, dtype).

Each dispatch function's gate calls `use_kernel(op, kernel_supports, *gate args)` once Metal
is available. The mode (`--kernels` on the CLI, MLXLOCAL_KERNELS for the library, default
auto) forces either side; under auto the first time a shape is seen, ours and the built-in
are timed (alternating calls on random inputs of that shape, medians, measure.py) and the
faster is recorded in $MLXLOCAL_HOME/kernel_choices.json under the chip's name; later calls
read the choice (from memory after the first read). Shapes our kernel does not support
always take the built-in; without Metal every dispatch point runs its MLX reference.
`warm_up` decides (and compiles) ahead of serving for the shapes a model will use.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx

from mlxlocal.errors import MlxLocalError
from mlxlocal.metal import kernel
from mlxlocal.metal.measure import (
    MLX,
    OPS,
    OURS,
    REFERENCE,
    Key,
    Timer,
    inputs,
    key_text,
    time_paths,
)

log = logging.getLogger(__name__)

MODES = ("auto", "ours", "mlx")
ENV = "MLXLOCAL_KERNELS"
CACHE_NAME = "kernel_choices.json"
FORMAT = 1
REPEATS = 5  # alternating timings per side when a shape is measured; the median decides

__all__ = ["MLX", "OURS", "REFERENCE", "Choice", "Chooser", "KernelModeError", "chooser", "describe",
           "forced", "mode", "reset", "set_mode", "status", "use_kernel", "warm_up"]


class KernelModeError(MlxLocalError, ValueError):
    """A kernel mode that is not auto, ours or mlx; the message names where it came from."""


_override: str | None = None
_local = threading.local()  # .force: the side a measurement runs, this thread only


def check_mode(value: str, source: str = "--kernels") -> str:
    v = value.strip().lower()
    if v not in MODES:
        raise KernelModeError(f"{source} must be auto, ours or mlx, not {value!r}")
    return v


def set_mode(value: str | None) -> None:
    """Force a side for this process (None: back to MLXLOCAL_KERNELS, default auto)."""
    global _override, _env
    _override, _env = None if value is None else check_mode(value), None


_env: str | None = None  # MLXLOCAL_KERNELS's mode, read once (reading the environment costs
# about as much as the rest of a dispatch decision); set_mode and reset read it again


def mode() -> str:
    global _env
    if _override is not None:
        return _override
    if _env is None:
        raw = os.environ.get(ENV)
        _env = "auto" if not raw else check_mode(raw, ENV)
    return _env


@contextlib.contextmanager
def forced(path: str | None) -> Iterator[None]:
    """Run the dispatch functions on one side (OURS or MLX) in this thread; None: no change."""
    before = getattr(_local, "force", None)
    _local.force = path if path is not None else before
    try:
        yield
    finally:
        _local.force = before


def use_kernel(op: str, supports: Callable[..., bool], *args) -> bool:
    """The gate of a dispatch function (Metal is available): True runs our kernel."""
    side = getattr(_local, "force", None)
    if side is None:
        side = {"auto": None, "ours": OURS, "mlx": MLX}[mode()]
    if side == MLX or not supports(*args):
        return False
    if side == OURS:
        return True
    c = chooser()
    fast = (op, OPS[op].fast(*args))
    ours = c.fast.get(fast)
    if ours is None:  # first call at this shape in this process
        ours = c.fast[fast] = c.choose(op, OPS[op].key(*args)).path == OURS
    return ours


@dataclass(frozen=True)
class Choice:
    """What one op at one shape runs, and why."""

    op: str
    key: Key
    path: str  # OURS, MLX or REFERENCE
    # "measured", "cached" (measured before), "forced (--kernels ours)" (or by MLXLOCAL_KERNELS),
    # "unsupported shape", "no Metal"
    how: str
    ours_us: float | None = None
    mlx_us: float | None = None

    def as_dict(self) -> dict:
        d = asdict(self)
        d["key"] = dict(self.key)
        return d


def default_cache_path() -> Path:
    home = os.environ.get("MLXLOCAL_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".cache" / "mlxlocal") / CACHE_NAME


def chip_name() -> str:
    try:
        info = mx.device_info()
    except Exception:  # older MLX: only the Metal namespace has it
        info = mx.metal.device_info()
    return str(info.get("device_name") or info.get("architecture") or "unknown chip")


def _entries_of(data) -> dict[str, dict[str, dict]]:
    """The chips' entries of a cache file's JSON; ValueError when it is not one."""
    if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("chips"), dict):
        raise ValueError(f'expected {{"format": {FORMAT}, "chips": {{...}}}}')
    for chip, entries in data["chips"].items():
        if not isinstance(entries, dict):
            raise ValueError(f"chip {chip!r}: expected an object of choices")
        for name, e in entries.items():
            if not (isinstance(e, dict) and e.get("path") in (OURS, MLX)
                    and all(isinstance(e.get(t), (int, float)) for t in ("ours_us", "mlx_us"))):
                raise ValueError(f"{chip!r} / {name!r}: expected path, ours_us and mlx_us")
    return data["chips"]


class Chooser:
    """Choices under auto for one chip, backed by a JSON file (read once, written on each new
    measurement, merged with what other processes wrote). `timer(op, key, side)` returns
    seconds per call (measure.Timer by default; tests inject their own)."""

    def __init__(self, path: Path | str | None = None, chip: str | None = None,
                 timer: Callable[[str, Key, str], float] | None = None, repeats: int = REPEATS):
        self.path = Path(path) if path is not None else default_cache_path()
        self._chip, self.timer, self.repeats = chip, timer, repeats
        self._seen: dict[tuple[str, Key], Choice] = {}
        self.fast: dict[tuple, bool] = {}  # use_kernel's memo of _seen by cheap argument keys
        self._file: dict[str, dict] | None = None  # this chip's entries, once read
        self._writable = True
        self._lock = threading.Lock()
        self._shared: Timer | None = None

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Decisions inside share one default Timer (a projection's weights are built once for
        all its row counts); its inputs are dropped at the end."""
        self._shared = Timer()
        try:
            yield
        finally:
            self._shared = None

    @property
    def chip(self) -> str:
        if self._chip is None:
            self._chip = chip_name()
        return self._chip

    def choose(self, op: str, key: Key) -> Choice:
        hit = self._seen.get((op, key))  # the per-call path: one dict lookup
        if hit is not None:
            return hit
        with self._lock:
            if (op, key) not in self._seen:
                self._seen[(op, key)] = self._decide(op, key)
            return self._seen[(op, key)]

    def _decide(self, op: str, key: Key) -> Choice:
        if self._file is None:
            self._file = self._read().get(self.chip, {})
        name = key_text(op, key)
        e = self._file.get(name)
        if e is not None:
            return Choice(op, key, e["path"], "cached", e["ours_us"], e["mlx_us"])
        t = time_paths(op, key, (OURS, MLX), self.timer or self._shared or Timer(), self.repeats)
        ours_us, mlx_us = t[OURS] * 1e6, t[MLX] * 1e6
        e = {"path": OURS if ours_us < mlx_us else MLX, "ours_us": round(ours_us, 3),
             "mlx_us": round(mlx_us, 3), "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self._file[name] = e
        self._write(name, e)
        return Choice(op, key, e["path"], "measured", e["ours_us"], e["mlx_us"])

    def _read(self) -> dict[str, dict[str, dict]]:
        """Every chip's entries; a file that cannot be read or parsed is moved aside, with a
        warning naming both files, and its choices are measured again."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError) as e:
            return self._set_aside(f"cannot be read ({e})")
        try:
            return _entries_of(json.loads(text))
        except ValueError as e:  # json.JSONDecodeError is a ValueError
            return self._set_aside(f"is not a kernel choice cache ({e})")

    def _set_aside(self, why: str) -> dict:
        aside = self.path.with_name(f"{self.path.name}.bad-{time.strftime('%Y%m%d-%H%M%S')}")
        try:
            os.replace(self.path, aside)
        except OSError as e:
            self._writable = False  # never overwrite a file we could not keep
            log.warning("kernel choice cache %s %s; it could not be moved aside (%s): it is left as it is and "
                        "new measurements stay in memory", self.path, why, e)
            return {}
        log.warning("kernel choice cache %s %s; kept as %s, shapes are measured again", self.path, why, aside)
        return {}

    def _write(self, name: str, entry: dict) -> None:
        if not self._writable:
            return
        chips = self._read()  # what other processes recorded meanwhile
        if not self._writable:
            return
        chips.setdefault(self.chip, {})[name] = entry
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"format": FORMAT, "chips": chips}, indent=1, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError as e:
            self._writable = False
            log.warning("kernel choice cache %s cannot be written (%s): choices stay in memory", self.path, e)


_chooser: Chooser | None = None
_chooser_lock = threading.Lock()


def chooser() -> Chooser:
    global _chooser
    if _chooser is None:
        with _chooser_lock:
            _chooser = _chooser or Chooser()
    return _chooser


def reset(new: Chooser | None = None) -> None:
    """Forget every choice in memory (the next use reads the file again and MLXLOCAL_KERNELS
    again), or use `new`."""
    global _chooser, _env
    _chooser, _env = new, None


def status() -> dict:
    """For reports: mode, whether Metal runs, the cache file and the chip it is keyed by."""
    metal = kernel.metal_available()
    return {"mode": mode(), "metal": metal, "cache": str(chooser().path),
            "chip": chooser().chip if metal else None}


def warm_up(sites: Iterable[tuple[str, tuple]], compile_kernels: bool = True) -> list[Choice]:
    """One Choice per distinct (op, key) among `sites` ((op, gate arguments): lazily built
    arrays of the shapes a model will use are enough). On Metal the kernels that will run are
    launched once (compiled), and under auto unknown shapes are measured, here rather than on
    the first request."""
    metal, m = kernel.metal_available(), mode()
    forced_by = f"forced (--kernels {m})" if _override is not None else f"forced ({ENV}={m})"
    with chooser().batch():
        return _warm_up(sites, metal, m, forced_by, compile_kernels)


def _warm_up(sites: Iterable[tuple[str, tuple]], metal: bool, m: str, forced_by: str,
             compile_kernels: bool) -> list[Choice]:
    out: list[Choice] = []
    seen: set[tuple[str, Key]] = set()
    for op, args in sites:
        spec = OPS[op]
        key = spec.key(*args)
        if (op, key) in seen:
            continue
        seen.add((op, key))
        if not metal:
            out.append(Choice(op, key, REFERENCE, "no Metal"))
        elif m == "mlx":
            out.append(Choice(op, key, MLX, forced_by))
        elif not spec.kernel_supports()(*args):
            out.append(Choice(op, key, MLX, "unsupported shape"))
        else:
            c = Choice(op, key, OURS, forced_by) if m == "ours" else chooser().choose(op, key)
            if compile_kernels and c.path == OURS and c.how != "measured":  # measuring compiled it
                # A projection site's arguments are its call's (the model's own weights): no copy.
                calls = [(args, {})] if op in ("linear", "quantized_linear") else inputs(op, key)
                with forced(OURS):
                    mx.eval([spec.dispatch()(*a, **kw) for a, kw in calls])
            out.append(c)
    return out


def describe(choices: Iterable[Choice | dict]) -> list[tuple[str, str, str, str]]:
    """Rows (op, shape, dtype, path + how) for a table; decode rows M of one projection that
    take the same path are folded into a range (M=1-8)."""
    rows: list[list] = []
    for c in choices:
        c = c if isinstance(c, dict) else c.as_dict()
        key = dict(c["key"])
        dtype = str(key.pop("dtype"))
        m = key.pop("M", None)
        rest = " ".join(f"{k}={v}" for k, v in key.items())
        how = c["how"] + (f": ours {c['ours_us']:.1f} us, mlx {c['mlx_us']:.1f} us"
                          if c.get("ours_us") is not None else "")
        path = c["path"] if c["path"] == REFERENCE else f"{c['path']} ({how})"
        last = rows[-1] if rows else None
        if m is not None and last and last[0] == c["op"] and last[2] == rest and last[4] == dtype \
                and last[5] == path and last[1][1] == m - 1:
            last[1] = (last[1][0], m)
            continue
        rows.append([c["op"], (m, m), rest, None, dtype, path])
    out = []
    for op, (lo, hi), rest, _, dtype, path in rows:
        ms = "" if lo is None else (f"M={lo} " if lo == hi else f"M={lo}-{hi} ")
        out.append((op, ms + rest, dtype, path))
    return out
