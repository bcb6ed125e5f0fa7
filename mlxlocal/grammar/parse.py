"""Split generated text into content, reasoning (<think>) and tool calls, as it streams.

Markers come from the model's ChatFormat (mlx-lm infers them from the chat template):
tool calls between tool_call_start/end are parsed by mlx-lm's tool parser for that family. Text that
might be the start of a marker is held back until it is decided.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from mlxlocal.source.chat_format import opens_think

if TYPE_CHECKING:
    from mlxlocal.engine import ChatFormat

EventKind = Literal["content", "reasoning", "tool_call"]


@dataclass
class Event:
    kind: EventKind
    text: str = ""
    name: str = ""
    arguments: str = ""  # JSON text
    id: str = ""


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def starts_in_reasoning(engine, ids: list[int]) -> bool:
    """Whether generation begins inside a think block: the prompt ends with the opening
    marker (templates such as DeepSeek-R1 / QwQ put it after the assistant header).
    Only the very end counts: an unclosed marker earlier in the tail is message text (a
    user asking about `<think>`), and treating it as open would file the answer as reasoning."""
    fmt = engine.chat_format
    return opens_think(fmt.think_start if fmt.has_thinking else None, engine.decode, ids)


def _tool_event(parsed: Any) -> list[Event]:
    calls = parsed if isinstance(parsed, list) else [parsed]
    events = []
    for call in calls:
        if not isinstance(call, dict) or "name" not in call:
            raise ValueError(f"not a tool call: {call!r}")
        args = call.get("arguments", call.get("parameters", {}))
        events.append(Event("tool_call", name=str(call["name"]),
                            arguments=args if isinstance(args, str) else json.dumps(args), id=new_call_id()))
    return events


class OutputParser:
    def __init__(self, fmt: ChatFormat, tools: list[dict] | None = None,
                 starts_in_reasoning: bool = False):
        self.tools = tools
        self.tool_start = fmt.tool_call_start if tools else None
        self.tool_end = fmt.tool_call_end if tools else None
        self.tool_parser = fmt.tool_parser
        self.think_start = fmt.think_start if fmt.has_thinking else None
        self.think_end = fmt.think_end if self.think_start else None
        self.state: Literal["content", "reasoning", "tool"] = (
            "reasoning" if starts_in_reasoning and self.think_end else "content")
        self.buffer = ""
        self.tool_text = ""
        self.made_tool_calls = False
        # Families without markers (Llama 3.x) answer a tool call as a bare JSON object:
        # hold content back while it still looks like one.
        self.held: str | None = "" if tools and not self.tool_start else None

    def _markers(self) -> list[str]:
        if self.state == "reasoning":
            return [self.think_end] if self.think_end else []
        if self.state == "tool":
            return [self.tool_end] if self.tool_end else []
        return [m for m in (self.think_start, self.tool_start) if m]

    def feed(self, text: str) -> list[Event]:
        self.buffer += text
        events: list[Event] = []
        while True:
            markers = self._markers()
            hits = [(self.buffer.find(m), m) for m in markers if m in self.buffer]
            if not hits:
                break
            at, marker = min(hits)
            self._emit(self.buffer[:at], events)
            self.buffer = self.buffer[at + len(marker):]
            self._switch(marker, events)
        hold = max((n for m in self._markers() for n in range(1, len(m)) if self.buffer.endswith(m[:n])), default=0)
        cut = len(self.buffer) - hold
        self._emit(self.buffer[:cut], events)
        self.buffer = self.buffer[cut:]
        return events

    def _emit(self, text: str, events: list[Event]) -> None:
        if not text:
            return
        if self.state == "tool":
            self.tool_text += text
        elif self.state == "content" and self.held is not None:
            self.held += text
            head = self.held.lstrip()
            if head and not (head.startswith("{") or head.startswith("<|python_tag|>") or "<|python_tag|>".startswith(head)):
                events.append(Event("content", self.held))
                self.held = None
        else:
            events.append(Event(self.state, text))

    def _switch(self, marker: str, events: list[Event]) -> None:
        if self.state == "content" and marker == self.think_start:
            self.state = "reasoning"
        elif self.state == "reasoning":
            self.state = "content"
        elif self.state == "content" and marker == self.tool_start:
            self.state, self.tool_text = "tool", ""
        elif self.state == "tool":
            events.extend(self._parse_tool(self.tool_text))
            self.state = "content"

    def _parse_tool(self, text: str) -> list[Event]:
        try:
            parsed = self.tool_parser(text, self.tools) if self.tool_parser else json.loads(text.strip())
            events = _tool_event(parsed)
        except Exception:  # not a valid call: keep the text, never lose what the model said
            return [Event("content", f"{self.tool_start}{text}{self.tool_end or ''}")]
        self.made_tool_calls = True
        return events

    def finish(self) -> list[Event]:
        events: list[Event] = []
        rest, self.buffer = self.buffer, ""
        if self.state == "tool":
            events.extend(self._parse_tool(self.tool_text + rest))
        else:
            self._emit(rest, events)
        if self.held:
            text = self.held.strip().removeprefix("<|python_tag|>").strip()
            try:
                calls = _tool_event(json.loads(text))
                self.made_tool_calls = True
                events.extend(calls)
            except (ValueError, TypeError):
                events.append(Event("content", self.held))
            self.held = None
        return events
