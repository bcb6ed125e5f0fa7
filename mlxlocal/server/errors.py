"""API errors, rendered in the format of the dialect the client speaks."""

from __future__ import annotations

import json

from fastapi import Request
from fastapi.responses import JSONResponse

# HTTP status -> (OpenAI error type, Anthropic error type)
_TYPES = {
    400: ("invalid_request_error", "invalid_request_error"),
    401: ("authentication_error", "authentication_error"),
    403: ("permission_error", "permission_error"),
    404: ("not_found_error", "not_found_error"),
    405: ("invalid_request_error", "invalid_request_error"),
    413: ("invalid_request_error", "request_too_large"),
    429: ("rate_limit_error", "rate_limit_error"),
    500: ("server_error", "api_error"),
    503: ("server_error", "overloaded_error"),
}


class APIError(Exception):
    """Raised by a route: becomes an HTTP error in the caller's dialect."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def dialect_of(path: str) -> str:
    if path.startswith("/api/"):
        return "ollama"
    if path.startswith("/v1/messages"):
        return "anthropic"
    return "openai"


def error_response(path: str, status: int, message: str, param: str | None = None,
                   code: str | None = None, headers: dict | None = None) -> JSONResponse:
    openai_type, anthropic_type = _TYPES.get(status, ("invalid_request_error", "invalid_request_error"))
    dialect = dialect_of(path)
    if dialect == "ollama":
        body = {"error": message}
    elif dialect == "anthropic":
        body = {"type": "error", "error": {"type": anthropic_type, "message": message}}
    else:
        body = {"error": {"message": message, "type": openai_type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


async def read_json_object(request: Request, empty_ok: bool = False) -> dict:
    """The request body as a JSON object, or a 400 saying what is wrong with it."""
    raw = await request.body()
    try:
        body = json.loads(raw or (b"{}" if empty_ok else b"null"))
    except ValueError as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body
