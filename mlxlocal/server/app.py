"""The FastAPI app: safety checks, error formats, health and metrics; the dialects' routers."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from mlxlocal import __version__
from mlxlocal.server.errors import APIError, error_response
from mlxlocal.server.metrics import Metrics
from mlxlocal.server.registry import ModelRegistry


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


def is_loopback_origin(origin: str) -> bool:
    host = urlsplit(origin).hostname or ""
    if host == "localhost":
        return True
    with contextlib.suppress(ValueError):
        return ipaddress.ip_address(host).is_loopback
    return False


class BodyLimit:
    """Refuse request bodies over the limit (413), whether or not Content-Length is sent."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        too_big = error_response(scope["path"], 413, f"request body over the {self.limit}-byte limit")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await too_big(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise APIError(413, f"request body over the {self.limit}-byte limit")
            return message

        await self.app(scope, limited_receive, send)


def create_app(config: ServerConfig, registry: ModelRegistry | None = None) -> FastAPI:
    registry = registry or ModelRegistry(config.models, config.engine_options, config.keep_alive,
                                         config.served_model_names)
    metrics = Metrics()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await registry.engine(registry.models[0].name)  # fail fast on a bad --model

        async def unloader():
            while True:
                await asyncio.sleep(1.0)
                await asyncio.to_thread(registry.unload_idle)

        task = asyncio.create_task(unloader())
        try:
            yield
        finally:
            task.cancel()
            registry.shutdown()

    app = FastAPI(title="mlxlocal", version=__version__, lifespan=lifespan)
    app.state.registry, app.state.metrics, app.state.config = registry, metrics, config

    @app.middleware("http")
    async def guard(request: Request, call_next):
        origin = request.headers.get("origin")
        allowed = config.allowed_origins
        if origin and not ("*" in allowed or origin in allowed or is_loopback_origin(origin)):
            # A web page from another site must not drive a local model (CSRF, DNS rebinding).
            return error_response(request.url.path, 403, f"origin {origin} is not allowed (see --allow-origin)")
        if config.api_key and request.url.path != "/health" and request.method != "OPTIONS":
            bearer = request.headers.get("authorization", "")
            given = bearer[7:] if bearer.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
            if not hmac.compare_digest(given.encode(), config.api_key.encode()):
                return error_response(request.url.path, 401, "missing or wrong API key",
                                      headers={"WWW-Authenticate": "Bearer"})
        try:
            response = await call_next(request)
        except APIError as e:  # raised by the body limit while a route reads the body
            response = error_response(request.url.path, e.status, e.message, e.param, e.code)
        metrics.requests.labels(request.url.path, str(response.status_code)).inc()
        return response

    app.add_middleware(
        CORSMiddleware,
        allow_origins=[o for o in config.allowed_origins if o != "*"] or [],
        allow_origin_regex=".*" if "*" in config.allowed_origins
        else r"https?://(localhost|127\.0\.0\.1|\[::1\])(:\d+)?",
        allow_methods=["*"],
        allow_headers=["*"],
    )
    app.add_middleware(BodyLimit, limit=config.max_body_bytes)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
        return error_response(request.url.path, e.status, e.message, e.param, e.code)

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
        while getattr(cause, "exceptions", None):
            cause = cause.exceptions[0]
        if isinstance(cause, APIError):
            return error_response(request.url.path, cause.status, cause.message, cause.param, cause.code)
        return error_response(request.url.path, e.status_code, str(e.detail))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception):
        return error_response(request.url.path, 500, f"internal error: {type(e).__name__}: {e}")

    @app.get("/health")
    async def health():
        return {"status": "ok", "models": [m.name for m in registry.models],
                "loaded": [m.name for m in registry.loaded()]}

    @app.get("/metrics")
    async def prometheus():
        await asyncio.to_thread(metrics.refresh, [m.engine for m in registry.loaded()])
        return Response(metrics.exposition(), media_type=CONTENT_TYPE_LATEST)

    from mlxlocal.server import anthropic_api, ollama_api, openai_api

    app.include_router(openai_api.router)
    app.include_router(anthropic_api.router)
    app.include_router(ollama_api.router)
    return app

