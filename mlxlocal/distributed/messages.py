"""What rank 0 tells the other ranks: one frozen dataclass per kind of message.

On the wire a message is a JSON object: its fields and an "op" tag naming its kind
(`encode` / `decode`); a follower dispatches on the decoded message's type."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar

from mlxlocal.errors import ClusterError


@dataclass(frozen=True)
class Message:
    """A message of one kind; `op` is its tag on the wire."""

    op: ClassVar[str] = ""


@dataclass(frozen=True)
class Load(Message):
    """Load your shard of `spec` as model `model`; `pp`: pipeline stages (0: tensor parallel)."""

    op: ClassVar[str] = "load"
    model: int
    spec: str
    pp: int = 0


@dataclass(frozen=True)
class Pools(Message):
    """Open KV pools for engine `engine` on model `model` (KVPools' arguments)."""

    op: ClassVar[str] = "pools"
    model: int
    engine: int
    num_blocks: int
    block_size: int
    dtype: str
    windowed: list[bool] | None = None
    window_blocks: int = 0
    bits: int | None = None
    group_size: int = 64


@dataclass(frozen=True)
class Copy(Message):
    """Copy block `src` to `dst` in engine `engine`'s pools (copy-on-write)."""

    op: ClassVar[str] = "copy"
    engine: int
    src: int
    dst: int


@dataclass(frozen=True)
class Stop(Message):
    """Drop engine `engine`'s pools."""

    op: ClassVar[str] = "stop"
    engine: int


@dataclass(frozen=True)
class ProbeCache(Message):
    """Build model `model`'s mlx-lm runner: its cache probe runs a forward with rank 0's."""

    op: ClassVar[str] = "probe_cache"
    model: int


@dataclass(frozen=True)
class Run(Message):
    """One forward of engine `engine` (leader.step_message). Tensor parallel: `tokens`
    (`mlx_lm` for an mlx-lm model); pipeline (`pp`): input length `n`, micro-batches
    `parts` ([lo, hi) each) and the hidden states' `dtype`."""

    op: ClassVar[str] = "run"
    engine: int
    starts: list[int]
    every: bool
    tables: list[list[int]]
    windows: list[list[int]] | None = None
    tokens: list[list[int]] | None = None
    mlx_lm: bool = False
    pp: bool = False
    n: int = 0
    parts: list[list[int]] = field(default_factory=list)
    dtype: str = ""


@dataclass(frozen=True)
class Report(Message):
    """Gather every rank's peak memory and weight bytes (report.cluster_report)."""

    op: ClassVar[str] = "report"


@dataclass(frozen=True)
class Probe(Message):
    """Time `count` all_sums (or ring trips) of one shape (report.all_sum_probe)."""

    op: ClassVar[str] = "probe"
    shape: list[int]
    dtype: str
    count: int
    ring: bool = False


@dataclass(frozen=True)
class Noop(Message):
    """Nothing to do: times a step's message (`pad` its size)."""

    op: ClassVar[str] = "noop"
    pad: str = ""


@dataclass(frozen=True)
class TierOpen(Message):
    """Open engine `engine`'s disk tier: a store under `root` of `budget` bytes, named by
    rank 0's `fingerprint` fields with this rank's (distributed/tier.py)."""

    op: ClassVar[str] = "tier_open"
    engine: int
    root: str
    budget: int
    fingerprint: dict


@dataclass(frozen=True)
class TierSave(Message):
    """Write this rank's part of pool `blocks` as one file of blocks `keys`; `windows`: per
    block, the sliding-window layers' block kept at its position (-1: none)."""

    op: ClassVar[str] = "tier_save"
    engine: int
    keys: list[str]
    blocks: list[int]
    windows: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class TierTail(Message):
    """A prompt's partial last block: the first `rows` rows of this rank's pool `block`, as
    the tail file `key`."""

    engine: int
    key: str
    block: int
    rows: int


@dataclass(frozen=True)
class TierSaveTail(TierTail):
    """Write them."""

    op: ClassVar[str] = "tier_save_tail"


@dataclass(frozen=True)
class TierReadTail(TierTail):
    """Read them from this rank's file, and answer whether it verified."""

    op: ClassVar[str] = "tier_read_tail"


@dataclass(frozen=True)
class TierRead(Message):
    """Read this rank's part of blocks `keys` (from the file `file`'s block `skip` on) into
    pool `blocks` (and, per block, its window layers' rows into window block `windows[j]`,
    -1: none), and answer whether it verified."""

    op: ClassVar[str] = "tier_read"
    engine: int
    file: str
    skip: int
    keys: list[str]
    blocks: list[int]
    windows: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Exit(Message):
    """Rank 0 is done: exit."""

    op: ClassVar[str] = "exit"


KINDS: dict[str, type[Message]] = {kind.op: kind for kind in
                                   (Load, Pools, Copy, Stop, ProbeCache, Run, Report, Probe, Noop,
                                    TierOpen, TierSave, TierRead, TierSaveTail, TierReadTail, Exit)}


def encode(msg: Message) -> dict[str, Any]:
    """The wire form: the fields and the "op" tag."""
    return {"op": msg.op, **asdict(msg)}


def decode(wire: dict[str, Any]) -> Message:
    """The message a wire form stands for; an unknown op or field is a ClusterError."""
    fields = dict(wire)
    op = fields.pop("op", None)
    kind = KINDS.get(op) if isinstance(op, str) else None
    if kind is None:
        raise ClusterError(f"rank 0 sent a message of unknown kind {op!r}: are all ranks on the same version?")
    try:
        return kind(**fields)
    except TypeError as e:
        raise ClusterError(f"rank 0 sent a {op!r} message this rank cannot read ({e})") from None


__all__ = ["KINDS", "Copy", "Exit", "Load", "Message", "Noop", "Pools", "Probe", "ProbeCache", "Report",
           "Run", "Stop", "TierOpen", "TierRead", "TierReadTail", "TierSave", "TierSaveTail", "decode",
           "encode"]
