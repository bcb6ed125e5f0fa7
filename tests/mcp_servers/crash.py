"""MCP test server that dies in the middle of a tool call.

    python tests/mcp_servers/crash.py [--http PORT]

  echo(text)   returns text (shows the server worked before the crash)
  crash()      the process exits at once (os._exit(3)) without answering
"""

from __future__ import annotations

import os

from _common import parse_args, run
from mcp.server.mcpserver import MCPServer
from mcp.types import ToolAnnotations

server = MCPServer("crash", log_level="WARNING")
READ_ONLY = ToolAnnotations(read_only_hint=True)


@server.tool(annotations=READ_ONLY, structured_output=False)
def echo(text: str) -> str:
    """Return the text unchanged."""
    return text


@server.tool(annotations=READ_ONLY, structured_output=False)
def crash() -> str:
    """Exit the server process mid-call."""
    os._exit(3)


if __name__ == "__main__":
    run(server, parse_args())
