"""The MCP server's transports: stdio, Streamable HTTP on its own port (`mlxlocal mcp serve`),
and the same endpoint mounted at /mcp on `mlxlocal serve`. Tools and resource: mcp_tools.py.

Every HTTP request goes through app.Guard first, the same pure-ASGI guard as the OpenAI
server, with the MCP path strict: Origin (a foreign one: 403), Host (a name that is not
loopback, the bound address or --allow-host: 421, whatever the bind), the API key (401,
constant-time compare), body size. The SDK's own check is switched off on purpose: in mcp
2.3.0, `streamable_http_app(host=...)` turns DNS-rebinding protection on only when host is
127.0.0.1 / localhost / ::1 and no settings are passed; for any other host (0.0.0.0) it
builds TransportSecurityMiddleware(None), which checks neither Host nor Origin
(mcp/server/lowlevel/server.py, mcp/server/transport_security.py). And where it is on, its
fixed lists would refuse what --allow-origin / --allow-host allow. One guard, one rule.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from mcp.server.mcpserver import MCPServer
from mcp.server.transport_security import TransportSecuritySettings
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware

from mlxlocal.server.app import Guard, ServerConfig, cors_options
from mlxlocal.server.mcp_tools import build_mcp
from mlxlocal.server.metrics import Metrics
from mlxlocal.server.registry import ModelRegistry

MCP_PATH = "/mcp"
# Our Guard checks Host and Origin; the SDK keeps only its Content-Type check (see above).
SDK_CHECKS_OFF = TransportSecuritySettings(enable_dns_rebinding_protection=False)


def streamable_http(mcp: MCPServer, config: ServerConfig) -> Starlette:
    """The SDK's Streamable HTTP app for `mcp` at MCP_PATH; its lifespan runs the session
    manager (and the MCPServer's lifespan). The body limit is ours (Guard), not the SDK's 4 MiB."""
    return mcp.streamable_http_app(streamable_http_path=MCP_PATH, transport_security=SDK_CHECKS_OFF,
                                   host=config.host, max_request_body_size=config.max_body_bytes)


def standalone_app(config: ServerConfig, registry: ModelRegistry) -> Guard:
    """`mlxlocal mcp serve --transport http`: only the MCP endpoint, behind the Guard with
    every path strict. Its lifespan loads the first model (a bad --model fails the start)."""
    inner = streamable_http(build_mcp(registry, own_registry=True), config)
    inner.add_middleware(CORSMiddleware, **cors_options(config))
    # The Guard counts requests into Metrics; this server has no /metrics, so nobody reads them.
    return Guard(inner, config, Metrics(), routes=inner, strict_paths=("/",))


def mount(app, config: ServerConfig, registry: ModelRegistry) -> Callable[[], contextlib.AbstractAsyncContextManager]:
    """Add the MCP endpoint to `mlxlocal serve`'s app (create_app's Guard already covers it);
    return what its lifespan must run: the session manager. The registry stays the app's."""
    mcp = build_mcp(registry)
    app.router.routes.extend(streamable_http(mcp, config).routes)
    return mcp.session_manager.run


async def serve_stdio(registry: ModelRegistry) -> None:
    """MCP over this process's stdin/stdout. The SDK points fd 1 at stderr while it serves,
    so the model is loaded inside (its lifespan) and stray prints cannot corrupt the wire."""
    await build_mcp(registry, own_registry=True).run_stdio_async()


def run_stdio(registry: ModelRegistry) -> None:
    asyncio.run(serve_stdio(registry))
