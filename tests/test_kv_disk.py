"""Disk KV tier storage: round trips, every corruption kind, LRU budget, restart, drops, 2 procs."""

from __future__ import annotations

import multiprocessing as mp
import os

import numpy as np
import pytest

from mlxlocal.cache.disk.format import CorruptBlock, Fingerprint, to_mx
from mlxlocal.cache.disk.keys import chain_hashes
from mlxlocal.cache.disk.store import DiskStore, norm_key


def fp(**kw) -> Fingerprint:
    base = dict(weights="w", dtype="bfloat16", kv_bits=None, kv_group_size=64, rope="{}",
                block_size=16, tokenizer="t", model_type="llama")
    return Fingerprint(**{**base, **kw})


def block(seed: int, n: int = 64) -> dict:
    r = np.random.default_rng(seed)
    return {"k0": r.standard_normal(n).astype(np.float16),
            "v0": r.integers(0, 2**32 - 1, n, dtype=np.uint32).reshape(4, -1)}


def key(i: int, tag=None):
    h = chain_hashes(list(range(16 * (i + 1))), 16)[-1]
    return h if tag is None else (h, tag)


def only_file(store: DiskStore) -> str:
    (name,) = [n for n in os.listdir(store.dir) if n.endswith(".kv")]
    return os.path.join(store.dir, name)


def test_block_keys_cover_the_prefix_and_come_lazily_in_any_order():
    """A block's key is blake2b over its prefix's token bytes (worked out here by hashlib on
    the whole prefix, apart from PrefixKeys' running hash); asked for in any order they are
    the same; a tag (an edit history) makes keys of its own from its block on, before it the
    plain ones stay; other tokens anywhere before a block change its key."""
    import hashlib
    import random

    import numpy as np

    from mlxlocal.cache.disk.keys import PrefixKeys

    rng = random.Random(0)
    tokens = [rng.randrange(50_000) for _ in range(16 * 40 + 5)]
    want = [hashlib.blake2b(np.asarray(tokens[:16 * (i + 1)], np.int64).tobytes(), digest_size=16,
                            person=b"mlxlocal-kv").digest() for i in range(40)]
    assert chain_hashes(tokens, 16) == want
    for _ in range(20):
        keys, order = PrefixKeys(tokens, 16), rng.sample(range(40), rng.randrange(1, 41))
        assert [keys[i] for i in order] == [want[i] for i in order] and keys.all() == want
    # From the int64s submit checked the prompt as (the engine's path): the same keys.
    assert PrefixKeys(np.asarray(tokens, np.int64), 16).all() == want
    assert PrefixKeys(np.asarray(tokens, np.int32), 16)[39] == want[39]
    changed = list(tokens)
    changed[16 * 7 + 3] += 1  # block 7
    assert chain_hashes(changed, 16)[:7] == want[:7]
    assert not set(chain_hashes(changed, 16)[7:]) & set(want)
    tags = [None] * 10 + [("drop", 3, 5)] * 30
    tagged = chain_hashes(tokens, 16, tags)
    assert tagged[:10] == want[:10] and not set(tagged[10:]) & set(want)
    assert PrefixKeys(tokens, 16, tags)[25] == tagged[25]
    assert chain_hashes(tokens, 16, [None] * 10 + [("drop", 3, 6)] * 30)[10:] != tagged[10:]


def test_round_trip_dtypes(tmp_path):
    import mlx.core as mx

    s = DiskStore(tmp_path, 1 << 20, fp())
    arrays = {"f32": np.arange(6, dtype=np.float32).reshape(2, 3), "i8": np.arange(5, dtype=np.int8),
              "u32": np.arange(4, dtype=np.uint32), "bf16": mx.array([1.5, -2.0, 3.25], mx.bfloat16)}
    s.put(key(0), arrays)
    s.put(key(0, tag="drop:3"), {"x": np.ones(2, np.float16)})
    assert s.flush()
    got, dtypes = s.get(key(0), with_dtypes=True)
    for name in ("f32", "i8", "u32"):
        assert got[name].dtype == arrays[name].dtype
        np.testing.assert_array_equal(got[name], arrays[name])
    assert dtypes["bf16"] == "bfloat16"
    back = to_mx(got, dtypes)["bf16"]
    assert back.dtype == mx.bfloat16 and mx.array_equal(back, arrays["bf16"]).item()
    assert list(s.get(key(0, tag="drop:3"))) == ["x"]  # the tag is part of the key
    assert s.get(key(1)) is None
    st = s.stats()
    assert st["hits"] == 2 and st["misses"] == 1 and st["writes"] == 2
    s.close()


def _truncate(p):
    with open(p, "r+b") as f:
        f.truncate(os.path.getsize(p) - 3)


def _flip(p):
    b = bytearray(open(p, "rb").read())
    b[len(b) // 2] ^= 0x40
    open(p, "wb").write(bytes(b))


def _garbage(p):
    open(p, "wb").write(os.urandom(200))


@pytest.mark.parametrize("damage", [_truncate, _flip, _garbage])
def test_corruption_removed(tmp_path, damage):
    s = DiskStore(tmp_path, 1 << 20, fp())
    s.put(key(0), block(0))
    assert s.flush()
    p = only_file(s)
    damage(p)
    assert s.get(key(0)) is None
    assert not os.path.exists(p) and s.stats()["corrupt_removed"] == 1
    s.close()


def test_read_into_streams_into_the_given_buffers_and_verifies(tmp_path):
    s = DiskStore(tmp_path, 1 << 20, fp())
    arrays = block(3)
    s.put_run([key(0), key(1)], arrays)
    assert s.flush()
    seen = {}
    k0 = np.zeros(64, np.float16)
    v0 = np.zeros((4, 16), np.uint32)

    def place(keys, table):  # k0 whole; v0's first and last rows, the middle ones dropped
        seen.update(keys=keys, table=table)
        return {"k0": [memoryview(k0).cast("B")],
                "v0": [memoryview(v0[0]).cast("B"), 2 * 64, memoryview(v0[3]).cast("B")]}
    assert s.read_into(key(0), place) == [norm_key(key(0)), norm_key(key(1))]
    assert seen["table"] == {"k0": ("float16", (64,)), "v0": ("uint32", (4, 16))}
    assert np.array_equal(k0, arrays["k0"])
    assert np.array_equal(v0[[0, 3]], arrays["v0"][[0, 3]]) and not v0[1:3].any()
    assert s.read_into(key(0), lambda keys, table: None) is None  # declined: nothing read, kept
    assert s.stats()["corrupt_removed"] == 0
    with pytest.raises(ValueError, match="wrong number of bytes"):  # a caller's bug, not corruption
        s.read_into(key(0), lambda keys, table: {"k0": [16]})
    _flip(only_file(s))
    # The bytes land before the checksum can be known: the caller is told, the file removed.
    assert s.read_into(key(0), place) is None
    assert s.stats()["corrupt_removed"] == 1
    assert not [n for n in os.listdir(s.dir) if n.endswith(".kv")]
    s.close()


def test_read_into_reads_a_large_payload_on_two_threads_and_verifies(tmp_path, monkeypatch):
    """From PARALLEL_BYTES on, a helper thread reads the payload's second half (dropped bytes
    into scratch of its own) while the caller's thread reads the first: the buffers get the
    same bytes, and a flipped byte, a cut or a file replaced meanwhile in that half is caught."""
    from mlxlocal.cache.disk import format as fmt

    monkeypatch.setattr(fmt, "PARALLEL_BYTES", 64)
    monkeypatch.setattr(fmt, "READ_PIECE", 32)
    helped = []
    read_later = fmt._read_later
    monkeypatch.setattr(fmt, "_read_later", lambda *a: helped.append(len(a[3])) or read_later(*a))
    s = DiskStore(tmp_path, 1 << 20, fp())
    arrays = {"k0": np.arange(64, dtype=np.float32),
              "v0": np.arange(256, dtype=np.uint32).reshape(4, -1)}
    s.put_run([key(0), key(1)], arrays)
    assert s.flush()
    k0, v0 = np.zeros(64, np.float32), np.zeros((4, 64), np.uint32)

    def place(keys, table):  # v0's rows 1 and 2 dropped: in the helper's half
        return {"k0": [memoryview(k0).cast("B")],
                "v0": [memoryview(v0[0]).cast("B"), 2 * 256, memoryview(v0[3]).cast("B")]}
    assert s.read_into(key(0), place) == [norm_key(key(0)), norm_key(key(1))]
    assert helped and helped[-1] > 0  # the second half was the helper's
    assert np.array_equal(k0, arrays["k0"]) and np.array_equal(v0[[0, 3]], arrays["v0"][[0, 3]])
    path = only_file(s)
    good = open(path, "rb").read()

    def damaged(data: bytes) -> bool:  # the file as given: not loaded, and removed
        open(path, "wb").write(data)
        return s.read_into(key(0), place) is None and not os.path.exists(path)
    flipped = bytearray(good)
    flipped[-300] ^= 1  # in v0's dropped rows: read by the helper, checked all the same
    assert damaged(bytes(flipped))

    def cutting(keys, table):  # cut after the checks of its length: the helper comes short
        os.truncate(path, len(good) - 8)
        return place(keys, table)

    def replacing(keys, table):  # another process wrote the key anew: the halves not mixed
        os.replace(path + "-copy", path)
        return place(keys, table)
    for meanwhile in (cutting, replacing):
        open(path, "wb").write(good)
        open(path + "-copy", "wb").write(good)
        with pytest.raises(CorruptBlock, match="truncated, or replaced"), open(path, "rb") as f:
            fmt.read_into(f, len(good), s.fp, norm_key(key(0)), meanwhile, path)
    s.close()


def test_foreign_fingerprint_and_wrong_key(tmp_path):
    other = DiskStore(tmp_path, 1 << 20, fp(kv_bits=8))
    other.put(key(0), block(0))
    assert other.flush()
    s = DiskStore(tmp_path, 1 << 20, fp())
    assert s.get(key(0)) is None  # another directory: simply a miss
    os.makedirs(s.dir, exist_ok=True)
    key_str = norm_key(key(0))
    os.replace(only_file(other), s._path(key_str))
    assert s.get(key(0)) is None and s.stats()["corrupt_removed"] == 1  # foreign fingerprint
    s.put(key(1), block(1))
    assert s.flush()
    os.replace(s._path(norm_key(key(1))), s._path(key_str))
    assert s.get(key(0)) is None and s.stats()["corrupt_removed"] == 2  # wrong key
    other.close()
    s.close()


def test_block_files_of_an_older_format_removed_on_open(tmp_path):
    """v4 keys blocks by their prefix's hash: a v3 file is named by no key any more, so a
    store opened by this version drops it instead of leaving it to the LRU."""
    from mlxlocal.cache.disk import format as fmt

    s = DiskStore(tmp_path, 1 << 20, fp())
    s.put(key(0), block(0))
    s.put(key(1), block(1))
    assert s.flush()
    s.close()
    files = sorted(e.path for e in os.scandir(s.dir) if e.name.endswith(".kv"))
    old = bytearray(open(files[0], "rb").read())
    old[len(fmt.MAGIC):len(fmt.MAGIC) + 4] = (fmt.VERSION - 1).to_bytes(4, "little")
    open(files[0], "wb").write(bytes(old))
    again = DiskStore(tmp_path, 1 << 20, fp())
    assert not os.path.exists(files[0]) and os.path.exists(files[1])
    assert again.stats()["files"] == 1
    again.close()


def test_leftover_temp_removed_on_open(tmp_path):
    s = DiskStore(tmp_path, 1 << 20, fp())
    s.close()
    stale = os.path.join(s.dir, ".tmp-999999999-1")
    open(stale, "wb").write(b"half")
    DiskStore(tmp_path, 1 << 20, fp()).close()
    assert not os.path.exists(stale)


def test_lru_budget_and_restart(tmp_path):
    s = DiskStore(tmp_path, 1 << 20, fp())
    s.put(key(0), block(0))
    assert s.flush()
    size = os.path.getsize(only_file(s))
    s.close()
    s = DiskStore(tmp_path, int(size * 3.5), fp())
    assert s.get(key(0)) is not None  # restart finds it
    for i in (1, 2):
        s.put(key(i), block(i))
    assert s.flush()
    assert s.get(key(0)) is not None  # now most recent: key(1) is the oldest
    s.put(key(3), block(3))
    assert s.flush()
    assert s.stats()["evictions"] == 1 and s.stats()["bytes_on_disk"] <= 3.5 * size
    assert s.get(key(1)) is None
    for i in (0, 2, 3):
        np.testing.assert_array_equal(s.get(key(i))["k0"], block(i)["k0"])
    s.close()


def test_full_queue_drops(tmp_path):
    s = DiskStore(tmp_path, 1 << 20, fp(), queue_size=2)
    s.pause()
    results = [s.put(key(i), block(i)) for i in range(5)]
    # the paused writer may hold one item already; at most 3 accepted
    assert results.count(False) >= 2 and s.stats()["dropped_writes"] == results.count(False)
    s.resume()
    assert s.flush()
    assert s.stats()["writes"] == results.count(True)
    s.close()


def _worker(root, seed, q):
    s = DiskStore(root, 6 * 400, fp())  # small budget: evictions race with writes
    bad = 0
    for j in range(60):
        i = (seed * 7 + j) % 12
        s.put(key(i), block(i))
        got = s.get(key((i + 5) % 12))
        if got is not None and not all(np.array_equal(got[n], block((i + 5) % 12)[n])
                                       for n in got):
            bad += 1
    s.flush()
    s.close()
    q.put(bad)


def test_two_processes(tmp_path):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_worker, args=(str(tmp_path), n, q)) for n in range(2)]
    for p in ps:
        p.start()
    for p in ps:
        p.join(60)
    assert [q.get(timeout=5) for _ in ps] == [0, 0]
    s = DiskStore(tmp_path, 6 * 400, fp())
    for i in range(12):
        got = s.get(key(i))
        assert got is None or np.array_equal(got["k0"], block(i)["k0"])
    assert s.stats()["corrupt_removed"] == 0 and s.stats()["bytes_on_disk"] <= 6 * 400
    s.close()


def test_fingerprint_from_model_dir(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "rope_theta": 1e4}))
    hdr = json.dumps({"w": {"dtype": "F16", "shape": [4], "data_offsets": [0, 8]}}).encode()
    (tmp_path / "model.safetensors").write_bytes(len(hdr).to_bytes(8, "little") + hdr + b"\1" * 8)
    (tmp_path / "tokenizer.json").write_text("{}")
    a = Fingerprint.from_model_dir(tmp_path, dtype="bfloat16", kv_bits=None, kv_group_size=64,
                                   block_size=16)
    assert a == Fingerprint.from_model_dir(tmp_path, dtype="bfloat16", kv_bits=None,
                                           kv_group_size=64, block_size=16)
    assert len(a.digest) == 32 and "rope_theta" in a.rope
    (tmp_path / "model.safetensors").write_bytes(len(hdr).to_bytes(8, "little") + hdr + b"\2" * 8)
    b = Fingerprint.from_model_dir(tmp_path, dtype="bfloat16", kv_bits=None, kv_group_size=64,
                                   block_size=16)
    assert a.digest != b.digest  # other weights, same header


def test_runs_of_block_ids_are_found_whole_and_in_order():
    """blocks.id_runs (numpy finds the breaks) against a walk of the ids one by one."""
    import random

    from mlxlocal.cache.blocks import id_runs as _runs

    def walk(ids):
        out, start = [], 0
        for j in range(1, len(ids) + 1):
            if j == len(ids) or ids[j] != ids[j - 1] + 1:
                out.append((start, ids[start], j - start))
                start = j
        return out

    rng = random.Random(2)
    for _ in range(500):
        ids = [b for _ in range(rng.randrange(0, 6)) for s in [rng.randrange(100)]
               for b in range(s, s + rng.randrange(1, 30))]
        if rng.random() < 0.2:
            rng.shuffle(ids)
        assert _runs(ids) == walk(ids)


@pytest.mark.parametrize("parallel", [False, True])
def test_read_into_checks_each_half_wherever_the_destinations_cut_it(tmp_path, monkeypatch, parallel):
    """The checksum covers the payload's halves apart (each checked by the thread that reads
    it): destinations cut anywhere, some bytes dropped, on one thread or two, read back the
    same bytes; one flipped byte anywhere in the payload is caught."""
    import random

    from mlxlocal.cache.disk import format as fmt

    monkeypatch.setattr(fmt, "PARALLEL_BYTES", 64 if parallel else 1 << 30)
    monkeypatch.setattr(fmt, "READ_PIECE", 48)
    rng = random.Random(1)
    s = DiskStore(tmp_path, 1 << 20, fp())
    arrays = {f"a{i}": np.arange(rng.randrange(1, 200), dtype=np.float32) + i for i in range(4)}
    s.put_run([key(0)], arrays)
    assert s.flush()
    path = only_file(s)
    good = open(path, "rb").read()
    for trial in range(30):
        out = {name: np.zeros_like(a) for name, a in arrays.items()}
        keep = {}

        def place(keys, table, out=out, keep=keep):
            sinks = {}
            for name, a in out.items():
                raw, views, at = memoryview(a).cast("B"), [], 0
                while at < len(raw):
                    n = rng.randrange(1, len(raw) - at + 1)
                    drop = rng.random() < 0.3
                    views.append(n if drop else raw[at:at + n])
                    keep.setdefault(name, []).append((at, n, drop))
                    at += n
                sinks[name] = views
            return sinks
        keep.clear()
        assert s.read_into(key(0), place) == [norm_key(key(0))], trial
        for name, parts in keep.items():
            got, want = memoryview(out[name]).cast("B"), memoryview(arrays[name]).cast("B")
            assert all(got[a:a + n] == want[a:a + n] for a, n, drop in parts if not drop)
        flipped = bytearray(good)
        flipped[rng.randrange(len(good) - sum(a.nbytes for a in arrays.values()), len(good))] ^= 4
        open(path, "wb").write(bytes(flipped))
        assert s.read_into(key(0), place) is None and not os.path.exists(path)
        open(path, "wb").write(good)
    s.close()
