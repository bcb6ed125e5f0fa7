"""MCP test server with awkward results: a huge text and an image block.

    python tests/mcp_servers/blobs.py [--http PORT]

  huge(chars=200000)   a text result of exactly `chars` characters (lines of "0123456789...")
  chart()              a text block "chart of the week" followed by a PNG image block
                       (PNG_BYTES below: a 1x1 picture; the client describes, not inlines, it)
  structured()         no text block, only structuredContent {"temperature": 21, "unit": "C"}
"""

from __future__ import annotations

import struct
import zlib

from _common import parse_args, run
from mcp.server.mcpserver import Image, MCPServer
from mcp.types import CallToolResult, ToolAnnotations

server = MCPServer("blobs", log_level="WARNING")
READ_ONLY = ToolAnnotations(read_only_hint=True)


def _png_1x1() -> bytes:
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
            + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b""))


PNG_BYTES = _png_1x1()


@server.tool(annotations=READ_ONLY, structured_output=False)
def huge(chars: int = 200_000) -> str:
    """Return a very long text."""
    line = "0123456789" * 7 + "\n"
    return (line * (chars // len(line) + 1))[:chars]


@server.tool(annotations=READ_ONLY, structured_output=False)
def chart() -> list:
    """Return a caption and a PNG image."""
    return ["chart of the week", Image(data=PNG_BYTES, format="png")]


@server.tool(annotations=READ_ONLY, structured_output=False)
def structured() -> CallToolResult:
    """Return only structured content."""
    return CallToolResult(content=[], structured_content={"temperature": 21, "unit": "C"})


if __name__ == "__main__":
    run(server, parse_args())
