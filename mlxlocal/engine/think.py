"""A thinking budget (SamplingParams.think_budget), kept in the engine's output processing.

Once `think_budget` tokens are generated and the think block is still open, the engine writes
the model's think-end marker ("\\n</think>\\n\\n", as a model closes its block) into the
sequence instead of the next sampled token, and decoding goes on in the same request. The
marker is prompt for what follows, not output: it is not counted in completion_tokens nor
against max_tokens, and its text reaches the caller in a chunk without a token.
The budget counts from the first generated token (exact when the reply opens with its
think block); it is checked once, at the budget. A request with a grammar ignores it: the
grammar bounds its think block itself (grammar.formats.with_reasoning).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlxlocal.source.chat_format import ChatFormat, opens_think


@dataclass(frozen=True)
class ThinkMarkers:
    start: tuple[int, ...]  # the opening marker's ids
    end: tuple[int, ...]  # the closing marker's ids
    close: tuple[int, ...]  # what a budget writes: the closing marker between newlines
    start_text: str


def think_markers(fmt: ChatFormat) -> ThinkMarkers | None:
    """The format's think markers as ids; None for a model without a think block."""
    if not fmt.has_thinking:
        return None
    start_text, end_text = fmt.think_start, fmt.think_end
    if not start_text or not end_text:
        return None
    start, end = fmt.think_start_tokens, fmt.think_end_tokens
    if not start or not end:
        start, end = tuple(fmt.encode(start_text)), tuple(fmt.encode(end_text))
    close = tuple(fmt.encode(f"\n{end_text}\n\n"))
    return ThinkMarkers(start, end, close, start_text)


class ThinkBudget:
    """One request's budget: whether its think block is open, and when to close it."""

    def __init__(self, markers: ThinkMarkers, budget: int, opened: bool, room: int):
        self.markers, self.budget, self.open = markers, budget, opened
        self.room = room  # context positions the output may take (prompt's context left)
        self.tail: list[int] = []  # the last generated ids, as long as the longer marker
        self.done = False  # the marker was written (or can no longer be)

    @classmethod
    def start(cls, markers: ThinkMarkers | None, params, prompt: list[int], decode,
              room: int) -> ThinkBudget | None:
        """The budget of a request, or None (no budget, no markers, or a grammar)."""
        if params.think_budget is None or markers is None or params.grammar is not None:
            return None
        return cls(markers, params.think_budget, opens_think(markers.start_text, decode, prompt), room)

    def after(self, token: int, generated: int) -> tuple[int, ...] | None:
        """Read one generated (counted) token; the ids to write after it, or None."""
        if self.done:
            return None
        m = self.markers
        self.tail = (self.tail + [token])[-max(len(m.start), len(m.end)):]
        if not self.open and tuple(self.tail[-len(m.start):]) == m.start:
            self.open = True
        elif self.open and tuple(self.tail[-len(m.end):]) == m.end:
            self.open = False
        if generated < self.budget:
            return None
        self.done = True  # decided once, at the budget: a block opened later runs free
        return m.close if self.open else None

    def write(self, out, tokens: tuple[int, ...]) -> tuple[Any, str | None, str | None]:
        """Hand the marker to the request's Output (engine.output): (its chunk, or None when
        it and one more token do not fit the context; the finish reason, if it ends the
        request; the finish's cause). The output's limit leaves the marker its room."""
        room = self.room - out.generated - len(tokens)
        if room < 1:
            return None, "length", "context"
        out.max_tokens = min(out.max_tokens, out.generated + room)
        chunk, finish = out.write(tokens)
        return chunk, finish, None
