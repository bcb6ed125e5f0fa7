"""What keys the disk KV tier: the model fingerprint (block keys: keys.py), the block file format.

A block file is: a fixed prefix (magic, format version, header length, payload length,
xxh3-128 checksum over header + payload), a JSON header (fingerprint digest, key, array
table) and the payload (each array's raw bytes). Anything that does not verify is not KV.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import xxhash

MAGIC = b"MLXKVBLK"
# 4: the payload's halves checked apart (two threads); 3: a run of blocks per file; 2: xxh3-128
# checksums; 1: blake2b
VERSION = 4
PREFIX = struct.Struct("<8sIIQ16s")  # magic, version, header len, payload len, checksum
MAX_HEADER = 1 << 20

# config.json keys that change what K/V a token gets (rope and position handling).
_ROPE_KEYS = ("rope_theta", "rope_scaling", "rope_traditional", "partial_rotary_factor",
              "rotary_dim", "rope_local_base_freq", "max_position_embeddings", "head_dim",
              "sliding_window", "attention_bias", "position_embedding_type")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model",
                    "special_tokens_map.json", "vocab.json", "merges.txt",
                    "added_tokens.json")
_SAMPLE = 64 * 1024  # bytes of weight data hashed at each of a few offsets per file


class CorruptBlock(ValueError):
    """A block file that does not verify (the store removes it)."""


@dataclass(frozen=True)
class Fingerprint:
    """Everything that changes a block's KV; blocks are only reused under an equal one."""

    weights: str
    dtype: str
    kv_bits: int | None
    kv_group_size: int
    rope: str  # canonical JSON of the rope/position configuration
    block_size: int
    tokenizer: str
    model_type: str
    config: str = ""  # digest of the whole config.json (conservative: any change misses)
    draft: str = ""  # a draft model's own fingerprint digest: its K/V is in the blocks too
    shard: str = ""  # "<rank>/<ranks>": a cluster rank's store holds that rank's part of the KV

    @property
    def digest(self) -> str:
        fields = asdict(self)
        for extra in ("draft", "shard"):  # unset: the digest stores had before these came in
            if not fields[extra]:
                del fields[extra]
        blob = json.dumps(fields, sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(blob.encode(), digest_size=16).hexdigest()

    @classmethod
    def from_model_dir(cls, path: str | os.PathLike, *, dtype: str, kv_bits: int | None,
                       kv_group_size: int, block_size: int, draft: str = "",
                       shard: str = "") -> Fingerprint:
        """From config.json, safetensors headers (+ sampled bytes), tokenizer files: fast."""
        root = Path(path)
        raw = (root / "config.json").read_bytes()
        config = json.loads(raw)
        text = config.get("text_config") or {}
        rope = {k: text.get(k, config.get(k)) for k in _ROPE_KEYS
                if k in config or k in text}
        return cls(weights=weights_digest(root), dtype=str(dtype), kv_bits=kv_bits,
                   kv_group_size=int(kv_group_size),
                   rope=json.dumps(rope, sort_keys=True, separators=(",", ":")),
                   block_size=int(block_size), tokenizer=tokenizer_digest(root),
                   model_type=str(config.get("model_type", "")),
                   config=hashlib.blake2b(raw, digest_size=16).hexdigest(), draft=draft,
                   shard=shard)


def weights_digest(root: Path) -> str:
    """Each safetensors file's name, size, header and a few sampled data chunks.

    Headers alone cannot tell two fine-tunes of one architecture apart, so a few 64 KiB
    chunks of the data are hashed too; no whole-file read, and no mtime (a copy still hits).
    """
    h = hashlib.blake2b(digest_size=16)
    for f in sorted(root.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            head = fh.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else 0
            h.update(fh.read(min(n, 100 << 20)))
            start = 8 + n
            for off in sorted({start, (start + size) // 2, max(start, size - _SAMPLE)}):
                fh.seek(off)
                h.update(fh.read(_SAMPLE))
    return h.hexdigest()


def tokenizer_digest(root: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    for name in _TOKENIZER_FILES:
        f = root / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def _raw(value) -> tuple[memoryview, str, tuple[int, ...]]:
    """An array's bytes (a view where already contiguous), dtype name and shape; mx arrays
    included (bfloat16 as its bits)."""
    if not isinstance(value, np.ndarray) and type(value).__module__ == "mlx.core":
        import mlx.core as mx  # only when given mx arrays: the store itself needs no MLX

        name = str(value.dtype).removeprefix("mlx.core.")
        if value.dtype == mx.bfloat16:
            value = value.view(mx.uint16)
        arr = np.array(value, copy=False)
    else:
        arr = np.asarray(value)
        name = arr.dtype.name
    return memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8)), name, tuple(arr.shape)


def np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        try:
            import ml_dtypes

            return np.dtype(ml_dtypes.bfloat16)
        except ImportError:
            return np.dtype(np.uint16)  # the bits; to_mx() views them back as bfloat16
    return np.dtype(name)


READ_PIECE = 256 << 10  # bytes per read: hashed right after, while still in the CPU's cache
# A payload from this size on is read by two threads, a half each (16.8 MB from the page cache
# here: 2.7 ms on one, 1.6 ms on two).
PARALLEL_BYTES = 4 << 20
HELPER_SCRATCH = 4 << 20  # most bytes the helper reads only to check them (into scratch)
HELPER_START_S = 0.05  # longest this thread waits for the helper to start before it reads


def _checksum(header, payload) -> bytes:
    """xxh3-128 over the header and the two halves' own xxh3-128s: each half is checked by
    the thread that reads it. Corruption, not tampering, is what it guards against: xxh3
    verifies at memory speed."""
    half = len(payload) // 2
    return _combine(header, xxhash.xxh3_128(payload[:half]).digest(),
                    xxhash.xxh3_128(payload[half:]).digest())


def _combine(header, first: bytes, second: bytes) -> bytes:
    h = xxhash.xxh3_128(header)
    h.update(first + second)
    return h.digest()


def encode(fp_digest: str, keys: list[str], arrays: dict) -> bytes:
    """One file: the blocks named by `keys` (a run of one chain, in order), their arrays as
    given (the tier stacks a run's blocks along the block axis)."""
    return b"".join(encode_parts(fp_digest, keys, arrays))


def encode_parts(fp_digest: str, keys: list[str], arrays: dict) -> list:
    """encode() as the buffers to write one after another: no copy of the whole file made
    (the writer thread shares two cores with decoding)."""
    table, chunks, off = [], [], 0
    for name, value in arrays.items():
        data, dtype, shape = _raw(value)
        table.append([str(name), dtype, list(shape), off, len(data)])
        chunks.append(data)
        off += len(data)
    header = json.dumps({"fp": fp_digest, "keys": list(keys), "arrays": table},
                        separators=(",", ":")).encode()
    halves, at = [xxhash.xxh3_128(), xxhash.xxh3_128()], 0
    for c in chunks:  # split where the payload's half falls
        cut = min(len(c), max(0, off // 2 - at))
        halves[0].update(memoryview(c)[:cut])
        halves[1].update(memoryview(c)[cut:])
        at += len(c)
    digest = _combine(header, halves[0].digest(), halves[1].digest())
    return [PREFIX.pack(MAGIC, VERSION, len(header), off, digest), header, *chunks]


def _prefix(head: bytes, size: int) -> tuple[int, int, bytes]:
    """(header length, payload length, checksum) of a file of `size` bytes starting with
    `head`, or CorruptBlock."""
    if len(head) < PREFIX.size:
        raise CorruptBlock("short file")
    magic, version, hlen, plen, digest = PREFIX.unpack(head)
    if magic != MAGIC:
        raise CorruptBlock("bad magic")
    if version != VERSION:
        raise CorruptBlock(f"format version {version}")
    if hlen > MAX_HEADER or size != PREFIX.size + hlen + plen:
        raise CorruptBlock("length mismatch (truncated or padded)")
    return hlen, plen, digest


def decode(blob, fp_digest: str, key: str) -> tuple[dict[str, np.ndarray], dict, list[str]]:
    """(arrays, dtype names, the file's block keys), or CorruptBlock naming what did not
    verify; `key` must be the first (a file is named by its first block's key)."""
    hlen, plen, digest = _prefix(bytes(blob[:PREFIX.size]), len(blob))
    body = memoryview(blob)[PREFIX.size:]
    if _checksum(body[:hlen], body[hlen:]) != digest:
        raise CorruptBlock("checksum mismatch")
    try:
        header = json.loads(bytes(body[:hlen]))
    except ValueError as e:
        raise CorruptBlock("bad header") from e
    if header.get("fp") != fp_digest:
        raise CorruptBlock("foreign fingerprint")
    keys = header.get("keys")
    if not isinstance(keys, list) or not keys or keys[0] != key:
        raise CorruptBlock("wrong key")
    payload = body[hlen:]
    arrays, dtypes = {}, {}
    try:
        for name, dtype, shape, off, n in header["arrays"]:
            dt = np_dtype(dtype)
            if off < 0 or off + n > plen or math.prod(shape) * dt.itemsize != n:
                raise CorruptBlock(f"array table entry {name!r} does not fit")
            arrays[name] = np.frombuffer(payload[off:off + n], dt).reshape(shape)
            dtypes[name] = dtype
    except (TypeError, ValueError, KeyError) as e:
        raise CorruptBlock(f"bad array table: {e}") from e
    return arrays, dtypes, [str(k) for k in keys]


def read_into(f, size: int, fp_digest: str, key: str, place, path: str | None = None
              ) -> list[str] | None:
    """Stream a file into the buffers `place` gives, verifying as it goes: the read-back
    path that copies each byte once (disk or page cache -> its destination).

    place(keys, table) -> {name: [writable byte views, in file order]} or None (decline:
    nothing read further); an int among the views: that many bytes read, checked, dropped,
    as is a name left out. Returns the file's keys; CorruptBlock when it does not verify
    (what place's views hold is then garbage: the caller drops it). With the file's `path`,
    a large payload's second half is read on a helper thread through a handle of its own
    while this one reads and checks the first (a copy from the page cache is bound by one
    core's memory bandwidth)."""
    hlen, plen, digest = _prefix(f.read(PREFIX.size), size)
    raw = f.read(hlen)
    keys, table = _header(raw, plen, fp_digest, key)
    sinks = place(keys, {name: (dtype, tuple(shape)) for name, dtype, shape, _ in table})
    if sinks is None:
        return None
    pieces: list = []  # the payload in file order: destinations, or byte counts to drop
    for name, _, _, n in table:
        views = sinks.get(name, [n])
        if sum(v if isinstance(v, int) else len(v) for v in views) != n:
            raise ValueError(f"place() gave {name!r} the wrong number of bytes")
        pieces += [p for v in views for p in _pieces(v)]
    first, second = _halves(pieces, plen)
    helper = _read_later(path, os.fstat(f.fileno()).st_ino, f.tell() + _nbytes(first), second) \
        if path is not None and _helped(second, plen) else None
    try:
        if helper is not None:  # both halves under way together: started after this one's
            helper[1].wait(HELPER_START_S)  # reads, the helper often ran after them (traced)
        scratch = memoryview(bytearray(min(READ_PIECE, plen) or 1))
        halves = [_read_checked(f, first, scratch)]
        if helper is None:
            halves.append(_read_checked(f, second, scratch))
    finally:
        read = helper[0].result() if helper is not None else None  # joined: it writes our buffers
    if helper is not None:
        if read is None:
            raise CorruptBlock("truncated, or replaced while read")
        halves.append(read)
    if _combine(raw, *halves) != digest:
        raise CorruptBlock("checksum mismatch")
    return keys


def _read_checked(f, pieces: list, scratch: memoryview) -> bytes:
    """Read pieces (a count: into scratch, dropped) from f's position on; their xxh3-128."""
    h = xxhash.xxh3_128()
    for piece in pieces:
        piece = scratch[:piece] if isinstance(piece, int) else piece
        if f.readinto(piece) != len(piece):
            raise CorruptBlock("truncated")
        h.update(piece)
    return h.digest()


def _header(raw: bytes, plen: int, fp_digest: str, key: str) -> tuple[list[str], list[tuple]]:
    """(the file's keys, its array table [(name, dtype, shape, bytes)] in payload order) from
    its JSON header, or CorruptBlock naming what does not fit."""
    try:
        header = json.loads(raw)
        table = [(str(name), str(dtype), [int(x) for x in shape], int(off), int(n))
                 for name, dtype, shape, off, n in header["arrays"]]
        keys = [str(k) for k in header["keys"]]
    except (ValueError, TypeError, KeyError, RecursionError) as e:
        raise CorruptBlock(f"bad header: {e}") from e
    if header.get("fp") != fp_digest:
        raise CorruptBlock("foreign fingerprint")
    if not keys or keys[0] != key:
        raise CorruptBlock("wrong key")
    at = 0
    for name, dtype, shape, off, n in table:  # the encoder writes them back to back, in order
        if off != at or min(shape, default=0) < 0 or math.prod(shape) * np_dtype(dtype).itemsize != n:
            raise CorruptBlock(f"array table entry {name!r} does not fit")
        at += n
    if at != plen:
        raise CorruptBlock("array table does not cover the payload")
    return keys, [(name, dtype, shape, n) for name, dtype, shape, _, n in table]


def _pieces(view) -> list:
    """A destination as READ_PIECE-sized reads (a count of bytes to drop as such counts)."""
    if isinstance(view, int):
        return [min(READ_PIECE, view - i) for i in range(0, view, READ_PIECE)]
    return [view[i:i + READ_PIECE] for i in range(0, len(view), READ_PIECE)]


def _nbytes(pieces: list) -> int:
    return sum(p if isinstance(p, int) else len(p) for p in pieces)


def _halves(pieces: list, total: int) -> tuple[list, list]:
    """The pieces cut where the payload's second half starts (the checksum's halves)."""
    half, passed = total // 2, 0
    for i, p in enumerate(pieces):
        n = p if isinstance(p, int) else len(p)
        if passed + n > half:
            cut = half - passed
            if not cut:
                return pieces[:i], pieces[i:]
            a, b = (cut, n - cut) if isinstance(p, int) else (p[:cut], p[cut:])
            return pieces[:i] + [a], [b] + pieces[i + 1:]
        passed += n
    return pieces, []


def _helped(second: list, total: int) -> bool:
    """The second half read by the helper, from PARALLEL_BYTES on, unless it drops more than
    HELPER_SCRATCH bytes (the helper reads those into scratch of its own)."""
    return bool(second) and total >= PARALLEL_BYTES and \
        sum(p for p in second if isinstance(p, int)) <= HELPER_SCRATCH


_HELPER = ThreadPoolExecutor(1, thread_name_prefix="mlxlocal-kv-read")


def start_helper() -> None:
    """Start the helper's thread now (a store opens), not in a restored request's first read:
    a thread's start took 0.3 ms of a restarted process's first restore."""
    _HELPER.submit(lambda: None)


def _read_later(path: str, ino: int, offset: int, pieces: list) -> tuple[Future, threading.Event]:
    """Read and check `pieces` from `offset` of the file at `path` on the helper thread (a
    handle of its own: no shared position); its result is their xxh3-128, or None where it
    came short or the path now names another file. The event: the helper has started."""
    pieces = [memoryview(bytearray(p)) if isinstance(p, int) else p for p in pieces]
    started = threading.Event()

    def read() -> bytes | None:  # their xxh3-128, or None
        started.set()
        with open(path, "rb", buffering=0) as g:
            if os.fstat(g.fileno()).st_ino != ino:
                return None
            g.seek(offset)
            try:
                return _read_checked(g, pieces, memoryview(b""))
            except CorruptBlock:
                return None
    return _HELPER.submit(read), started


def file_keys(path: str) -> list[str]:
    """The block keys a file holds, from its prefix and header alone ([] if they do not read):
    listings count blocks without reading the arrays."""
    try:
        with open(path, "rb") as f:
            _, _, hlen, _, _ = PREFIX.unpack(f.read(PREFIX.size))
            keys = json.loads(f.read(min(hlen, MAX_HEADER))).get("keys")
    except (OSError, ValueError, struct.error, AttributeError):
        return []
    return keys if isinstance(keys, list) else []


def to_mx(arrays: dict[str, np.ndarray], dtypes: dict[str, str]) -> dict:
    """Numpy arrays from get() as mx arrays in their stored dtypes (bfloat16 included)."""
    import mlx.core as mx

    out = {}
    for name, arr in arrays.items():
        if dtypes.get(name) == "bfloat16":
            out[name] = mx.array(arr.view(np.uint16)).view(mx.bfloat16)
        else:
            out[name] = mx.array(arr)
    return out
