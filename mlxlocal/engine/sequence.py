"""A request as the scheduler sees it: its tokens, its blocks, and how far it has computed."""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass, field
from typing import Any

from mlxlocal.engine.handle import RequestHandle
from mlxlocal.engine.output import Output
from mlxlocal.engine.sampling import Sampler
from mlxlocal.engine.types import Chunk, GenerationStats, SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    id: int
    prompt: list[int]
    params: SamplingParams
    sampler: Sampler
    out: Output  # token ids -> Chunks: EOS, detokenizer, stop strings, max_tokens, stats
    handle: RequestHandle  # where Chunks go; holds the cancel flag
    session: Any = None  # engine Session this turn belongs to, if any
    tokens: list[int] = field(default_factory=list)  # prompt + generated
    block_table: list[int] = field(default_factory=list)
    run_cache: tuple | None = None  # (block_table, ids checked, its runs): runner.table_segments
    cached: tuple | None = None  # (block_table, num_computed) it last put in the prefix cache
    # Models with sliding-window layers: those layers' blocks, parallel to block_table
    # (holes where a block left the window; cache/window.py).
    window_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V are in the cache
    prefilled: int = 0  # prompt tokens this request fed to the model
    status: Status = Status.WAITING
    preemptions: int = 0
    # The token sampled by the step in flight: fed to the next step before its value is
    # known (the engine pipelines steps), appended to `tokens` once it is.
    pending: Any = None
    pending_from: Any = None  # (the sampled batch's token array, this row): fed as one array
    # Hybrid models: (n_tokens, state) after the last forward and the one before it; a
    # finished turn keeps the one that matches its tokens (the last step may be wasted).
    recurrent: Any = None
    recurrent_prev: Any = None
    snapshot_at: int = 0  # hybrids: a prefill chunk ends here, so the state there is kept
    constraint: Any = None  # engine.constraint.Constraint: the request's grammar, if any
    edit: Any = None  # engine.edits.EditState: a request with cache edits, else None
    spec: Any = None  # engine.speculative.SpecState: its draft length and lookup index, if it speculates
    think: Any = None  # engine.think.ThinkBudget: the request's thinking budget, if any
    written: int = 0  # tokens the engine wrote after the prompt unsampled (think): not output
    prefetch: Any = None  # cache.disk.prefetch.Prefetch: its disk blocks read ahead, if they are
    # The prompt as the int64s submit checked (numpy), or None: the disk tier hashes their bytes.
    prompt_ids: Any = None

    def __post_init__(self):
        if not self.tokens:
            self.tokens = list(self.prompt)

    @property
    def stats(self) -> GenerationStats:
        return self.out.stats

    @property
    def max_tokens(self) -> int:
        return self.out.max_tokens

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - len(self.prompt) - self.written

    @property
    def remaining(self) -> int:
        """Tokens still to feed before the next token can be sampled."""
        return len(self.tokens) + (self.pending is not None) - self.num_computed

    @property
    def may_decode(self) -> bool:
        """Another decode step is useful: one token to feed and room under max_tokens."""
        return self.remaining == 1 and self.num_generated + (self.pending is not None) < self.max_tokens

    @property
    def rope_start(self) -> int:
        """Rope position of the first token not yet computed (its slot, unless edited)."""
        return self.num_computed if self.edit is None else self.edit.position(self.num_computed)

    def state_at(self, n: int) -> list | None:
        """The recurrent state after exactly n tokens, if one is held."""
        for held in (self.recurrent, self.recurrent_prev):
            if held is not None and held[0] == n:
                return held[1]
        return None

    def forget_state(self) -> None:
        self.recurrent = self.recurrent_prev = None

    @property
    def cancelled(self) -> threading.Event:
        return self.handle.cancelled

    def emit(self, chunk: Chunk | BaseException) -> None:
        self.handle.put(chunk)
