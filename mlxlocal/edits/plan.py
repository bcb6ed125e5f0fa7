"""Drops and repositions named by message -> the engine's CacheEdits in token spans.

A plan says, per trigger message, which messages (or which messages' think blocks) leave
the cache when that message arrives, and which messages are repositioned to close the
gaps. A trigger's edit happens once the tokens before the trigger message are cached, so
everything from the trigger on is computed without the dropped tokens, and everything
before it keeps what it learned from them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from mlxlocal.engine import CacheEdit

Span = tuple[int, int]


class PlanError(ValueError):
    """A drop plan that does not fit the conversation; `field` names the request field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field

    # The chat message it is about, where a front end with other indices renames it (spans).
    message: int | None = None


@dataclass
class DropPlan:
    messages: dict[int, list[int]] = field(default_factory=dict)  # trigger -> messages dropped whole
    thinking: dict[int, list[int]] = field(default_factory=dict)  # trigger -> messages whose think block goes
    reposition: list[int] = field(default_factory=list)  # messages whose keys close the gaps before them

    @property
    def empty(self) -> bool:
        return not any(self.messages.values()) and not any(self.thinking.values())


def _index(value: Any, n: int, field: str, what: str) -> int:
    # JSON object keys are strings ("3"); only plain ASCII integers count (str.isdigit takes
    # "²", which int() refuses, and lstrip("-") took "--3").
    if isinstance(value, str) and re.fullmatch(r"\s*-?[0-9]+\s*", value):
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise PlanError(field, f"{what} must be a message index (an integer), got {value!r}")
    if not 0 <= value < n:
        raise PlanError(field, f"{what} {value} is not a message of this request (0..{n - 1})")
    return value


def parse_drop_message(value: Any, n_messages: int, field: str = "drop_message") -> dict[int, list[int]]:
    """AKV's {"<trigger message index>": [message indices]}: each listed message leaves the
    cache when the trigger message arrives. Every index names a message of the request, a
    dropped message comes before its trigger, and no message is dropped twice."""
    if not isinstance(value, dict):
        raise PlanError(field, f"must be an object of trigger message index -> [message indices], got {type(value).__name__}")
    plan: dict[int, list[int]] = {}
    seen: dict[int, int] = {}
    for key, listed in value.items():
        trigger = _index(key, n_messages, field, "trigger")
        if not isinstance(listed, list):
            raise PlanError(f"{field}.{key}", f"must be a list of message indices, got {type(listed).__name__}")
        for item in listed:
            m = _index(item, n_messages, f"{field}.{key}", "dropped message")
            if m >= trigger:
                raise PlanError(f"{field}.{key}", f"message {m} is not before its trigger {trigger}")
            if m in seen:
                raise PlanError(f"{field}.{key}", f"message {m} is already dropped at trigger {seen[m]}")
            seen[m] = trigger
            plan.setdefault(trigger, []).append(m)
    return {t: sorted(ms) for t, ms in sorted(plan.items())}


def parse_reposition(value: Any, n_messages: int, field: str = "reposition") -> list[int]:
    if not isinstance(value, list):
        raise PlanError(field, f"must be a list of message indices, got {type(value).__name__}")
    return sorted({_index(v, n_messages, field, "message") for v in value})


def think_span(ids: list[int], span: Span, open_ids: list[int], close_ids: list[int]) -> Span | None:
    """The tokens of the think block (markers included) inside a message's span, or None."""
    a, b = span

    def find(seq: list[int], start: int) -> int:
        k = len(seq)
        return next((i for i in range(start, b - k + 1) if ids[i:i + k] == seq), -1)

    if not open_ids or not close_ids:
        return None
    start = find(open_ids, a)
    end = find(close_ids, start + len(open_ids)) if start >= 0 else -1
    return None if end < 0 else (start, end + len(close_ids))


def _subtract(span: Span, gone: list[Span]) -> list[Span]:
    """span minus the (sorted) spans in gone."""
    out, a = [], span[0]
    for x, y in sorted(gone):
        if y <= a or x >= span[1]:
            continue
        if x > a:
            out.append((a, x))
        a = max(a, y)
    if a < span[1]:
        out.append((a, span[1]))
    return out


def _merge(spans: list[Span]) -> list[Span]:
    out: list[Span] = []
    for x, y in sorted(s for s in spans if s[1] > s[0]):
        if out and x <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], y))
        else:
            out.append((x, y))
    return out


def to_edits(plan: DropPlan, spans: list[Span], thinks: dict[int, Span] | None = None) -> list[CacheEdit]:
    """The plan as CacheEdits, given each message's token span in the prompt (spans tile it:
    message i is spans[i], template glue included) and the think blocks found in them. A
    message dropped whole after its think block went loses only what is left of it; a
    repositioned message moves the parts of it still cached that follow a gap."""
    thinks = thinks or {}
    gone: list[Span] = []
    edits = []
    for trigger in sorted(set(plan.messages) | set(plan.thinking)):
        new = [s for m in plan.messages.get(trigger, []) for s in _subtract(spans[m], gone)]
        new += [s for m in plan.thinking.get(trigger, []) if m in thinks for s in _subtract(thinks[m], gone)]
        new = _merge(new)
        if not new:
            continue
        gone = _merge(gone + new)
        first_gap = new[0][0]
        moved = [s for m in plan.reposition if m < trigger
                 for s in _subtract(spans[m], gone) if s[0] >= first_gap]
        edits.append(CacheEdit(at=spans[trigger][0], drop=tuple(new), reposition=tuple(_merge(moved)),
                               close_tail=trigger in plan.reposition))
    return edits
