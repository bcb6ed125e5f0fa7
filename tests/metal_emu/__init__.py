"""CPU emulation of `mx.fast.metal_kernel` kernels (Metal is not available on Linux).

`run_kernel(...)` takes exactly what `mx.fast.metal_kernel(...)(...)` takes, wraps the kernel body
the way MLX does (same generated signature: inputs, `<name>_shape/_strides/_ndim`, outputs and
the Metal attributes the body mentions, same template parameters), checks it as Metal (below),
compiles it as C++20 against `metal.h` (a model of the Metal types and functions) with g++, and
runs it on the CPU.

Metal-language check (check.py; `metal_check=False` skips it): the same translation unit parsed
by libclang with metal.h in MTL_CHECK mode: device / constant / threadgroup are distinct clang
address spaces (thread is the default one, as unqualified pointers are in Metal; constant is
read-only), no C/C++ library or double is visible, so only the built-ins metal.h models exist.
Code g++ would take but Apple's compiler rejects (constant -> device or device -> thread
pointers, a threadgroup array as a device pointer, const_cast dropping `device`, a store into
constant memory, a writable global or static, ldexp or any C function metal.h lacks) fails with
the kernel line and clang's message. Once per distinct source (~5 ms, metal.h precompiled); skipped without libclang.
Not checked: C-style casts between address spaces (clang's C++ allows them), and member calls
on vectors/structs in device/threadgroup memory (clang's C++ cannot declare them per address
space, so those errors are dropped: check.py `_metal_allows`).

Execution model
---------------
* Threadgroups run one after another. Inside a group every thread is a fiber with its own stack
  (a tiny x86-64 context switch; ucontext elsewhere), started in thread_index_in_threadgroup order.
  A fiber runs until it ends or reaches `threadgroup_barrier`, `simdgroup_barrier` or a `simd_*`
  function, so all threads of a group are live at the same time and scheduling is deterministic.
  With `schedule_seed` the next fiber to run is drawn at random from the ready ones (a
  different interleaving between sync points per seed): work that needs a barrier it lacks
  then reads another thread's data before it is written (threadgroup memory starts 0xFF).
* `threadgroup_barrier` releases when every live thread of the group waits at a barrier (threads
  that already returned count as arrived). A barrier that can never release (some threads wait at
  a barrier, others in a SIMD function) is reported as a deadlock instead of hanging.
* SIMD-groups are 32 consecutive `thread_index_in_threadgroup`s. A SIMD function releases when
  every live lane of the simdgroup called one; lanes deposit their value in per-simdgroup slots and
  each computes its result from the active lanes (lanes that returned or do not exist in a partial
  last simdgroup are inactive: reductions skip them, shuffles from them return 0xFF bytes, i.e.
  NaN or -1). Live lanes calling different SIMD functions is an error (divergence).
* `threadgroup T name[N];` declarations are rewritten into `auto& name = mtl::tg_var<T[N]>(id);`:
  storage in a per-group arena (32 KiB, the Metal limit), filled with 0xFF at group start.
* Buffers are copied into guarded allocations that end exactly where the buffer does: any access
  past the end (even one byte into what would be MLX's allocation slack), or into the guard before
  the start, and writes to the bytes just before the start raise `KernelRuntimeError` naming the
  buffer and the thread, as do integer division by zero and stack overflow.
* Outputs start as 0xFF bytes (NaN, -1) unless `init_value` is given: MLX leaves them
  uninitialised, so an element no thread stores must not pass as a zero.

Assumptions: edge threadgroups of a non-uniform dispatch report their actual (partial) size in
`threads_per_threadgroup` / `simdgroups_per_threadgroup` (`dispatch_threads_per_threadgroup` has
the full size) and `thread_index_in_threadgroup` linearises with that size; the threadgroup is
clamped to the grid per dimension as MLX does (`min(threadgroup, grid)`).

Compilation: `g++ -O1 -std=c++20` (METAL_EMU_CXX overrides the compiler, METAL_EMU_CXXFLAGS adds
flags), metal.h precompiled once, each kernel's .so cached under $METAL_EMU_CACHE (default
$TMPDIR/metal_emu_cache_<uid>) by a hash of the generated source, header, flags and compiler.
Without a compiler, `run_kernel` calls pytest.skip inside a test run (RuntimeError otherwise).

Not modelled: timing and performance, concurrency between threadgroups, memory ordering beyond
what barriers give (each fiber runs alone between sync points: a race shows only when some
seeded interleaving changes the result),
simdgroup_matrix, textures, quad-group functions, and the rounding inside half/bfloat math
functions (exp, sqrt, ... are computed in float and rounded once). Half and bfloat operators
round every result, as Metal does (test_half_and_bfloat_arithmetic_rounds_every_operation pins
it: a compiler keeping half sums in float would fail it).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import numpy as np

from . import check as _check
from .codegen import _TYPES, _dtype_name, generate_source

__all__ = [
    "KernelCompileError",
    "KernelRuntimeError",
    "bf16_to_float32",
    "bfloat16",
    "compiler_available",
    "float32_to_bf16",
    "generate_source",
    "metal_kernel",
    "run_kernel",
    "skip_reason",
]

_HERE = Path(__file__).resolve().parent
_SEED_VAR = "METAL_EMU_SCHEDULE_SEED"  # read by metal.h's scheduler at each run
_HEADER = _HERE / "metal.h"
_INCLUDE = _HERE / "include"
_CXX_FLAGS = [  # extra flags: METAL_EMU_CXXFLAGS
    "-O1", "-std=c++20", "-shared", "-fPIC", "-fno-strict-aliasing", "-fvisibility=hidden",
    "-Wno-attributes", "-Wno-unknown-pragmas",
]

_lock = threading.RLock()
_libs: dict[str, ctypes.CDLL] = {}
_compiler_version: dict[str, str] = {}


class KernelCompileError(RuntimeError):
    """The generated C++ did not compile. `.stderr` is the compiler output, `.source` the TU."""

    def __init__(self, message: str, stderr: str = "", source: str = ""):
        super().__init__(message)
        self.stderr = stderr
        self.source = source


class KernelRuntimeError(RuntimeError):
    """The kernel faulted, deadlocked, diverged or wrote out of bounds while running."""


# ---------------------------------------------------------------------------------------------
# bfloat16 helpers (bit patterns in uint16, round-to-nearest-even like MLX)
# ---------------------------------------------------------------------------------------------
def _c(arr, dtype=None) -> np.ndarray:
    """Row-contiguous copy if needed (unlike np.ascontiguousarray, keeps 0-d arrays 0-d)."""
    return np.require(np.asarray(arr, dtype=dtype), requirements="C")


def float32_to_bf16(x) -> np.ndarray:
    """float32 values -> bfloat16 bit patterns (uint16), round to nearest even, NaN kept."""
    u = _c(x, np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    out = np.where(nan, (u >> np.uint32(16)) | np.uint32(0x40), rounded)
    return out.astype(np.uint16)


def bf16_to_float32(bits) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32."""
    b = _c(bits, np.uint16)
    return (b.astype(np.uint32) << np.uint32(16)).view(np.float32)


class bfloat16:  # noqa: N801 - mirrors the dtype name
    """Marks a uint16 numpy array (bit patterns) as a bfloat16 kernel input."""

    def __init__(self, bits):
        self.bits = np.asarray(bits)
        if self.bits.dtype != np.uint16:
            raise TypeError("metal_emu.bfloat16 wraps uint16 bit patterns; use float32_to_bf16")


# ---------------------------------------------------------------------------------------------
# Compiler
# ---------------------------------------------------------------------------------------------
def _cxx() -> str | None:
    cxx = os.environ.get("METAL_EMU_CXX") or "g++"
    return shutil.which(cxx)


def compiler_available() -> bool:
    return _cxx() is not None


def skip_reason() -> str:
    return ("metal_emu needs a C++20 compiler: g++ not found on PATH "
            "(install g++ or set METAL_EMU_CXX)")


def _flags() -> list[str]:
    return _CXX_FLAGS + os.environ.get("METAL_EMU_CXXFLAGS", "").split()


def _cache_dir() -> Path:
    d = os.environ.get("METAL_EMU_CACHE")
    path = Path(d) if d else Path(tempfile.gettempdir()) / f"metal_emu_cache_{os.getuid()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _version(cxx: str) -> str:
    if cxx not in _compiler_version:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True)
        _compiler_version[cxx] = out.stdout
    return _compiler_version[cxx]


# ---------------------------------------------------------------------------------------------
# Argument normalisation
# ---------------------------------------------------------------------------------------------
def _to_numpy(x, override: str | None) -> tuple[np.ndarray, str]:
    """An input -> (row-contiguous storage array, MLX dtype name)."""
    if isinstance(x, bfloat16):
        return _c(x.bits), "bfloat16"
    if type(x).__module__.startswith("mlx"):  # mx.array
        import mlx.core as mx

        if x.dtype == mx.bfloat16:
            return _c(np.array(x.view(mx.uint16))), "bfloat16"
        arr = _c(np.array(x))
        return arr, _dtype_name(arr.dtype)
    arr = np.asarray(x)
    if arr.dtype.name == "bfloat16":  # ml_dtypes
        return _c(arr.view(np.uint16)), "bfloat16"
    name = _dtype_name(arr.dtype)
    if override is not None:
        want = _dtype_name(override)
        if want == "bfloat16":
            if arr.dtype == np.uint16:
                return _c(arr), "bfloat16"
            return float32_to_bf16(arr.astype(np.float32)), "bfloat16"
        return _c(arr, _TYPES[want][1]), want
    return _c(arr), name


def _describe_error(stderr: str, src: str, cpp: Path, ranges: dict) -> str:
    src_lines = src.split("\n")
    where = ""
    pat = re.compile(re.escape(str(cpp)) + r":(\d+):(?:\d+:)?\s*(error|required from here)")
    m = pat.search(stderr) or re.search(re.escape(str(cpp)) + r":(\d+):", stderr)
    if m:
        ln = int(m.group(1))
        part = ""
        for key, (a, b) in ranges.items():
            if a <= ln <= b:
                part = f" = kernel {key} line {ln - a + 1}"
        ctx = []
        for k in range(max(1, ln - 2), min(len(src_lines), ln + 2) + 1):
            mark = ">" if k == ln else " "
            ctx.append(f"  {mark}{k:5d} | {src_lines[k - 1]}")
        where = f"\nat generated line {ln}{part}:\n" + "\n".join(ctx)
    errs = [ln for ln in stderr.splitlines() if ln.strip()]
    shown = "\n".join(errs[:60]) + ("\n  ..." if len(errs) > 60 else "")
    return f"{shown}\n{where}\n(generated source: {cpp})"


def _pch_dir(cxx: str, flags: list[str]) -> Path:
    """A directory holding metal.h and its precompiled metal.h.gch (falls back to the source)."""
    text = _HEADER.read_text()
    key = hashlib.sha256("\0".join([text, " ".join(flags), cxx, _version(cxx)]).encode())
    d = _cache_dir() / f"pch_{key.hexdigest()[:16]}"
    if (d / "metal.h.gch").exists():
        return d
    d.mkdir(exist_ok=True)
    tag = f"{os.getpid()}.{threading.get_ident()}.tmp"
    (d / f"metal.h.{tag}").write_text(text)
    os.replace(d / f"metal.h.{tag}", d / "metal.h")
    gch = d / f"metal.h.gch.{tag}"
    cmd = [cxx, *[f for f in flags if f != "-shared"], f"-I{_INCLUDE}", "-x", "c++-header",
           "-o", str(gch), str(d / "metal.h")]
    if subprocess.run(cmd, capture_output=True).returncode != 0:
        gch.unlink(missing_ok=True)
        return _HERE
    os.replace(gch, d / "metal.h.gch")
    return d


def _compile(name: str, src: str, ranges: dict) -> ctypes.CDLL:
    cxx = _cxx()
    if cxx is None:
        if "pytest" in sys.modules:  # inside a test run: a clean skip, not a failure
            import pytest

            pytest.skip(skip_reason())
        raise RuntimeError(skip_reason())
    flags = _flags()
    key = hashlib.sha256(
        "\0".join([src, _HEADER.read_text(), " ".join(flags), cxx, _version(cxx)]).encode()
    ).hexdigest()[:24]
    with _lock:
        if key in _libs:
            return _libs[key]
        cache = _cache_dir()
        so = cache / f"{key}.so"
        cpp = cache / f"{key}.cpp"
        if not so.exists():
            # unique temporary names: concurrent pytest workers may compile the same kernel
            tag = f"{key}.{os.getpid()}.{threading.get_ident()}.tmp"
            tmp_cpp, tmp_so = cache / f"{tag}.cpp", cache / f"{tag}.so"
            tmp_cpp.write_text(src)
            pch = _pch_dir(cxx, flags)
            cmd = [cxx, *flags, f"-I{pch}", f"-I{_INCLUDE}", "-o", str(tmp_so), str(tmp_cpp)]
            res = subprocess.run(cmd, capture_output=True, text=True)
            if res.returncode != 0:
                tmp_so.unlink(missing_ok=True)
                stderr = res.stderr.replace(str(tmp_cpp), str(cpp))
                os.replace(tmp_cpp, cpp)
                raise KernelCompileError(
                    f"metal_emu: kernel '{name}' failed to compile:\n"
                    + _describe_error(stderr, src, cpp, ranges),
                    stderr=stderr, source=src)
            os.replace(tmp_cpp, cpp)
            os.replace(tmp_so, so)
        lib = ctypes.CDLL(str(so))
        fn = lib.mtl_run
        fn.restype = ctypes.c_int
        fn.argtypes = [
            ctypes.c_int, ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_uint64),
            ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_char_p),
            ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
            ctypes.c_char_p, ctypes.c_int,
        ]
        _libs[key] = lib
        return lib


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------
def _dims3(v, what: str) -> tuple[int, int, int]:
    t = tuple(int(x) for x in v)
    if len(t) != 3 or min(t) < 0:
        raise ValueError(f"metal_emu: {what} must be 3 non-negative ints, got {v!r}")
    return t


def run_kernel(name, source, header="", input_names=None, output_names=None, inputs=None,
               output_shapes=None, output_dtypes=None, grid=None, threadgroup=None,
               template=None, init_value=None, *, atomic_outputs=False, input_dtypes=None,
               verbose=False, schedule_seed=None, metal_check=True):
    """Run a `mx.fast.metal_kernel` body on the CPU; returns the outputs as numpy arrays.

    Inputs: numpy arrays (float32/float16/int*/uint*/bool), `mx.array`s (any of those or
    bfloat16), `metal_emu.bfloat16(uint16_bits)`, or uint16 arrays with `input_dtypes[i] =
    'bfloat16'`. Dtypes (outputs, template) may be numpy dtypes, MLX dtype names or mx.Dtype.
    bfloat16 outputs are returned as uint16 bit patterns (see bf16_to_float32). Outputs start
    as `init_value` if given, else 0xFF bytes in every element (NaN for floats, -1 for signed
    integers): MLX leaves them uninitialised, so a missing store must not pass as a zero.
    `schedule_seed`: run the group's threads in a random interleaving between sync points
    (one per seed) instead of in thread order: a missing barrier shows as a wrong result.
    `metal_check`: first parse the generated source as Metal (check.py: real address spaces,
    no C/C++ library; once per distinct source); False runs the g++ emulation alone.
    """
    input_names = list(input_names or [])
    output_names = list(output_names or [])
    inputs = list(inputs or [])
    output_shapes = [tuple(int(d) for d in s) for s in (output_shapes or [])]
    out_dts = [_dtype_name(d) for d in (output_dtypes or [])]
    template = list(template or [])
    if not output_names:
        raise ValueError("[metal_kernel] Must specify at least one output.")
    for got, want, what in ((len(inputs), len(input_names), "inputs"),
                            (len(output_shapes), len(output_names), "output_shapes"),
                            (len(out_dts), len(output_names), "output_dtypes")):
        if got != want:
            raise ValueError(f"[metal_kernel] Expected `{what}` to have size {want} but got "
                             f"size {got}.")
    if grid is None or threadgroup is None:
        raise ValueError("metal_emu: grid and threadgroup are required")
    grid3, tg3 = _dims3(grid, "grid"), _dims3(threadgroup, "threadgroup")
    overrides = list(input_dtypes or [None] * len(inputs))

    arrays, metas = [], []
    for x, ov in zip(inputs, overrides):
        arr, dt = _to_numpy(x, ov)
        arrays.append(arr)
        metas.append((dt, arr.ndim, arr.size))

    src, kname, ranges = generate_source(name, source, header, input_names, output_names,
                                         metas, out_dts, template, atomic_outputs)
    if verbose:
        print(f"Generated source code for `{name}`:\n```\n{src}\n```")
    if metal_check and _check.available():
        _check.check(name, src, ranges, _cache_dir())
    lib = _compile(name, src, ranges)

    bufs, names, writeback = [], [], []
    for arr, iname in zip(arrays, input_names):
        bufs.append(arr)
        names.append(iname)
        writeback.append(0)
        if arr.ndim > 0:
            if iname + "_shape" in source:
                bufs.append(np.array(arr.shape, dtype=np.int32))
                names.append(iname + "_shape")
                writeback.append(0)
            if iname + "_strides" in source:
                strides = [s // arr.itemsize for s in arr.strides]
                bufs.append(np.array(strides, dtype=np.int64))
                names.append(iname + "_strides")
                writeback.append(0)
            if iname + "_ndim" in source:
                bufs.append(np.array([arr.ndim], dtype=np.int32))
                names.append(iname + "_ndim")
                writeback.append(0)
    outputs = []
    for oname, shape, dt in zip(output_names, output_shapes, out_dts):
        storage = _TYPES[dt][1]
        if init_value is None:
            # MLX leaves outputs uninitialised: start them as 0xFF bytes (NaN, -1), so an
            # element no thread stores shows up instead of passing as a zero.
            out = np.empty(shape, dtype=storage)
            out.reshape(-1).view(np.uint8)[:] = 0xFF
        elif dt == "bfloat16":
            out = np.full(shape, float32_to_bf16(np.float32(init_value)), dtype=np.uint16)
        else:
            out = np.full(shape, init_value, dtype=storage)
        outputs.append(out)
        bufs.append(out)
        names.append(oname)
        writeback.append(1)

    n = len(bufs)
    ptrs = (ctypes.c_void_p * n)(*[b.ctypes.data for b in bufs])
    sizes = (ctypes.c_uint64 * n)(*[b.nbytes for b in bufs])
    wb = (ctypes.c_int * n)(*writeback)
    cnames = (ctypes.c_char_p * n)(*[s.encode() for s in names])
    g = (ctypes.c_uint32 * 3)(*grid3)
    t = (ctypes.c_uint32 * 3)(*tg3)
    err = ctypes.create_string_buffer(4096)
    with _lock:  # signal handlers, the runtime state and the environment are process-wide
        before = os.environ.pop(_SEED_VAR, None)
        if schedule_seed is not None:
            os.environ[_SEED_VAR] = str(int(schedule_seed))
        try:
            rc = lib.mtl_run(n, ptrs, sizes, wb, cnames, g, t, err, len(err))
        finally:
            os.environ.pop(_SEED_VAR, None)
            if before is not None:
                os.environ[_SEED_VAR] = before
    if rc != 0:
        raise KernelRuntimeError(f"metal_emu: kernel '{name}' ({kname}): "
                                 f"{err.value.decode(errors='replace')}")
    return outputs


def metal_kernel(name, input_names, output_names, source, header="",
                 ensure_row_contiguous=True, atomic_outputs=False, **_ignored):
    """Drop-in for `mx.fast.metal_kernel` that runs on the emulator and returns mx.arrays."""

    def call(inputs, output_shapes, output_dtypes, grid, threadgroup, template=None,
             init_value=None, verbose=False, stream=None):
        import mlx.core as mx

        outs = run_kernel(name, source, header, input_names, output_names, inputs,
                          output_shapes, output_dtypes, grid, threadgroup, template,
                          init_value, atomic_outputs=atomic_outputs, verbose=verbose)
        result = []
        for o, d in zip(outs, output_dtypes):
            a = mx.array(o)
            result.append(a.view(mx.bfloat16) if _dtype_name(d) == "bfloat16" else a)
        return result

    return call
