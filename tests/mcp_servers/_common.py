"""Shared start-up for the test MCP servers in this directory (see README of each script).

Every server here is a plain script: `python tests/mcp_servers/NAME.py` speaks MCP over stdio;
`--http PORT` serves Streamable HTTP at http://127.0.0.1:PORT/mcp instead. Scripts import this
module by name, which works because Python puts a script's own directory first on sys.path.
"""

from __future__ import annotations

import argparse
import sys

from mcp.server.mcpserver import MCPServer


def parse_args(extra=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--http", type=int, metavar="PORT", help="serve Streamable HTTP on 127.0.0.1:PORT/mcp")
    if extra is not None:
        extra(parser)
    return parser.parse_args()


def run(server: MCPServer, args: argparse.Namespace) -> None:
    """Serve stdio, or HTTP with --http. The servers are built with log_level="WARNING":
    the SDK's per-request INFO lines (and uvicorn's access log) would swamp a test's output."""
    if args.http:
        server.run("streamable-http", host="127.0.0.1", port=args.http)
    else:
        server.run("stdio")
    sys.exit(0)
