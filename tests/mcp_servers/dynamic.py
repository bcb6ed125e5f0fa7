"""MCP test server whose tool list changes at run time (notifications/tools/list_changed).

    python tests/mcp_servers/dynamic.py [--http PORT]

  add_tool(name)   registers a new tool `name` (it returns "I am <name>") and tells the
                   client the tool list changed
"""

from __future__ import annotations

from _common import parse_args, run
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations

server = MCPServer("dynamic", log_level="WARNING")


@server.tool(annotations=ToolAnnotations(read_only_hint=False, destructive_hint=False), structured_output=False)
async def add_tool(name: str, ctx: Context) -> str:
    """Add a tool called `name`."""
    def new_tool() -> str:
        return f"I am {name}"
    server.add_tool(new_tool, name=name, description=f"the {name} tool", structured_output=False)
    await ctx.session.send_tool_list_changed()
    return f"added {name}"


if __name__ == "__main__":
    run(server, parse_args())
