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
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import mlx.core as mx
import numpy as np

from mlxlocal.distributed.messages import Exit, Load, Message, decode, encode
from mlxlocal.errors import ClusterError, ModelLoadError


class Channel:
    """Rank 0 -> every other rank: messages (messages.py) as JSON, in order. A broadcast is an
    all_sum to which the other ranks add zeros: the ring backend sends only to direct neighbours.

    One channel per process group (`Channel.of`): it keeps the group's health. A failed
    collective (a rank died, a link dropped) leaves the group unusable: the first failure is
    kept as `broken`, and every later message fails at once with it (ClusterError) instead of
    waiting on a peer that is gone."""

    def __init__(self, group: mx.distributed.Group):
        self.group = group
        # Collectives must come in the same order on every rank: rank 0's engines (and their
        # threads) take turns, a whole message or forward at a time.
        self.lock = threading.RLock()
        self.broken: str | None = None
        # Rank 0 waits at most this long for the others in one message or forward: a rank that
        # stopped answering (or a link that dropped without closing) would otherwise hang it.
        self.timeout = float(os.environ.get("MLXLOCAL_CLUSTER_TIMEOUT", "120"))
        self.on_lost: list[Callable[[str], object]] = []  # called with the reason when rank 0 gives up
        self._waiting_since: float | None = None
        self._watchdog: threading.Thread | None = None

    @staticmethod
    def of(group: mx.distributed.Group) -> Channel:
        """The channel of `group`, made on first use (every user of a group shares its state)."""
        with _channels_lock:
            channel = _channels.get(id(group))  # the channel holds its group: the id stays its own
            if channel is None:
                channel = _channels[id(group)] = Channel(group)
            return channel

    def evaluate(self, *arrays, watch: bool = True) -> None:
        """mx.eval of work holding collectives; a backend failure marks the group broken.
        `watch`: rank 0 waiting on the others, which must answer within `timeout`."""
        if self.broken is not None:
            raise ClusterError(self.broken)
        if watch:
            self._arm()
        try:
            mx.eval(*arrays)
        except RuntimeError as e:
            if not str(e).startswith("["):  # backends tag their errors: "[ring] ...", not ours
                raise
            self.broken = f"a rank of the cluster is gone ({e}); restart the cluster"
            raise ClusterError(self.broken) from None
        finally:
            if watch:
                self._waiting_since = None

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Hold `lock` for one message or forward. Gives up (ClusterError) once the group is
        broken, even while a thread stuck in a dead collective still holds the lock."""
        while not self.lock.acquire(timeout=0.25):
            if self.broken is not None:
                raise ClusterError(self.broken)
        try:
            if self.broken is not None:
                raise ClusterError(self.broken)
            yield
        finally:
            self.lock.release()

    def _arm(self) -> None:
        self._waiting_since = time.monotonic()
        if self._watchdog is None:
            self._watchdog = threading.Thread(target=self._watch, name="mlxlocal-cluster-watchdog", daemon=True)
            self._watchdog.start()

    def _watch(self) -> None:
        while self.broken is None:
            since = self._waiting_since
            if since is not None and time.monotonic() - since > self.timeout:
                self.broken = (f"the other ranks did not answer within {self.timeout:g} s (a rank stopped or a "
                               "link dropped); restart the cluster")
                for fn in list(self.on_lost):
                    fn(self.broken)
                return
            time.sleep(min(0.5, self.timeout / 4))

    def _all_sum(self, x: mx.array, watch: bool = True) -> mx.array:
        out = mx.distributed.all_sum(x, group=self.group)
        self.evaluate(out, watch=watch)
        return out

    def send_bounded(self, msg: Message, timeout: float = 5.0) -> bool:
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
        if thread.is_alive() and self.broken is None:
            self.broken = f"the other ranks did not take a message within {timeout:g} s; restart the cluster"
        return bool(done and done[0])

    def send(self, msg: Message) -> None:
        payload = np.frombuffer(json.dumps(encode(msg)).encode(), dtype=np.uint8)
        with self.turn():
            self._all_sum(mx.array([payload.size], mx.int32))
            self._all_sum(mx.array(payload))

    def recv(self) -> Message:
        """A follower waiting for rank 0: unwatched (a server may idle for hours)."""
        size = int(self._all_sum(mx.zeros((1,), mx.int32), watch=False).item())
        raw = np.array(self._all_sum(mx.zeros((size,), mx.uint8), watch=False)).tobytes()
        return decode(json.loads(raw))


_channels: dict[int, Channel] = {}  # by id of the group: one channel per process group
_channels_lock = threading.Lock()


def cluster_problem() -> str | None:
    """Why this process's cluster cannot run any more (None while it can, or when not launched)."""
    with _channels_lock:
        return next((c.broken for c in _channels.values() if c.broken is not None), None)


_announced: list[str] = []  # model specs rank 0 told the followers to load, in order


def announce_load(group: mx.distributed.Group, spec: str, pp: int = 0) -> int:
    """Rank 0: tell the followers to load their shards of `spec` (`pp`: pipeline stages, 0
    under tensor parallelism); returns the model's id in the messages that follow. The first call also
    arranges that they exit with this process."""
    if not _announced:
        atexit.register(release, group)
    _announced.append(spec)
    Channel.of(group).send(Load(len(_announced) - 1, spec, pp))
    return len(_announced) - 1


def release(group: mx.distributed.Group | None = None) -> bool:
    """Rank 0: let the followers exit (once; before MLX's streams are cleared at exit). False
    when they could not be told (a rank gone or stuck): a thread may then be stuck in a
    collective, and the process should end without waiting for it (os._exit)."""
    if not _announced or _announced[-1] is None:
        return True
    _announced.append(None)  # released: nothing more to announce
    channel = Channel.of(group or world())
    if channel.broken is not None:
        return False
    return channel.send_bounded(Exit())


def launched() -> bool:
    """Started as one rank of several (mlx.launch or launch-cluster set MLX_RANK)."""
    return "MLX_RANK" in os.environ


_world: mx.distributed.Group | None = None


def world(size: int | None = None) -> mx.distributed.Group:
    """The distributed group this process belongs to (mlx.launch sets it up); `size`, when
    given, must match it."""
    global _world
    if _world is None:  # one Group object per process: its Channel is found by it
        _world = mx.distributed.init()
    group = _world
    if size is not None and group.size() != size:
        raise ModelLoadError(f"--tp {size} asks for {size} ranks, but this process runs in a group of "
                             f"{group.size()} (start it with `mlx.launch -n {size} ...`)")
    return group


__all__ = ["Channel", "announce_load", "cluster_problem", "launched", "release", "world"]
