"""MCP test server that plays one server of an injection scenario (tests/fixtures/injection).

    python tests/mcp_servers/scenario.py SCENARIO.json SERVER --outbox FILE [--http PORT]

It lists exactly SERVER's tools from the scenario's "tools", with the description,
inputSchema and annotations written there, so the live loop's client and policy see what
`mlxlocal tools check` reads from TOOLS.json. Calls are answered from the scenario's "trace":
  a trace step's call (same tool, same arguments)   that step's canned `result`
  the attempted_call                                "done", after appending one JSON line
                                                    {"tool": "SERVER.NAME", "arguments": ...} to
                                                    --outbox (the test's proof that it ran)
  anything else                                     a tool error naming the call (the test
                                                    scripted a call the scenario does not have)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from _common import parse_args, run
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import CallToolResult, TextContent, Tool


class ScenarioServer(MCPServer):
    """The SDK's server with its tool registry replaced by the scenario's tools: registering
    Python functions would derive the inputSchema from their signatures, and the point is to
    serve the scenario's schemas and annotations exactly as written."""

    def __init__(self, scenario: dict[str, Any], name: str, outbox: Path):
        super().__init__(name, log_level="WARNING")
        self.listed = [t for t in scenario["tools"] if t["server"] == name]
        if not self.listed:
            raise SystemExit(f"scenario {scenario.get('name')!r} has no tools for server {name!r}")
        trace = scenario["trace"]
        self.canned = [(s["tool"], s["arguments"], s["result"]) for s in trace["steps"] if "tool" in s]
        self.attempted = (trace["attempted_call"]["tool"], trace["attempted_call"]["arguments"])
        self.outbox = outbox

    async def list_tools(self) -> list[Tool]:
        # An empty annotations object is sent as none at all: both mean "no hints" in MCP.
        return [Tool.model_validate({"name": t["name"], "description": t.get("description", ""),
                                     "inputSchema": t.get("inputSchema") or {"type": "object"},
                                     **({"annotations": t["annotations"]} if t.get("annotations") else {})})
                for t in self.listed]

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Any = None) -> CallToolResult:
        tool = f"{self.name}.{name}"
        # The attempted call first: it is what the test watches, and no scenario repeats a
        # trace step as its attempted call.
        if (tool, arguments) == self.attempted:
            with self.outbox.open("a") as out:
                out.write(json.dumps({"tool": tool, "arguments": arguments}) + "\n")
            return _text("done")
        for step_tool, step_arguments, result in self.canned:
            if (tool, arguments) == (step_tool, step_arguments):
                return _text(result)
        raise ToolError(f"the scenario has no call {tool} {json.dumps(arguments)}")


def _text(text: str) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=text)])


if __name__ == "__main__":
    def extra(parser):
        parser.add_argument("scenario", type=Path)
        parser.add_argument("server")
        parser.add_argument("--outbox", type=Path, required=True)

    args = parse_args(extra)
    run(ScenarioServer(json.loads(args.scenario.read_text()), args.server, args.outbox), args)
