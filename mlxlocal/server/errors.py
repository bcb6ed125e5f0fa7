"""API errors, rendered in the format of the dialect the client speaks."""

from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

# HTTP status -> (OpenAI error type, Anthropic error type)
_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    403: ("permission_error", "permission_error"),
    404: ("not_found_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    408: ("invalid_request_error", "timeout_error"),
    413: ("invalid_request_error", "request_too_large"),
    421: ("permission_error", "permission_error"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
    503: ("server_error", "overloaded_error"),
}

RETRY_AFTER = "1"  # seconds: a short back-off; the queue drains as running requests finish


class APIError(Exception):
    """Raised by a route: becomes an HTTP error in the caller's dialect."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers


def dialect_of(path: str) -> str:
    if path.startswith("/api/"):
        return "ollama"
    if path.startswith("/v1/messages"):
        return "anthropic"
    return "openai"


def error_response(path: str, status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    openai_type, anthropic_type = _TYPES.get(status, ("invalid_request_error", "invalid_request_error"))
    # A message may quote the request (a model name): a lone surrogate in it must not turn
    # this error into a 500 when the JSON is encoded.
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    param = param.encode("utf-8", "backslashreplace").decode("utf-8") if param else param
    dialect = dialect_of(path)
    body: dict[str, Any]
    if dialect == "ollama":
        body = {"error": message}
    elif dialect == "anthropic":
        body = {"type": "error", "error": {"type": anthropic_type, "message": message}}
    else:
        body = {"error": {"message": message, "type": openai_type, "param": param, "code": code}}
    if status == 429 and not any(k.lower() == "retry-after" for k in headers or {}):
        headers = {**(headers or {}), "Retry-After": RETRY_AFTER}  # clients back off instead of hammering
    return JSONResponse(body, status_code=status, headers=headers)


async def read_json_object(request: Request, empty_ok: bool = False) -> dict:
    """The request body as a JSON object, or a 400 saying what is wrong with it (malformed,
    not UTF-8, nested too deep, lone surrogates: see validation.parse_json)."""
    from mlxlocal.server.validation import parse_body  # validation imports APIError from here

    body = await parse_body(await request.body(), b"{}" if empty_ok else b"null")
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body
