"""The tool loop: the local model calls MCP tools until it answers.

One `ToolLoop` is one agent conversation on one engine session. A turn (`run(text)`):
render the conversation with the MCP tools as the chat template's `tools=`, generate, split
the output into reasoning / content / tool calls with the family's parser
(grammar/parse.py), put every call through the Rule-of-Two policy (allow: call it; ask: the
`approve` callback decides; block: the policy's own result), send the results back as
`role: "tool"` messages, and generate again, until a reply has no tool call or `max_steps`
generations have run.

The loop keeps its messages, the token ids the model saw and produced and the engine
session in a `Conversation` (agents/conversation.py, the chat REPL's too: AgentRepl shares one
with its loop); a step's prompt is those ids plus the template's continuation (`encode_continuation`: the end of the reply, the tool
messages, the next assistant header), so the session's KV cache is a prefix of it and only
the new tokens are prefilled (`StepStats.cached_tokens`).

With a compaction policy (`compact`, `--kv-compact keep-last-tool-outputs=K`), the loop
knows each message's token span (edits/spans.py) and sends every step the policy's
cumulative cache edits: old tool results (and think blocks) leave the KV cache, the
prompt's ids stay what they were, so the session keeps matching it.

With more MCP tools than `max_tools`, only some are offered (agents/pruning.py): the top K
for the turn, the ones called before, and a built-in `search_tools` that finds more. The
offered list is chosen per user turn, so the steps of a turn keep hitting the cache.

Everything that happens goes out as `AgentEvent`s through one callback, so the chat REPL,
`mlxlocal run` and its `--json` transcript all render the same events. Engine contract only:
no MLX arrays here, and nothing from the front ends (cli, server, the REPLs) but the
`Conversation`, which itself knows only the engine contract and compaction.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from mlxlocal.agents.conversation import Conversation, Message
from mlxlocal.agents.pruning import (
    DEFAULT_MAX_TOOLS,
    SEARCH_TOOLS,
    Ranker,
    ToolSelection,
    search_tools_schema,
)
from mlxlocal.agents.types import Decision, ToolCall, ToolInfo, ToolResult
from mlxlocal.edits import CompactionPolicy
from mlxlocal.engine import Engine, EngineSession, GenerationStats, Grammar, SamplingParams
from mlxlocal.errors import MlxLocalError
from mlxlocal.grammar.errors import GrammarError
from mlxlocal.grammar.parse import OutputParser, new_call_id, starts_in_reasoning
from mlxlocal.grammar.tools import tool_calls

# Templates want a plain identifier as a function name; MCP tool ids are "server.name".
# Flattened as Responses namespaces are (server/responses_items.py): "server__name".
NAME_SEP = "__"
SHORT_RESULT = 200  # characters of a tool result shown in an event line


class Hub(Protocol):
    """What the loop needs of the MCP client (agents/client.py McpHub)."""

    @property
    def tools(self) -> list[ToolInfo]: ...

    def call(self, tool_id: str, arguments: dict[str, Any], timeout: float = 60,
             cancel: threading.Event | None = None) -> ToolResult: ...


class Policy(Protocol):
    """What the loop needs of the Rule-of-Two policy (agents/policy.py RuleOfTwo)."""

    def check(self, call: ToolCall) -> Decision: ...

    def record(self, call: ToolCall, result: ToolResult) -> None: ...

    def approve(self, call: ToolCall) -> Any: ...

    def note_user_input(self, untrusted: bool, what: str = ...) -> None: ...

    def stopped_result(self, decision: Decision) -> ToolResult: ...


Approve = Callable[[ToolCall, Decision], bool]


def function_name(tool_id: str) -> str:
    server, _, name = tool_id.partition(".")
    return f"{server}{NAME_SEP}{name}"


def tool_schemas(tools: Sequence[ToolInfo]) -> list[dict[str, Any]]:
    """MCP tools as the OpenAI function schemas chat templates render."""
    return [{"type": "function", "function": {
        "name": function_name(t.id), "description": t.description or t.annotations.get("title", ""),
        "parameters": t.input_schema or {"type": "object"}}} for t in tools]


def short(text: str, limit: int = SHORT_RESULT) -> str:
    one_line = " ".join(text.split())
    return one_line if len(one_line) <= limit else one_line[: limit - 1] + "…"


@dataclass
class StepStats:
    """One generation: `new_tokens` were prefilled, `cached_tokens` came from the KV cache."""

    step: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    tools: int = 0  # tool schemas in the prompt (search_tools included)
    dropped_tokens: int = 0  # prompt tokens out of the KV cache (--kv-compact): not attended
    new_tokens: int = 0  # prompt tokens computed (the engine's prefill_tokens)

    def as_dict(self) -> dict[str, Any]:
        return {"step": self.step, "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "new_tokens": self.new_tokens, "completion_tokens": self.completion_tokens,
                "finish_reason": self.finish_reason, "tools": self.tools, "dropped_tokens": self.dropped_tokens}


@dataclass
class CallRecord:
    """One tool call of a step: what the model asked, what the policy said, what came back."""

    id: str
    function: str  # the name the model called ("server__name")
    tool: str  # the MCP tool id ("server.name"); "" when the name is no known tool
    arguments: Any  # a dict, or the text when it was not JSON
    decision: Decision | None = None
    approved: bool | None = None  # for an "ask": the human's (or --yes's) answer
    result: ToolResult | None = None

    def as_dict(self) -> dict[str, Any]:
        r = self.result
        return {"id": self.id, "function": self.function, "tool": self.tool, "arguments": self.arguments,
                "decision": self.decision.as_dict() if self.decision else None, "approved": self.approved,
                "result": None if r is None else {"text": r.text, "error": r.error, "truncated": r.truncated,
                                                  "stopped_by_policy": r.stopped_by_policy}}


@dataclass
class AgentEvent:
    """kind: "step" (a generation starts), "reasoning" / "content" (text as it streams),
    "tool_call" (call: CallRecord with its arguments), "decision" (the policy's verdict on
    it; "ask" comes before the approve callback runs), "tool_result" (call.result),
    "step_end" (stats), "finish" (reason, note, the turn's steps)."""

    kind: str
    step: int
    text: str = ""
    call: CallRecord | None = None
    stats: StepStats | None = None
    reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind, "step": self.step}
        if self.text:
            out["text"] = self.text
        if self.call is not None:
            out["call"] = self.call.as_dict()
        if self.stats is not None:
            out["stats"] = self.stats.as_dict()
        if self.reason:
            out["reason"] = self.reason
        return out


@dataclass
class Step:
    stats: StepStats
    reasoning: str = ""
    content: str = ""
    calls: list[CallRecord] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {**self.stats.as_dict(), "reasoning": self.reasoning, "content": self.content,
                "calls": [c.as_dict() for c in self.calls]}


@dataclass
class TurnResult:
    """finish: "answer" (a reply without tool calls), "length" (that reply was cut by
    max_tokens or the context), "max_steps", "cancelled" (Ctrl-C), "error" (the engine
    refused the prompt, e.g. the context is full); `note` says what happened in words."""

    answer: str
    finish: str
    note: str
    steps: list[Step]


class ToolLoop:
    def __init__(self, engine: Engine, hub: Hub, policy: Policy, *, system: str | None = None,
                 params: SamplingParams | None = None, max_steps: int = 8,
                 approve: Approve | None = None, on_event: Callable[[AgentEvent], None] | None = None,
                 call_timeout: float = 60.0, constrain_calls: bool = True,
                 max_tools: int | None = DEFAULT_MAX_TOOLS, index: Ranker | None = None,
                 compact: CompactionPolicy | None = None, conversation: Conversation | None = None):
        if max_steps < 1:
            raise ValueError(f"max_steps must be at least 1, got {max_steps}")
        # The messages, kept ids and session (with `compact`'s spans); `system` and `compact`
        # are its own when one is given.
        self.conv = conversation or Conversation(engine, system=system, compact=compact)
        self.hub = hub
        self.policy = policy
        self.params = params or SamplingParams(max_tokens=1024)
        self.max_steps = max_steps
        # No callback: nobody can say yes, so "ask" stops the call (what `run` does without --yes).
        self.approve = approve or (lambda call, decision: False)
        self.on_event = on_event or (lambda event: None)
        self.call_timeout = call_timeout
        # Calls constrained to the offered tools and their inputSchemas where the family's
        # syntax allows it (the reply may still be text): arguments valid by construction.
        # Keyed by (the prompt opened a think block, the callable names); None: not enforceable
        # (`grammar_note`).
        self.constrain_calls = constrain_calls
        self._grammars: dict[tuple[bool, tuple[str, ...]], Grammar | None] = {}
        self.grammar_note = ""
        # Which tools are offered (all of them unless there are more than max_tools).
        self.selection = ToolSelection(max_tools, index)
        self._catalog_version: int | None = None
        self.tools: dict[str, ToolInfo] = {}  # every tool of the hub, by function name
        self.schemas: list[dict[str, Any]] | None = None  # the prompt's tools=
        self.callable: list[dict[str, Any]] | None = None  # schemas, plus what search_tools found
        self._rendered: list[str] | None = None  # the tools= names the kept ids were rendered with
        self._refresh_tools()
        self.steps: list[Step] = []  # every step of every turn, for the transcript
        self.last_stats: GenerationStats | None = None  # the last generation's, for a /stats footer
        self._step_no = 0

    @property
    def engine(self) -> Engine:
        return self.conv.engine  # the conversation's: /model switches it there

    @property
    def messages(self) -> list[Message]:
        return self.conv.messages

    @property
    def ids(self) -> list[int]:
        return self.conv.ids

    @property
    def session(self) -> EngineSession:
        return self.conv.session

    def reset(self) -> None:
        self.conv.reset()
        self.steps, self._step_no = [], 0
        self.selection.reset()
        self._catalog_version = None
        self._refresh_tools()

    # the offered tools -------------------------------------------------------------------
    def _refresh_tools(self) -> None:
        """The hub's tools at the start of a conversation; later (checked at each user turn)
        only tools a server added (list_changed). A dead server's tools stay listed: calling
        one gives an error result that says so, and dropping them would change the system
        prompt and lose the session's cache."""
        version = getattr(self.hub, "tools_version", 0)
        if version == self._catalog_version:
            return
        first = self._catalog_version is None
        self._catalog_version = version
        tools = self.hub.tools
        if not first:
            known = self.selection.tools
            added = [t for t in tools if t.id not in known]
            if not added:
                return
            tools = list(known.values()) + added
        self.tools = {function_name(t.id): t for t in tools}
        self.selection.set_catalog(tools)
        self._offer()

    def _offer(self) -> None:
        sel = self.selection
        extra = [search_tools_schema()] if sel.pruning else []
        self.schemas = tool_schemas([sel.tools[i] for i in sel.prompt]) + extra or None
        self.callable = tool_schemas([sel.tools[i] for i in sel.callable]) + extra or None

    def offered(self) -> list[tuple[str, str]]:
        """(tool id, why) of every callable tool, for /tools and the transcript."""
        sel = self.selection
        return [(i, sel.why[i].text() if sel.pruning and i in sel.why else "all tools offered")
                for i in sel.callable]

    def conversation(self) -> list[Message]:
        return self.conv.rendered()

    def _emit(self, kind: str, **fields: Any) -> None:
        self.on_event(AgentEvent(kind, self._step_no, **fields))

    # prompts -----------------------------------------------------------------------------
    def _prompt(self) -> list[int]:
        """The kept ids plus the template's continuation after the last reply they hold;
        the whole conversation encoded when there is none yet or the template cannot
        continue (then the session still reuses the longest common prefix)."""
        # A changed tools= changes the system prompt: the kept ids no longer start this prompt.
        return self.conv.prompt_ids(tools=self.schemas, reuse=self._rendered == _names(self.schemas))

    # a turn ------------------------------------------------------------------------------
    def run(self, text: str, cancel: threading.Event | None = None, *, untrusted: bool = False) -> TurnResult:
        """One user message, then steps until the model answers without calling a tool.
        `cancel` (Ctrl-C) stops the generation or the tool call under way; the conversation
        keeps what happened up to there, so the next `run` continues it. `untrusted`: the
        message carries text the user did not write (a pasted email or page); the policy
        counts it as untrusted input [A], as it would the same text returned by a tool."""
        cancel = cancel or threading.Event()
        self._refresh_tools()
        previous = next((m["content"] for m in reversed(self.messages) if m["role"] == "assistant"), "")
        if self.selection.start_turn(text, previous or ""):
            self._offer()
        if self.selection.pruning:
            self._emit("tools", text=f"{len(self.selection.callable)} of {len(self.tools)} tools offered "
                                     "(+ search_tools): /tools says why")
        self.messages.append({"role": "user", "content": text})
        # The policy counts every user message as a step; one the user typed is trusted.
        self.policy.note_user_input(untrusted, "the user's message")
        steps: list[Step] = []
        while True:
            if len(steps) == self.max_steps:
                note = (f"stopped after {self.max_steps} steps: the model still wanted to call tools "
                        "(raise --max-steps)")
                return self._finish("max_steps", note, steps)
            self._step_no += 1
            try:
                step = self._generate(cancel)
            except (MlxLocalError, ValueError) as e:  # context full, engine refused: the session stays
                self._forget_unanswered(steps)
                return self._finish("error", str(e), steps)
            if step is None:
                self._forget_unanswered(steps)
                return self._finish("cancelled", "cancelled before the first token", steps)
            steps.append(step)
            self.steps.append(step)
            if cancel.is_set():
                self._close_calls(step, "not run: the reply was cancelled")
                return self._finish("cancelled", "generation cancelled", steps, step.content)
            if not step.calls:
                if step.stats.finish_reason == "length":
                    return self._finish("length", "the reply was cut at the token limit", steps, step.content)
                return self._finish("answer", "", steps, step.content)
            if len(steps) == self.max_steps:
                # Nobody would read these results: do not run the calls (they may act on the world).
                self._close_calls(step, f"not run: the step limit ({self.max_steps}) was reached")
                continue
            for call in step.calls:
                self._run_call(call, cancel)
                if cancel.is_set():
                    self._close_calls(step, "not run: cancelled by the user")
                    return self._finish("cancelled", "tool call cancelled", steps, step.content)

    def _forget_unanswered(self, steps: list[Step]) -> None:
        """A turn that produced nothing at all is forgotten, as the chat REPL forgets it: the
        next message follows the last answered one (the policy still counted the input)."""
        if not steps and self.messages and self.messages[-1]["role"] == "user":
            self.messages.pop()

    def _finish(self, finish: str, note: str, steps: list[Step], answer: str = "") -> TurnResult:
        self._emit("finish", reason=finish, text=note)
        return TurnResult(answer, finish, note, steps)

    def _generate(self, cancel: threading.Event) -> Step | None:
        """One step: generate a reply, parse it, append the assistant message. None when it
        was cancelled before any token (nothing is kept, as in the chat REPL)."""
        prompt = self._prompt()
        edits = self.conv.edits()
        self._rendered = _names(self.schemas)
        self._emit("step")
        opened = starts_in_reasoning(self.engine, prompt)
        parser = OutputParser(self.engine.chat_format, self.callable, opened)
        grammar = self._call_grammar(opened)
        params = replace(self.params, grammar=grammar) if grammar and self.params.grammar is None else self.params
        step = Step(StepStats(self._step_no, tools=len(self.callable or ())))
        generated: list[int] = []
        calls = []
        stats = None
        extra = {"edits": edits} if edits is not None else {}  # no policy: the engine sees no edits at all
        for chunk in self.engine.generate(prompt, params, session=self.session, cancel=cancel, **extra):
            if chunk.token is not None:
                generated.append(chunk.token)
            generated += chunk.written  # a thinking budget's marker: the model saw it
            events = parser.feed(chunk.text) if chunk.text else []
            if chunk.stats is not None:
                stats = chunk.stats
                events += parser.finish()
            for ev in events:
                if ev.kind == "tool_call":
                    calls.append(ev)
                elif ev.kind == "reasoning":
                    step.reasoning += ev.text
                    self._emit("reasoning", text=ev.text)
                else:
                    step.content += ev.text
                    self._emit("content", text=ev.text)
        if stats is not None:
            self.last_stats = stats
            step.stats.prompt_tokens, step.stats.cached_tokens = stats.prompt_tokens, stats.cached_tokens
            step.stats.new_tokens = stats.prefill_tokens
            step.stats.completion_tokens, step.stats.finish_reason = stats.completion_tokens, stats.finish_reason
            step.stats.dropped_tokens = stats.dropped_tokens
        if not generated and cancel.is_set():
            return None
        step.calls = [self._call_record(ev) for ev in calls]
        message: dict[str, Any] = {"role": "assistant", "content": step.content}
        if step.reasoning:
            message["reasoning_content"] = step.reasoning
        if step.calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function, "arguments": c.arguments}}
                for c in step.calls]
        self.conv.replied(message, prompt, generated)
        self._emit("step_end", stats=step.stats)
        for c in step.calls:
            self._emit("tool_call", call=c)
        return step

    def _call_grammar(self, opened: bool) -> Grammar | None:
        if not self.constrain_calls or not self.callable:
            return None
        # Per callable set: a tool found by search_tools is callable (and constrained) next step.
        key = (opened, tuple(_names(self.callable) or ()))
        if key not in self._grammars:
            try:
                # Thinking gets the budget or else at most half the reply, as the server allows
                # before a forced call (with a grammar, the engine leaves the budget to it).
                think = self.params.think_budget or max(1, self.params.max_tokens // 2)
                self._grammars[key] = tool_calls(self.engine.chat_format, self.callable, None, "tools", opened,
                                                 True, think, optional=True)
            except GrammarError as e:  # a family or schema the grammar cannot express: the hub still validates
                self._grammars[key] = None
                self.grammar_note = f"tool calls are checked after generation only: {e}"
        return self._grammars[key]

    def _call_record(self, event: Any) -> CallRecord:
        info = self.tools.get(event.name)
        try:
            arguments = json.loads(event.arguments) if event.arguments.strip() else {}
        except ValueError:
            arguments = event.arguments  # kept as text: the call is refused with the reason
        tool = SEARCH_TOOLS if event.name == SEARCH_TOOLS and self.selection.pruning else info.id if info else ""
        return CallRecord(event.id or new_call_id(), event.name, tool, arguments)

    # tool calls --------------------------------------------------------------------------
    def _run_call(self, record: CallRecord, cancel: threading.Event) -> None:
        offered = _names(self.callable) or []
        if not record.tool:
            names = ", ".join(sorted(offered)) or "none"
            result = ToolResult(f"error: there is no tool named {record.function!r}; the tools are: {names}",
                                error=True)
        elif not isinstance(record.arguments, dict):
            result = ToolResult("error: the arguments must be a JSON object, got "
                                f"{short(str(record.arguments), 80)!r}", error=True)
        elif record.tool == SEARCH_TOOLS:
            result = self._search(record.arguments)
        elif record.function not in offered:
            result = ToolResult(f"error: {record.function} is not among the offered tools; call {SEARCH_TOOLS} "
                                "to make it available", error=True)
        else:
            result = self._checked_call(record, ToolCall(record.tool, record.arguments), cancel)
        self._add_result(record, result)

    def _search(self, arguments: dict[str, Any]) -> ToolResult:
        """The built-in search_tools: not an MCP call and not put to the policy (it reads only
        the tool descriptions the servers listed, which a full prompt would hold anyway)."""
        query = arguments.get("query")
        if not isinstance(query, str):
            return ToolResult("error: search_tools needs {\"query\": \"what the tool should do\"}", error=True)
        text, new = self.selection.search(query)
        if new:
            self._offer()  # callable from the next step; the prompt's tools= stays (the cache too)
        return ToolResult(text, error=text.startswith("error:"))

    def _checked_call(self, record: CallRecord, call: ToolCall, cancel: threading.Event) -> ToolResult:
        # An attempted call keeps its tool offered: the conversation names it from now on.
        self.selection.note_called(call.tool)
        decision = self.policy.check(call)
        record.decision = decision
        self._emit("decision", call=record)
        if decision.decision == "ask":
            record.approved = bool(self.approve(call, decision))
            if record.approved:
                self.policy.approve(call)
        if decision.decision == "block" or (decision.decision == "ask" and not record.approved):
            result = self.policy.stopped_result(decision)
        else:
            try:
                result = self.hub.call(call.tool, call.arguments, timeout=self.call_timeout, cancel=cancel)
            except Exception as e:  # the hub turns failures into results; anything else must not
                # leave a call unanswered (the conversation would no longer render) or end the session
                result = ToolResult(f"error: {call.tool} failed: {type(e).__name__}: {e}", error=True)
        # Every outcome is recorded: a stopped call still tells the policy what was attempted,
        # and an untrusted result sets flag [A] even when it is an error text.
        self.policy.record(call, result)
        return result

    def _add_result(self, record: CallRecord, result: ToolResult) -> None:
        record.result = result
        self.messages.append({"role": "tool", "tool_call_id": record.id, "name": record.function,
                              "content": result.text})
        self._emit("tool_result", call=record)

    def _close_calls(self, step: Step, why: str) -> None:
        """Calls that will not run still get a tool message, so the conversation stays well
        formed (every call answered) for the template and the next turn."""
        for record in step.calls:
            if record.result is None:
                self._add_result(record, ToolResult(why, error=True))

    # the transcript ----------------------------------------------------------------------
    def transcript(self) -> dict[str, Any]:
        """The whole conversation: messages, every step's calls, results, decisions and
        token counts (what `mlxlocal run --json` prints)."""
        return {
            "model": self.engine.info.name,
            "tools": [{"id": t.id, "function": name, "annotations": t.annotations} for name, t in self.tools.items()],
            "max_tools": self.selection.max_tools,
            "offered": [{"id": i, "why": why} for i, why in self.offered()],
            "messages": self.conversation(),
            "steps": [s.as_dict() for s in self.steps],
            "prefill_tokens_per_step": [s.stats.new_tokens for s in self.steps],
            "kv_compact": self.conv.spans.policy.describe(),
            "kv_compact_note": self.conv.spans.note,  # why the last step dropped nothing, if it could not
            "dropped_tokens_per_step": [s.stats.dropped_tokens for s in self.steps],
            "calls_constrained": bool(self._grammars) and all(g is not None for g in self._grammars.values()),
            "grammar_note": self.grammar_note,
        }


def _names(schemas: list[dict[str, Any]] | None) -> list[str] | None:
    return [s["function"]["name"] for s in schemas] if schemas else None
