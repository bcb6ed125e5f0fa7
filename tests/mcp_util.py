"""Helpers for tests that talk to the MCP servers in tests/mcp_servers (see each script's
docstring for its tools): a stdio ServerConfig for a script, and a script served over
Streamable HTTP in a subprocess on a free port."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from mlxlocal.agents.types import ServerConfig

SERVERS = Path(__file__).parent / "mcp_servers"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stdio_server(name: str, script: str, *args: str, **fields) -> ServerConfig:
    """A ServerConfig that runs tests/mcp_servers/SCRIPT.py over stdio with this Python;
    `fields` are ServerConfig's other fields (env, trust, sensitive, allow, deny ...)."""
    return ServerConfig(name=name, source="test", command=sys.executable,
                        args=(str(SERVERS / f"{script}.py"), *args), **fields)


@contextmanager
def http_server(script: str, *args: str, env: dict[str, str] | None = None, timeout: float = 30):
    """Serve tests/mcp_servers/SCRIPT.py over Streamable HTTP; yield its URL; kill it after."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(SERVERS / f"{script}.py"), *args, "--http", str(port)],
                            env={**os.environ, **env} if env else None, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{script}.py --http {port} did not start") from None
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}/mcp"
    finally:
        proc.kill()
        proc.wait(timeout=10)
