"""`mlxlocal serve`'s startup banner, and the uvicorn server that prints it once it listens."""

from __future__ import annotations

import uvicorn
from rich.console import Console
from rich.text import Text

from mlxlocal import __version__
from mlxlocal.server.app import ServerConfig, create_app
from mlxlocal.server.registry import ModelRegistry

DIALECTS = ("OpenAI /v1/chat/completions /v1/completions /v1/models · Anthropic /v1/messages"
            " · Ollama /api/chat /api/generate")


def url_of(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def kv_pool(engine) -> str:
    """The engine's KV pool: blocks × block size and bytes, or why there is none."""
    if engine is None:
        return "KV pool: allocated when the model is first used"
    pools = getattr(engine, "pools", None)
    if pools is None:  # SimpleEngine (mlx-lm path): one growing cache per request
        return "KV cache: per request (mlx-lm path, no paged pool)"
    blocks, size = engine.num_blocks, engine.config.block_size
    return f"KV pool: {blocks} blocks × {size} tokens = {blocks * size:,} tokens, {_bytes(pools.nbytes)}"


def banner_text(config: ServerConfig, registry: ModelRegistry, port: int | None = None) -> str:
    """What a user needs first: where, which models under which names, which APIs, whether a key."""
    lines = [f"mlxlocal {__version__} serving on {url_of(config.host, port or config.port)}"]
    for m in registry.models:
        others = m.names[1:]
        lines.append(f"  model    {m.name}" + (f"  (also: {', '.join(others)})" if others else ""))
        lines.append(f"           {kv_pool(m.engine)}")
    lines.append(f"  APIs     {DIALECTS}")
    lines.append(f"  API key  {'on' if config.api_key else 'off'}")
    return "\n".join(lines)


class BannerServer(uvicorn.Server):
    """uvicorn's server; prints the banner once the lifespan loaded the model and the socket listens."""

    def __init__(self, config: uvicorn.Config, server_config: ServerConfig, registry: ModelRegistry,
                 console: Console):
        super().__init__(config)
        self.server_config, self.registry, self.console = server_config, registry, console
        self.banner_shown = False

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if not self.started or self.banner_shown:
            return
        self.banner_shown = True
        port = self.servers[0].sockets[0].getsockname()[1] if self.servers else self.config.port  # --port 0
        text = Text(banner_text(self.server_config, self.registry, port))
        text.stylize("bold green", 0, text.plain.index("\n"))
        self.console.print(Text("\n") + text + Text("\n"), highlight=False)


def run_server(config: ServerConfig, console: Console | None = None) -> bool:
    """Serve until interrupted (uvicorn's logs, access log included); False if it never started."""
    app = create_app(config)
    server = BannerServer(uvicorn.Config(app, host=config.host, port=config.port, log_level="info"),
                          config, app.state.registry, console or Console(stderr=True, soft_wrap=True))
    try:
        server.run()
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl+C it handled, once shut down
        pass
    return server.started
