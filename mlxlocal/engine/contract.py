"""The engine contract: everything a front end (chat, server, bench) may use on an engine.

Both engines implement all of it, so front ends call it directly instead of probing
with hasattr / getattr for what one engine lacks.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable

from mlxlocal.engine.handle import RequestHandle
from mlxlocal.engine.types import CacheEdit, Chunk, SamplingParams
from mlxlocal.source.chat_format import ChatFormat
from mlxlocal.source.loader import ModelInfo

DISK_STATS_KEYS = ("disk_hit_blocks", "disk_read_bytes", "disk_write_blocks", "disk_write_bytes",
                   "disk_dropped_writes", "disk_corrupt_removed", "disk_bytes")
# The keys of Engine.stats(), identical for both engines (a dense engine reports 0 blocks);
# a stopped engine adds "dead_reason".
STATS_KEYS = frozenset({
    "blocks_total", "blocks_max", "blocks_used", "blocks_cached", "blocks_free", "block_size", "waste",
    "prefix_hit_tokens", "running", "waiting", "tokens_in", "tokens_out",
    "tokens_dropped", "tokens_repositioned",
    # Speculative decoding: verify steps, tokens drafted, drafted tokens accepted.
    "spec_steps", "spec_rows", "spec_drafted", "spec_accepted",
    # The disk tier (--kv-disk): blocks read back, bytes read, blocks and bytes written,
    # writes dropped (queue full, disk failing), bad files removed, bytes the store holds.
    *DISK_STATS_KEYS,
})


@runtime_checkable
class EngineSession(Protocol):
    """A conversation's cached KV, reused across turns."""

    @property
    def cached_len(self) -> int:
        """Tokens whose K/V the session holds: the context its next turn attends to."""
        ...

    @property
    def dropped_len(self) -> int:
        """Tokens of the conversation dropped from the cache by edits (CacheEdit)."""
        ...

    def reset(self) -> None: ...


@runtime_checkable
class Engine(Protocol):
    # The chat template, tool-call and think markers, special tokens: typed, read at load.
    chat_format: ChatFormat
    # Why the engine stopped for good (then every request raises EngineDeadError), or None.
    dead_reason: str | None

    @property
    def info(self) -> ModelInfo: ...

    @property
    def context_length(self) -> int: ...

    @property
    def kv_pool(self) -> dict[str, Any]:
        """The KV memory, known without asking the engine thread: {"kind": "paged", "blocks",
        "block_size", "bytes"} for the paged pools, {"kind": "dense"} for per-request caches."""
        ...

    def encode_chat(self, messages: list[dict[str, Any]], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]: ...

    def encode_continuation(self, messages: list[dict[str, Any]], new_messages: list[dict[str, Any]],
                            tools: list[dict] | None = None) -> list[int] | None: ...

    def encode_text(self, text: str) -> list[int]: ...

    def decode(self, tokens: list[int]) -> str: ...

    def validate(self, prompt: list[int], params: SamplingParams) -> None: ...

    def new_session(self) -> EngineSession: ...

    def submit(self, prompt: list[int], params: SamplingParams | None = None, session: Any = None,
               cancel: threading.Event | None = None,
               loop: asyncio.AbstractEventLoop | None = None,
               edits: list[CacheEdit] | None = None) -> RequestHandle:
        """Queue a request. `edits` drop / reposition spans of the prompt's cache;
        an engine or model that cannot edits raises ValueError naming why. The handle's
        progress() says how far the prompt's prefill is; astream(idle=) ticks while quiet;
        with `loop`, batches() yields all chunks ready at each wake-up (one per step)."""
        ...

    def generate(self, prompt: list[int], params: SamplingParams | None = None, session: Any = None,
                 cancel: threading.Event | None = None,
                 edits: list[CacheEdit] | None = None) -> Iterator[Chunk]: ...

    def stats(self) -> dict[str, Any]:
        """Counters with the keys in STATS_KEYS (plus "dead_reason" once stopped)."""
        ...

    def shutdown(self, timeout: float = 5.0) -> None: ...
