"""Safetensors loader: round trips, sharded dirs, and hostile files that must fail cleanly."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlxlocal.errors import ModelLoadError, WeightFileError
from mlxlocal.weights import (
    INDEX_NAME,
    load_file,
    load_model_weights,
    load_tensors,
    metal_available,
    read_header,
    weights_summary,
)


def write_raw(path: Path, header: Any, data: bytes = b"", *, raw_header: bytes | None = None,
              header_len: int | None = None) -> Path:
    """Write a safetensors file by hand so tests can break any part of it."""
    hb = raw_header if raw_header is not None else json.dumps(header).encode()
    n = len(hb) if header_len is None else header_len
    path.write_bytes(struct.pack("<Q", n) + hb + data)
    return path


def f32_entry(shape: list[int], begin: int, end: int, dtype: str = "F32") -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def assert_error(path: Path, exc: pytest.ExceptionInfo[BaseException], *needles: str) -> None:
    msg = str(exc.value)
    assert path.name in msg, msg
    for needle in needles:
        assert needle in msg, f"{needle!r} not in {msg!r}"


def same(a: mx.array, b: mx.array) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(mx.array_equal(a, b).item())


# ---------------------------------------------------------------- round trips


def test_roundtrip_mlx_all_dtypes(tmp_path: Path) -> None:
    src = {
        "bf16": (mx.arange(12, dtype=mx.float32).reshape(3, 4) / 7).astype(mx.bfloat16),
        "f16": mx.array([[1.5, -2.25], [3.0, 0.125]], dtype=mx.float16),
        "f32": mx.random.normal((5, 3)),
        "i32": mx.array([-1, 2, 2**31 - 1], dtype=mx.int32),
        "i64": mx.array([-(2**40), 7], dtype=mx.int64),
        "i8": mx.array([-128, 127], dtype=mx.int8),
        "u8": mx.array([0, 255], dtype=mx.uint8),
        "u32": mx.array([2**32 - 1, 3], dtype=mx.uint32),
        "bool": mx.array([True, False, True]),
        "scalar": mx.array(3.5),
        "empty": mx.zeros((0, 4)),
    }
    p = tmp_path / "model.safetensors"
    mx.save_safetensors(str(p), src, metadata={"format": "mlx"})
    header = read_header(p)
    assert header.metadata == {"format": "mlx"}
    assert header.tensors["bf16"].dtype == "BF16" and header.tensors["bf16"].shape == (3, 4)
    out, how = load_file(p)
    assert set(out) == set(src)
    for name, arr in src.items():
        assert same(out[name], arr), name


def test_roundtrip_safetensors_numpy_api(tmp_path: Path) -> None:
    st_numpy = pytest.importorskip("safetensors.numpy")
    rng = np.random.default_rng(0)
    src = {
        "w": rng.standard_normal((4, 8)).astype(np.float32),
        "h": rng.standard_normal((3,)).astype(np.float16),
        "d": rng.standard_normal((2, 2)).astype(np.float64),
        "u16": np.array([1, 65535], dtype=np.uint16),
        "i16": np.array([-5, 5], dtype=np.int16),
    }
    p = tmp_path / "np.safetensors"
    st_numpy.save_file(src, str(p), metadata={"k": "v"})
    out, _ = load_file(p)
    assert read_header(p).metadata == {"k": "v"}
    for name, arr in src.items():
        np.testing.assert_array_equal(np.array(out[name]), arr)


def test_misaligned_tensor_still_loads(tmp_path: Path) -> None:
    # An odd-length header puts the F32 data at an unaligned file offset.
    vals = np.array([1.0, -2.0, 3.5], dtype=np.float32)
    hdr = {"x": f32_entry([3], 0, 12)}
    hb = json.dumps(hdr).encode()
    hb += b" " * ((1 - len(hb)) % 2)  # make 8 + len(hb) odd
    p = write_raw(tmp_path / "odd.safetensors", None, vals.tobytes(), raw_header=hb)
    assert read_header(p).data_start % 4 != 0
    res = load_tensors(p, adopt=True)
    assert res.n_copied == 1 and res.n_zero_copy == 0
    np.testing.assert_array_equal(np.array(res.arrays["x"]), vals)


def test_cpu_backend_reports_copy(tmp_path: Path) -> None:
    if metal_available():
        pytest.skip("Metal backend: the zero-copy path applies")
    p = tmp_path / "model.safetensors"
    mx.save_safetensors(str(p), {"w": mx.ones((4, 4))})
    for adopt in (None, True, False):
        _, how = load_file(p, adopt=adopt)
        assert how == "copy"
    _, report = load_model_weights(tmp_path)
    assert report.load_path == "copy (CPU backend: MLX cannot adopt host memory)"


def test_copied_data_is_independent_of_file(tmp_path: Path) -> None:
    p = tmp_path / "model.safetensors"
    mx.save_safetensors(str(p), {"w": mx.full((8,), 2.0)})
    out, how = load_file(p, adopt=False)
    p.write_bytes(b"\0" * p.stat().st_size)  # overwrite the file on disk
    if how == "copy":
        assert out["w"].tolist() == [2.0] * 8


def write_sharded(tmp_path: Path) -> dict[str, mx.array]:
    a = {"layers.0.w": mx.arange(6, dtype=mx.float32).reshape(2, 3),
         "embed": mx.ones((4, 2), dtype=mx.bfloat16)}
    b = {"layers.1.w": mx.full((3,), -1.0, dtype=mx.float16)}
    mx.save_safetensors(str(tmp_path / "model-00001-of-00002.safetensors"), a)
    mx.save_safetensors(str(tmp_path / "model-00002-of-00002.safetensors"), b)
    wm = {k: "model-00001-of-00002.safetensors" for k in a}
    wm.update({k: "model-00002-of-00002.safetensors" for k in b})
    (tmp_path / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    return {**a, **b}


def test_sharded_with_index(tmp_path: Path) -> None:
    src = write_sharded(tmp_path)
    # A stray consolidated file must be ignored when an index exists.
    mx.save_safetensors(str(tmp_path / "consolidated.safetensors"), src)
    weights, report = load_model_weights(tmp_path)
    assert set(weights) == set(src)
    for name, arr in src.items():
        assert same(weights[name], arr), name
    assert report.n_tensors == 3
    assert [f for f, _ in report.files] == ["model-00001-of-00002.safetensors",
                                            "model-00002-of-00002.safetensors"]
    assert report.total_bytes == sum(s for _, s in report.files)
    assert report.dtypes == {"F32", "BF16", "F16"}
    assert "3 tensors" in report.describe() and "2 files" in report.describe()


def test_glob_without_index_and_summary(tmp_path: Path) -> None:
    mx.save_safetensors(str(tmp_path / "b.safetensors"), {"y": mx.zeros((2, 5))})
    mx.save_safetensors(str(tmp_path / "a.safetensors"),
                        {"x": mx.zeros((3, 3), dtype=mx.bfloat16)})
    weights, report = load_model_weights(tmp_path)
    assert set(weights) == {"x", "y"}
    assert [f for f, _ in report.files] == ["a.safetensors", "b.safetensors"]
    summary = weights_summary(tmp_path)
    assert summary.params_by_dtype == {"BF16": 9, "F32": 10}
    assert summary.n_params == 19 and summary.n_tensors == 2
    assert "not loaded" in summary.load_path
    assert "19 params" in summary.describe()


# ---------------------------------------------------------------- hostile files


@pytest.mark.parametrize("content", [b"", b"\x01\x02\x03"])
def test_too_short_file(tmp_path: Path, content: bytes) -> None:
    p = tmp_path / "short.safetensors"
    p.write_bytes(content)
    with pytest.raises(WeightFileError) as exc:
        load_file(p)
    assert_error(p, exc, "too short", f"{len(content)} bytes")


def test_truncated_data_section(tmp_path: Path) -> None:
    src = tmp_path / "full.safetensors"
    mx.save_safetensors(str(src), {"w": mx.ones((16, 16))})
    p = tmp_path / "cut.safetensors"
    p.write_bytes(src.read_bytes()[:-100])
    with pytest.raises(WeightFileError) as exc:
        load_file(p)
    assert_error(p, exc, "'w'", "past the end of the data section", "924 bytes", "truncated")


def test_header_length_past_eof(tmp_path: Path) -> None:
    p = write_raw(tmp_path / "eof.safetensors", {}, header_len=5000)
    with pytest.raises(WeightFileError) as exc:
        read_header(p)
    assert_error(p, exc, "header length 5000", "past the end of the file")


def test_huge_header_length(tmp_path: Path) -> None:
    p = write_raw(tmp_path / "huge.safetensors", {}, header_len=2**60)
    with pytest.raises(WeightFileError) as exc:
        load_file(p)
    assert_error(p, exc, str(2**60), "limit")


@pytest.mark.parametrize("raw, needle", [
    (b'{"w": {"dtype": "F32",', "not valid JSON"),
    (b"\xff\xfe{}", "not valid UTF-8"),
    (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
    (b'{"w": {}, "w": {}}', "duplicate key 'w'"),
])
def test_malformed_header(tmp_path: Path, raw: bytes, needle: str) -> None:
    p = write_raw(tmp_path / "bad.safetensors", None, raw_header=raw)
    with pytest.raises(WeightFileError) as exc:
        read_header(p)
    assert_error(p, exc, needle)


@pytest.mark.parametrize("obj", [[1, 2], "hello", 42])
def test_header_not_object(tmp_path: Path, obj: Any) -> None:
    p = write_raw(tmp_path / "list.safetensors", obj)
    with pytest.raises(WeightFileError) as exc:
        read_header(p)
    assert_error(p, exc, "expected an object")


def test_bad_metadata(tmp_path: Path) -> None:
    p = write_raw(tmp_path / "meta.safetensors", {"__metadata__": {"n": 3}})
    with pytest.raises(WeightFileError) as exc:
        read_header(p)
    assert_error(p, exc, "__metadata__", "'n'")


def test_unknown_dtype(tmp_path: Path) -> None:
    p = write_raw(tmp_path / "dt.safetensors", {"w": f32_entry([2], 0, 2, dtype="F8_E4M3")},
                  b"\0\0")
    with pytest.raises(WeightFileError) as exc:
        load_file(p)
    assert_error(p, exc, "'w'", "unknown dtype 'F8_E4M3'")


def test_byte_length_mismatch(tmp_path: Path) -> None:
    p = write_raw(tmp_path / "model.safetensors", {"layers.0.w": f32_entry([32, 32], 0, 4000)},
                  b"\0" * 4000)
    with pytest.raises(WeightFileError) as exc:
        load_file(p)
    assert_error(p, exc, "tensor 'layers.0.w' needs 4096 bytes (F32 [32, 32]) but "
                         "data_offsets give 4000")


def test_overlapping_offsets(tmp_path: Path) -> None:
    hdr = {"a": f32_entry([4], 0, 16), "b": f32_entry([4], 8, 24)}
    p = write_raw(tmp_path / "ovl.safetensors", hdr, b"\0" * 24)
    with pytest.raises(WeightFileError) as exc:
        load_file(p)
    assert_error(p, exc, "'a'", "'b'", "overlapping")


def test_offsets_past_data_section(tmp_path: Path) -> None:
    hdr = {"a": f32_entry([4], 0, 16), "b": f32_entry([4], 16, 32)}
    p = write_raw(tmp_path / "past.safetensors", hdr, b"\0" * 16)
    with pytest.raises(WeightFileError) as exc:
        load_file(p)
    assert_error(p, exc, "'b'", "[16, 32]", "16 bytes")


@pytest.mark.parametrize("offsets", [[8, 4], [-4, 0], [0], [0.0, 4.0], "0-4"])
def test_invalid_offsets(tmp_path: Path, offsets: Any) -> None:
    hdr = {"w": {"dtype": "F32", "shape": [1], "data_offsets": offsets}}
    p = write_raw(tmp_path / "offs.safetensors", hdr, b"\0" * 16)
    with pytest.raises(WeightFileError) as exc:
        read_header(p)
    assert_error(p, exc, "'w'", "data_offsets")


@pytest.mark.parametrize("shape", [[-1, 4], [2.5], "4x4", [True], None])
def test_invalid_shape(tmp_path: Path, shape: Any) -> None:
    hdr = {"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 16]}}
    p = write_raw(tmp_path / "shape.safetensors", hdr, b"\0" * 16)
    with pytest.raises(WeightFileError) as exc:
        read_header(p)
    assert_error(p, exc, "'w'", "shape")


def test_missing_entry_field(tmp_path: Path) -> None:
    p = write_raw(tmp_path / "nofield.safetensors", {"w": {"dtype": "F32", "shape": [1]}},
                  b"\0" * 4)
    with pytest.raises(WeightFileError) as exc:
        read_header(p)
    assert_error(p, exc, "'w'", "data_offsets")


def test_path_is_directory_or_missing(tmp_path: Path) -> None:
    for p in (tmp_path, tmp_path / "nope.safetensors"):
        with pytest.raises(WeightFileError) as exc:
            load_file(p)
        assert_error(p, exc, "cannot read")


# ---------------------------------------------------------------- model directories


def test_missing_shard(tmp_path: Path) -> None:
    write_sharded(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightFileError) as exc:
        load_model_weights(tmp_path)
    assert_error(tmp_path / INDEX_NAME, exc, "model-00002-of-00002.safetensors",
                 "does not exist")


@pytest.mark.parametrize("text, needle", [
    ("{not json", "not valid JSON"),
    ('{"metadata": {}}', "weight_map"),
    ('{"weight_map": []}', "weight_map"),
    ('{"weight_map": {}}', "empty"),
    ('{"weight_map": {"w": 3}}', "'w'"),
    ('{"weight_map": {"w": "../outside.safetensors"}}', "outside the model directory"),
    ('{"weight_map": {"w": "a/../../outside.safetensors"}}', "outside the model directory"),
    ('{"weight_map": {"w": "/etc/outside.safetensors"}}', "outside the model directory"),
])
def test_index_malformed(tmp_path: Path, text: str, needle: str) -> None:
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"w": mx.ones((2,))})
    (tmp_path / INDEX_NAME).write_text(text)
    with pytest.raises(WeightFileError) as exc:
        load_model_weights(tmp_path)
    assert_error(tmp_path / INDEX_NAME, exc, needle)


def test_shards_linked_out_of_the_dir_load(tmp_path: Path) -> None:
    """The HF cache's snapshot files are links into its blobs/: named inside, stored out."""
    blobs, snap = tmp_path / "blobs", tmp_path / "snapshots" / "abc"
    blobs.mkdir()
    snap.mkdir(parents=True)
    mx.save_safetensors(str(blobs / "1234.safetensors"), {"w": mx.ones((2,))})
    (snap / "model-00001-of-00001.safetensors").symlink_to(Path("../../blobs/1234.safetensors"))
    (snap / INDEX_NAME).write_text('{"weight_map": {"w": "model-00001-of-00001.safetensors"}}')
    weights, _ = load_model_weights(snap)
    assert mx.array_equal(weights["w"], mx.ones((2,)))


def test_weight_map_tensor_missing_from_shard(tmp_path: Path) -> None:
    write_sharded(tmp_path)
    idx = json.loads((tmp_path / INDEX_NAME).read_text())
    idx["weight_map"]["lm_head.weight"] = "model-00002-of-00002.safetensors"
    (tmp_path / INDEX_NAME).write_text(json.dumps(idx))
    with pytest.raises(WeightFileError) as exc:
        weights_summary(tmp_path)
    assert_error(tmp_path / INDEX_NAME, exc, "'lm_head.weight'",
                 "model-00002-of-00002.safetensors", "no such tensor")


def test_duplicate_tensor_across_shards(tmp_path: Path) -> None:
    mx.save_safetensors(str(tmp_path / "a.safetensors"), {"w": mx.ones((2,))})
    mx.save_safetensors(str(tmp_path / "b.safetensors"), {"w": mx.zeros((2,))})
    with pytest.raises(WeightFileError) as exc:
        load_model_weights(tmp_path)
    assert_error(tmp_path / "a.safetensors", exc, "'w'", "b.safetensors")


def test_no_weights_in_dir(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError) as exc:
        load_model_weights(tmp_path)
    assert str(tmp_path) in str(exc.value) and "no *.safetensors" in str(exc.value)


def test_bad_shard_error_names_shard(tmp_path: Path) -> None:
    write_sharded(tmp_path)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:-3])
    with pytest.raises(WeightFileError) as exc:
        load_model_weights(tmp_path)
    assert_error(shard, exc, "'layers.1.w'", "truncated")
