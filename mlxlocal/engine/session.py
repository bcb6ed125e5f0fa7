"""A conversation the engine keeps between turns: the tokens whose state it holds.

Both engines' sessions share this: the held tokens, one turn at a time, and how much of
a new prompt they reuse (the longest common prefix, always leaving one prompt token to
compute: its logits start the reply). Where the state lives is each engine's own: KV
blocks and recurrent states on the paged engine, a dense mlx-lm cache on the other.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from mlxlocal.engine.errors import SessionBusy


def common_prefix(held: list[int], prompt: list[int]) -> int:
    """Leading tokens `held` shares with `prompt`, at most len(prompt) - 1."""
    limit = min(len(held), len(prompt) - 1)
    return next((i for i in range(limit) if held[i] != prompt[i]), limit)


class Session(ABC):
    def __init__(self) -> None:
        self.tokens: list[int] = []  # tokens whose state the engine holds for this conversation
        self.busy = False

    @property
    def cached_len(self) -> int:
        return len(self.tokens)

    @property
    def dropped_len(self) -> int:
        """Tokens of the conversation dropped from the cache by edits (paged engine only)."""
        return 0

    def claim(self) -> None:
        """Start a turn: a session runs one request at a time."""
        if self.busy:
            raise SessionBusy()
        self.busy = True

    @abstractmethod
    def reset(self) -> None:
        """Forget everything held (the next turn starts from nothing)."""


class PagedSession(Session):
    """A conversation whose KV blocks (and recurrent state) stay pinned between turns."""

    def __init__(self, engine):  # a PagedEngine
        super().__init__()
        self.engine = engine
        self.block_table: list[int] = []  # holds the K/V of self.tokens
        self.window_table: list[int] = []  # sliding-window layers' blocks (cache/window.py)
        self.recurrent: list | None = None  # hybrid models: the state after self.tokens
        # Cache edits the conversation went through (engine.edits.EditState: origins,
        # positions, the applied edits), None while it has had none.
        self.edit = None

    @property
    def dropped_len(self) -> int:
        return self.edit.dropped if self.edit is not None else 0

    def reset(self) -> None:
        self.engine.call(lambda: self.engine.reuse.release_session(self))
