"""What the agent parts hand each other: MCP server settings, tools, calls, results, policy
decisions. The MCP client (client.py / config.py), the Rule-of-Two policy (policy.py) and
the tool loop (loop.py) all speak these; none of them touches MLX (the loop uses the engine
contract only)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Trust = Literal["trusted", "untrusted"]
Verdict = Literal["allow", "ask", "block"]


@dataclass(frozen=True)
class ServerConfig:
    """One entry of a config's "mcpServers" (Claude Desktop / Claude Code / Cursor shape),
    `${VAR}` already expanded, plus our per-server keys."""

    name: str
    source: str  # the config file it came from (named in errors)
    command: str | None = None  # stdio: a local subprocess
    args: tuple[str, ...] = ()
    env: dict[str, str] | None = None
    cwd: str | None = None
    url: str | None = None  # Streamable HTTP
    headers: dict[str, str] | None = None
    trust: Trust = "trusted"
    sensitive: bool = False
    allow: tuple[str, ...] | None = None  # tool names (None: all)
    deny: tuple[str, ...] = ()
    # Per-tool overrides of the policy's annotation-derived defaults, e.g.
    # {"send_email": {"state_change": true}, "fetch": {"untrusted_output": true}}.
    tool_policy: dict[str, dict[str, bool]] = field(default_factory=dict)


@dataclass(frozen=True)
class ToolInfo:
    """An MCP tool as the model and the policy see it; `id` is "server.name"."""

    server: str
    name: str
    description: str = ""
    input_schema: dict[str, Any] = field(default_factory=lambda: {"type": "object"})
    # MCP ToolAnnotations as given: readOnlyHint, destructiveHint, idempotentHint, openWorldHint, title.
    annotations: dict[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.server}.{self.name}"


@dataclass(frozen=True)
class ToolCall:
    tool: str  # "server.name"
    arguments: dict[str, Any]


@dataclass(frozen=True)
class ToolResult:
    """A call's outcome as text for the model. `error`: the tool failed, timed out, its
    server died, or the policy stopped the call (then `stopped_by_policy`). `truncated`:
    the text was cut to the size limit (the text says so too)."""

    text: str
    error: bool = False
    truncated: bool = False
    stopped_by_policy: bool = False


@dataclass(frozen=True)
class Decision:
    """The Rule-of-Two verdict on one attempted call: `flags` are the session's three
    flags as they would be with the call ([A] untrusted_input, [B] sensitive,
    [C] state_change); `reasons` say why, one line each."""

    decision: Verdict
    flags: dict[str, bool]
    reasons: list[str]

    def as_dict(self) -> dict[str, Any]:
        return {"decision": self.decision, "flags": dict(self.flags), "reasons": list(self.reasons)}
