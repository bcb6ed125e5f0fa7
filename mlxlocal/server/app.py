"""The FastAPI app: safety checks, error formats, health and metrics; the dialects' routers."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import re
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from mlxlocal import __version__
from mlxlocal.edits.policy import CompactionPolicy
from mlxlocal.server.errors import APIError, error_response
from mlxlocal.server.metrics import Metrics
from mlxlocal.server.pipeline import DROPPED_HEADER
from mlxlocal.server.pipeline import SCOPE_KEY as DROPPED_SCOPE_KEY
from mlxlocal.server.registry import ModelRegistry
from mlxlocal.server.ui import is_ui_path
from mlxlocal.server.ui import router as ui_router


@dataclass
class ServerConfig:
    models: list[str]
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    allowed_origins: list[str] = field(default_factory=list)  # beyond loopback; "*" = any
    max_body_bytes: int = 8 << 20
    keep_alive: float = float("inf")  # seconds a model stays loaded when idle
    engine_options: dict = field(default_factory=dict)
    served_model_names: list[str] = field(default_factory=list)  # see registry.assign_names
    allowed_hosts: list[str] = field(default_factory=list)  # Host names beyond loopback; "*" = any
    body_timeout: float = 30.0  # seconds for a whole request body to arrive (else 408)
    header_timeout: float = 10.0  # seconds for a request's headers to arrive (else closed)
    keep_alive_timeout: int = 5  # idle seconds between requests on one connection
    max_connections: int | None = None  # None: half the open-file limit, at most 4096
    mcp_endpoint: bool = True  # MCP (Streamable HTTP) at /mcp: mcp_http.py
    ui: bool = True  # the chat page at / and /ui (ui.py); --no-ui leaves it out
    mcp_max_sessions: int = 256  # MCP sessions open at once; a full table evicts the LRU idle one
    mcp_session_idle: float = 1800.0  # seconds an MCP session lives without a request
    expose_paths: bool = False  # --expose-paths: models' file paths to clients (model_cards.client_names)
    allow_client_unload: bool = False  # --allow-client-unload: Ollama keep_alive 0 / under 5m honoured
    max_tools: int | None = None  # --max-tools: render only the top K of a request's tools (pipeline.prune_tools)
    # --stream-keepalive: seconds between keep-alives on a stream with no output yet (a long
    # prefill) or for a while; 0 turns them off (then no byte goes out before the first token).
    stream_keepalive: float = 2.0
    embed_models: list[str] = field(default_factory=list)  # --embed-model: embeddings_api.py
    # Cache edits (server/prompt.py): --kv-compact's policy for session requests without drop fields
    # (None: off), sessions kept per model, their idle expiry.
    kv_compact: CompactionPolicy | None = None
    max_sessions: int = 32
    session_idle: float = 1800.0


def is_loopback_origin(origin: str) -> bool:
    host = urlsplit(origin).hostname or ""
    if host == "localhost":
        return True
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return False


class _BodyError(Exception):
    """The request body broke a limit while the app read it; Guard answers with `status`."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status, self.message = status, message


def _host_name(host: str) -> str:
    """`Host` header -> lower-case name or IP without port or brackets ("[::1]:80" -> "::1")."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


# A DNS name or IPv4 address: labels of letters, digits, '-' and '_', an optional final dot.
_HOST_NAME = re.compile(r"[a-z0-9_-]+(\.[a-z0-9_-]+)*\.?")


def host_header_name(value: str) -> str | None:
    """A `Host` header's name or IP, lower case, without port or brackets ("[::1]:80" -> "::1");
    None unless it is exactly host[:port] with a port of digits in 1-65535 (RFC 9110 7.2):
    `localhost:x@evil.example` must not pass as localhost."""
    host = value.strip().lower()
    if host.startswith("["):
        end = host.find("]")
        name, rest = host[1:end], host[end + 1:]
        if end < 0 or not (is_ip_literal(name) and ":" in name):
            return None
    else:
        cut = host.find(":") if ":" in host else len(host)
        name, rest = host[:cut], host[cut:]
        if not _HOST_NAME.fullmatch(name):
            return None
    if rest:
        port = rest[1:]
        if rest[0] != ":" or not (port.isascii() and port.isdigit() and len(port) <= 5 and 0 < int(port) < 65536):
            return None
    return name


def is_loopback_host(name: str) -> bool:
    if name in ("localhost", "localhost.") or name.endswith(".localhost"):
        return True
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(name).is_loopback
    return False


def is_ip_literal(name: str) -> bool:
    with contextlib.suppress(ValueError):
        ipaddress.ip_address(name)
        return True
    return False


class Guard:
    """Pure ASGI guard: Host, Origin, API key, body size and read time, request metrics.

    Pure ASGI rather than @app.middleware("http") (BaseHTTPMiddleware), which hides the
    client's disconnect from request.is_disconnected() so abandoned requests ran to the end.

    `strict_paths`: path prefixes whose Host is checked whatever the bind (the MCP endpoint:
    the MCP spec asks servers to validate it against DNS rebinding on every request).
    """

    def __init__(self, app, config: ServerConfig, metrics: Metrics, routes=None, strict_paths: tuple[str, ...] = ()):
        self.app, self.config, self.metrics, self.routes = app, config, metrics, routes
        self.strict_paths = strict_paths
        self._paths: set[str] | None = None
        self.allowed_hosts = {h.lower() for h in config.allowed_hosts}
        self.bound = _host_name(config.host)
        # Loopback bind: only loopback names reach us legitimately; anything else is a page on
        # another site that re-pointed its DNS at 127.0.0.1 (DNS rebinding).
        self.check_host = bool(self.allowed_hosts) or is_loopback_host(self.bound)

    def strict(self, path: str) -> bool:
        return any(path == p or path.startswith(p.rstrip("/") + "/") for p in self.strict_paths)

    def host_allowed(self, host: str | None, strict: bool = False) -> bool:
        if host is not None and host_header_name(host) is None:
            return False  # malformed: refused whatever the bind (refusal answers 400)
        if not (self.check_host or strict) or host is None or "*" in self.allowed_hosts:
            return True  # no Host header: not a browser (browsers always send one)
        name = host_header_name(host)
        assert name is not None  # a malformed host was refused above
        if is_loopback_host(name) or name in self.allowed_hosts or host.lower() in self.allowed_hosts:
            return True
        # Strict on a non-loopback bind: the bound address itself, or any IP literal on a
        # wildcard bind (the machine's addresses are many). An IP is never a rebinding vector:
        # only a DNS name can be re-pointed; names need --allow-host.
        wildcard = self.bound in ("0.0.0.0", "::", "")
        return strict and (name == self.bound or (wildcard and is_ip_literal(name)))

    def refusal(self, scope) -> tuple[int, str, dict | None] | None:
        raw = scope.get("headers") or []
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw}
        path, cfg = scope["path"], self.config
        host = headers.get("host")
        if (host is not None and host_header_name(host) is None) or sum(k.lower() == b"host" for k, _ in raw) > 1:
            return 400, f"malformed Host header {host!r}: expected host[:port], a port of digits 1-65535", None
        if path != "/health" and not self.host_allowed(host, self.strict(path)):
            return 421, f"host {headers.get('host')!r} is not served here (see --allow-host)", None
        origin = headers.get("origin")
        allowed = cfg.allowed_origins
        if origin and not ("*" in allowed or origin in allowed or is_loopback_origin(origin)):
            # A web page from another site must not drive a local model (CSRF); preflights too.
            return 403, f"origin {origin} is not allowed (see --allow-origin)", None
        # A browser's CORS preflight never carries credentials: one from an allowed origin (the
        # check above) passes without the key, to CORSMiddleware, which answers it with CORS
        # headers only and calls no route. Any other OPTIONS needs the key like every method.
        preflight = scope["method"] == "OPTIONS" and origin and "access-control-request-method" in headers
        # The chat page's files are public (a navigation cannot send a key; the page asks for
        # it and sends it on its API calls), but Host and Origin were checked above.
        page = cfg.ui and scope["method"] in ("GET", "HEAD") and is_ui_path(path)
        if cfg.api_key and path != "/health" and not preflight and not page:
            bearer = headers.get("authorization", "")
            given = bearer[7:] if bearer.lower().startswith("bearer ") else headers.get("x-api-key", "")
            if not hmac.compare_digest(given.encode(), cfg.api_key.encode()):
                return 401, "missing or wrong API key", {"WWW-Authenticate": "Bearer"}
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > cfg.max_body_bytes:
            return 413, f"request body over the {cfg.max_body_bytes}-byte limit", {"Connection": "close"}
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, status = scope["path"], 500
        refused = self.refusal(scope)
        if refused is not None:
            status = refused[0]
            await error_response(path, refused[0], refused[1], headers=refused[2])(scope, receive, send)
            return self.count(scope, status)
        limit, timeout = self.config.max_body_bytes, self.config.body_timeout
        deadline = time.monotonic() + timeout
        seen, body_done, failed, started = 0, False, None, False

        async def guarded_receive():
            nonlocal seen, body_done, failed
            if body_done or failed is not None:
                return await receive()  # after the body: disconnect polling must not time out
            try:
                # One deadline for the whole body: a byte a second must not keep a slot forever.
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                failed = _BodyError(408, f"request body not received within {timeout:g} s")
                raise failed from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                body_done = not message.get("more_body", False)
                if seen > limit:
                    failed = _BodyError(413, f"request body over the {limit}-byte limit")
                    raise failed
            return message

        async def guarded_send(message):
            nonlocal status, started
            if message["type"] == "http.response.start":
                if failed is not None:  # the route turned our error into its own: answer ours
                    raise failed
                started, status = True, message["status"]
                dropped = scope.get(DROPPED_SCOPE_KEY)
                if dropped:  # set by pipeline.prune_tools: the client learns tools were left out
                    message = {**message, "headers": [*message.get("headers", []),
                                                      (DROPPED_HEADER.encode(), str(dropped).encode())]}
            await send(message)

        try:
            await self.app(scope, guarded_receive, guarded_send)
        except BaseException as e:
            error = failed if failed is not None else _body_error_in(e)
            if error is None or started:
                raise
            # Close: the client may still be sending the rest of the body.
            status = error.status
            await error_response(path, error.status, error.message, headers={"Connection": "close"})(
                scope, receive, send)
        finally:
            self.count(scope, status)

    def count(self, scope, status: int) -> None:
        if self._paths is None:
            self._paths = {getattr(r, "path", "") for r in getattr(self.routes, "routes", [])}
        # Route templates, not raw paths: a scan of random URLs must not grow the label set.
        path = scope["path"]
        label = path if path in self._paths else getattr(scope.get("route"), "path", None) or "other"
        self.metrics.requests.labels(label, str(status)).inc()


def _body_error_in(e: BaseException | None) -> _BodyError | None:
    """Our body error, possibly wrapped (ExceptionGroup, `raise ... from`) by the framework."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, _BodyError):
            return e
        group = getattr(e, "exceptions", None)  # an ExceptionGroup's
        e = group[0] if group else (e.__cause__ or e.__context__)
    return None


def cors_options(config: ServerConfig) -> dict:
    """CORSMiddleware's settings: loopback origins and --allow-origin ones (Guard refuses the rest)."""
    return dict(
        allow_origins=[o for o in config.allowed_origins if o != "*"] or [],
        allow_origin_regex=".*" if "*" in config.allowed_origins
        else r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?",
        allow_methods=["*"],
        allow_headers=["*"],
        # A browser MCP client must read the session id to send it back.
        expose_headers=["Mcp-Session-Id"],
    )


def create_app(config: ServerConfig, registry: ModelRegistry | None = None) -> FastAPI:
    registry = registry or ModelRegistry(config.models, config.engine_options, config.keep_alive,
                                         config.served_model_names, config.embed_models,
                                         config.max_sessions, config.session_idle)
    metrics = Metrics()

    mcp_sessions = None  # the MCP endpoint's session manager, run by the lifespan

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if registry.models:
            await registry.engine(registry.models[0].name)  # fail fast on a bad --model
        for e in registry.embedders:  # small; loaded now so their own names are known
            await registry.embedder(e.name)

        async def unloader():
            from mlxlocal.server.prompt import reset_quietly

            while True:
                await asyncio.sleep(1.0)
                await asyncio.to_thread(registry.unload_idle)
                await reset_quietly(registry.expired_sessions())  # --session-idle

        task = asyncio.create_task(unloader())
        try:
            async with mcp_sessions() if mcp_sessions else contextlib.nullcontext():
                yield
        finally:
            task.cancel()
            # Stopping (SIGTERM): streams have ended; an engine stuck in a step must not hold the exit.
            registry.shutdown(timeout=1.0 if registry.stopping else 5.0)

    app = FastAPI(title="mlxlocal", version=__version__, lifespan=lifespan)
    app.state.registry, app.state.metrics, app.state.config = registry, metrics, config

    app.add_middleware(CORSMiddleware, **cors_options(config))
    # Outermost, so a foreign preflight gets a JSON 403 before CORSMiddleware answers it. The
    # MCP endpoint's Host is checked whatever the bind (see Guard).
    app.add_middleware(Guard, config=config, metrics=metrics, routes=app, strict_paths=("/mcp",))
    if config.mcp_endpoint:
        from mlxlocal.server import mcp_http

        mcp_sessions = mcp_http.mount(app, config, registry)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return error_response(request.url.path, e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        errors = e.errors()
        first = errors[0] if errors else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or "body"
        message = f"{where}: {first.get('msg', 'invalid request')}"
        if first.get("type") == "json_invalid":
            message = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"
        return error_response(request.url.path, 400, message, param=where)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        # FastAPI wraps errors raised while it reads a pydantic body (the body limit, itself
        # wrapped in an ExceptionGroup by the http middleware's task group).
        cause = e.__cause__
        while group := getattr(cause, "exceptions", None):  # an ExceptionGroup's
            cause = group[0]
        if isinstance(cause, APIError):
            return error_response(request.url.path, cause.status, cause.message, cause.param, cause.code,
                                  cause.headers)
        return error_response(request.url.path, e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        return error_response(request.url.path, 500, f"internal error: {type(e).__name__}: {e}")

    @app.get("/health")
    async def health():
        from fastapi.responses import JSONResponse

        status, body = registry.health()  # 503 naming the model while its engine is stopped
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def prometheus():
        await asyncio.to_thread(metrics.refresh, [m.engine for m in registry.loaded()])
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    from mlxlocal.server import anthropic_api, embeddings_api, ollama_api, openai_api, responses_api

    app.state.responses = responses_api.ResponseStore()  # per server: previous_response_id, GET
    app.include_router(openai_api.router)
    app.include_router(responses_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(ollama_api.router)
    app.include_router(embeddings_api.router)
    if config.ui:
        app.include_router(ui_router)
    return app

