"""Our own safetensors reader: validate the header fully, then memory-map the data.

Format: 8-byte little-endian header length N, N bytes of UTF-8 JSON, then the data
section. Every check runs before any tensor memory is touched, and every problem
becomes one `WeightFileError` naming the file (and tensor), never a numpy/OS traceback.
"""

from __future__ import annotations

import json
import math
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import numpy as np

from mlxlocal.errors import WeightFileError

# name, shape -> the slices of that tensor to load (None: all of it; SKIP: none, not read)
Selector = Callable[[str, tuple[int, ...]], "tuple[slice, ...] | None | _Skip"]


class _Skip:
    def __repr__(self) -> str:
        return "SKIP"


SKIP = _Skip()  # a Selector's answer for a tensor this process does not hold (pipeline stages)

# A real header is a few hundred KiB at most; a bigger claim is corruption or an attack.
MAX_HEADER_BYTES = 100 * 1024 * 1024

# safetensors dtype -> (numpy dtype used to read the bytes, mlx dtype, itemsize).
# numpy has no bfloat16: BF16 is read as uint16 and reinterpreted with .view in mlx.
DTYPES: dict[str, tuple[Any, mx.Dtype, int]] = {
    "F64": (np.float64, mx.float64, 8),
    "F32": (np.float32, mx.float32, 4),
    "F16": (np.float16, mx.float16, 2),
    "BF16": (np.uint16, mx.bfloat16, 2),
    "I64": (np.int64, mx.int64, 8),
    "I32": (np.int32, mx.int32, 4),
    "I16": (np.int16, mx.int16, 2),
    "I8": (np.int8, mx.int8, 1),
    "U8": (np.uint8, mx.uint8, 1),
    "U16": (np.uint16, mx.uint16, 2),
    "U32": (np.uint32, mx.uint32, 4),
    "U64": (np.uint64, mx.uint64, 8),
    "BOOL": (np.bool_, mx.bool_, 1),
}

ZERO_COPY = "zero-copy"
COPY = "copy"


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offsets are relative to the start of the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class SafetensorsHeader:
    path: Path
    header_len: int
    data_start: int  # absolute file offset of the data section (8 + header_len)
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    file_size: int = 0

    @property
    def data_len(self) -> int:
        return self.file_size - self.data_start


@dataclass
class LoadResult:
    """What `load_tensors` produced and how: counts per load path, for reporting."""

    arrays: dict[str, mx.array]
    n_zero_copy: int = 0
    n_copied: int = 0
    adopt_tried: bool = False
    metal: bool = False
    copied_names: list[str] = field(default_factory=list)

    @property
    def load_path(self) -> str:
        # "zero-copy" only if nothing had to be copied; one copied tensor makes it "copy".
        return ZERO_COPY if self.n_zero_copy and not self.n_copied else COPY


def _fail(path: Path, problem: str) -> WeightFileError:
    return WeightFileError(f"{path}: {problem}")


def _is_int(x: object) -> bool:
    # JSON true/false parse as bool, which is an int subclass in Python: reject them.
    return isinstance(x, int) and not isinstance(x, bool)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # json.loads silently keeps the last duplicate; a duplicated tensor name is corruption.
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"duplicate key {k!r}")
        out[k] = v
    return out


def metal_available() -> bool:
    try:
        return bool(mx.metal.is_available())
    except Exception:  # older/newer mlx without mx.metal, or a broken driver
        return False


def _read_prefix(path: Path, f: Any) -> tuple[int, int, bytes]:
    """Read and bounds-check the length prefix and header bytes from an open file."""
    size = os.fstat(f.fileno()).st_size
    if size < 8:
        raise _fail(path, f"file is {size} bytes, too short for a safetensors file "
                          "(needs an 8-byte header length)")
    n = int.from_bytes(f.read(8), "little")
    if n > MAX_HEADER_BYTES:
        raise _fail(path, f"header length {n} bytes is over the {MAX_HEADER_BYTES} byte "
                          "limit (corrupt or not a safetensors file)")
    if 8 + n > size:
        raise _fail(path, f"header length {n} bytes runs past the end of the file "
                          f"({size} bytes; truncated or not a safetensors file)")
    if n == 0:
        raise _fail(path, "header length is 0 (expected a JSON object)")
    raw = f.read(n)
    if len(raw) != n:  # file shrank while we were reading it
        raise _fail(path, f"could read only {len(raw)} of {n} header bytes")
    return size, n, raw


def _parse_json(path: Path, raw: bytes) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _fail(path, f"header is not valid UTF-8 (byte {e.start})") from None
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as e:
        raise _fail(path, f"header is not valid JSON: {e.msg} at line {e.lineno} "
                          f"column {e.colno}") from None
    except ValueError as e:  # duplicate key from the hook
        raise _fail(path, f"header JSON has a {e}") from None
    except RecursionError:
        raise _fail(path, "header JSON is nested too deeply") from None
    if not isinstance(obj, dict):
        raise _fail(path, f"header JSON is a {type(obj).__name__}, expected an object "
                          "mapping tensor names to entries")
    return obj


def _parse_metadata(path: Path, meta: Any) -> dict[str, str]:
    if meta is None:  # mx.save_safetensors writes "__metadata__": null
        return {}
    if not isinstance(meta, dict):
        raise _fail(path, f"__metadata__ is a {type(meta).__name__}, expected an object "
                          "of string to string")
    for k, v in meta.items():
        if not isinstance(v, str):
            raise _fail(path, f"__metadata__ key {k!r} has a {type(v).__name__} value, "
                              "expected a string")
    return dict(meta)


def _parse_tensor(path: Path, name: str, entry: Any, data_len: int) -> TensorInfo:
    where = f"tensor {name!r}"
    if not isinstance(entry, dict):
        raise _fail(path, f"{where}: entry is a {type(entry).__name__}, expected an object "
                          "with dtype, shape and data_offsets")
    for key in ("dtype", "shape", "data_offsets"):
        if key not in entry:
            raise _fail(path, f"{where}: entry has no '{key}'")
    dtype = entry["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _fail(path, f"{where}: unknown dtype {dtype!r} (supported: "
                          f"{', '.join(DTYPES)})")
    shape = entry["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise _fail(path, f"{where}: shape {json.dumps(shape)} is not a list of "
                          "non-negative integers")
    offs = entry["data_offsets"]
    if not (isinstance(offs, list) and len(offs) == 2 and all(_is_int(o) for o in offs)):
        raise _fail(path, f"{where}: data_offsets {json.dumps(offs)} is not a "
                          "[begin, end] pair of integers")
    begin, end = offs
    if not 0 <= begin <= end:
        raise _fail(path, f"{where}: data_offsets [{begin}, {end}] are invalid "
                          "(need 0 <= begin <= end)")
    if end > data_len:
        raise _fail(path, f"{where}: data_offsets [{begin}, {end}] run past the end of "
                          f"the data section ({data_len} bytes; file truncated?)")
    itemsize = DTYPES[dtype][2]
    need = math.prod(shape) * itemsize
    if need != end - begin:
        raise _fail(path, f"{where} needs {need} bytes ({dtype} {list(shape)}) but "
                          f"data_offsets give {end - begin}")
    return TensorInfo(dtype, tuple(shape), begin, end)


def _check_overlaps(path: Path, tensors: dict[str, TensorInfo]) -> None:
    # Sort by start; any range starting before the previous one ended overlaps it.
    ranges = sorted((t.begin, t.end, n) for n, t in tensors.items() if t.end > t.begin)
    for (b0, e0, n0), (b1, e1, n1) in zip(ranges, ranges[1:], strict=False):
        if b1 < e0:
            raise _fail(path, f"tensors {n0!r} [{b0}, {e0}] and {n1!r} [{b1}, {e1}] have "
                              "overlapping data_offsets")


def _parse_header(path: Path, size: int, n: int, raw: bytes) -> SafetensorsHeader:
    obj = _parse_json(path, raw)
    data_start = 8 + n
    metadata = _parse_metadata(path, obj.pop("__metadata__", None))
    tensors = {
        name: _parse_tensor(path, name, entry, size - data_start)
        for name, entry in obj.items()
    }
    _check_overlaps(path, tensors)
    return SafetensorsHeader(path, n, data_start, tensors, metadata, size)


def read_header(path: str | os.PathLike[str]) -> SafetensorsHeader:
    """Read and fully validate a safetensors header without touching tensor data."""
    p = Path(path)
    try:
        with open(p, "rb") as f:
            return _parse_header(p, *_read_prefix(p, f))
    except OSError as e:
        raise _fail(p, f"cannot read file: {e.strerror or e}") from None


def _to_mx(view: np.ndarray, info: TensorInfo, aligned: bool, try_adopt: bool
           ) -> tuple[mx.array, bool]:
    """Turn a mapped numpy view into an mx.array; return (array, adopted_without_copy)."""
    mx_dtype = DTYPES[info.dtype][1]
    # BF16 bytes arrive as uint16. Always pass dtype: mlx would turn float64 into float32.
    read_dtype = mx.uint16 if info.dtype == "BF16" else mx_dtype
    arr: mx.array | None = None
    if try_adopt and aligned:
        try:
            arr = mx.asarray(view, dtype=read_dtype, copy=False)
        except (ValueError, TypeError, RuntimeError):
            arr = None  # e.g. CPU backend: "Cannot import a CPU array without a copy"
    adopted = arr is not None
    if arr is None:
        arr = mx.array(view, dtype=read_dtype)  # the one copy
    if read_dtype != mx_dtype:
        arr = arr.view(mx_dtype)  # reinterpret the bits, no copy
    return arr, adopted


def load_tensors(path: str | os.PathLike[str], adopt: bool | None = None,
                 select: Selector | None = None) -> LoadResult:
    """Validate, memory-map and load every tensor; count which load path each took.

    adopt=None tries zero-copy adoption only when Metal is available; True always tries
    (falling back to a copy on failure); False always copies. `select(name, shape)` may
    return the slices of a tensor to load (tensor parallelism: a rank's shard): only those
    bytes are copied out of the mapping; or SKIP: the tensor is left out, its bytes never read.
    """
    p = Path(path)
    metal = metal_available()
    try_adopt = metal if adopt is None else adopt
    result = LoadResult(arrays={}, adopt_tried=try_adopt, metal=metal)
    try:
        with open(p, "rb") as f:
            header = _parse_header(p, *_read_prefix(p, f))
            if not header.tensors:
                return result
            # Copy-on-write mapping: if MLX ever writes into an adopted buffer (buffer
            # donation) it touches a private page, never the file, and never faults.
            mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    except OSError as e:
        raise _fail(p, f"cannot read or map file: {e.strerror or e}") from None
    if len(mm) != header.file_size:  # file changed between fstat and mmap
        raise _fail(p, f"file size changed while loading ({header.file_size} -> {len(mm)})")

    for name, info in header.tensors.items():
        part = select(name, tuple(info.shape)) if select is not None else None
        if part is SKIP:
            continue
        np_dtype, mx_dtype, itemsize = DTYPES[info.dtype]
        if info.nbytes == 0:  # nothing to map; an empty array is free
            result.arrays[name] = mx.zeros(info.shape, dtype=mx_dtype)
            continue
        offset = header.data_start + info.begin
        view = np.frombuffer(mm, dtype=np_dtype, count=info.numel, offset=offset)
        view = view.reshape(info.shape)
        if part is not None:  # a strided slice of the mapping: copied, never adopted
            view = view[part]
        # The map starts page-aligned, so file-offset alignment == pointer alignment.
        arr, adopted = _to_mx(view, info, offset % itemsize == 0 and part is None, try_adopt)
        result.arrays[name] = arr
        if adopted:
            result.n_zero_copy += 1
        else:
            result.n_copied += 1
            result.copied_names.append(name)
    # Copied arrays own their memory; adopted ones keep `mm` alive through numpy's base.
    return result


def load_file(path: str | os.PathLike[str], adopt: bool | None = None
              ) -> tuple[dict[str, mx.array], str]:
    """Load all tensors of one file. The str is "zero-copy" or "copy" (any tensor copied)."""
    result = load_tensors(path, adopt)
    return result.arrays, result.load_path
