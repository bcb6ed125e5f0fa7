"""The cluster's channel and messages, without launching ranks: the wire form of every kind of
message, and each process group's channel keeping its own health."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from mlxlocal.distributed import channel as channel_module
from mlxlocal.distributed import cluster_problem
from mlxlocal.distributed.channel import Channel
from mlxlocal.distributed.messages import (
    KINDS,
    Copy,
    Exit,
    Load,
    Noop,
    Pools,
    Probe,
    ProbeCache,
    Report,
    Run,
    Stop,
    TierOpen,
    TierRead,
    TierReadTail,
    TierSave,
    TierSaveTail,
    decode,
    encode,
)
from mlxlocal.errors import ClusterError

ONE_OF_EACH = [
    Load(0, "synthetic:tiny"), Load(1, "/models/x", pp=2),
    Pools(0, 3, 64, 16, "bfloat16", [False, True], 4, 4, 64), Pools(1, 0, 8, 16, "float16"),
    Copy(3, 5, 7), Stop(3), ProbeCache(1),
    Run(3, [0, 9], False, [[1, 2], [3]], None, tokens=[[5, 6], [7]]),
    Run(3, [4], True, [[1]], [[2]], tokens=[[5]], mlx_lm=True),
    Run(0, [0, 0], False, [[1], [2]], pp=True, n=3, parts=[[0, 1], [1, 2]], dtype="bfloat16"),
    Report(), Probe([2, 1, 64], "float16", 8, ring=True), Noop("x" * 10), Exit(),
    TierOpen(3, "/kv", 1 << 30, {"weights": "ab", "dtype": "float16", "kv_bits": None}),
    TierSave(3, ["a1", "b2"], [7, 8]), TierRead(3, "a1", 1, ["b2"], [9]),
    TierSave(3, ["a1"], [7], [2]), TierRead(3, "a1", 0, ["a1"], [9], [-1]),
    TierSaveTail(3, "t1", 7, 5), TierReadTail(3, "t1", 9, 4),
]


def test_every_kind_round_trips_through_json():
    assert {type(m) for m in ONE_OF_EACH} == set(KINDS.values())
    for msg in ONE_OF_EACH:
        wire = json.loads(json.dumps(encode(msg)))
        assert wire["op"] == msg.op
        assert decode(wire) == msg


def test_the_wire_form_is_the_old_dicts():
    assert encode(Copy(3, 5, 7)) == {"op": "copy", "engine": 3, "src": 5, "dst": 7}
    assert encode(Exit()) == {"op": "exit"}


@pytest.mark.parametrize("wire", [{"op": "reboot"}, {"engine": 1}, {"op": 7}, {"op": "copy", "engine": 1}])
def test_an_unknown_or_malformed_message_is_refused(wire):
    with pytest.raises(ClusterError):
        decode(wire)


class _Group:
    """Stands for an mx.distributed.Group: a channel only keeps it."""


def test_each_group_has_one_channel_with_its_own_health(monkeypatch):
    monkeypatch.setattr(channel_module, "_channels", {})
    a, b = _Group(), _Group()
    first, second = Channel.of(a), Channel.of(b)  # type: ignore[arg-type]
    assert Channel.of(a) is first and first is not second  # type: ignore[arg-type]

    def lost(*arrays):
        raise RuntimeError("[ring] peer closed the connection")

    monkeypatch.setattr(mx, "eval", lost)
    with pytest.raises(ClusterError, match="a rank of the cluster is gone"):
        first.evaluate(mx.zeros((1,)), watch=False)
    monkeypatch.undo()
    monkeypatch.setattr(channel_module, "_channels", {id(a): first, id(b): second})
    assert first.broken is not None and second.broken is None
    with pytest.raises(ClusterError), first.turn():
        pass
    with second.turn():  # the other group still works
        second.evaluate(mx.zeros((1,)), watch=False)
    assert cluster_problem() == first.broken
    assert first.on_lost is not second.on_lost and first.lock is not second.lock


def test_not_ours_errors_pass_through(monkeypatch):
    channel = Channel(_Group())  # type: ignore[arg-type]

    def fails(*arrays):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(mx, "eval", fails)
    with pytest.raises(RuntimeError, match="out of memory"):
        channel.evaluate(watch=False)
    assert channel.broken is None
