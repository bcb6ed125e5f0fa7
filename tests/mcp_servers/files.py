"""Filesystem-like MCP test server: four tools over one root directory.

    python tests/mcp_servers/files.py [--root DIR] [--http PORT]

The root is --root, else $MCP_FILES_ROOT, else the current directory; paths are relative to
it and may not leave it. Tools and their annotations (what the Rule-of-Two policy reads):
  read_file(path)           readOnly
  list_dir(path=".")        readOnly
  write_file(path, content) destructive (overwrites)
  delete_file(path)         destructive
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from _common import parse_args, run
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.types import ToolAnnotations

ROOT = Path(os.environ.get("MCP_FILES_ROOT") or ".").resolve()  # --root overrides it in __main__
server = MCPServer("files", log_level="WARNING")

READ_ONLY = ToolAnnotations(read_only_hint=True, destructive_hint=False, open_world_hint=False)
DESTRUCTIVE = ToolAnnotations(read_only_hint=False, destructive_hint=True, open_world_hint=False)


def _inside(path: str) -> Path:
    full = (ROOT / path).resolve()
    if full != ROOT and ROOT not in full.parents:
        raise ToolError(f"{path}: outside the server's root")
    return full


def _tool(fn):
    """File errors as tool errors (isError with the message); other exceptions would reach
    the client only as "Error executing tool"."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except OSError as exc:
            raise ToolError(f"{kwargs.get('path', '.')}: {exc.strerror}") from None
    return wrapper


@server.tool(annotations=READ_ONLY, structured_output=False)
@_tool
def read_file(path: str) -> str:
    """Read a text file under the root."""
    return _inside(path).read_text()


@server.tool(annotations=READ_ONLY, structured_output=False)
@_tool
def list_dir(path: str = ".") -> str:
    """List a directory under the root, one name per line (directories end with /)."""
    entries = sorted(_inside(path).iterdir())
    return "\n".join(e.name + ("/" if e.is_dir() else "") for e in entries)


@server.tool(annotations=DESTRUCTIVE, structured_output=False)
@_tool
def write_file(path: str, content: str) -> str:
    """Write (create or overwrite) a text file under the root."""
    target = _inside(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(content)
    return f"wrote {len(content)} characters to {path}"


@server.tool(annotations=DESTRUCTIVE, structured_output=False)
@_tool
def delete_file(path: str) -> str:
    """Delete a file under the root."""
    _inside(path).unlink()
    return f"deleted {path}"


if __name__ == "__main__":
    args = parse_args(lambda p: p.add_argument("--root"))
    ROOT = Path(args.root).resolve() if args.root else ROOT
    run(server, args)
