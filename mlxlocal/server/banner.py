"""`mlxlocal serve`'s startup banner, and the uvicorn server that prints it once it listens."""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections.abc import Callable

import uvicorn
from rich.console import Console
from rich.text import Text
from uvicorn.protocols.http.h11_impl import H11Protocol

from mlxlocal import __version__
from mlxlocal.engine import Engine, speculation_of
from mlxlocal.server.app import ServerConfig, create_app
from mlxlocal.server.registry import ModelRegistry
from mlxlocal.units import human_bytes

DIALECTS = ("OpenAI /v1/chat/completions /v1/completions /v1/responses /v1/models · Anthropic /v1/messages"
            " · Ollama /api/chat /api/generate")


def url_of(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def kv_pool(engine: Engine | None) -> str:
    """The engine's KV pool: blocks × block size and bytes, or why there is none."""
    if engine is None:
        return "KV pool: allocated when the model is first used"
    kv = engine.kv_pool
    if kv["kind"] != "paged":  # SimpleEngine (mlx-lm path): one growing cache per request
        return "KV cache: per request (mlx-lm path, no paged pool)"
    blocks, size = kv["blocks"], kv["block_size"]
    bits = f", K/V {kv['kv_bits']}-bit (group {kv['kv_group_size']})" if kv.get("kv_bits") else ""
    line = f"KV pool: {blocks} blocks × {size} tokens = {blocks * size:,} tokens, {human_bytes(kv['bytes'])}{bits}"
    most = kv.get("max_blocks", blocks)
    if most > blocks:  # it starts light and grows on demand
        line += f"; grows on demand to {most * size:,} tokens, {human_bytes(kv['max_bytes'])}"
    return line


def banner_text(config: ServerConfig, registry: ModelRegistry, port: int | None = None) -> str:
    """What a user needs first: where, which models under which names, which APIs, whether a key."""
    lines = [f"mlxlocal {__version__} serving on {url_of(config.host, port or config.port)}"]
    for m in registry.models:
        others = m.names[1:]
        lines.append(f"  model    {m.name}" + (f"  (also: {', '.join(others)})" if others else ""))
        lines.append(f"           {kv_pool(m.engine)}")
    for e in registry.embedders:
        info = e.engine.info if e.engine is not None else None
        detail = f"  ({info.name}: dim {info.dim}, max {info.max_length} tokens)" if info else ""
        lines.append(f"  embed    {e.name}{detail} · /v1/embeddings /api/embed")
    spec = speculation_of(config.engine_options)
    if spec is not None:
        lines.append(f"  spec     speculative decoding, {spec.describe()} · a request opts out with "
                     "\"speculative\": false")
    lines.append(f"  APIs     {DIALECTS}")
    if config.ui:
        lines.append(f"  chat     {url_of(config.host, port or config.port)}/ in a browser")
    if config.mcp_endpoint:
        lines.append(f"  MCP      {url_of(config.host, port or config.port)}/mcp (Streamable HTTP)")
    policy = config.kv_compact.describe() if config.kv_compact is not None else "off"
    idle = "never" if config.session_idle == float("inf") else f"{config.session_idle:g} s idle"
    lines.append(f"  sessions X-Session-Id: up to {config.max_sessions} per model, freed after {idle} · "
                 f"--kv-compact {policy}")
    lines.append(f"  API key  {'on' if config.api_key else 'off'}")
    return "\n".join(lines)


class BannerServer(uvicorn.Server):
    """uvicorn's server; prints the banner once the lifespan loaded the model and the socket listens."""

    def __init__(self, config: uvicorn.Config, server_config: ServerConfig, registry: ModelRegistry,
                 console: Console, text: Callable[[ServerConfig, ModelRegistry, int], str] = banner_text):
        super().__init__(config)
        self.server_config, self.registry, self.console = server_config, registry, console
        self.text = text  # `mlxlocal mcp serve` has a banner of its own
        self.banner_shown = False
        _own_sse_drain()

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if not self.started or self.banner_shown:
            return
        self.banner_shown = True
        port = self.servers[0].sockets[0].getsockname()[1] if self.servers else self.config.port  # --port 0
        text = Text(self.text(self.server_config, self.registry, port))
        text.stylize("bold green", 0, text.plain.index("\n"))
        self.console.print(Text("\n") + text + Text("\n"), highlight=False)

    async def shutdown(self, sockets=None) -> None:
        # First end what is in flight (streams get a final event, MCP sessions close): uvicorn
        # then waits for connections that are already finishing, not for its deadline.
        await self.registry.begin_shutdown()
        await super().shutdown(sockets)


def _own_sse_drain() -> None:
    """The MCP SDK's SSE responses (sse-starlette) cancel themselves on SIGTERM without ending
    their body: the client sees a cut connection. BannerServer.shutdown ends them instead
    (the MCP sessions close, their streams finish); what still runs then is cancelled by
    uvicorn after GRACE_S."""
    try:
        from sse_starlette.sse import AppStatus
    except ImportError:  # no MCP endpoint's SSE here
        return
    AppStatus.disable_automatic_graceful_drain()


class HeaderDeadline(H11Protocol):
    """uvicorn's h11 protocol plus a deadline for a request's headers.

    uvicorn times out idle keep-alive connections, but a client that trickles its headers (a
    byte every few seconds: slowloris) resets nothing and holds its socket forever. The clock
    starts when the connection opens or a new request's first byte arrives, stops once the
    headers are parsed (a cycle exists), and closes the connection when it runs out.
    """

    header_timeout = 10.0
    _header_timer: asyncio.TimerHandle | None  # set per connection (read with getattr before)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)

    def data_received(self, data: bytes) -> None:
        idle = self.cycle is None or self.cycle.response_complete
        if idle and getattr(self, "_header_timer", None) is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._headers_too_slow)
        super().data_received(data)
        if self.cycle is not None and not self.cycle.response_complete:
            self._stop_header_timer()  # the headers are in: the body has its own timeout

    def connection_lost(self, exc) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def _stop_header_timer(self) -> None:
        timer, self._header_timer = getattr(self, "_header_timer", None), None
        if timer is not None:
            timer.cancel()

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
            self.transport.close()


def raise_open_file_limit() -> int:
    """Soft RLIMIT_NOFILE up to the hard limit (every connection is a descriptor); the new soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def connection_cap(config: ServerConfig, open_files: int) -> int:
    """Connections served at once (more get 503): well below the open-file limit, which also
    covers model files, the log and the accept loop."""
    if config.max_connections:
        return config.max_connections
    return max(32, min(4096, open_files // 2))


GRACE_S = 3


def uvicorn_config(app, config: ServerConfig, open_files: int | None = None, **kwargs) -> uvicorn.Config:
    """uvicorn settings that bound what one client can hold: connections, idle and header time,
    the size of an unfinished request head."""
    protocol = type("HeaderDeadline", (HeaderDeadline,), {"header_timeout": config.header_timeout})
    files = open_files or resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return uvicorn.Config(app, host=config.host, port=config.port, http=protocol,
                          limit_concurrency=connection_cap(config, files),
                          timeout_keep_alive=config.keep_alive_timeout,
                          h11_max_incomplete_event_size=64 * 1024,
                          # On SIGTERM, streams end at once (BannerServer.shutdown); whatever still
                          # runs after this is cancelled, and the engines get 1 s: exit within 5 s.
                          timeout_graceful_shutdown=GRACE_S, **kwargs)


class RepeatFilter(logging.Filter):
    """Let the first `burst` copies of a log message through per `interval` seconds, then drop
    them; the next copy after the interval says how many were suppressed. A flood of identical
    errors ("Too many open files" from the accept loop) must not fill the disk."""

    def __init__(self, burst: int = 5, interval: float = 10.0, max_keys: int = 1024):
        super().__init__()
        self.burst, self.interval, self.max_keys = burst, interval, max_keys
        self.seen: dict[tuple, list] = {}  # key -> [window start, count in window, suppressed]

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg)[:200], str(record.exc_info and record.exc_info[0]))
        now = time.monotonic()
        entry = self.seen.get(key)
        if entry is None or now - entry[0] >= self.interval:
            suppressed = entry[2] if entry else 0
            if len(self.seen) >= self.max_keys:
                self.seen.clear()  # bounded memory; at worst a few extra lines get through
            self.seen[key] = [now, 1, 0]
            if suppressed:
                record.msg = f"{record.msg} (suppressed {suppressed} similar messages)"
            return True
        entry[1] += 1
        if entry[1] <= self.burst:
            return True
        entry[2] += 1
        return False


def install_log_filter(names=("asyncio", "uvicorn", "uvicorn.error", "mlxlocal")) -> RepeatFilter:
    """One RepeatFilter on the loggers that can flood (a logger's filters see only its own records)."""
    flt = RepeatFilter()
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(f, RepeatFilter) for f in logger.filters):
            logger.addFilter(flt)
    return flt


def run_server(config: ServerConfig, console: Console | None = None, app=None, registry: ModelRegistry | None = None,
               text: Callable[[ServerConfig, ModelRegistry, int], str] = banner_text) -> bool:
    """Serve until interrupted (uvicorn's logs, access log included); False if it never started.
    `app` and `registry` (both or neither): another ASGI app on the same settings (`mcp serve`)."""
    if app is None:
        app = create_app(config)
        registry = app.state.registry
    files = raise_open_file_limit()
    uv = uvicorn_config(app, config, files, log_level="info")
    install_log_filter()  # after uvicorn.Config, which (re)configures uvicorn's loggers
    assert registry is not None  # given with `app`, or the new app's
    server = BannerServer(uv, config, registry, console or Console(stderr=True, soft_wrap=True), text)
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl+C it handled, once shut down
        pass
    return server.started
