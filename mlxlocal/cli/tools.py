"""The `tools` command group: offline looks at MCP tools. `tools check` replays a recorded
trace through the Rule-of-Two policy (mlxlocal.agents.policy) and judges the attempted call,
the same engine the tool loop enforces live. (`tools rank` joins this group later.)

The package calls `register(app)`. Input problems exit 2 with one line naming the file and
the field; the verdict itself is never an error (exit 0 for allow, ask and block alike).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape

from mlxlocal.cli.common import fail

tools_app = typer.Typer(name="tools", help="Offline checks of MCP tools: the Rule-of-Two policy on a trace.",
                        no_args_is_help=True)


@tools_app.command("check")
def check(
    mcp: list[Path] = typer.Option(..., "--mcp", help="MCP config (mcpServers with trust / sensitive / policy); repeatable"),
    tools: Path = typer.Option(..., "--tools", help="TOOLS.json: a list of tools with server, name, description, inputSchema, annotations"),
    trace: Path = typer.Option(..., "--trace", help='TRACE.json: {"steps": [{"tool", "arguments", "result"}], "attempted_call": {"tool", "arguments"}}'),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object: decision, flags, reasons"),
) -> None:
    """Replay TRACE's steps through the Rule-of-Two policy; print the verdict on its attempted call."""
    # Imported here so `mlxlocal --help` does not pay for the agents package.
    from mlxlocal.agents.trace import PolicyInputError, load_check_inputs, replay

    try:
        policy, parsed = load_check_inputs(mcp, tools, trace)
    except PolicyInputError as e:
        fail(escape(str(e)), 2)
    decision = replay(policy, parsed)
    if as_json:
        print(json.dumps(decision.as_dict()))
        return
    console = Console(highlight=False, soft_wrap=True)  # per call: CliRunner captures stdout
    style = {"allow": "green", "ask": "yellow", "block": "bold red"}[decision.decision]
    call = parsed.attempted
    arguments = json.dumps(call.arguments)
    if len(arguments) > 200:  # the verdict is the point; the trace file has the whole call
        arguments = arguments[:200] + "…"
    console.print(f"[{style}]{decision.decision}[/] {escape(call.tool)} {escape(arguments)}")
    flags = decision.flags
    console.print(escape("flags: " + "  ".join(
        f"[{k}] {name} {'yes' if flags[name] else 'no'}"
        for k, name in (("A", "untrusted_input"), ("B", "sensitive"), ("C", "state_change")))))
    for reason in decision.reasons:
        console.print(f"  {escape(reason)}")


def register(app: typer.Typer) -> None:
    """Add the `tools` group to the main Typer app."""
    app.add_typer(tools_app, name="tools")
