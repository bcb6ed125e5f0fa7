"""The Rule of Two, enforced before every tool call of an agent session.

An agent session may hold at most two of three properties without a human in the loop:
[A] it has ingested untrusted input (text an attacker may have written), [B] it has touched a
sensitive system or private data, [C] it is about to change state or talk to the outside. A
call that would complete all three is stopped: "block" when the tool is destructive, "ask"
(a human approves this one call) otherwise.

Where the facts come from, most specific first:

1. the config's per-tool `policy` (ServerConfig.tool_policy): `untrusted_output`,
   `sensitive`, `state_change`, `destructive`. The config is the user's own file, so it
   overrides everything below, in both directions.
2. the server's `trust` and `sensitive` keys.
3. MCP tool annotations, from trusted servers only. MCP says clients must treat annotations
   from untrusted servers as untrusted: a server that wants to be let through would simply
   claim `readOnlyHint: true`. So an untrusted server's annotations are ignored and MCP's
   defaults apply to its tools.
4. MCP's defaults for an absent hint, which are the worst case: readOnlyHint false,
   destructiveHint true, openWorldHint true. A tool we know nothing about may change
   anything and may return anything; the config is the way to say otherwise.

[A] and [B] are session state, set by `record` once a call has run (B also counts the
attempted call itself: calling a sensitive server is touching it). [C] belongs to the
attempted call alone: a session that changed state earlier has nothing left to protect by
that, while one that reads after untrusted input may still be steered into the next call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from mlxlocal.agents.types import Decision, ServerConfig, ToolCall, ToolInfo, ToolResult

POLICY_KEYS = ("untrusted_output", "sensitive", "state_change", "destructive")

# MCP ToolAnnotations defaults (spec 2025-06-18): what a client assumes when a hint is absent.
MCP_DEFAULTS = {"readOnlyHint": False, "destructiveHint": True, "openWorldHint": True}


@dataclass(frozen=True)
class ToolFacts:
    """What the policy believes about one tool, each fact with the why that goes in reasons."""

    untrusted_output: bool
    untrusted_why: str
    sensitive: bool
    sensitive_why: str
    state_change: bool
    state_why: str
    destructive: bool
    destructive_why: str


def _hint(tool: ToolInfo, trusted: bool, name: str) -> tuple[bool, str]:
    """An annotation's effective value and how it was arrived at."""
    if not trusted:
        return MCP_DEFAULTS[name], f"{name} ignored from an untrusted server, MCP default {_b(MCP_DEFAULTS[name])}"
    value = tool.annotations.get(name)
    if isinstance(value, bool):
        return value, f"{name} {_b(value)}"
    return MCP_DEFAULTS[name], f"{name} absent, MCP default {_b(MCP_DEFAULTS[name])}"


def _b(value: bool) -> str:
    return "true" if value else "false"


def tool_facts(tool: ToolInfo, server: ServerConfig) -> ToolFacts:
    """Derive the four facts of a tool from config overrides, trust and annotations."""
    override = server.tool_policy.get(tool.name, {})
    trusted = server.trust == "trusted"
    read_only, ro_why = _hint(tool, trusted, "readOnlyHint")
    open_world, ow_why = _hint(tool, trusted, "openWorldHint")
    destructive_hint, d_why = _hint(tool, trusted, "destructiveHint")

    def from_config(key: str) -> tuple[bool, str] | None:
        if key in override:
            return override[key], f"config policy {server.name}.{tool.name}.{key} = {_b(override[key])}"
        return None

    # [A] the tool's output: anything from an untrusted server or the open world may carry an
    # attacker's instructions.
    if (a := from_config("untrusted_output")) is None:
        if not trusted:
            a = True, f"from untrusted server '{server.name}'"
        elif open_world:
            a = True, f"from an open-world tool ({ow_why})"
        else:
            a = False, f"trusted server, closed world ({ow_why})"

    if (b := from_config("sensitive")) is None:
        b = (True, f"sensitive server '{server.name}'") if server.sensitive else (False, f"server '{server.name}' is not sensitive")

    # Destructive only matters for tools that write at all (MCP: destructiveHint is meaningful
    # only when readOnlyHint is false).
    if (d := from_config("destructive")) is None:
        if override.get("state_change") is False:
            # The user said it changes nothing; a default destructiveHint must not undo that.
            d = False, f"config policy {server.name}.{tool.name}.state_change = false"
        else:
            d = (False, f"read-only ({ro_why})") if read_only else (destructive_hint, d_why)

    if (c := from_config("state_change")) is None:
        if not read_only:
            c = True, f"not read-only ({ro_why})"
        elif open_world:
            c = True, f"talks to the outside ({ow_why})"
        else:
            c = False, f"read-only and closed world ({ro_why}, {ow_why})"
    # A destructive tool changes state: when the config says both destructive and no state
    # change, the stronger statement wins.
    if d[0] and not c[0]:
        c = True, f"destructive ({d[1]})"
    return ToolFacts(a[0], a[1], b[0], b[1], c[0], c[1], d[0], d[1])


def _call_key(call: ToolCall) -> tuple[str, str]:
    # Approval is for this exact call: same tool, same arguments (canonical JSON).
    return call.tool, json.dumps(call.arguments, sort_keys=True, default=str)


class RuleOfTwo:
    """The policy state of one agent session.

    Use: `d = policy.check(call)`; "allow" -> run it; "ask" -> show the call and reasons to a
    human, and `policy.approve(call)` if they agree (else give the model
    `policy.stopped_result(d)`); "block" -> give the model `policy.stopped_result(d)`. After a
    call ran (or was stopped), `policy.record(call, result)`.
    """

    def __init__(self, servers: list[ServerConfig], tools: list[ToolInfo]):
        by_name = {s.name: s for s in servers}
        self.tools: dict[str, ToolInfo] = {}
        self.facts: dict[str, ToolFacts] = {}
        for tool in tools:
            server = by_name.get(tool.server)
            if server is None:
                raise ValueError(f"tool {tool.id}: server '{tool.server}' is not in the MCP config")
            self.tools[tool.id] = tool
            self.facts[tool.id] = tool_facts(tool, server)
        self.step = 0  # calls recorded (and user inputs noted) so far; reasons count from 1
        self.untrusted_input = False
        self.sensitive = False
        self._why: dict[str, str] = {}  # flag -> the reason line of what set it first
        self._approved: set[tuple[str, str]] = set()
        self.approvals: list[tuple[int, ToolCall]] = []  # (step it ran as, call) for the log

    @property
    def flags(self) -> dict[str, bool]:
        """The session's [A] and [B] now; [C] is per attempted call, so False here."""
        return {"untrusted_input": self.untrusted_input, "sensitive": self.sensitive, "state_change": False}

    def check(self, call: ToolCall) -> Decision:
        """The verdict on `call` before it runs; does not change the session."""
        facts = self.facts.get(call.tool)
        if facts is None:
            # Never run what no configured server listed: the model made the name up, or a
            # server changed its tools under us.
            return Decision("block", {**self.flags, "state_change": True},
                            [f"block: {call.tool} is not a tool of any configured server"])
        a = self.untrusted_input
        b = self.sensitive or facts.sensitive
        c = facts.state_change
        reasons = [
            self._why.get("A", "[A] untrusted input: no, nothing untrusted ingested so far"),
            self._why.get("B") or (f"[B] sensitive: the attempted call {call.tool} touches {facts.sensitive_why}"
                                   if facts.sensitive else "[B] sensitive: no, nothing sensitive touched so far"),
            f"[C] state change: {call.tool} {'may change state' if c else 'no, it does not change state'}: {facts.state_why}",
        ]
        flags = {"untrusted_input": a, "sensitive": b, "state_change": c}
        if not (a and b and c):
            held = "+".join(k for k, v in (("[A]", a), ("[B]", b), ("[C]", c)) if v) or "none"
            reasons.append(f"allow: {call.tool} holds {held}, at most two of the three")
            return Decision("allow", flags, reasons)
        if facts.destructive:
            reasons.append(f"block: {call.tool} would complete [A]+[B]+[C] and is destructive ({facts.destructive_why})")
            return Decision("block", flags, reasons)
        if _call_key(call) in self._approved:
            reasons.append(f"allow: {call.tool} would complete [A]+[B]+[C]; a human approved this call")
            return Decision("allow", flags, reasons)
        reasons.append(f"ask: {call.tool} would complete [A]+[B]+[C]; a human must approve this call")
        return Decision("ask", flags, reasons)

    def approve(self, call: ToolCall) -> Decision:
        """A human said yes to an "ask": this one call (same arguments) may run once. The
        approval is spent by `record`. A "block" cannot be approved: destructive calls in a
        session holding all three need the config changed, not a keypress."""
        decision = self.check(call)
        if decision.decision == "block":
            raise ValueError(f"{call.tool} is blocked by policy and cannot be approved: {decision.reasons[-1]}")
        if decision.decision == "ask":
            self._approved.add(_call_key(call))
            self.approvals.append((self.step + 1, call))
            decision = self.check(call)
        return decision

    def record(self, call: ToolCall, result: ToolResult) -> None:
        """A call finished (or was stopped): update [A] and [B] from what actually ran."""
        facts = self.facts.get(call.tool)
        if facts is None:
            raise ValueError(f"cannot record {call.tool}: not a tool of any configured server")
        self.step += 1
        self._approved.discard(_call_key(call))
        if result.stopped_by_policy:
            return  # it did not run: nothing was read, nothing touched
        # A failed call counts too: error text from an untrusted tool is still attacker text,
        # and a sensitive server was touched whether or not it answered.
        if facts.untrusted_output and not self.untrusted_input:
            self.untrusted_input = True
            self._why["A"] = f"[A] untrusted input: {call.tool} returned content {facts.untrusted_why} at step {self.step}"
        if facts.sensitive and not self.sensitive:
            self.sensitive = True
            self._why["B"] = f"[B] sensitive: {call.tool} touched {facts.sensitive_why} at step {self.step}"

    def note_user_input(self, untrusted: bool, what: str = "the user's input") -> None:
        """A user message in the session. Marked untrusted when it carries text the user did
        not write (a pasted email, a web page): the front end says so, and it counts as [A]
        like a tool result would. It takes a step either way, so reasons count like the log."""
        self.step += 1
        if untrusted and not self.untrusted_input:
            self.untrusted_input = True
            self._why["A"] = f"[A] untrusted input: {what} at step {self.step} was marked untrusted"

    @staticmethod
    def stopped_result(decision: Decision) -> ToolResult:
        """The tool result the model gets instead of the call's output."""
        verdict = {"block": "blocked", "ask": "stopped (it needs a human's approval, which was not given)"}
        if decision.decision not in verdict:
            raise ValueError("an allowed call is not stopped")
        why = "; ".join(r for r in decision.reasons)
        text = (f"This tool call was {verdict[decision.decision]} by the Rule-of-Two security policy and did "
                f"not run. Why: {why}. Do not retry it or work around it; tell the user what you wanted "
                f"to do and why.")
        return ToolResult(text=text, error=True, stopped_by_policy=True)
