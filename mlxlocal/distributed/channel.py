"""The cluster's wires: rank 0's messages to the other ranks, and the group this process is in.

A message is broadcast as an all_sum on the group the model was loaded with (the followers
add zeros): a length, then that many bytes of JSON. The channel keeps the group's health:
the first failed collective, or rank 0 waiting past its timeout, marks it broken for good.
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from contextlib import contextmanager

import mlx.core as mx
import numpy as np

from mlxlocal.errors import ClusterError, ModelLoadError


class Channel:
    """Rank 0 -> every other rank: JSON messages, in order. A broadcast is an all_sum to which
    the other ranks add zeros: the ring backend sends only to direct neighbours.

    A failed collective (a rank died, a link dropped) leaves the group unusable: the first
    failure is kept as `broken`, and every later message fails at once with it (ClusterError)
    instead of waiting on a peer that is gone."""

    # Collectives must come in the same order on every rank: rank 0's engines (and their
    # threads) take turns, a whole message or forward at a time.
    lock = threading.RLock()
    broken: str | None = None

    def __init__(self, group: mx.distributed.Group):
        self.group = group

    # Rank 0 waits at most this long for the others in one message or forward: a rank that
    # stopped answering (or a link that dropped without closing) would otherwise hang it.
    timeout = float(os.environ.get("MLXLOCAL_CLUSTER_TIMEOUT", "120"))
    on_lost: list = []  # called with the reason when rank 0 gives up waiting
    _waiting_since: float | None = None
    _watchdog: threading.Thread | None = None

    @classmethod
    def evaluate(cls, *arrays, watch: bool = True) -> None:
        """mx.eval of work holding collectives; a backend failure marks the group broken.
        `watch`: rank 0 waiting on the others, which must answer within `timeout`."""
        if cls.broken is not None:
            raise ClusterError(cls.broken)
        if watch:
            cls._arm()
        try:
            mx.eval(*arrays)
        except RuntimeError as e:
            if not str(e).startswith("["):  # backends tag their errors: "[ring] ...", not ours
                raise
            cls.broken = f"a rank of the cluster is gone ({e}); restart the cluster"
            raise ClusterError(cls.broken) from None
        finally:
            if watch:
                cls._waiting_since = None

    @classmethod
    @contextmanager
    def turn(cls):
        """Hold `lock` for one message or forward. Gives up (ClusterError) once the group is
        broken, even while a thread stuck in a dead collective still holds the lock."""
        while not cls.lock.acquire(timeout=0.25):
            if cls.broken is not None:
                raise ClusterError(cls.broken)
        try:
            if cls.broken is not None:
                raise ClusterError(cls.broken)
            yield
        finally:
            cls.lock.release()

    @classmethod
    def _arm(cls) -> None:
        cls._waiting_since = time.monotonic()
        if cls._watchdog is None:
            cls._watchdog = threading.Thread(target=cls._watch, name="mlxlocal-cluster-watchdog", daemon=True)
            cls._watchdog.start()

    @classmethod
    def _watch(cls) -> None:
        while cls.broken is None:
            since = cls._waiting_since
            if since is not None and time.monotonic() - since > cls.timeout:
                cls.broken = (f"the other ranks did not answer within {cls.timeout:g} s (a rank stopped or a link "
                              "dropped); restart the cluster")
                for fn in list(cls.on_lost):
                    fn(cls.broken)
                return
            time.sleep(min(0.5, cls.timeout / 4))

    def _all_sum(self, x: mx.array, watch: bool = True) -> mx.array:
        out = mx.distributed.all_sum(x, group=self.group)
        self.evaluate(out, watch=watch)
        return out

    def send_bounded(self, msg: dict, timeout: float = 5.0) -> bool:
        """send, from a thread of its own, waited for at most `timeout` seconds: for goodbyes
        (shutdown, exit), which must not hang on a rank that stopped answering. False if it did
        not complete (the group is then broken)."""
        done: list[bool] = []

        def go() -> None:
            try:
                self.send(msg)
                done.append(True)
            except ClusterError:
                done.append(False)

        thread = threading.Thread(target=go, name="mlxlocal-cluster-goodbye", daemon=True)
        thread.start()
        thread.join(timeout)
        if thread.is_alive() and Channel.broken is None:
            Channel.broken = f"the other ranks did not take a message within {timeout:g} s; restart the cluster"
        return bool(done and done[0])

    def send(self, msg: dict) -> None:
        payload = np.frombuffer(json.dumps(msg).encode(), dtype=np.uint8)
        with self.turn():
            self._all_sum(mx.array([payload.size], mx.int32))
            self._all_sum(mx.array(payload))

    def recv(self) -> dict:
        """A follower waiting for rank 0: unwatched (a server may idle for hours)."""
        size = int(self._all_sum(mx.zeros((1,), mx.int32), watch=False).item())
        return json.loads(np.array(self._all_sum(mx.zeros((size,), mx.uint8), watch=False)).tobytes())


_announced: list[str] = []  # model specs rank 0 told the followers to load, in order


def announce_load(group: mx.distributed.Group, spec: str, **how) -> int:
    """Rank 0: tell the followers to load their shards of `spec` (`how`: e.g. pp=N, pipeline
    stages); returns the model's id in the messages that follow. The first call also
    arranges that they exit with this process."""
    if not _announced:
        atexit.register(release, group)
    _announced.append(spec)
    Channel(group).send({"op": "load", "model": len(_announced) - 1, "spec": spec, **how})
    return len(_announced) - 1


def release(group: mx.distributed.Group | None = None) -> bool:
    """Rank 0: let the followers exit (once; before MLX's streams are cleared at exit). False
    when they could not be told (a rank gone or stuck): a thread may then be stuck in a
    collective, and the process should end without waiting for it (os._exit)."""
    if not _announced or _announced[-1] is None:
        return True
    _announced.append(None)  # released: nothing more to announce
    if Channel.broken is not None:
        return False
    return Channel(group or world()).send_bounded({"op": "exit"})


def launched() -> bool:
    """Started as one rank of several (mlx.launch or launch-cluster set MLX_RANK)."""
    return "MLX_RANK" in os.environ


def world(size: int | None = None) -> mx.distributed.Group:
    """The distributed group this process belongs to (mlx.launch sets it up); `size`, when
    given, must match it."""
    group = mx.distributed.init()
    if size is not None and group.size() != size:
        raise ModelLoadError(f"--tp {size} asks for {size} ranks, but this process runs in a group of "
                             f"{group.size()} (start it with `mlx.launch -n {size} ...`)")
    return group


__all__ = ["Channel", "announce_load", "launched", "release", "world"]
