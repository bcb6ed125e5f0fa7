"""Request checks shared by the three dialects, so a bad value is a 400 naming its field.

Routers translate their dialect's fields into SamplingParams; SamplingParams.validate and
EngineBase.validate hold the ranges, and `pipeline.check_params` turns their ValueError into
an APIError that names the field as the dialect calls it. What the engine cannot check (JSON
depth, text that cannot be encoded, JSON value types, list sizes) is checked here.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from typing import Any, Literal, TypeGuard, TypeVar, overload

import numpy as np
from fastapi import Request
from fastapi.routing import APIRoute

from mlxlocal.server.errors import APIError

# Deeper JSON than any real request; json.loads, pydantic and Jinja recurse per level.
T = TypeVar("T")  # what a tokenize call's encoder returns

MAX_DEPTH = 64
MAX_MESSAGES = 10_000
MAX_TOOLS = 128  # OpenAI's limit
MAX_STOP_CHARS = 1000  # the stop checker holds back this much streamed text
# Over this, a body is parsed on a worker thread rather than on the event loop.
_THREAD_BODY_BYTES = 1 << 20

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


# --- JSON bodies -----------------------------------------------------------------------
def json_depth(raw: bytes) -> int:
    """Nesting depth of JSON text, without parsing it (brackets inside strings ignored)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return 0  # cannot be deeper than the number of openers: the common case, no scan
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    a = np.frombuffer(brackets, np.uint8)
    return int(np.cumsum(np.where((a == ord("[")) | (a == ord("{")), 1, -1)).max())


def _unencodable(obj: Any) -> str | None:
    """Path of the first string (key or value) that is not valid Unicode (a lone surrogate)."""
    stack: list[tuple[Any, str]] = [(obj, "")]
    while stack:
        value, path = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return path or "body"
        for k, v in items:
            where = f"{path}.{k}" if path else str(k)
            if isinstance(k, str):
                try:
                    k.encode("utf-8")
                except UnicodeEncodeError:
                    return path or "body"
            stack.append((v, where))
    return None


def parse_json(raw: bytes, empty: bytes = b"null") -> Any:
    """Bytes -> JSON value, or an APIError: not UTF-8, too deep, malformed, lone surrogates."""
    try:
        text = (raw or empty).decode("utf-8")  # RFC 8259: JSON between systems is UTF-8
    except UnicodeDecodeError as e:
        raise APIError(400, f"the request body is not valid UTF-8: {e}") from None
    # Before json.loads: it recurses once per level and a deep enough body is a RecursionError.
    if json_depth(raw) > MAX_DEPTH:
        raise APIError(400, f"the request body nests JSON deeper than {MAX_DEPTH} levels")
    try:
        body = json.loads(text)
    except ValueError as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    # Only a \uD800-\uDFFF escape can make a lone surrogate, which no encoder can write out.
    if _SURROGATE_ESCAPE.search(text):
        where = _unencodable(body)
        if where is not None:
            raise APIError(400, f"{where}: the text contains a lone UTF-16 surrogate (not valid Unicode)",
                           param=where)
    return body


async def parse_body(raw: bytes, empty: bytes = b"null") -> Any:
    if len(raw) > _THREAD_BODY_BYTES:
        return await asyncio.to_thread(parse_json, raw, empty)
    return parse_json(raw, empty)


class CheckedBodyRoute(APIRoute):
    """A pydantic-body route whose POST body gets `parse_json`'s checks before FastAPI parses
    it: FastAPI's own json.loads recurses into any depth and passes lone surrogates through."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def checked(request: Request):
            raw = await request.body()
            if raw and request.method == "POST":
                # Starlette's Request.json() cache: FastAPI reuses it instead of parsing again.
                request._json = await parse_body(raw)
            return await handler(request)

        return checked


# --- JSON value types (for the dialects that read plain dicts) ----------------------------
def is_int(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def number(obj: dict, key: str, default: Any, where: str, integer: bool = False) -> Any:
    """obj[key] as a finite number (an int when `integer`: 40.0 is 40, 40.5 is refused)."""
    v = obj.get(key)
    if v is None:
        return default
    if not is_number(v) or not math.isfinite(v):
        raise APIError(400, f"{where}: must be a finite number, got {v!r}", param=where)
    if integer:
        if v != int(v):
            raise APIError(400, f"{where}: must be an integer, got {v!r}", param=where)
        return int(v)
    return float(v)


@overload
def boolean(obj: dict, key: str, default: bool, where: str | None = None) -> bool: ...
@overload
def boolean(obj: dict, key: str, default: None, where: str | None = None) -> bool | None: ...
def boolean(obj: dict, key: str, default: bool | None, where: str | None = None) -> bool | None:
    """Strictly true/false: a client sending "yes" or 5 gets told, rather than a guess."""
    v = obj.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        where = where or key
        raise APIError(400, f"{where}: must be true or false, got {v!r}", param=where)
    return v


def speculative(obj: dict | None, where: str = "speculative") -> bool:
    """The per-request opt-out of speculative decoding (`serve --draft-model / --prompt-lookup`),
    an extension field in every dialect: "speculative": false decodes this request one token per
    step (Ollama: options.speculative). Absent or null: true; on a server that does not
    speculate it changes nothing."""
    return boolean(obj or {}, "speculative", True, where)


def thinking_budget(obj: dict | None, where: str = "thinking_budget") -> int | None:
    """The thinking budget, an extension field (/v1/messages has thinking.budget_tokens):
    "thinking_budget": N closes a think block still open after N generated tokens, and the
    reply goes on (SamplingParams.think_budget; Ollama: options.thinking_budget). Absent or
    null: none; on a model without a think block it changes nothing."""
    v = number(obj or {}, "thinking_budget", None, where, integer=True)
    if v is not None and not 1 <= v < 2**31:
        raise APIError(400, f"{where}: must be an integer in [1, 2**31), got {v!r}", param=where)
    return v


@overload
def string(obj: dict, key: str, where: str | None = None, *, required: Literal[True]) -> str: ...
@overload
def string(obj: dict, key: str, where: str | None = None, required: bool = False) -> str | None: ...
def string(obj: dict, key: str, where: str | None = None, required: bool = False) -> str | None:
    v = obj.get(key)
    where = where or key
    if v is None or (required and v == ""):
        if required:
            raise APIError(400, f"{where}: required", param=where)
        return None
    if not isinstance(v, str):
        raise APIError(400, f"{where}: must be a string, got {type(v).__name__}", param=where)
    return v


def sized_list(value: Any, where: str, limit: int) -> list:
    if not isinstance(value, list):
        raise APIError(400, f"{where}: must be a list", param=where)
    if len(value) > limit:
        raise APIError(400, f"{where}: at most {limit} entries (got {len(value)})", param=where)
    return value


def stop_strings(value: Any, where: str) -> list[str]:
    """A string or a list of them, each non-empty and at most MAX_STOP_CHARS long."""
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return []
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise APIError(400, f"{where}: must be a string or a list of strings", param=where)
    for s in stops:
        if not s:
            raise APIError(400, f"{where}: stop strings must not be empty", param=where)
        if len(s) > MAX_STOP_CHARS:
            raise APIError(400, f"{where}: a stop string is at most {MAX_STOP_CHARS} characters "
                                f"(got {len(s)})", param=where)
    return list(stops)
