"""Compaction policies: drop plans derived from the conversation itself.

`keep-last-tool-outputs=K`: a tool result leaves the cache when the K-th newer one arrives
(AKV's benchmarks use K = 12). `drop-thinking`: an assistant message's think block leaves
when the next user message arrives (what templates such as Qwen3's do to the text).
`reposition`: every message after a gap is re-rotated to close it. Plans depend only on
the messages, so a conversation's plan for turn n+1 extends its plan for turn n and the
cache of turn n stays reusable.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlxlocal.edits.plan import DropPlan

POLICY_HELP = ("comma-separated: keep-last-tool-outputs=K (drop older tool results from the KV cache), "
               "drop-thinking (drop old think blocks at the next user message), reposition (close the gaps)")


@dataclass(frozen=True)
class CompactionPolicy:
    keep_tool_outputs: int | None = None
    drop_thinking: bool = False
    reposition: bool = False

    @property
    def active(self) -> bool:
        return self.keep_tool_outputs is not None or self.drop_thinking

    def plan(self, messages: list[dict[str, Any]]) -> DropPlan:
        from mlxlocal.edits.plan import DropPlan  # the engine's types: not for --help

        plan = DropPlan()
        roles = [m.get("role") for m in messages]
        if self.keep_tool_outputs is not None:
            tools = [i for i, r in enumerate(roles) if r == "tool"]
            k = self.keep_tool_outputs
            for j, i in enumerate(tools[: max(0, len(tools) - k)]):
                plan.messages.setdefault(tools[j + k], []).append(i)
        if self.drop_thinking:
            users = [i for i, r in enumerate(roles) if r == "user"]
            for i, r in enumerate(roles):
                later = next((u for u in users if u > i), None)
                if r == "assistant" and later is not None:
                    plan.thinking.setdefault(later, []).append(i)
        if self.reposition:
            plan.reposition = list(range(len(messages)))
        return plan

    def describe(self) -> str:
        parts = [f"keep-last-tool-outputs={self.keep_tool_outputs}"] if self.keep_tool_outputs is not None else []
        parts += ["drop-thinking"] * self.drop_thinking + ["reposition"] * self.reposition
        return ",".join(parts) or "off"


def parse_policy(text: str | None) -> CompactionPolicy:
    """`keep-last-tool-outputs=12,drop-thinking,reposition`; "" / "off" / None: no compaction."""
    if not text or text.strip() == "off":
        return CompactionPolicy()
    keep, thinking, reposition = None, False, False
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, value = part.partition("=")
        if name == "keep-last-tool-outputs":
            if not value.isdigit() or int(value) < 1:
                raise ValueError(f"--kv-compact: keep-last-tool-outputs needs a count >= 1, got {value!r}")
            keep = int(value)
        elif name == "drop-thinking" and not value:
            thinking = True
        elif name == "reposition" and not value:
            reposition = True
        else:
            raise ValueError(f"--kv-compact: unknown policy {part!r} ({POLICY_HELP})")
    return CompactionPolicy(keep, thinking, reposition)
