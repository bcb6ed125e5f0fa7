"""MCP test server that never answers a tool call (and, on request, never starts at all).

    python tests/mcp_servers/hang.py [--no-init] [--stubborn] [--pidfile FILE] [--http PORT]

  ping()           returns "pong" (the session still works after a call timed out)
  wait_forever()   sleeps forever (until the client's cancel interrupts it)
  headers()        the x-* HTTP request headers this call arrived with, as JSON ({} over stdio)
--no-init: never speak MCP at all (the client's initialize times out).
--stubborn: ignore SIGTERM and stdin closing (the client must kill the process).
--pidfile FILE: write the process id there first (a test can check the process is gone).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import anyio
from _common import parse_args, run
from mcp.server.mcpserver import Context, MCPServer
from mcp.types import ToolAnnotations

server = MCPServer("hang", log_level="WARNING")
READ_ONLY = ToolAnnotations(read_only_hint=True)


@server.tool(annotations=READ_ONLY, structured_output=False)
def ping() -> str:
    """Answer pong."""
    return "pong"


@server.tool(annotations=READ_ONLY, structured_output=False)
async def wait_forever() -> str:
    """Never return."""
    await anyio.sleep_forever()
    return "unreachable"


@server.tool(annotations=READ_ONLY, structured_output=False)
def headers(ctx: Context) -> str:
    """Show the x-* request headers (checks a client sends its configured headers)."""
    return json.dumps({k: v for k, v in (ctx.headers or {}).items() if k.lower().startswith("x-")})


def _sleep_forever() -> None:
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    args = parse_args(lambda p: (p.add_argument("--no-init", action="store_true"),
                                 p.add_argument("--stubborn", action="store_true"),
                                 p.add_argument("--pidfile")))
    if args.pidfile:
        with open(args.pidfile, "w") as f:
            f.write(str(os.getpid()))
    if args.stubborn:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args.no_init:
        _sleep_forever()
    try:
        run(server, args)
    except SystemExit:
        if not args.stubborn:
            raise
    sys.stdin.close()
    _sleep_forever()  # only reached when stubborn: outlive the end of the session
