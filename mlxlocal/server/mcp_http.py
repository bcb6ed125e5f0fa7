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

Sessions are bounded (BoundedSessions): at most --mcp-max-sessions, each closed after
--mcp-session-idle without a request; a full table evicts its least recently used idle
session, so a client that opens sessions and never closes them cannot lock others out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable

from mcp.server.mcpserver import MCPServer
from mcp.server.streamable_http_manager import StreamableHTTPASGIApp, StreamableHTTPSessionManager
from mcp.server.transport_security import TransportSecuritySettings
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Route

from mlxlocal.server.app import Guard, ServerConfig, cors_options
from mlxlocal.server.mcp_tools import build_mcp
from mlxlocal.server.metrics import Metrics
from mlxlocal.server.registry import ModelRegistry

MCP_PATH = "/mcp"
# Our Guard checks Host and Origin; the SDK keeps only its Content-Type check (see above).
SDK_CHECKS_OFF = TransportSecuritySettings(enable_dns_rebinding_protection=False)
# "Never" for --mcp-session-idle: the SDK wants a finite timeout, and eviction reads it.
FOREVER = 10 * 365 * 86400.0
log = logging.getLogger("mlxlocal.server")


class BoundedSessions(StreamableHTTPSessionManager):
    """The SDK's session manager (max_sessions, session_idle_timeout), except that a full
    table makes room: the least recently used idle session is closed, as if it had timed out,
    and the new client gets in. A session with a request in flight (an open GET stream
    included) is never evicted; only when every session is busy is a new one refused (503).

    Hooks into one SDK method, `_admit_session` (the admission decision, taken under the
    SDK's lock). Recency is the transport's own idle deadline: `idle_scope.deadline` is
    infinite while a request is in flight, else the last request's end + the idle timeout.
    """

    evicted = 0

    def _admit_session(self, requestor):
        if self.max_sessions is not None and len(self._server_instances) >= self.max_sessions:
            self._evict_one()
        return super()._admit_session(requestor)

    def _evict_one(self) -> None:
        idle = [(scope.deadline, sid) for sid, t in self._server_instances.items()
                if (scope := t.idle_scope) is not None and math.isfinite(scope.deadline) and not scope.cancel_called]
        if not idle:
            return
        sid = min(idle)[1]
        transport = self._server_instances.pop(sid)  # 404 from now on; its task ends and cleans up
        self._session_owners.pop(sid, None)
        assert transport.idle_scope is not None  # only idle sessions were candidates
        transport.idle_scope.cancel()
        self.evicted += 1
        log.debug("MCP session table full (%d): closed the least recently used idle session", self.max_sessions)

    @property
    def open_sessions(self) -> int:
        return len(self._server_instances)

    async def close_all(self) -> None:
        """Shutdown: end every session now, so its streams end cleanly (not cut at the deadline)."""
        for transport in list(self._server_instances.values()):
            with contextlib.suppress(Exception):
                await transport.terminate()


def streamable_http(mcp: MCPServer, config: ServerConfig) -> tuple[Starlette, BoundedSessions]:
    """The SDK's Streamable HTTP endpoint for `mcp` at MCP_PATH, on a BoundedSessions manager;
    the app's lifespan runs the manager (and the MCPServer's lifespan). The body limit is ours
    (Guard), not the SDK's 4 MiB."""
    # The SDK's app is one route on its own manager (no auth settings: the Guard holds the key);
    # building it gives us the low-level server, which ours then serves in its place.
    mcp.streamable_http_app(streamable_http_path=MCP_PATH, transport_security=SDK_CHECKS_OFF, host=config.host)
    idle = config.mcp_session_idle if math.isfinite(config.mcp_session_idle) else FOREVER
    manager = BoundedSessions(app=mcp.session_manager.app, security_settings=SDK_CHECKS_OFF,
                              max_request_body_size=config.max_body_bytes, session_idle_timeout=idle,
                              max_sessions=config.mcp_max_sessions)
    app = Starlette(routes=[Route(MCP_PATH, endpoint=StreamableHTTPASGIApp(manager))],
                    lifespan=lambda _app: manager.run())
    return app, manager


def standalone_app(config: ServerConfig, registry: ModelRegistry) -> Guard:
    """`mlxlocal mcp serve --transport http`: only the MCP endpoint, behind the Guard with
    every path strict. Its lifespan loads the first model (a bad --model fails the start)."""
    mcp = build_mcp(registry, own_registry=True, expose_paths=config.expose_paths)
    inner, sessions = streamable_http(mcp, config)
    registry.on_stop.append(sessions.close_all)
    inner.add_middleware(CORSMiddleware, **cors_options(config))
    # The Guard counts requests into Metrics; this server has no /metrics, so nobody reads them.
    return Guard(inner, config, Metrics(), routes=inner, strict_paths=("/",))


def mount(app, config: ServerConfig, registry: ModelRegistry) -> Callable[[], contextlib.AbstractAsyncContextManager]:
    """Add the MCP endpoint to `mlxlocal serve`'s app (create_app's Guard already covers it);
    return what its lifespan must run: the session manager. The registry stays the app's."""
    inner, sessions = streamable_http(build_mcp(registry, expose_paths=config.expose_paths), config)
    app.router.routes.extend(inner.routes)
    app.state.mcp_sessions = sessions
    registry.on_stop.append(sessions.close_all)
    return sessions.run


async def serve_stdio(registry: ModelRegistry) -> None:
    """MCP over this process's stdin/stdout. The SDK points fd 1 at stderr while it serves,
    so the model is loaded inside (its lifespan) and stray prints cannot corrupt the wire."""
    await build_mcp(registry, own_registry=True).run_stdio_async()


def run_stdio(registry: ModelRegistry) -> None:
    asyncio.run(serve_stdio(registry))
