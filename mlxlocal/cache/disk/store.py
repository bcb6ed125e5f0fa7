"""Disk tier for KV blocks: one checksummed file per block under root/<fingerprint digest>/.

put() never blocks: a background writer with a bounded queue writes each block to a temp
file and os.replace()s it in (atomic: kill -9 loses only blocks in flight); a full queue
drops the write. get() verifies everything and removes a file that does not verify. LRU by
file mtime (get and put touch it), so a restart or another process sees the same order.
Writes and evictions hold an fcntl lock, so two processes may share a store.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import hashlib
import json
import os
import queue
import threading
import time
from dataclasses import asdict

from mlxlocal.cache.disk.format import (
    MAGIC,
    VERSION,
    CorruptBlock,
    Fingerprint,
    decode,
    encode_parts,
    file_keys,
    read_into,
    start_helper,
)

Key = bytes | tuple  # block key (keys.py), or (block key, edit-history tag)
_SUFFIX = ".kv"
MANIFEST = "manifest.json"
_TMP = ".tmp-"
_STALE_TMP_S = 3600


def norm_key(key: Key | str) -> str:
    """A key as the files record it (a str is one already)."""
    if type(key) is bytes:  # most keys: a restore of 16k tokens names 1,024 of them
        return key.hex()
    if isinstance(key, str):
        return key
    chain, tag = (key, None) if isinstance(key, bytes | bytearray) else key
    return bytes(chain).hex() + ("" if tag is None else "/" + repr(tag))


def _write_json(path: str, obj: dict) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
    os.replace(tmp, path)


def stores(root: str | os.PathLike) -> list[dict]:
    """Every store under root: its digest, directory, manifest (may be {}), block files and
    bytes, last use (newest file mtime, 0 if none)."""
    out = []
    if not os.path.isdir(root):
        return out
    for e in sorted(os.scandir(root), key=lambda e: e.name):
        if not e.is_dir() or e.name.startswith("."):
            continue
        try:
            with open(os.path.join(e.path, MANIFEST)) as f:
                manifest = json.load(f)
        except (OSError, ValueError):
            manifest = {}
        entries = [f for f in os.scandir(e.path) if f.name.endswith(_SUFFIX)]
        files = [f.stat() for f in entries]
        out.append({"digest": e.name, "dir": e.path, "manifest": manifest, "files": len(files),
                    "blocks": sum(len(file_keys(f.path)) for f in entries),
                    "bytes": sum(st.st_size for st in files),
                    "last_used": max((st.st_mtime for st in files), default=0.0)})
    return out


def remove_store(path: str | os.PathLike) -> int:
    """Delete one store (under its lock, so no writer of ours is mid-replace); its bytes."""
    path = os.fspath(path)
    lock = os.path.join(path, ".lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        freed = 0
        for e in os.scandir(path):
            if e.name != ".lock":
                with contextlib.suppress(OSError):
                    freed += e.stat().st_size
                    os.unlink(e.path)
        os.unlink(lock)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        os.rmdir(path)
    return freed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (OSError, OverflowError, ValueError):
        return False
    return True


class DiskStore:
    def __init__(self, root: str | os.PathLike, budget_bytes: int, fingerprint: Fingerprint,
                 queue_size: int = 4096, fsync: bool = False, queue_bytes: int = 256 << 20,
                 about: dict | None = None):
        self.fp = fingerprint.digest
        start_helper()
        self.dir = os.path.join(os.fspath(root), self.fp)
        os.makedirs(self.dir, exist_ok=True)
        # What `mlxlocal cache ls` shows of a store: the fingerprint, and (about) the model.
        manifest = {**asdict(fingerprint), **(about or {})}
        with contextlib.suppress(OSError):
            _write_json(os.path.join(self.dir, MANIFEST), manifest)
        self.budget = int(budget_bytes)
        self.fsync = fsync
        self._stats = dict(hits=0, misses=0, reads=0, read_bytes=0, read_seconds=0.0,
                           writes=0, write_bytes=0,
                           dropped_writes=0, corrupt_removed=0, evictions=0, write_errors=0)
        self._mu = threading.Lock()
        self._clock = time.time_ns()
        self._lockfd = os.open(os.path.join(self.dir, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        self._q: queue.Queue = queue.Queue(maxsize=queue_size)
        self.queue_bytes = queue_bytes  # what the queue may hold: past it, writes are dropped
        self._queued_bytes = 0
        self._run = threading.Event()
        self._run.set()
        self._closing = False
        with self._locked():
            self._clean_tmp()
            self._drop_old_formats()
            self._held = self._sizes(self._scan())
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer",
                                        daemon=True)
        self._writer.start()
        # A process that exits without shutting its engine down still drains what is queued
        # (a few seconds at most): kill -9 is what loses the blocks in flight.
        atexit.register(self.close)

    # -- paths, lock, clock ------------------------------------------------------------

    def _path(self, k: str) -> str:
        return os.path.join(self.dir, hashlib.blake2b(k.encode(), digest_size=20).hexdigest()
                            + _SUFFIX)

    @contextlib.contextmanager
    def _locked(self):
        fcntl.flock(self._lockfd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lockfd, fcntl.LOCK_UN)

    def _touch(self, path: str) -> None:
        """Mark as most recently used: strictly increasing mtimes within this process."""
        with self._mu:
            self._clock = max(self._clock + 1, time.time_ns())
            now = self._clock
        with contextlib.suppress(OSError):
            os.utime(path, ns=(now, now))

    def _count(self, **kw) -> None:
        with self._mu:
            for k, v in kw.items():
                self._stats[k] += v

    def _clean_tmp(self) -> None:
        """Temp files of dead writers (crashed mid-write), or very old ones."""
        for e in os.scandir(self.dir):
            if not e.name.startswith(_TMP):
                continue
            try:
                pid = int(e.name[len(_TMP):].split("-")[0])
            except ValueError:
                pid = -1
            with contextlib.suppress(OSError):
                old = time.time() - e.stat().st_mtime > _STALE_TMP_S
                if old or not _pid_alive(pid) or pid < 0:
                    os.unlink(e.path)

    def _drop_old_formats(self) -> None:
        """Block files of an older format version: no key of this one names them (v4 keys
        blocks by their prefix's hash), so they would only wait for the LRU."""
        for e in os.scandir(self.dir):
            if not e.name.endswith(_SUFFIX):
                continue
            with contextlib.suppress(OSError), open(e.path, "rb") as f:
                head = f.read(len(MAGIC) + 4)
                if head[:len(MAGIC)] == MAGIC and head[len(MAGIC):] != VERSION.to_bytes(4, "little"):
                    os.unlink(e.path)

    def _scan(self) -> list[tuple[int, int, str]]:
        out = []
        for e in os.scandir(self.dir):
            if e.name.endswith(_SUFFIX):
                with contextlib.suppress(OSError):
                    st = e.stat()
                    out.append((st.st_mtime_ns, st.st_size, e.path))
        return out

    # -- reads ---------------------------------------------------------------------------

    def get(self, key: Key, with_dtypes: bool = False):
        """The arrays of the file named by key, or None (missing, or did not verify: then
        removed). with_dtypes: (arrays, stored dtype names), for to_mx() (bfloat16 without
        ml_dtypes)."""
        got = self.get_run(key)
        if got is None:
            return None
        arrays, dtypes, _ = got
        return (arrays, dtypes) if with_dtypes else arrays

    def get_run(self, key: Key) -> tuple[dict, dict, list[str]] | None:
        """(arrays, dtype names, the keys of its blocks, `key` first) of the file named by
        `key`, verified; None if missing or it did not verify (then removed)."""
        path = self._path(norm_key(key))
        try:
            with open(path, "rb") as f:
                ino = os.fstat(f.fileno()).st_ino
                blob = f.read()
        except OSError:  # missing, or removed by another process meanwhile
            self._count(misses=1)
            return None
        try:
            got = decode(blob, self.fp, norm_key(key))
        except Exception:  # CorruptBlock, or anything odd: never an exception to the caller
            self._remove_corrupt(path, ino)
            self._count(misses=1)
            return None
        self._touch(path)
        self._count(hits=1, reads=1, read_bytes=len(blob))
        return got

    def read_into(self, key: Key, place) -> list[str] | None:
        """format.read_into on the file named by `key`: its arrays streamed into place()'s
        buffers and verified. The file's keys, or None: missing, declined, or it did not
        verify (then removed, and what place's buffers hold is garbage)."""
        path = self._path(norm_key(key))
        t = time.perf_counter()
        try:
            with open(path, "rb") as f:
                st = os.fstat(f.fileno())
                keys = read_into(f, st.st_size, self.fp, norm_key(key), place, path)
        except OSError:  # missing, or removed by another process meanwhile
            self._count(misses=1)
            return None
        except CorruptBlock:
            self._remove_corrupt(path, st.st_ino)
            self._count(misses=1)
            return None
        if keys is not None:
            self._touch(path)
            self._count(hits=1, reads=1, read_bytes=st.st_size,
                        read_seconds=time.perf_counter() - t)  # open, read and check
        return keys

    def _remove_corrupt(self, path: str, ino: int) -> None:
        with self._locked(), contextlib.suppress(OSError):
            st = os.stat(path)
            if st.st_ino == ino:  # not a good copy written meanwhile
                os.unlink(path)
                self._count(corrupt_removed=1)
                with self._mu:
                    self._held = (max(0, self._held[0] - 1), max(0, self._held[1] - st.st_size))

    def remove(self, key: Key) -> None:
        """Remove the file named by `key`, if there (a cluster rank's part of it did not verify:
        written again with the next save, on every rank)."""
        path = self._path(norm_key(key))
        with contextlib.suppress(OSError):
            self._remove_corrupt(path, os.stat(path).st_ino)

    def warm(self, key: Key, buf: bytearray) -> int:
        """Read the file named by `key` through `buf` and drop the bytes: the OS keeps them,
        so a read_into soon after copies from memory (a prefetch, off the engine thread).
        Bytes read (0: no such file)."""
        n = 0
        with contextlib.suppress(OSError), open(self._path(norm_key(key)), "rb", buffering=0) as f:
            while got := f.readinto(buf):
                n += got
        return n

    def __contains__(self, key: Key) -> bool:
        return os.path.exists(self._path(norm_key(key)))

    # -- writes --------------------------------------------------------------------------

    def put(self, key: Key, arrays: dict) -> bool:
        """Queue a write (arrays: name -> np or mx array, not mutated after); False: dropped
        (closing, or the queue holds queue_size files or queue_bytes already)."""
        return self.put_run([key], arrays)

    def put_run(self, keys: list, arrays: dict) -> bool:
        """Queue consecutive blocks of one chain (`keys`, in order) as one file named by the
        first, `arrays` holding them all: one read and one check restore the run (a file per
        block cost ~140 us each to read back)."""
        n = sum(int(getattr(a, "nbytes", 0)) for a in arrays.values())
        with self._mu:
            full = self._closing or self._queued_bytes + n > self.queue_bytes
            if not full:
                self._queued_bytes += n
        if not full:
            try:
                self._q.put_nowait(([norm_key(k) for k in keys], arrays, n))
                return True
            except queue.Full:
                with self._mu:
                    self._queued_bytes -= n
        self._count(dropped_writes=1)
        return False

    def pause(self) -> None:
        """Hold the writer (tests: fill the queue)."""
        self._run.clear()

    def resume(self) -> None:
        self._run.set()

    def _write_loop(self) -> None:
        while True:
            self._run.wait()
            try:
                item = self._q.get(timeout=0.05)
            except queue.Empty:
                if self._closing:
                    return
                continue
            names, arrays, n = item
            try:
                self._write(names, arrays)
            except Exception:  # a full or failing disk: drop, count, keep serving
                self._count(write_errors=1, dropped_writes=1)
            finally:
                with self._mu:
                    self._queued_bytes -= n
                self._q.task_done()

    def _write(self, names: list[str], arrays: dict) -> None:
        parts = encode_parts(self.fp, names, arrays)
        size = sum(len(p) for p in parts)
        k = names[0]
        if not os.path.isdir(self.dir):  # removed under us (`mlxlocal cache rm`): start over
            os.makedirs(self.dir, exist_ok=True)
            fd = os.open(os.path.join(self.dir, ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
            self._lockfd, old = fd, self._lockfd
            os.close(old)
        path = self._path(k)
        tmp = os.path.join(self.dir, f"{_TMP}{os.getpid()}-{threading.get_ident()}")
        try:
            with open(tmp, "wb") as f:
                for part in parts:
                    f.write(part)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            with self._locked():
                os.replace(tmp, path)
                self._touch(path)
                self._evict()
        finally:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        self._count(writes=len(names), write_bytes=size)

    def _evict(self) -> None:
        """Under the lock: remove least recently used files until within budget."""
        files = sorted(self._scan())
        total = sum(s for _, s, _ in files)
        kept = len(files)
        for _, size, path in files:
            if total <= self.budget:
                break
            with contextlib.suppress(OSError):
                os.unlink(path)
                self._count(evictions=1)
            total -= size
            kept -= 1
        with self._mu:
            self._held = (kept, total)

    @staticmethod
    def _sizes(files: list[tuple[int, int, str]]) -> tuple[int, int]:
        return len(files), sum(s for _, s, _ in files)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until queued writes are done (tests, shutdown); False on timeout."""
        end = time.monotonic() + timeout
        while self._q.unfinished_tasks:
            if time.monotonic() > end:
                return False
            time.sleep(0.005)
        return True

    def close(self, timeout: float = 5.0) -> None:
        """Drain pending writes within timeout; what is left is dropped and counted."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.close)
        self._run.set()
        self._writer.join(timeout)
        while True:
            try:
                self._q.get_nowait()
            except queue.Empty:
                break
            self._count(dropped_writes=1)
        os.close(self._lockfd)

    # -- stats ---------------------------------------------------------------------------

    def stats(self) -> dict:
        """Counters, and the files and bytes the store held at this process's last write
        (no directory scan here: the engine thread and every /metrics scrape call it)."""
        with self._mu:
            out = dict(self._stats)
            files, held = self._held
        out.update(files=files, bytes_on_disk=held, queued=self._q.qsize(), budget_bytes=self.budget)
        return out

